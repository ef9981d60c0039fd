"""Megatron-LM's command line as Piper reads it: Piper's flags, the model spec, the sizes a user
pinned, and the rewrite of Megatron's parallel arguments to a chosen plan.

Pure Python over ``argparse`` namespaces and the specs (no torch, no Megatron import), so that
``python -m piper_megatron ... --piper-plan-only`` plans from a laptop. Two sources of a namespace
with Megatron's attribute names feed :func:`model_spec_from_args`: Megatron's own parsed arguments
(inside the ``validate_args`` hook, :mod:`piper_megatron.install`) and, for plan-only runs,
:func:`parse_megatron_args`, whose flags, types and defaults are Megatron's
(``megatron/training/arguments.py`` at core_v0.16.1 and 0.19.2, where most of these flags are
generated from ``TransformerConfig`` fields; tests compare both against the real parsers; the same
at every tag from core_v0.16.1 to core_v0.19.0: :mod:`piper_megatron.versions`).
Flag names for the rewrite come from :func:`piper_core.export.parallel_flags`, the spec -> flags
mapping checked against Megatron's parser; this module is its inverse for the model. What the
command line pins (sizes written on it, ``--piper-off``) is :mod:`piper_megatron.pins`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from piper_core.errors import SpecError, nearest
from piper_core.export import parallel_flags
from piper_core.specs.model import MLASpec, ModelSpec
from piper_core.specs.parallel import LEGACY_PIPELINED, ParallelPlan, read_a2a
from piper_megatron.pins import OFF_NAMES, PINNABLE, Pins, off_names
from piper_megatron.versions import MegatronRelease

A2AFlag = Literal["auto", "flat", "hierarchical"]
# --piper-a2a's values; "pipelined" is the spelling from before the algorithm and the chunk count were
# independent, read by piper_core.specs.parallel.read_a2a as flat exchanges in 2 chunks or more.
A2A_FLAGS: tuple[str, ...] = ("auto", "flat", "hierarchical", LEGACY_PIPELINED)
GPT2_BPE_VOCAB = 50257  # len(encoder) of GPT-2's vocab.json (Megatron _GPT2BPETokenizer.vocab_size)
NULL_TOKENIZER = "NullTokenizer"


# ---- Piper's flags -------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class PiperOptions:
    """Piper's flags, checked. ``a2a`` (``--piper-a2a``): the exchange algorithm, auto (the
    scheduler picks), flat or hierarchical; ``chunks`` (``--piper-chunks``), independent of it: the
    pipeline chunks of every exchange (1: unpipelined), None means auto (the scheduler picks among
    counts >= ``min_chunks``); ``tune`` (``--piper-chunks tune``): each MoE layer measures its chunk
    count at run time, with either algorithm; ``min_chunks`` 2 only for the old ``--piper-a2a
    pipelined`` (flat, pipelined), whose reading ``notes`` holds; ``world_size``
    (``--piper-world-size``) stands in for the launcher's WORLD_SIZE in plan-only runs; ``off``
    (``--piper-off``): Megatron switches the plan must leave off (:data:`piper_megatron.pins.OFF_NAMES`);
    ``defer_wgrad`` (``--piper-defer-wgrad``): plans with ep > 1 defer the experts' weight gradients;
    ``placement`` (``--piper-placement``): the JSON file placing each logical expert in a physical slot,
    for every MoE layer or per layer (:mod:`piper_core.runtime.placement`; read and checked against the
    plan by ``install.plan_job``);
    ``routing`` (``--piper-routing``): tokens per expert per MoE layer, a histogram or ``--piper-trace``
    files (:mod:`piper_core.specs.routing`): the scheduler prices each MoE layer at its measured load;
    ``migrate_every`` (``--piper-migrate-every``): every that many iterations, between two of them,
    decide from the tokens routed since the last decision whether moving experts pays over
    ``migrate_horizon`` iterations (``--piper-migrate-horizon``, default ``migrate_every``), and move
    them if it does (:mod:`piper_megatron.live`)."""

    enabled: bool
    cluster: str | None = None
    profile: Path | None = None
    a2a: A2AFlag = "auto"
    chunks: int | None = None
    tune: bool = False
    min_chunks: int = 1
    notes: tuple[str, ...] = ()
    plan_only: bool = False
    trace: Path | None = None
    world_size: int | None = None
    off: tuple[str, ...] = ()
    defer_wgrad: bool = False
    placement: Path | None = None
    routing: tuple[Path, ...] = ()
    migrate_every: int | None = None
    migrate_horizon: int | None = None


def _chunks(text: str) -> int | str | None:
    if text == "auto":
        return None
    if text == "tune":
        return text
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--piper-chunks {text!r}: give 'auto', 'tune' or a whole number >= 1") \
            from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def add_piper_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Piper's flags to ``parser`` (Megatron's ``extra_args_provider`` shape: returns it)."""
    group = parser.add_argument_group("Piper", "plan the parallel layout and run Piper's MoE all-to-all")
    group.add_argument("--piper", action="store_true",
                       help="plan tp/pp/vpp/ep/etp/cp, micro batch and recompute for this job and use "
                            "Piper's token dispatcher; sizes given on the command line are kept")
    group.add_argument("--piper-cluster", metavar="NAME|YAML", help="cluster preset name or ClusterSpec YAML")
    group.add_argument("--piper-profile", metavar="YAML", type=Path,
                       help="calibrated profile written by `piper calibrate` (instead of --piper-cluster)")
    group.add_argument("--piper-a2a", choices=A2A_FLAGS, default="auto", metavar="auto|flat|hierarchical",
                       help="MoE all-to-all algorithm: auto (the scheduler picks), flat or hierarchical (intra-node, "
                            "then inter-node); the old 'pipelined' is read as flat with --piper-chunks >= 2")
    group.add_argument("--piper-chunks", type=_chunks, default=None, metavar="N|auto|tune",
                       help="pipeline chunks of the all-to-all, with either algorithm (chunk k+1's exchange overlaps "
                            "chunk k's experts): N (1: unpipelined), auto (the scheduler picks; default) or tune "
                            "(each MoE layer measures 1/2/4/8 chunks for 3 steps each, then keeps the fastest)")
    group.add_argument("--piper-defer-wgrad", action="store_true",
                       help="compute the experts' weight gradients after posting each dispatch gradient, while it "
                            "is in flight (plans with ep > 1; bit-identical gradients; priced by the scheduler)")
    group.add_argument("--piper-placement", type=Path, metavar="FILE",
                       help="expert placement JSON, one for every MoE layer ({\"num_experts\": E, \"ep\": N, "
                            "\"ranks\": [[logical expert ids of rank 0], ...]}) or one per MoE layer (\"layers\": "
                            "{layer_number: ranks}, as piper placement --out and a migrated checkpoint write; layers "
                            "not listed keep the default): the dispatcher sends each logical expert's tokens to its "
                            "slot; the slots' weights must be those experts' (docs/placement.md)")
    group.add_argument("--piper-routing", type=Path, nargs="+", metavar="FILE",
                       help="measured routing (a tokens-per-expert histogram per MoE layer, or this job's "
                            "--piper-trace files): the scheduler prices each MoE layer at its busiest rank under the "
                            "placement (--piper-placement, else Megatron's contiguous one; docs/routing.md)")
    group.add_argument("--piper-migrate-every", metavar="N",
                       help="every N iterations, between two of them: sum the tokens each MoE layer's router sent "
                            "each expert since the last decision over the job, let the placement optimizer propose "
                            "a placement per layer, and move the experts (weights, gradients, optimizer state) when "
                            "the predicted step saving over --piper-migrate-horizon iterations exceeds the predicted "
                            "move; rank 0 prints each decision, checkpoints keep the placement "
                            "(docs/migration.md)")
    group.add_argument("--piper-migrate-horizon", metavar="H",
                       help="iterations a migration's predicted saving is counted over (default: "
                            "--piper-migrate-every's N)")
    group.add_argument("--piper-plan-only", action="store_true", help="print the plan and exit")
    group.add_argument("--piper-trace", type=Path, metavar="FILE",
                       help="write per-layer, per-rank dispatch/expert/combine times as JSON lines")
    group.add_argument("--piper-world-size", type=_positive, metavar="N",
                       help="world size to plan for with --piper-plan-only when no launcher sets WORLD_SIZE")
    group.add_argument("--piper-off", action="append", metavar="NAME[,NAME...]",
                       help="Megatron switches the plan must leave off (repeatable): " + ", ".join(OFF_NAMES))
    return parser


