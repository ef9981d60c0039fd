"""Rank side of ``test_megatron_lm_dispatcher.py``: Megatron-LM's own alltoall dispatcher tests on
gloo CPU processes, against Megatron's dispatcher and every Piper variant.

The tests are ``TestAlltoAllDispatcher`` of ``tests/unit_tests/transformer/moe/test_a2a_token_dispatcher.py``
in a Megatron-LM checkout (core_v0.16.1), imported from that folder and called method by method with
their bodies unchanged; they build ``MoEModelTestContainer`` (``test_token_dispatcher.py``), which
calls ``Utils.initialize_model_parallel`` (``tests/unit_tests/test_utilities.py``), builds an
``MoELayer`` and drives its dispatcher phase by phase. What is swapped, and nothing else:

* the backend: the process group is the gloo group :func:`tests.gloo.run_ranks` opens (so
  ``Utils.initialize_distributed`` finds one and skips its NCCL set-up);
  :func:`piper_megatron.cpu.install_cpu_shims` lets the MoE layer run on the host; ``.cuda()`` of
  modules and tensors returns them unchanged and ``torch.cuda.synchronize`` does nothing (host work
  is synchronous); where ``triton`` is not installed, the Triton kernel module that
  ``megatron.training.initialize`` imports (and these tests never call) is a stand-in; where
  Transformer Engine is not, ``is_te_min_version`` answers False (0.16.1 raises TypeError);
* the class: for a Piper variant, ``Utils.initialize_model_parallel`` is followed by
  :func:`piper_megatron.dispatcher.install_dispatcher` on the expert-parallel groups just made
  (:func:`~piper_megatron.dispatcher.create_ep_comm`), so the container's layers hold
  ``PiperTokenDispatcher``; the patches are restored after each test.

Megatron's ``tests`` package and Piper's share a name: the checkout's ``tests`` folder is appended
to the ``__path__`` of Piper's (which has no ``unit_tests``), and the checkout itself to
``sys.path`` (its ``megatron/training`` joins the wheel's ``megatron`` namespace package).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import sys
import time
import traceback
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

A2A_TESTS = "tests.unit_tests.transformer.moe.test_a2a_token_dispatcher"
# (tp, ep) on 2 ranks: ep 2, and Megatron's own (1, 1) (expert parallel size 1, data parallel 2)
LAYOUTS = ((1, 2), (1, 1))
# case -> (method of TestAlltoAllDispatcher, its arguments besides tp_size/ep_size/permute_fusion);
# permute_fusion is False: the fused permutation is Transformer Engine's (permute_fusion_params)
TESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dropless": ("test_forward_backward", {"deterministic": False}),
    "dropless-deterministic": ("test_forward_backward", {"deterministic": True}),
    "capacity": ("test_capacity_forward_backward", {}),
    "capacity-padding": ("test_capacity_padding_forward_backward", {}),
}
CASES = tuple(f"tp{tp}-ep{ep}-{name}" for tp, ep in LAYOUTS for name in TESTS)
VARIANTS = ("stock", "flat", "hierarchical", "pipelined", "tune")
PIPELINED = ("pipelined", "tune")
NODES = ((0,), (1,))  # each rank its own "node": the hierarchical exchange runs its inter-node stage
CHUNKS = 2


def _settings(variant: str) -> Any:
    from piper_core.runtime import Algorithm
    from piper_megatron.dispatcher import DispatchSettings

    return {"stock": None,
            "flat": DispatchSettings(algorithm=Algorithm.FLAT),
            "hierarchical": DispatchSettings(algorithm=Algorithm.HIERARCHICAL),
            "pipelined": DispatchSettings(algorithm=Algorithm.FLAT, chunks=CHUNKS),
            "tune": DispatchSettings(algorithm=Algorithm.FLAT, chunks=CHUNKS, tune=True)}[variant]


# ---- the backend -----------------------------------------------------------------------------------

def _import_checkout(root: Path) -> types.ModuleType:
    """Megatron's test module, from the checkout at ``root`` (see the module docstring)."""
    import tests  # Piper's package: this module is part of it

    sys.path.append(str(root))
    tests.__path__.append(str(root / "tests"))
    if importlib.util.find_spec("triton") is None:
        _stand_in_batch_invariant_kernels()
    if importlib.util.find_spec("transformer_engine") is None:
        _no_te_version()
    return importlib.import_module(A2A_TESTS)


