"""Measure the activation memory one Megatron-Core transformer layer keeps for backward (CPU).

The reference for :mod:`piper_core.resource.activations`. One layer is built from the local spec
(:mod:`piper_megatron.build`), cast to the plan's precision as ``Float16Module`` does (an fp32 plan
keeps Megatron's fp32 parameters: fp32 training has no ``Float16Module``), and run
forward under ``torch.autograd.graph.saved_tensors_hooks``. Every tensor autograd saves is recorded;
after the forward, the storages still held by the graph are summed once each (views share a
storage, and a saved view keeps its whole storage alive). Saves whose graph branch died inside the
forward (the aux loss's top-k indices) are freed by then and are not counted.

Convention (the same as the formula's): the layer input counts (the input norm or the full-recompute
checkpoint saves it); parameters, the attention mask and the RoPE table (model-owned, shared by all
layers) do not. Recompute as Megatron does it: ``recompute_granularity='selective'`` with
``recompute_modules=['core_attn']``, or ``'full'`` with ``recompute_method='uniform'`` through a
one-layer ``TransformerBlock``.

Kernels: the CPU run takes Megatron's pure-torch paths. Where a CUDA kernel would keep something
else, the run is set up to keep what the GPU keeps, or the difference is declared in
:data:`CPU_KERNELS` for the formula:

* softmax: CUDA uses ``scaled_upper_triang_masked_softmax`` (keeps its bf16 output); on CPU
  ``attention_softmax_in_fp32=False`` makes the torch fallback keep the same bf16 output (in fp32
  the fused kernel does not apply, ``FusedScaleMaskSoftmax.is_kernel_available``, and both run the
  torch fallback, keeping fp32 probabilities);
* SwiGLU and bias-dropout-add: Megatron's fused autograd functions (``bias_activation_fusion``,
  ``bias_dropout_fusion``, on in megatron.training) run eagerly (TorchDynamo disabled);
* RoPE fusion, a bool dropout mask and fp32 norm statistics are CUDA-only: see :data:`CPU_KERNELS`;
* RMSNorm is refused: torch's CPU ``RMSNorm`` is a decomposition that keeps three fp32 copies of its
  input, where the CUDA kernel (and Transformer Engine) keeps the input and rstd.

Needs one initialised process group (gloo is fine), ``parallel_state.initialize_model_parallel``
with tp = cp = ep = 1, and :func:`piper_megatron.cpu.install_cpu_shims`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch._dynamo
from megatron.core import parallel_state
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

from piper_core.errors import SpecError
from piper_core.resource.activations import Kernels
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_megatron.build import layer_spec, transformer_config

#: What the CPU run keeps differently from a GPU run, for the formula's ``kernels=`` argument.
CPU_KERNELS = Kernels(rope_fusion=False, dropout_mask_bytes=2, norm_stats_bytes=2)

Kind = Literal["activation", "parameter", "model_input"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True, slots=True)
class SavedStorage:
    """One storage kept for backward: its bytes, the first saved tensor that used it, and where."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    kind: Kind
    where: str  # innermost Megatron frame that saved it, "file.py:line"


@dataclasses.dataclass(frozen=True, slots=True)
class LayerMeasurement:
    """The storages one layer keeps for backward after its forward; ``activation_bytes`` sums the
    ``kind == "activation"`` ones (the quantity the formula predicts)."""

    storages: tuple[SavedStorage, ...]

    @property
    def activation_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages if s.kind == "activation")

    def table(self) -> str:
        """One line per storage, for reading a failure."""
        return "\n".join(f"{s.nbytes:>10} {str(s.shape):22} {s.dtype:9} {s.kind:11} {s.where}"
                         for s in self.storages)