PIPER_FLAGS: frozenset[str] = frozenset(
    s for a in add_piper_arguments(argparse.ArgumentParser(add_help=False))._actions for s in a.option_strings)


def check_piper_flags(argv: Sequence[str]) -> None:
    """Every argument starting with ``--piper`` is exactly one of Piper's flags (SpecError naming
    the nearest otherwise): Piper's own reading (``parse_known_args``) would skip a misspelt flag,
    and Megatron's parser would skip it too under ``ignore_unknown_args`` or, with ``allow_abbrev``,
    take a prefix such as ``--piper-chunk`` for ``--piper-chunks``."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if arg.startswith("--piper") and flag not in PIPER_FLAGS:
            near = nearest(flag, PIPER_FLAGS)
            raise SpecError("flag", flag, f"is not one of Piper's flags ({', '.join(sorted(PIPER_FLAGS))})",
                            f"write {near}" if near else "see python -m piper_megatron --help")


def piper_options(ns: argparse.Namespace) -> PiperOptions:
    """:class:`PiperOptions` from a namespace holding Piper's flags (SpecError on a bad mix)."""
    given_chunks = getattr(ns, "piper_chunks", None)
    tune = given_chunks == "tune"
    chunks = None if tune else given_chunks
    given_a2a = getattr(ns, "piper_a2a", "auto")
    a2a, min_chunks, notes = _read_a2a_flag(given_a2a, given_chunks)
    options = PiperOptions(enabled=bool(getattr(ns, "piper", False)), cluster=getattr(ns, "piper_cluster", None),
                           profile=getattr(ns, "piper_profile", None), a2a=a2a, chunks=chunks, tune=tune,
                           min_chunks=min_chunks, notes=notes, plan_only=bool(getattr(ns, "piper_plan_only", False)),
                           trace=getattr(ns, "piper_trace", None), world_size=getattr(ns, "piper_world_size", None),
                           off=off_names(getattr(ns, "piper_off", None)),
                           defer_wgrad=bool(getattr(ns, "piper_defer_wgrad", False)),
                           placement=getattr(ns, "piper_placement", None),
                           routing=tuple(getattr(ns, "piper_routing", None) or ()),
                           migrate_every=_iterations(ns, "piper_migrate_every"),
                           migrate_horizon=_iterations(ns, "piper_migrate_horizon"))
    given = [flag for flag, on in (("--piper-cluster", options.cluster), ("--piper-profile", options.profile),
                                   ("--piper-a2a", given_a2a != "auto"), ("--piper-chunks", given_chunks),
                                   ("--piper-plan-only", options.plan_only), ("--piper-trace", options.trace),
                                   ("--piper-world-size", options.world_size),
                                   ("--piper-defer-wgrad", options.defer_wgrad),
                                   ("--piper-placement", options.placement),
                                   ("--piper-routing", options.routing),
                                   ("--piper-migrate-every", options.migrate_every),
                                   ("--piper-migrate-horizon", options.migrate_horizon),
                                   ("--piper-off", getattr(ns, "piper_off", None))) if on]
    if given and not options.enabled:
        raise SpecError(given[0], "given", "Piper's flags act only together with --piper (without it nothing of "
                        "Megatron is changed)", "add --piper, or drop " + ", ".join(given))
    if options.world_size is not None and not options.plan_only:
        raise SpecError("--piper-world-size", options.world_size, "stands in for the launcher only when "
                        "planning (--piper-plan-only); a real run takes its world size from the launcher",
                        "add --piper-plan-only, or drop --piper-world-size and launch with torchrun")
    if options.migrate_horizon is not None and options.migrate_every is None:
        raise SpecError("--piper-migrate-horizon", options.migrate_horizon, "counts a migration's gain over that many "
                        "iterations, and no migration is decided without --piper-migrate-every",
                        "add --piper-migrate-every N, or drop --piper-migrate-horizon")
    if options.migrate_every is not None and options.migrate_horizon is None:
        options = dataclasses.replace(options, migrate_horizon=options.migrate_every)
    if options.profile is not None and options.profile.suffix not in (".yaml", ".yml"):
        raise SpecError("--piper-profile", str(options.profile), "must be a YAML file (.yaml or .yml)",
                        "pass the profile `piper calibrate --out` wrote")
    return options