def _no_te_version() -> None:
    """0.16.1's ``megatron.core.utils.is_te_min_version`` compares ``None >= Version`` (TypeError)
    when Transformer Engine is absent; ``test_token_dispatcher.py`` calls it at import to choose
    ``permute_fusion_params``. Without TE no version is new enough: False."""
    from megatron.core import utils

    if utils.get_te_version() is None:
        utils.is_te_min_version = lambda version, check_equality=True: False


def _stand_in_batch_invariant_kernels() -> None:
    """``megatron.training.initialize`` imports ``enable_batch_invariant_mode`` from megatron-core's
    ``custom_layers/batch_invariant_kernels.py``, which imports ``triton`` at the top (a GPU kernel
    compiler). The dispatcher tests never call it; without triton it is a function that raises."""
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"

    def enable_batch_invariant_mode(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("batch-invariant mode needs triton (a stand-in module without it: tests only)")

    module = types.ModuleType(name)
    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    sys.modules[name] = module


@contextlib.contextmanager
def _on_host() -> Iterator[None]:
    """``.cuda()`` is the identity and ``torch.cuda.synchronize`` a no-op while the tests run."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)
        patch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
        patch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        yield


# ---- the class -------------------------------------------------------------------------------------

class _Swap:
    """Installs Piper's dispatcher after each ``Utils.initialize_model_parallel`` (a new comm per
    (tp, ep), cached: its groups outlive Megatron's) and records the dispatchers it builds."""

    def __init__(self, utils: Any, settings: Any, comms: dict[tuple[int, int], Any]) -> None:
        self.utils, self.settings, self.comms = utils, settings, comms
        self.patches: Any = None
        self.built: list[Any] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[_Swap]:
        original = vars(self.utils)["initialize_model_parallel"]  # a staticmethod

        def initialize_model_parallel(*args: Any, **kwargs: Any) -> None:
            original.__func__(*args, **kwargs)
            self._install()

        if self.settings is not None:
            self.utils.initialize_model_parallel = staticmethod(initialize_model_parallel)
        try:
            yield self
        finally:
            self.utils.initialize_model_parallel = original
            self._restore()

    def _install(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.transformer.moe import moe_layer

        from piper_core.runtime import NodeTopology
        from piper_megatron.dispatcher import create_ep_comm, install_dispatcher

        self._restore()
        key = (parallel_state.get_tensor_model_parallel_world_size(),
               parallel_state.get_expert_model_parallel_world_size())
        if key not in self.comms:
            self.comms[key] = create_ep_comm(NodeTopology(nodes=NODES))
        self.patches = install_dispatcher(self.comms[key], self.settings)
        bound, built = moe_layer.MoEAlltoAllTokenDispatcher, self.built
        init = bound.__init__

        def __init__(dispatcher: Any, *args: Any, **kwargs: Any) -> None:
            init(dispatcher, *args, **kwargs)
            built.append(dispatcher)

        bound.__init__ = __init__  # on the class install_dispatcher just made, not Piper's

    def _restore(self) -> None:
        if self.patches is not None:
            self.patches.restore()
            self.patches = None


def _phase_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    from piper_megatron.dispatcher import PhaseDrivenWarning

    return [str(w.message) for w in caught if issubclass(w.category, PhaseDrivenWarning)]


def _run_test(a2a: types.ModuleType, tp: int, ep: int, name: str) -> str | None:
    """One of Megatron's test methods as pytest would run it (setup, call, teardown); the
    traceback if it raised, skipped or failed, else None."""
    import pytest

    method_name, extra = TESTS[name]
    cls = a2a.TestAlltoAllDispatcher
    method = getattr(cls, method_name)
    test, monkeypatch = cls(), pytest.MonkeyPatch()
    kwargs = {"tp_size": tp, "ep_size": ep, "permute_fusion": False, **extra}
    if "monkeypatch" in inspect.signature(method).parameters:
        kwargs["monkeypatch"] = monkeypatch
    test.setup_method(method)
    try:
        getattr(test, method_name)(**kwargs)
        return None
    except (Exception, pytest.skip.Exception, pytest.fail.Exception):  # a skip fails the case too
        return traceback.format_exc()
    finally:
        monkeypatch.undo()
        test.teardown_method(method)


def _case(a2a: types.ModuleType, utils: Any, variant: str, tp: int, ep: int, name: str,
          comms: dict[tuple[int, int], Any]) -> dict[str, Any]:
    swap = _Swap(utils, _settings(variant), comms)
    with swap.active(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _run_test(a2a, tp, ep, name)
    used = [d for d in swap.built if d._counts is not None]  # preprocess ran: the test drove it
    return {"error": error, "built": [type(d).__name__ for d in swap.built], "used": len(used),
            "warned": sum(d._warned for d in used), "warnings": _phase_warnings(caught),
            "tuner_calls": [d.auto_chunks._calls for d in swap.built if d.auto_chunks is not None]}


def _fused_after_phases(utils: Any, variant: str, comms: dict[tuple[int, int], Any]) -> dict[str, Any]:
    """A pipelined layer's dispatcher driven phase by phase twice (Megatron's test helpers), then
    the layer's own forward and backward: one warning; the forward still pipelined (the experts run
    once per chunk: the first tuner candidate for ``tune``, whose tuner counts only that call)."""
    swap = _Swap(utils, _settings(variant), comms)
    with swap.active(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: dict[str, Any] = {"error": None, **_phases_then_forward()}
        except Exception:
            result = {"error": traceback.format_exc()}
        utils.destroy_model_parallel()  # the container's __del__ (a barrier) has run on every rank by now
        result["warnings"] = _phase_warnings(caught)
    return result


def _phases_then_forward() -> dict[str, Any]:
    from megatron.core.typed_torch import apply_module

    helpers = sys.modules["tests.unit_tests.transformer.moe.test_token_dispatcher"]
    container = helpers.MoEModelTestContainer(tp_size=1, ep_size=2, pp_size=1)
    layer, dispatcher = container.moe_layer, container.moe_layer.token_dispatcher
    for _ in range(2):
        x = torch.randn(16, layer.config.hidden_size, requires_grad=True)
        probs, indices = apply_module(layer.router)(x)
        out, _, out_probs = helpers.token_permutation(dispatcher, x, probs, indices)
        restored, _ = helpers.token_unpermutation(dispatcher, out * out_probs.unsqueeze(-1))
        restored.sum().backward()
    calls: list[int] = []
    hook = layer.experts.register_forward_hook(lambda m, args, out: calls.append(len(args[0])))
    y, _ = layer(torch.randn(8, 2, layer.config.hidden_size, requires_grad=True))
    y.sum().backward()
    hook.remove()
    tuner = dispatcher.auto_chunks
    return {"dispatcher": type(dispatcher).__name__, "expert_calls": len(calls),
            "tuner_calls": None if tuner is None else tuner._calls}


def run_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every variant x case on this rank: ``{"cases": {variant: {case: result}}, "fused": {...}}``."""
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what Utils reads at import
    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex/absl
    from piper_megatron.cpu import install_cpu_shims

    start = time.perf_counter()
    install_cpu_shims()
    a2a = _import_checkout(Path(root))
    utils = sys.modules["tests.unit_tests.test_utilities"].Utils
    comms: dict[tuple[int, int], Any] = {}
    imported = time.perf_counter()
    with _on_host():
        cases = {variant: {f"tp{tp}-ep{ep}-{name}": _case(a2a, utils, variant, tp, ep, name, comms)
                           for tp, ep in LAYOUTS for name in TESTS} for variant in VARIANTS}
        fused = {variant: _fused_after_phases(utils, variant, comms) for variant in PIPELINED}
    return {"cases": cases, "fused": fused,
            "timing": {"import_s": imported - start, "cases_s": time.perf_counter() - imported}}
