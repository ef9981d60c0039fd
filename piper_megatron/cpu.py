"""Let Megatron-Core's MoE layers and GPTModel run on CPU over gloo (tests and CPU demos only).

Megatron-Core assumes a CUDA device (and, in 0.16.1, Transformer Engine) in a handful of places
on the MoE GPT path. :func:`install_cpu_shims` redirects those places to the host, each patch
confined to the Megatron module that needs it:

- in the modules of ``_HOST_DEVICE_MODULES`` the module-global name ``torch`` is rebound to a
  copy of ``torch`` whose ``cuda`` answers ``current_device()`` with the CPU and has no-op streams
  and events; every other module, and ``torch`` itself, is untouched;
- the dispatcher's ``maybe_move_tensor_to_cpu`` turns host split sizes into numpy arrays;
- 0.16.1's router gets the ``te_general_gemm = None`` its no-Transformer-Engine branch expects;
- Megatron's RNG tracker class is replaced by one that forks the CPU generator;
- multi-latent attention learns that Transformer Engine is absent (0.16.1 mistakes the stand-in
  Megatron puts in TE's place for TE itself);
- the default causal mask (used when no attention mask is passed) is made on the host;
- tied embeddings copy their first-stage weights to the last stage without ``Tensor.cuda()``.

Only tests and CPU demos import this module, explicitly; no GPU code path does, because the shims
would move the work onto the host. Install before building models (the dispatcher and RNG tracker
read the patched names at construction time).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Module -> why its ``torch.cuda`` lookups must answer with the host (one line per patch).
_HOST_DEVICE_MODULES: dict[str, str] = {
    "megatron.core.transformer.moe.token_dispatcher":
        "MoEAlltoAllTokenDispatcher makes a D2H torch.cuda.Stream in __init__ and syncs it with "
        "torch.cuda.current_stream/stream/Event in _maybe_dtoh_and_synchronize",
    "megatron.core.tensor_parallel.mappings":
        "all-to-all-v and all-gather allocate their output on torch.cuda.current_device()",
    "megatron.core.transformer.moe.router":
        "Router.gating moves CPU-initialised router weights to torch.cuda.current_device()",
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        "RotaryEmbedding.forward moves inv_freq to torch.cuda.current_device() on first use",
    "megatron.core.tensor_parallel.layers":
        "the sequence-parallel linear backward allocates its reduce-scatter buffer on "
        "torch.cuda.current_device()",
    "megatron.core.utils":
        "GlobalMemoryBuffer.get_tensor, the unfused attention's score buffer, allocates on "
        "torch.cuda.current_device()",
    "megatron.core.transformer.multi_token_prediction":
        "MTPLossLoggingHelper.save_loss_to_tracker allocates the MTP loss tracker on torch.cuda.current_device()",
}
_MARK = "_piper_cpu_shim"


class _HostEvent:
    """A CUDA event stand-in: host work is complete when issued, so every wait returns at once."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream stand-in: the host runs everything in order, so ordering calls are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: _HostEvent | None = None) -> _HostEvent:
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        return None


_HOST_STREAM = _HostStream()


def _forwarding_module(name: str, original: types.ModuleType, **overrides: Any) -> types.ModuleType:
    """A module object with ``original``'s names plus ``overrides``; unknown names fall through."""
    module = types.ModuleType(name)
    module.__dict__.update(original.__dict__)
    module.__dict__.update(overrides)
    module.__getattr__ = lambda attr: getattr(original, attr)  # PEP 562: lazily created names
    setattr(module, _MARK, True)
    return module


def _host_torch() -> types.ModuleType:
    """``torch`` as the patched modules see it: identical except that ``torch.cuda`` is the host."""
    cuda = _forwarding_module(
        "torch.cuda", torch.cuda,
        current_device=lambda: torch.device("cpu"),
        current_stream=lambda device=None: _HOST_STREAM,
        default_stream=lambda device=None: _HOST_STREAM,
        stream=lambda stream=None: contextlib.nullcontext(),
        Stream=_HostStream,
        Event=_HostEvent,
    )
    return _forwarding_module("torch", torch, cuda=cuda)