def _iterations(ns: argparse.Namespace, dest: str) -> int | None:
    """A whole number of iterations >= 1 given as ``--piper-migrate-*`` (None when not given; SpecError
    naming the flag otherwise)."""
    text = getattr(ns, dest, None)
    if text is None:
        return None
    flag = "--" + dest.replace("_", "-")
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < 1:
        what = "decides every that many iterations" if dest == "piper_migrate_every" else \
            "counts the gain over that many iterations"
        raise SpecError(flag, text, f"must be a whole number of iterations >= 1 ({what})",
                        f"write e.g. {flag} 100")
    return value


def _read_a2a_flag(given: str, chunks: int | str | None) -> tuple[A2AFlag, int, tuple[str, ...]]:
    """(algorithm, least chunk count, notes) of ``--piper-a2a``: the old ``pipelined`` (flat exchanges
    in 2 chunks or more) is read by :func:`read_a2a` as flat with chunks auto among >= 2, or the
    chunks given, with its FutureWarning and the note the report prints."""
    if given == LEGACY_PIPELINED and chunks == 1:
        raise SpecError("--piper-chunks", 1, "--piper-a2a pipelined meant flat exchanges in 2 chunks or more, so "
                        "one chunk contradicts it", "write --piper-a2a flat --piper-chunks 1 (unpipelined), or "
                        "--piper-a2a flat --piper-chunks N with N >= 2")
    shown = {None: "2 or more (auto)", "tune": "tuned"}.get(chunks, chunks)  # type: ignore[arg-type]
    a2a, _, note = read_a2a(given, shown, where="--piper-a2a")
    return (a2a, 1, ()) if note is None else (a2a, 2, (note,))


