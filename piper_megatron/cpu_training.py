"""Let Megatron-LM's own training loop -- ``megatron.training``, as ``pretrain_gpt.py`` runs it --
train on CPU ranks over gloo (tests and CPU demos only).

:func:`piper_megatron.cpu.install_cpu_training_shims` already runs Megatron-Core's model, DDP and
schedules on the host. ``megatron.training`` (from a Megatron-LM checkout: the megatron-core
0.16.1 wheel ships only ``megatron/core``) asks for a CUDA device in more places, and
:func:`install_megatron_lm_cpu_shims` answers them, each patch confined to the module that needs it:

- in the modules of ``megatron.training`` listed in :data:`_DEVICE_PRESENT_MODULES`, ``torch`` reports
  one CUDA device that is the host (``is_available()``, ``device_count() == 1``, ``set_device`` a
  no-op, memory statistics 0, tensor factories' ``device='cuda'`` on the host);
- in the Megatron-Core modules the training loop reaches (:data:`_HOST_MODULES`), ``torch.cuda`` is
  the host as in :mod:`piper_megatron.cpu`, and the CUDA generator state is empty (the CPU
  generator's, saved beside it, is the one that counts);
- during the calls of :data:`_HOST_TENSOR_CALLS` only, ``Tensor.cuda()`` returns the tensor and
  ``Tensor.type()`` names a host tensor as its CUDA twin (``torch.cuda.FloatTensor``);
- ``initialize._compile_dependencies`` checks the prebuilt dataset helpers instead of running
  ``make`` and nvcc, and ``initialize._warmup_jit_function`` (CUDA warm-up of fused kernels) is skipped;
- where ``triton`` is not installed, the batch-invariant kernel module ``initialize`` imports is a
  stand-in that refuses ``--batch-invariant-mode``.

Only tests and CPU demos import this module, explicitly (``python -m piper_megatron.cpu_launch``); no
GPU code path does: the shims would move the work onto the host. Install before the training
script runs, with the Megatron-LM checkout importable (its directory on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from piper_megatron.cpu import _forwarding_module, _host_training_torch, install_cpu_training_shims

_MARK = "_piper_megatron_lm_shim"

# megatron.training module -> why its ``torch`` must report a CUDA device that is the host.
_DEVICE_PRESENT_MODULES: dict[str, str] = {
    "megatron.training.initialize":
        "initialize_megatron asserts torch.cuda.is_available(); _initialize_distributed calls set_device and "
        "creates the model-parallel groups and RNG tracker only when torch.cuda.device_count() > 0",
    "megatron.training.training":
        "pretrain/train/get_model place timestamps, loss sums and flags on device='cuda' or "
        "torch.cuda.current_device(), make a DDP side stream and read torch.cuda memory statistics",
    "megatron.training.utils":
        "batches, loss reporting and grad norms live on torch.cuda.current_device() or device='cuda'",
    "megatron.training.checkpointing":
        "checkpoints save and restore torch.cuda RNG states and place tensors on the current device",
}
# Megatron-Core module -> why its CUDA calls must land on the host in megatron.training's loop.
_HOST_MODULES: dict[str, str] = {
    "megatron.core.utils":
        "local_multi_tensor_l2_norm (the grad norm without Apex/TE) returns its norm on device='cuda'",
    "megatron.core.timers":
        "timers call torch.cuda.synchronize and gather their times on torch.cuda.current_device()",
    "megatron.core.rerun_state_machine":
        "the rerun state machine saves torch.cuda.get_rng_state() each step and reduces flags on 'cuda'",
    "megatron.core.transformer.moe.moe_utils":
        "track_moe_metrics (training_log) accumulates per-layer MoE losses in torch.zeros(device='cuda')",
    "megatron.core.optimizer.clip_grads":
        "grad norm and clipping buffers are made with device='cuda'",
    "megatron.core.optimizer.optimizer":
        "found-inf flags and loss scales are made with device='cuda'",
    "megatron.core.optimizer.distrib_optimizer":
        "the distributed optimizer's parameter buffers live on torch.cuda.current_device()",
    "megatron.core.optimizer.grad_scaler":
        "loss scales are made with device='cuda'",
}
# (module, attribute) -> why ``Tensor.cuda()``/``Tensor.type()`` must treat host tensors as on the device
# while it runs (methods of ``Tensor``: no module-level name to rebind).
_HOST_TENSOR_CALLS: dict[tuple[str, str], str] = {
    ("megatron.training.training", "get_model"): "moves every model chunk with module.cuda(current_device())",
    ("megatron.training.utils", "get_batch_on_this_tp_rank"): "moves each batch tensor with .cuda(non_blocking=True)",
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"):
        "asserts param.grad.type() == 'torch.cuda.FloatTensor'",
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"):
        "sorts parameters by param.type() in 'torch.cuda.{Half,BFloat16,Float}Tensor'",
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"):
        "sorts parameters by param.type() in 'torch.cuda.{Half,BFloat16,Float}Tensor'",
}
_TRITON_KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _host_core_torch() -> types.ModuleType:
    """:func:`piper_megatron.cpu._host_training_torch` whose CUDA generator state is empty: the
    host has no device generator, and the CPU state is saved and restored beside it."""
    host = _host_training_torch()
    cuda = _forwarding_module("torch.cuda", host.cuda,
                              get_rng_state=lambda device="cuda": torch.empty(0, dtype=torch.uint8),
                              set_rng_state=lambda new_state, device="cuda": None)
    return _forwarding_module("torch", host, cuda=cuda, _piper_training_shim=True)


def _device_present_torch() -> types.ModuleType:
    """:func:`_host_core_torch` that also reports one CUDA device (the host): available, counted,
    selectable, with no memory in use."""
    host = _host_core_torch()
    zero = lambda device=None: 0  # noqa: E731 - memory statistics of a device that holds nothing
    cuda = _forwarding_module("torch.cuda", host.cuda, is_available=lambda: True, device_count=lambda: 1,
                              set_device=lambda device: None, memory_allocated=zero, max_memory_allocated=zero,
                              memory_reserved=zero, max_memory_reserved=zero,
                              reset_peak_memory_stats=lambda device=None: None)
    return _forwarding_module("torch", host, cuda=cuda)


def _rebind_torch(modules: dict[str, str], make: Callable[[], types.ModuleType]) -> None:
    made = None
    for name in modules:
        module = importlib.import_module(name)
        if getattr(module.torch, _MARK, None) == make.__name__:
            continue
        made = made or make()
        setattr(made, _MARK, make.__name__)
        module.torch = made


@contextlib.contextmanager
def _host_tensor_methods() -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor itself and ``Tensor.type()`` (no arguments) says
    ``torch.cuda.XTensor`` for a host tensor, until the block ends."""
    cuda, type_name = torch.Tensor.cuda, torch.Tensor.type

    def on_host(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
        return self

    def type_as_on_device(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = type_name(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return type_name(self, dtype, non_blocking, **kwargs)

    torch.Tensor.cuda, torch.Tensor.type = on_host, type_as_on_device
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.type = cuda, type_name


def _wrap_with_host_tensors(module_name: str, path: str) -> Callable[..., Any]:
    """Replace ``module.path`` (``function`` or ``Class.method``) by a wrapper that runs it inside
    :func:`_host_tensor_methods`; returns the wrapper."""
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _host_tensor_methods():
            return original(*args, **kwargs)

    setattr(call, _MARK, True)
    setattr(owner, name, call)
    return call


def _compile_dependencies() -> None:
    """``initialize._compile_dependencies`` on the host: rank 0 runs ``make`` in the installed
    ``megatron/core/datasets`` (the wheel ships the built ``helpers_cpp`` but no Makefile, so
    ``make`` fails and Megatron exits), then every rank builds CUDA fused kernels with nvcc. Here:
    check the prebuilt helpers import, and keep the barrier that lines the ranks up."""
    importlib.import_module("megatron.core.datasets.helpers_cpp")
    torch.distributed.barrier()


def _stand_in_for_triton_kernels() -> None:
    """``megatron.training.initialize`` imports ``enable_batch_invariant_mode`` from a module that
    imports ``triton`` unguarded; without triton, put a stand-in there that refuses the mode."""
    if _TRITON_KERNELS in sys.modules:
        return
    try:
        importlib.import_module(_TRITON_KERNELS)
        return
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise

    def enable_batch_invariant_mode(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("--batch-invariant-mode runs Triton kernels, which CPU ranks do not have: drop the flag")

    stand_in = types.ModuleType(_TRITON_KERNELS, "stand-in (piper_megatron.cpu_training): triton is not installed")
    stand_in.__dict__.update(enable_batch_invariant_mode=enable_batch_invariant_mode,
                             set_batch_invariant_mode=enable_batch_invariant_mode,
                             disable_batch_invariant_mode=lambda: None, is_batch_invariant_mode_enabled=lambda: False)
    setattr(stand_in, _MARK, True)
    sys.modules[_TRITON_KERNELS] = stand_in


def install_core_optimizer_shims() -> None:
    """:func:`piper_megatron.cpu.install_cpu_training_shims` plus Megatron-Core's own optimizers
    (``get_megatron_optimizer``: the distributed optimizer, clipping, the grad scaler, and the grad norm
    of ``megatron.core.utils`` that the chained optimizer takes at every step) on the host:
    the Megatron-Core half of :func:`install_megatron_lm_cpu_shims`, for trainers that run
    Megatron-Core without ``megatron.training`` (:mod:`piper_megatron.train`); idempotent."""
    install_cpu_training_shims()
    optimizer = "megatron.core.optimizer."
    _rebind_torch({k: v for k, v in _HOST_MODULES.items() if k.startswith(optimizer) or k == "megatron.core.utils"},
                  _host_core_torch)
    for module_name, path in _HOST_TENSOR_CALLS:
        if module_name.startswith(optimizer):
            _wrap_core(module_name, path)


def _wrap_core(module_name: str, path: str) -> None:
    wrapped = _wrap_with_host_tensors(module_name, path)
    if path == "clip_grad_by_total_norm_fp32":  # optimizer.py imported the name
        importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32 = wrapped


def install_megatron_lm_cpu_shims() -> None:
    """:func:`piper_megatron.cpu.install_cpu_training_shims` plus ``megatron.training`` (see the
    module docstring); idempotent. Raises ModuleNotFoundError when ``megatron.training`` is not
    importable (put the Megatron-LM checkout on ``sys.path`` first)."""
    install_cpu_training_shims()
    _stand_in_for_triton_kernels()
    _rebind_torch(_DEVICE_PRESENT_MODULES, _device_present_torch)
    _rebind_torch(_HOST_MODULES, _host_core_torch)
    initialize = importlib.import_module("megatron.training.initialize")
    initialize._compile_dependencies = _compile_dependencies
    initialize._warmup_jit_function = lambda: None  # warms CUDA fusions with device='cuda' tensors
    for module_name, path in _HOST_TENSOR_CALLS:
        _wrap_core(module_name, path)


__all__ = ["install_core_optimizer_shims", "install_megatron_lm_cpu_shims"]