def _patch_host_device() -> None:
    host = None
    for name in _HOST_DEVICE_MODULES:
        module = importlib.import_module(name)
        if getattr(module.torch, _MARK, False):
            continue
        host = host or _host_torch()
        module.torch = host


def _patch_split_sizes() -> None:
    """Split sizes on the host stay tensors in ``maybe_move_tensor_to_cpu`` (it converts only CUDA
    tensors), and ``all_to_all_single`` rejects tensor splits with a TypeError; return numpy as the
    GPU path does. The dispatcher imported the name, so both bindings are replaced."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original: Callable[..., Any] = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, _MARK, False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    setattr(maybe_move_tensor_to_cpu, _MARK, True)
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(dispatcher, "maybe_move_tensor_to_cpu"):
        dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_router_gemm() -> None:
    """0.16.1 defines ``te_general_gemm`` only when Transformer Engine imports, yet the router's
    ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` (NameError without TE)."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _host_rng_tracker_class() -> type:
    random = importlib.import_module("megatron.core.tensor_parallel.random")

    class HostRNGStatesTracker(random.CudaRNGStatesTracker):
        """Named RNG streams on the CPU generator. Megatron's tracker saves and restores the CUDA
        generator (``torch.cuda.get_rng_state``), which a CPU build lacks; dropout on CPU draws from
        the CPU generator, so that is the one forked here."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"RNG state '{name}' is already tracked")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"RNG state '{name}' was never added (call model_parallel_cuda_manual_seed)")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    setattr(HostRNGStatesTracker, _MARK, True)
    return HostRNGStatesTracker


def _patch_rng_tracker() -> None:
    """``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` (attention dropout,
    expert init) use CUDA generator states; ``initialize_rng_tracker`` instantiates the module-global
    ``CudaRNGStatesTracker``, so that name is rebound and any CUDA tracker already made is dropped."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    if getattr(random.CudaRNGStatesTracker, _MARK, False):
        return
    random.CudaRNGStatesTracker = _host_rng_tracker_class()
    random._CUDA_RNG_STATE_TRACKER = None
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