def parse_piper_options(argv: Sequence[str]) -> PiperOptions:
    """Piper's flags from a command line that also holds Megatron's (those are ignored here; a
    misspelt Piper flag is an error, :func:`check_piper_flags`)."""
    check_piper_flags(argv)
    parser = add_piper_arguments(argparse.ArgumentParser(prog="piper_megatron", allow_abbrev=False,
                                                         add_help=False))
    known, _ = parser.parse_known_args(list(argv))
    return piper_options(known)


# ---- Megatron's flags (for planning without megatron.training) -------------------------------

def _moe_freq(text: str) -> int | list[int]:
    """Megatron's ``moe_freq_type``: an int N, or a list expression such as ``([0]*3+[1]*58)``."""
    if "[" not in text:
        return int(text)
    return eval_layer_pattern(text)


# (flag, dest, type, default): Megatron's, read from its parser (tests compare them).
_MODEL_FLAGS: tuple[tuple[str, str, Callable[[str], Any] | None, Any], ...] = (
    ("--num-layers", "num_layers", int, None), ("--hidden-size", "hidden_size", int, None),
    ("--ffn-hidden-size", "ffn_hidden_size", int, None), ("--num-attention-heads", "num_attention_heads", int, None),
    ("--num-query-groups", "num_query_groups", int, 1), ("--kv-channels", "kv_channels", int, None),
    ("--num-experts", "num_experts", int, None), ("--moe-ffn-hidden-size", "moe_ffn_hidden_size", int, None),
    ("--moe-router-topk", "moe_router_topk", int, 2),
    ("--moe-shared-expert-intermediate-size", "moe_shared_expert_intermediate_size", int, None),
    ("--moe-layer-freq", "moe_layer_freq", _moe_freq, 1),
    ("--moe-expert-capacity-factor", "moe_expert_capacity_factor", float, None),
    ("--moe-router-num-groups", "moe_router_num_groups", int, None),
    ("--moe-router-group-topk", "moe_router_group_topk", int, None),
    ("--mtp-num-layers", "mtp_num_layers", int, None),
    ("--seq-length", "seq_length", int, None), ("--vocab-size", "vocab_size", int, None),
    ("--vocab-file", "vocab_file", str, None), ("--tokenizer-type", "tokenizer_type", str, None),
    ("--normalization", "normalization", str, "LayerNorm"),
    ("--q-lora-rank", "q_lora_rank", int, None), ("--kv-lora-rank", "kv_lora_rank", int, 32),
    ("--qk-head-dim", "qk_head_dim", int, 128), ("--qk-pos-emb-head-dim", "qk_pos_emb_head_dim", int, 64),
    ("--v-head-dim", "v_head_dim", int, 128),
    ("--position-embedding-type", "position_embedding_type", str, "learned_absolute"),
    ("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by", int, 128),
    ("--attention-dropout", "attention_dropout", float, 0.1), ("--hidden-dropout", "hidden_dropout", float, 0.1),
    ("--moe-token-dispatcher-type", "moe_token_dispatcher_type", str, "allgather"),
    ("--attention-backend", "attention_backend", str, "auto"),
    ("--global-batch-size", "global_batch_size", int, None), ("--micro-batch-size", "micro_batch_size", int, None),
    ("--load", "load", str, None), ("--save", "save", str, None),
)
# (flag, dest, default) of store_true switches; --disable-bias-linear is Megatron's store_false.
_MODEL_SWITCHES: tuple[tuple[str, str, bool], ...] = (
    ("--group-query-attention", "group_query_attention", False), ("--swiglu", "swiglu", False),
    ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights", False),
    ("--qk-layernorm", "qk_layernorm", False), ("--multi-latent-attention", "multi_latent_attention", False),
    ("--add-qkv-bias", "add_qkv_bias", False), ("--bf16", "bf16", False), ("--fp16", "fp16", False),
    ("--use-checkpoint-args", "use_checkpoint_args", False), ("--overlap-grad-reduce", "overlap_grad_reduce", False),
    ("--overlap-param-gather", "overlap_param_gather", False),
    ("--use-precision-aware-optimizer", "use_precision_aware_optimizer", False),
)


