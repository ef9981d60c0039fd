"""The megatron-core releases ``--piper`` supports, as data, and the check where it installs.

Read from NVIDIA/Megatron-LM at tags core_v0.16.1, core_v0.17.0 (whose ``package_info`` says
0.17.0rc0), core_v0.17.1, core_v0.18.0, core_v0.18.2 and core_v0.19.0 (0.19.1), and from the megatron-core
0.19.2 wheel: ``megatron/training/{arguments,initialize,training,global_vars}.py``, ``pretrain_gpt.py``,
``megatron/core/transformer/moe/{moe_layer,token_dispatcher,moe_utils}.py``,
``megatron/core/tensor_parallel/mappings.py``, ``megatron/core/parallel_state.py`` and the NullTokenizer.

The same in every supported release, so ``--piper`` writes them one way:

* every Megatron flag ``--piper`` reads or rewrites (:data:`piper_megatron.pins.PINNABLE`, the model
  flags of :mod:`piper_megatron.args`, :func:`piper_core.export.parallel_flags`): option string, dest,
  default, type and action of the parser ``add_megatron_arguments`` builds (compared at every tag
  above); only new choices appear (``--position-embedding-type yarn`` in 0.18, which Piper does not
  model, ``--moe-flex-dispatcher-backend ncclep`` in 0.19);
* the ``validate_args`` rules the rewrite follows (virtual stages by layers per stage or by stage
  count, ``overlap_p2p_comm`` with interleaving, the global batch default), ``parse_args`` reading
  ``args.rank``/``args.world_size`` from RANK/WORLD_SIZE;
* the Megatron-Core callables Piper's dispatcher subclasses, wraps or calls (:data:`RELIED_ON`).

What differs is how a training script reaches ``validate_args`` (:attr:`MegatronRelease.entry`) and
what ``--vocab-size`` means to the NullTokenizer (:attr:`MegatronRelease.null_tokenizer_eod`).
Pure Python: importing this module imports no Megatron.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

from packaging.version import InvalidVersion, Version

from piper_core.errors import SpecError

# How a training script reaches validate_args:
# "pretrain": pretrain(..., extra_args_provider, args_defaults) -> initialize_megatron -> the validate_args
#   that megatron/training/initialize.py imported by name (`from megatron.training.arguments import
#   parse_args, validate_args`), so that binding must be hooked besides arguments.validate_args;
# "parse_and_validate_args": the script's __main__ calls arguments.parse_and_validate_args(extra_args_provider,
#   ignore_unknown_args, args_defaults), which looks validate_args up in megatron.training.arguments.
Entry = Literal["pretrain", "parse_and_validate_args"]

REQUIREMENT = "megatron-core>=0.16,<0.20"  # pyproject.toml's megatron extras (a test keeps them equal)


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronRelease:
    """One supported megatron-core minor release: ``minor`` (0.<minor>.x), the Megatron-LM ``tags``
    read, its ``entry`` to argument validation, whether its NullTokenizer appends an end-of-document
    token to ``--vocab-size`` (``null_tokenizer_eod``), its Python floor, and what changed since the
    previous release in the APIs Piper touches (``differs``)."""

    minor: int
    tags: tuple[str, ...]
    entry: Entry
    null_tokenizer_eod: bool
    python: str
    differs: tuple[str, ...] = ()

    @property
    def series(self) -> str:
        """e.g. ``0.16``."""
        return f"0.{self.minor}"


RELEASES: tuple[MegatronRelease, ...] = (
    MegatronRelease(
        minor=16, tags=("core_v0.16.1",), entry="pretrain", null_tokenizer_eod=True, python=">=3.10",
        # NullTokenizer: megatron/training/tokenizer/tokenizer.py _NullTokenizer.vocab_size = vocab_size + 1
        differs=("the oldest release --piper supports",)),
    MegatronRelease(
        minor=17, tags=("core_v0.17.0", "core_v0.17.1"), entry="pretrain", null_tokenizer_eod=True, python=">=3.12",
        # megatron/training/initialize.py still imports validate_args by name; arguments.py has no
        # parse_and_validate_args; NullTokenizer (megatron/core/tokenizers/text/libraries/null_tokenizer.py): + 1
        differs=("needs Python 3.12", "parallel_state.initialize_model_parallel gains rank_offset and local_world_size "
                 "(Piper wraps it whole)")),
    MegatronRelease(
        minor=18, tags=("core_v0.18.0", "core_v0.18.2"), entry="parse_and_validate_args", null_tokenizer_eod=False,
        python=">=3.12",
        # megatron/training/arguments.py: parse_and_validate_args; initialize_megatron(allow_no_cuda, ...) and
        # pretrain(cfg_container, ...) take no extra_args_provider/args_defaults; NullTokenizer.vocab_size = vocab_size
        differs=("pretrain_gpt.py parses and validates in __main__ (arguments.parse_and_validate_args); "
                 "initialize_megatron and pretrain no longer take extra_args_provider or args_defaults",
                 "NullTokenizer's vocabulary is --vocab-size itself (its end-of-document id is the last one)",
                 "--position-embedding-type gains yarn (not modelled by Piper)")),
    MegatronRelease(
        minor=19, tags=("core_v0.19.0", "megatron-core 0.19.2 wheel"), entry="parse_and_validate_args",
        null_tokenizer_eod=False, python=">=3.12",
        # megatron/core/transformer/moe/moe_layer.py routed_experts_compute; transformer_config.py
        differs=("TransformerConfig.overlap_dispatch_backward_with_experts_wgrad (refused with Piper's fused "
                 "exchange, as delay_wgrad_compute)",
                 "MoELayer.routed_experts_compute passes the dispatcher's zero-copy buffers to the experts (none "
                 "for the alltoall dispatcher)", "--moe-flex-dispatcher-backend gains ncclep")),
)
SUPPORTED = f"{RELEASES[0].series}.x-{RELEASES[-1].series}.x"

# module:qualname -> parameter names, identical at every tag above: what Piper's dispatcher
# subclasses (MoEAlltoAllTokenDispatcher's phases), wraps (MoELayer's) or calls.
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher."
_LAYER = "megatron.core.transformer.moe.moe_layer:MoELayer."
RELIED_ON: dict[str, tuple[str, ...]] = {
    _DISPATCHER + "__init__": ("self", "num_local_experts", "local_expert_indices", "config", "pg_collection"),
    _DISPATCHER + "preprocess": ("self", "routing_map"),
    _DISPATCHER + "dispatch_preprocess": ("self", "hidden_states", "routing_map", "probs"),
    _DISPATCHER + "token_dispatch": ("self", "permutated_local_input_tokens", "permuted_probs"),
    _DISPATCHER + "dispatch_postprocess": ("self", "global_input_tokens", "global_probs"),
    _DISPATCHER + "combine_preprocess": ("self", "hidden_states"),
    _DISPATCHER + "token_combine": ("self", "hidden_states", "async_finish", "allocate_on_comm_stream"),
    _DISPATCHER + "combine_postprocess": ("self", "permutated_local_input_tokens"),
    _DISPATCHER + "set_shared_experts": ("self", "shared_experts"),
    _LAYER + "dispatch": ("self", "hidden_states", "probs"),
    _LAYER + "routed_experts_compute": ("self", "hidden_states", "probs"),
    _LAYER + "set_layer_number": ("self", "layer_number"),
    "megatron.core.transformer.moe.moe_utils:sort_chunks_by_idxs": ("input", "split_sizes", "sorted_idxs", "probs",
                                                                     "fused"),
    "megatron.core.tensor_parallel.mappings:gather_from_sequence_parallel_region":
        ("input_", "tensor_parallel_output_grad", "group", "output_split_sizes", "use_global_buffer"),
    "megatron.core.tensor_parallel.mappings:reduce_scatter_to_sequence_parallel_region":
        ("input_", "group", "input_split_sizes", "use_global_buffer"),
    "megatron.core.parallel_state:get_expert_model_parallel_group": ("check_initialized",),
}


def release(version: str) -> MegatronRelease:
    """The supported release of megatron-core ``version`` (pre- and dev releases count as theirs);
    SpecError naming the supported range and the fix otherwise."""
    try:
        minor = Version(version).release[:2]
    except InvalidVersion:
        minor = ()
    found = [r for r in RELEASES if minor == (0, r.minor)]
    if not found:
        raise SpecError("megatron-core", version, f"is not supported by --piper: supported {SUPPORTED}, whose "
                        "argument validation and MoE dispatcher APIs Piper hooks (piper_megatron/versions.py)",
                        f"install {REQUIREMENT}, or run without --piper")
    return found[0]


def installed_release() -> MegatronRelease:
    """The release of the megatron-core that ``import megatron.core`` finds (its ``package_info``)."""
    info = importlib.import_module("megatron.core.package_info")
    return release(info.__version__)


def distribution_release() -> MegatronRelease | None:
    """The release of the installed megatron-core distribution, read from its metadata without
    importing it (for a process that plans what a Megatron-LM script run here will plan, as
    :mod:`piper_megatron.twin` does); None when none is installed."""
    try:
        return release(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:
        return None


def drift() -> list[str]:
    """What differs between :data:`RELIED_ON` and the importable megatron-core, one line each."""
    lines = []
    for name, expected in RELIED_ON.items():
        module, _, qualname = name.partition(":")
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part, None)
        found = None if target is None else tuple(inspect.signature(target).parameters)
        if found != expected:
            lines.append(f"{name} takes {found or 'nothing (missing)'}, --piper relies on {expected}")
    return lines


def check_relied_on(found: MegatronRelease) -> None:
    """SpecError when the installed megatron-core's dispatcher APIs are not those of :data:`RELIED_ON`
    (a patch release that changed them): before Piper's dispatcher is bound to them."""
    lines = drift()
    if lines:
        raise SpecError("megatron-core", found.series, f"differs from the APIs --piper relies on in {SUPPORTED}: "
                        + "; ".join(lines), "report it to Piper with the megatron-core version, or run without --piper")


__all__ = ["Entry", "MegatronRelease", "RELEASES", "RELIED_ON", "REQUIREMENT", "SUPPORTED", "check_relied_on",
           "distribution_release", "drift", "installed_release", "release"]