@functools.lru_cache(maxsize=8)
def _patch_checkpoint_rng() -> None:
    """Full recompute (``CheckpointFunction``) saves and restores every generator's state around the
    recomputed forward (``_get_all_rng_states`` / ``_set_all_rng_states`` in
    megatron/core/tensor_parallel/random.py); its CUDA part calls ``torch.cuda.get_rng_state``, which a
    CPU build lacks. On the host there is no CUDA generator: the CPU generator (saved beside it) and
    the tracker's states (host generators, :func:`_patch_rng_tracker`) are the whole state, so the CUDA
    part becomes an empty state that restores nothing."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    if getattr(random._get_cuda_rng_state, _MARK, False):
        return

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_state(new_state: Any, device: int = -1, graph_safe: bool = False) -> None:
        return None

    setattr(get_state, _MARK, True)
    random._get_cuda_rng_state, random._set_cuda_rng_state = get_state, set_state


def _host_causal_mask(sq: int) -> torch.Tensor:
    """[sq, sq] bool, True above the diagonal: the positions a causal query must not see."""
    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


def _patch_causal_mask() -> None:
    """``transformer.utils.get_default_causal_mask`` builds its mask with ``device="cuda"``; the
    unfused softmax (``fusions.fused_softmax``, which imported the name) calls it whenever the
    attention mask is None."""
    for name in ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax"):
        module = importlib.import_module(name)
        if hasattr(module, "get_default_causal_mask"):
            module.get_default_causal_mask = _host_causal_mask


def _patch_mla_te_guard() -> None:
    """0.16.1 without Transformer Engine: ``extensions.transformer_engine`` binds ``te`` to a
    MagicMock, so ``multi_latent_attention``'s ``try: import TELinear`` succeeds, its ``HAVE_TE`` is
    True, and ``MLASelfAttention.__init__`` raises TypeError on ``isinstance(x, TELinear)``."""
    te_ext = importlib.import_module("megatron.core.extensions.transformer_engine")
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if not te_ext.HAVE_TE:
        mla.HAVE_TE = False


def _patch_tied_embedding_sync() -> None:
    """With tied embeddings and pp > 1, ``LanguageModule.setup_embeddings_and_output_layer`` copies
    the first stage's embedding to the last stage by an all-reduce of ``weight.data.cuda()``. Run it
    with the embedding group hidden (so it only sets its flags and zeroes the last-stage copy), then
    do the same all-reduce on the host tensor."""
    module = importlib.import_module("megatron.core.models.common.language_module.language_module")
    cls = module.LanguageModule
    original = cls.setup_embeddings_and_output_layer
    if getattr(original, _MARK, False):
        return

    def setup_embeddings_and_output_layer(self: Any) -> None:
        group = self.embd_group
        self.embd_group = None  # LanguageModule._is_in_embd_group() is False without a group
        try:
            original(self)
        finally:
            self.embd_group = group
        shared = self.share_embeddings_and_output_weights or getattr(self.config, "mtp_num_layers", 0)
        if (shared and self.config.pipeline_model_parallel_size > 1 and torch.distributed.is_initialized()
                and self._is_in_embd_group()):
            torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=group)

    setattr(setup_embeddings_and_output_layer, _MARK, True)
    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def install_cpu_shims() -> None:
    """Apply every CPU shim (idempotent). Call before building Megatron modules in a process."""
    _patch_host_device()
    _patch_split_sizes()
    _patch_router_gemm()
    _patch_rng_tracker()
    _patch_checkpoint_rng()
    _patch_causal_mask()
    _patch_mla_te_guard()
    _patch_tied_embedding_sync()


# ---- training loop (mcore DDP + get_forward_backward_func), separate from the model shims ------

# Module -> why its torch calls must land on the host during a training step.
_TRAINING_MODULES: dict[str, str] = {
    "megatron.core.pipeline_parallel.schedules":
        "the forward-backward schedules count tokens in torch.zeros(..., device='cuda')",
    "megatron.core.pipeline_parallel.p2p_communication":
        "pipeline sends/receives allocate on torch.cuda.current_device() and call torch.cuda.synchronize()",
    "megatron.core.distributed.param_and_grad_buffer":
        "DDP's parameter and gradient buffers are allocated on torch.cuda.current_device()",
    "megatron.core.distributed.distributed_data_parallel":
        "DDP makes a communication torch.cuda.Stream and calls torch.cuda.synchronize()",
}
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like")


def _on_host(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory`` with a CUDA ``device=`` argument redirected to the CPU."""

    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


def _host_training_torch() -> types.ModuleType:
    """:func:`_host_torch` whose tensor factories also turn ``device='cuda'`` into the host, and
    whose ``cuda.synchronize``/``empty_cache`` are no-ops (host work is synchronous)."""
    host = _host_torch()
    cuda = _forwarding_module("torch.cuda", host.cuda, synchronize=lambda device=None: None,
                              empty_cache=lambda: None)
    return _forwarding_module("torch", host, cuda=cuda, **{name: _on_host(getattr(torch, name)) for name in _FACTORIES})


def install_cpu_training_shims() -> None:
    """:func:`install_cpu_shims` plus the training loop: Megatron-Core's DistributedDataParallel
    and forward-backward schedules (``get_forward_backward_func``) on CPU over gloo (idempotent)."""
    install_cpu_shims()
    host = None
    for name in _TRAINING_MODULES:
        module = importlib.import_module(name)
        if getattr(module.torch, "_piper_training_shim", False):
            continue
        host = host or _host_training_torch()
        host._piper_training_shim = True
        module.torch = host