def parse_megatron_args(argv: Sequence[str]) -> argparse.Namespace:
    """The model, batch and precision flags of ``pretrain_gpt.py`` from ``argv`` with Megatron's
    defaults (other flags are ignored), plus the parallel sizes as Megatron's parser leaves them."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False)
    for flag, dest, kind, default in _MODEL_FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=default)
    for flag, dest, default in _MODEL_SWITCHES:
        parser.add_argument(flag, dest=dest, action="store_true", default=default)
    parser.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=True)
    # how the experts run (priced by piper_megatron.install._experts_as_written); not a model or parallel flag
    parser.add_argument("--moe-grouped-gemm", dest="moe_grouped_gemm", action="store_true", default=False)
    for flag, (dest, kind, default) in PINNABLE.items():
        if not any(a.dest == dest for a in parser._actions):
            parser.add_argument(flag, dest=dest, **({"action": "store_true", "default": False} if kind is None
                                                     else {"type": kind, "default": default}))
    known, _ = parser.parse_known_args(list(argv))
    return known


# ---- Megatron arguments -> ModelSpec -------------------------------------------------------------

def eval_layer_pattern(text: str) -> list[int]:
    """A ``--moe-layer-freq`` list expression (``[1]*3+[0]`` style: lists, ints, ``+``, ``*``),
    evaluated without ``eval``."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        result = None
    if not isinstance(result, list) or any(v not in (0, 1) for v in result):
        raise SpecError("--moe-layer-freq", text, "must be an int or a list expression of 0/1 per layer",
                        "write e.g. 1, 2 or '([0]*3+[1]*58)'")
    return result