class _Box:
    """What the pack hook hands autograd; it lives exactly as long as autograd holds the save."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Ledger:
    """Records every save; :meth:`live` reports the storages still held, once each."""

    def __init__(self, owned: dict[int, Kind]) -> None:
        self._owned = owned  # storage data_ptr -> kind, for parameters and model-owned inputs
        self._saves: list[tuple[weakref.ref[_Box], int, SavedStorage]] = []

    def pack(self, tensor: torch.Tensor) -> _Box:
        box = _Box(tensor)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        info = SavedStorage(storage.nbytes(), tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                            self._owned.get(ptr, "activation"), _caller())
        self._saves.append((weakref.ref(box), ptr, info))
        return box

    @staticmethod
    def unpack(box: _Box) -> torch.Tensor:
        return box.tensor

    def live(self) -> tuple[SavedStorage, ...]:
        found: dict[int, SavedStorage] = {}
        for ref, ptr, info in self._saves:
            if ref() is not None and ptr not in found:  # live storages never share an address
                found[ptr] = info
        return tuple(found.values())


def _caller() -> str:
    for frame in reversed(traceback.extract_stack(limit=40)):
        if "/megatron/" in frame.filename:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def _host_only_fixes() -> Iterator[None]:
    """Two CUDA assumptions the CPU shims leave in place, both scoped to the measurement.

    ``CheckpointFunction`` saves and restores the CUDA generator (``_get/_set_cuda_rng_state``);
    on CPU there is none (the CPU generator is saved alongside already). DotProductAttention takes
    its score buffer from the global memory buffer, which allocates on ``torch.cuda.current_device``;
    a host buffer under the same key is used instead.
    """
    random = tensor_parallel.random
    saved = random._get_cuda_rng_state, random._set_cuda_rng_state
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    try:
        with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile
            yield
    finally:
        random._get_cuda_rng_state, random._set_cuda_rng_state = saved


def _score_buffer(model: ModelSpec, plan: ParallelPlan, dtype: torch.dtype) -> None:
    buffer = parallel_state.get_global_memory_buffer().buffer
    need = plan.micro_batch_size * model.num_attention_heads * model.seq_length ** 2
    have = buffer.get(("mpu", dtype))
    if have is None or have.numel() < need:
        buffer[("mpu", dtype)] = torch.empty(need, dtype=dtype)


def _config_overrides(model: ModelSpec) -> dict[str, Any]:
    """One layer on the host, with the kernels megatron.training turns on where they run on CPU.

    ``masked_softmax_fusion`` off: the fused softmax is a CUDA extension; ``attention_softmax_in_fp32``
    off: the torch fallback then keeps the bf16 probabilities the CUDA kernel keeps (in fp32 it would
    keep an fp32 copy as well). ``bias_activation_fusion`` only for SwiGLU: Megatron's fused GeLU
    needs a bias and its weighted (expert) variant exists only for SwiGLU.
    """
    return dict(
        num_layers=1, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        bias_activation_fusion=model.gated_linear_unit, bias_dropout_fusion=True,
        masked_softmax_fusion=False, attention_softmax_in_fp32=False, apply_rope_fusion=False,
    )


def _check(model: ModelSpec, plan: ParallelPlan) -> None:
    if model.normalization == "RMSNorm":
        raise SpecError("normalization", "RMSNorm", "torch's CPU RMSNorm keeps three fp32 copies of its input "
                        "(a decomposition), unlike the CUDA kernel", "measure with normalization: LayerNorm")
    for key in ("tp", "cp", "ep", "pp"):
        if getattr(plan, key) != 1:
            raise SpecError(key, getattr(plan, key), "the CPU measurement builds one layer in one process",
                            f"set {key}=1 (the formula prices splits)")
    if plan.attention_backend != "unfused":
        raise SpecError("attention_backend", plan.attention_backend, "flash attention needs a GPU",
                        "measure with attention_backend: unfused")


def _build(model: ModelSpec, plan: ParallelPlan, moe: bool, overrides: dict[str, Any]) -> torch.nn.Module:
    one = dataclasses.replace(model, num_layers=1, moe_first_k_dense=0, moe_layer_freq=1)
    config = transformer_config(one, plan, **(_config_overrides(model) | overrides))
    spec = layer_spec(one, moe=moe)
    if plan.recompute == "full":  # full recompute lives in TransformerBlock._checkpointed_forward
        module = TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[spec]),
                                  post_layer_norm=False, pre_process=True, post_process=False)
    else:
        module = build_module(spec, config=config, layer_number=1)
    if plan.precision != "fp32":  # as Float16Module casts the model; fp32 training has none
        module = module.to(_DTYPES[plan.precision])
    return module.train()


def measure_layer_activations(model: ModelSpec, plan: ParallelPlan, *, moe: bool, seed: int = 0,
                              **overrides: Any) -> LayerMeasurement:
    """Storages one layer of ``model`` keeps for backward after a forward of one micro-batch.

    ``overrides`` are TransformerConfig fields (e.g. ``moe_aux_loss_coeff=1e-2``). A backward is run
    afterwards, so a measurement whose graph does not run backward fails here.
    """
    _check(model, plan)
    torch.manual_seed(seed)
    dtype = _DTYPES[plan.precision]
    layer = _build(model, plan, moe, overrides)
    s, b, h = model.seq_length, plan.micro_batch_size, model.hidden_size
    x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
    mask = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)[None, None]  # True = masked (causal)
    rope = None
    if model.position_embedding == "rope" and model.mla is None:  # MLA makes its own
        rope = RotaryEmbedding(model.head_dim, rotary_percent=1.0, use_cpu_initialization=True)(s)
    owned: dict[int, Kind] = {p.untyped_storage().data_ptr(): "parameter" for p in layer.parameters()}
    owned |= {t.untyped_storage().data_ptr(): "model_input" for t in (mask, rope) if t is not None}
    ledger = _Ledger(owned)
    _score_buffer(model, plan, dtype)
    with _host_only_fixes():
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack):
            out = layer(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)
        out = out[0] if isinstance(out, tuple) else out
        result = LayerMeasurement(ledger.live())
        out.float().square().mean().backward()
    return result