def moe_layout(freq: int | str | Sequence[int], num_layers: int) -> tuple[int, int]:
    """(moe_first_k_dense, moe_layer_freq) of ModelSpec for Megatron's ``--moe-layer-freq``."""
    if isinstance(freq, str):
        freq = _moe_freq(freq)
    if isinstance(freq, int):
        return 0, freq
    pattern = tuple(bool(v) for v in freq)
    if len(pattern) != num_layers:
        raise SpecError("--moe-layer-freq", list(freq), f"lists {len(pattern)} layers, the model has {num_layers}",
                        "give one 0/1 per layer")
    first = pattern.index(True) if True in pattern else num_layers
    for every in range(1, num_layers + 1):
        for k in range(first + 1):  # ModelSpec's rule: layer i is MoE when i >= k and i % every == 0
            if all(moe == (i >= k and i % every == 0) for i, moe in enumerate(pattern)):
                return k, every
    raise SpecError("--moe-layer-freq", list(freq), "Piper models MoE layers as leading dense layers, then every "
                    "N-th layer (ModelSpec moe_first_k_dense, moe_layer_freq); this pattern is not of that form",
                    "use a pattern such as ([0]*3+[1]*58) or ([1,0]*12), or plan without --piper")


def vocab_size(ns: argparse.Namespace, defaults: Mapping[str, Any], release: MegatronRelease | None = None) -> int:
    """Vocabulary before padding, as Megatron's tokenizer reports it.

    ``--vocab-size`` when given, plus the end-of-document token that the NullTokenizer of
    ``release`` appends (:attr:`~piper_megatron.versions.MegatronRelease.null_tokenizer_eod`: 0.16
    and 0.17; ``release`` None reads it as the newest release does, without); GPT2BPETokenizer: the
    entries of ``--vocab-file`` when readable, else GPT-2's 50257. Other tokenizers must be loaded
    to know, so ``--vocab-size`` is required (they ignore it). ``defaults``: the script's
    ``args_defaults`` (pretrain_gpt.py defaults the tokenizer to GPT2BPETokenizer).
    """
    tokenizer = getattr(ns, "tokenizer_type", None) or defaults.get("tokenizer_type")
    given = getattr(ns, "vocab_size", None)
    if given is not None:
        return given + int(tokenizer == NULL_TOKENIZER and release is not None and release.null_tokenizer_eod)
    if tokenizer == "GPT2BPETokenizer":
        path = getattr(ns, "vocab_file", None)
        if path and Path(path).is_file():
            return len(json.loads(Path(path).read_text()))
        return GPT2_BPE_VOCAB
    raise SpecError("--vocab-size", None, f"Piper needs the vocabulary size and cannot read it from "
                    f"--tokenizer-type {tokenizer} without loading the tokenizer",
                    "add --vocab-size N (Megatron uses it only for NullTokenizer; other tokenizers ignore it)")


def vocab_notes(ns: argparse.Namespace, defaults: Mapping[str, Any], release: MegatronRelease | None) -> list[str]:
    """The report's note when ``release``'s NullTokenizer makes the vocabulary ``--vocab-size`` + 1."""
    read = vocab_size(ns, defaults, release) if getattr(ns, "vocab_size", None) is not None else None
    if read is None or read == ns.vocab_size:
        return []
    return [f"megatron-core {release.series}'s NullTokenizer appends an end-of-document token: vocabulary {read} "
            f"(--vocab-size {ns.vocab_size} + 1), padded as Megatron pads it"]


def _required(ns: argparse.Namespace, dest: str) -> int:
    value = getattr(ns, dest, None)
    if value is None:
        flag = "--" + dest.replace("_", "-")
        raise SpecError(flag, None, "is required with --piper (the model spec needs it)", f"add {flag} N")
    return value


def _position(ns: argparse.Namespace) -> str:
    kind = getattr(ns, "position_embedding_type", "learned_absolute")
    if kind not in ("rope", "learned_absolute", "none"):
        raise SpecError("--position-embedding-type", kind, "Piper models rope, learned_absolute and none",
                        "choose one of those, or plan without --piper")
    return kind


def _mla(ns: argparse.Namespace) -> MLASpec | None:
    if not getattr(ns, "multi_latent_attention", False):
        return None
    return MLASpec(q_lora_rank=ns.q_lora_rank, kv_lora_rank=ns.kv_lora_rank, qk_head_dim=ns.qk_head_dim,
                   qk_pos_emb_head_dim=ns.qk_pos_emb_head_dim, v_head_dim=ns.v_head_dim)


def model_name(spec_fields: Mapping[str, Any]) -> str:
    """A short name for a model read off a command line, e.g. ``gpt-24L-4096H-512E-top1``."""
    name = f"gpt-{spec_fields['num_layers']}L-{spec_fields['hidden_size']}H"
    if spec_fields.get("num_experts"):
        name += f"-{spec_fields['num_experts']}E-top{spec_fields['moe_router_topk']}"
    return name


def model_spec_from_args(ns: argparse.Namespace, defaults: Mapping[str, Any] | None = None, *,
                         release: MegatronRelease | None = None) -> ModelSpec:
    """The ModelSpec of the GPT model Megatron builds from ``ns`` (Megatron's argument names).

    Defaults that ``validate_args`` fills (it has not run yet) follow its rules: ffn_hidden_size
    4h, or int(8h/3 / 64) * 64 with --swiglu; moe_ffn_hidden_size = ffn_hidden_size; query groups
    only with --group-query-attention. ``defaults`` is the script's ``args_defaults``; ``release``
    the megatron-core that builds it (:func:`vocab_size`).
    """
    defaults = defaults or {}
    hidden = _required(ns, "hidden_size")
    swiglu = bool(getattr(ns, "swiglu", False))
    ffn = getattr(ns, "ffn_hidden_size", None) or (int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden)
    layers, experts = _required(ns, "num_layers"), getattr(ns, "num_experts", None) or 0
    fields: dict[str, Any] = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=_required(ns, "num_attention_heads"),
        num_query_groups=ns.num_query_groups if getattr(ns, "group_query_attention", False) else None,
        kv_channels=getattr(ns, "kv_channels", None), ffn_hidden_size=ffn, num_experts=experts,
        seq_length=_required(ns, "seq_length"), vocab_size=vocab_size(ns, defaults, release),
        make_vocab_size_divisible_by=getattr(ns, "make_vocab_size_divisible_by", 128), gated_linear_unit=swiglu,
        tie_embeddings=not getattr(ns, "untie_embeddings_and_output_weights", False),
        normalization=getattr(ns, "normalization", "LayerNorm"), add_bias_linear=getattr(ns, "add_bias_linear", True),
        add_qkv_bias=bool(getattr(ns, "add_qkv_bias", False)), qk_layernorm=bool(getattr(ns, "qk_layernorm", False)),
        position_embedding=_position(ns), attention_dropout=getattr(ns, "attention_dropout", 0.1),
        hidden_dropout=getattr(ns, "hidden_dropout", 0.1), mla=_mla(ns),
        mtp_num_layers=getattr(ns, "mtp_num_layers", None) or 0,
    )
    if fields["mla"] is not None:
        fields.update(num_query_groups=None, kv_channels=None)
    if experts:
        first_k, freq = moe_layout(getattr(ns, "moe_layer_freq", 1), layers)
        fields.update(moe_ffn_hidden_size=getattr(ns, "moe_ffn_hidden_size", None) or ffn,
                      moe_router_topk=getattr(ns, "moe_router_topk", 2), moe_first_k_dense=first_k,
                      moe_layer_freq=freq,
                      moe_shared_expert_intermediate_size=getattr(ns, "moe_shared_expert_intermediate_size", None) or 0,
                      moe_capacity_factor=getattr(ns, "moe_expert_capacity_factor", None),
                      moe_router_num_groups=getattr(ns, "moe_router_num_groups", None),
                      moe_router_group_topk=getattr(ns, "moe_router_group_topk", None))
    try:
        return ModelSpec(name=model_name(fields), **fields)
    except SpecError as exc:
        raise SpecError(exc.key, exc.value, exc.rule, exc.fix, where="model read from the Megatron arguments") from exc


# ---- rewrite -----------------------------------------------------------------------------------------

# Settings the plan owns: when a plan leaves one out, it is reset to Megatron's default so that a
# value from the command line cannot contradict the plan (explicit flags are never reset: pinned).
_RESETS: dict[str, Any] = {
    "num_layers_per_virtual_pipeline_stage": None, "num_virtual_stages_per_pipeline_rank": None,
    "pipeline_model_parallel_layout": None,
    "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
    "sequence_parallel": False, "recompute_granularity": None, "recompute_method": None,
    "recompute_num_layers": None, "use_distributed_optimizer": False, "overlap_param_gather": False,
    "grad_reduce_in_bf16": False, "optimizer_cpu_offload": False, "use_precision_aware_optimizer": False,
}
# export.parallel_flags dests that are inputs to the plan, not choices of it.
_INPUTS = frozenset({"global_batch_size", "bf16", "fp16", "attention_backend"})
_VPP = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")


def megatron_settings(model: ModelSpec, plan: ParallelPlan, pins: Pins) -> dict[str, Any]:
    """dest -> value for Megatron's arguments under ``plan`` (flag names from
    :func:`piper_core.export.parallel_flags`, in its order, then the resets), the switches of
    ``--piper-off`` off, without the dests the user gave explicitly."""
    settings: dict[str, Any] = {}
    for flag, value in parallel_flags(model, plan):
        dest = flag[2:].replace("-", "_")
        if dest not in _INPUTS:
            settings[dest] = True if value is None else value
    if model.is_moe:
        settings["moe_token_dispatcher_type"] = "alltoall"
    settings |= {dest: value for dest, value in _RESETS.items() if dest not in settings}
    settings |= pins.off_dests  # e.g. --overlap-grad-reduce, which every plan sets otherwise
    given = pins.values
    skip = set(given) | (set(_VPP) if any(d in given for d in _VPP) else set())
    if "recompute_granularity" in given:
        skip |= {"recompute_method", "recompute_num_layers"}
    return {dest: value for dest, value in settings.items() if dest not in skip}


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    dest: str
    old: Any
    new: Any

    def describe(self) -> str:
        """e.g. ``--tensor-model-parallel-size 4 (was 1)``, ``--sequence-parallel (was off)``."""
        return f"--{self.dest.replace('_', '-')} {_show(self.new)} (was {_show(self.old)})"


def _show(value: Any) -> str:
    """A switch as on/off, an absent value as unset, anything else as written."""
    if value is None:
        return "unset"
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def apply_settings(ns: argparse.Namespace, settings: Mapping[str, Any]) -> list[Change]:
    """Set ``settings`` on Megatron's namespace; the changes made, in order."""
    changes = []
    for dest, value in settings.items():
        old = getattr(ns, dest, None)
        if old != value:
            setattr(ns, dest, value)
            changes.append(Change(dest=dest, old=old, new=value))
    return changes
