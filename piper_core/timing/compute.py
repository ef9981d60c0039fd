"""Roofline compute time of one layer's forward pass on one GPU, for one micro-batch.

A GEMM ``[m, k] x [k, n]`` (``batch`` of them) takes
``max(2 m n k / (peak x efficiency(m, n, k)), bytes / (hbm x hbm_efficiency)) + kernel latency``
with ``bytes = 2 (m k + k n + m n)`` (Williams et al., "Roofline", CACM 2009). The compute
efficiency is ``gemm_efficiency`` for large GEMMs and falls with the GEMM's smallest dimensions
when the accelerator sets ``gemm_half_size`` (:mod:`piper_core.timing.gemm`: tile and wave
quantization); unset, it is flat, as it was. Core attention keeps the flat efficiency
(:func:`core_attention_gemm_time`). Skinny expert GEMMs
(few tokens per expert) fall on the memory side and, run one expert at a time (Megatron's
``SequentialMLP``), pay the launch latency per expert -- the "small, imbalanced expert GEMM"
bottleneck of the Piper paper; with ``--moe-grouped-gemm`` each expert linear is one grouped GEMM
over the local experts, whose launches overlap on four streams (:func:`grouped_gemm_time`).
Element-wise work (norms, activations, softmax, permutation) is priced by the bytes it moves
through HBM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from piper_core.resource.activations import busiest_rows
from piper_core.specs.cluster import AcceleratorSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import grouped_gemm
from piper_core.timing.gemm import gemm_efficiency

BYTES = 2  # bf16 / fp16 activations and weights (see element_bytes)


def element_bytes(precision: str) -> int:
    """Bytes of one activation or weight element in ``precision``: 4 in fp32 training (Megatron
    with neither --bf16 nor --fp16), 1 for an FP8 GEMM's operands, else 2 (bf16 / fp16)."""
    return 4 if precision == "fp32" else 1 if precision == "fp8" else BYTES


FP8_CAST_BYTES = 3
"""Bytes an FP8 GEMM's input costs to quantize, per element: read bf16 (2), write FP8 (1). Transformer
Engine casts each FP8 linear's input in forward and the output gradient in backward (the backward
is priced as a multiple of the forward, so this term is too)."""


def gemm_time(acc: AcceleratorSpec, precision: str, m: float, n: float, k: float, *, batch: float = 1) -> float:
    """Seconds for ``batch`` GEMMs of shape m x k by k x n (one kernel launch), each at the
    efficiency its shape allows (:func:`piper_core.timing.gemm.gemm_efficiency`)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return _roofline(acc, precision, m, n, k, batch, gemm_efficiency(acc, precision, m, n, k))


def _roofline(acc: AcceleratorSpec, precision: str, m: float, n: float, k: float, batch: float,
              efficiency: float) -> float:
    """The roofline at the calibrated rates, over ``core_share``: the GEMM and copy benchmarks time one
    call while its rank holds a core, so they measure a full core's rate even where ranks share the
    cores (4 ranks on 2 cores fitted 0.1015 TFLOP/s fp32 against 2 ranks' 0.1003,
    docs/validation/fp32/rounds3-dopt/2/profiles), while in a step every rank computes at once and
    each gets ``core_share`` of one. Host terms and the element-wise rate are fitted to whole
    training steps (the probe), already at the shared rate, and are not scaled."""
    flops = 2.0 * m * n * k * batch
    moved = element_bytes(precision) * (m * k + k * n + m * n) * batch
    compute = flops / (acc.peak_flops(precision) * efficiency)
    memory = moved / (acc.hbm_gb_per_s * 1e9 * acc.hbm_efficiency)
    return max(compute, memory) / acc.core_share + acc.kernel_latency_us * 1e-6


def core_attention_gemm_time(acc: AcceleratorSpec, precision: str, m: float, n: float, k: float, *,
                             batch: float) -> float:
    """One of core attention's two products (``Q K^T``, ``P V``; ``batch`` heads) at the flat
    ``gemm_efficiency``, not the shape efficiency of a per-head GEMM: a fused kernel tiles over
    heads and query blocks and loops over the keys (FlashAttention-2 reaches 50-73 % of A100 peak
    forward, Dao 2023, abstract), and the unfused backend's batched GEMMs draw
    their parallelism from the heads, which the per-head ``head_dim`` does not show."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return _roofline(acc, precision, m, n, k, batch, acc.gemm_efficiency)


def stream_time(acc: AcceleratorSpec, nbytes: float, *, elementwise: bool = True) -> float:
    """Seconds for work that streams ``nbytes`` (read + write counted by the caller): a layer's
    element-wise kernels at the calibrated element-wise rate when the spec has one; everything else
    (``elementwise=False``: the optimizer's fp32 sweep, copies) at HBM x efficiency."""
    if elementwise and acc.elementwise_gb_per_s is not None:
        return nbytes / (acc.elementwise_gb_per_s * 1e9)
    return nbytes / (acc.hbm_gb_per_s * 1e9 * acc.hbm_efficiency) / acc.core_share


def linear_time(acc: AcceleratorSpec, shape: LayerShape, m: float, n: float, k: float, *, count: int = 0) -> float:
    """One of a layer's linears, ``[m, k] x [k, n]`` (``count`` > 0: a grouped GEMM of that many,
    :func:`grouped_gemm_time`), as the plan runs it: in its precision, or with ``shape.fp8`` as
    Transformer Engine's FP8 GEMM at the FP8 peak after quantizing its input (:data:`FP8_CAST_BYTES`).
    Only these run in FP8: core attention, the router (fp32), the output layer and every element-wise
    kernel stay in the plan's precision (Megatron-Core's TE spec: ``TELayerNormColumnParallelLinear``,
    ``TERowParallelLinear``, ``TEGroupedMLP``; the output layer is a ``ColumnParallelLinear``)."""
    precision = "fp8" if shape.fp8 else shape.precision
    batch = max(count, 1)
    gemm = grouped_gemm_time(acc, precision, m, n, k, count) if count else gemm_time(acc, precision, m, n, k)
    return gemm + (stream_time(acc, FP8_CAST_BYTES * m * k * batch) if shape.fp8 else 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerShape:
    """The parts of a plan that change one layer's cost (cache key; pp, dp, batch do not)."""

    tp: int
    cp: int
    ep: int
    etp: int
    sp: bool
    mbs: int
    recompute: str
    attention_backend: str
    precision: str
    a2a: str
    chunks: int
    shared_overlap: bool = False
    deferred_wgrad: bool = False  # expert weight gradients computed while the dispatch gradient is in flight
    grouped_gemm: bool | None = None  # the plan's moe_grouped_gemm (None: the accelerator's default)
    ep_overlap: float = 0.0  # share of micro-batches whose exchanges Megatron's EP overlap hides
    fp8: bool = False  # the plan's Transformer Engine linears run FP8 GEMMs (ParallelPlan.fp8)

    def tokens_for(self, model: ModelSpec) -> int:
        """Tokens a tp rank's GEMMs see: the micro-batch's [s/cp, b] (gathered under SP)."""
        return model.seq_length // self.cp * self.mbs


def attention_forward(model: ModelSpec, shape: LayerShape, acc: AcceleratorSpec) -> tuple[float, float]:
    """(projection + element-wise time, core-attention time) of one attention block, forward."""
    t, h, tp, prec = shape.tokens_for(model), model.hidden_size, shape.tp, shape.precision
    a = model.num_attention_heads // tp
    mla = model.mla
    if mla is None:
        d, g = model.head_dim, model.query_groups
        proj = linear_time(acc, shape, t, (model.num_attention_heads + 2 * g) * d / tp, h)
        proj += linear_time(acc, shape, t, h, model.num_attention_heads * d / tp)
        qk_dim, v_dim = d, d
    else:
        q_head = mla.qk_head_dim + mla.qk_pos_emb_head_dim
        if mla.q_lora_rank is None:
            proj = linear_time(acc, shape, t, model.num_attention_heads * q_head / tp, h)
        else:
            proj = linear_time(acc, shape, t, mla.q_lora_rank, h)
            proj += linear_time(acc, shape, t, model.num_attention_heads * q_head / tp, mla.q_lora_rank)
        proj += linear_time(acc, shape, t, mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h)
        proj += linear_time(acc, shape, t, model.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim) / tp,
                          mla.kv_lora_rank)
        proj += linear_time(acc, shape, t, h, model.num_attention_heads * mla.v_head_dim / tp)
        qk_dim, v_dim = q_head, mla.v_head_dim
    # causal: on average each query sees half the keys (s/2), with load-balanced cp as well
    keys = model.seq_length / 2
    core = (core_attention_gemm_time(acc, prec, t, keys, qk_dim, batch=a)
            + core_attention_gemm_time(acc, prec, t, v_dim, keys, batch=a))
    if shape.attention_backend == "unfused":  # scores written, softmaxed, read back by AV
        core += stream_time(acc, 3 * element_bytes(prec) * a * t * model.seq_length)
    # input norm (read + write), rope on q and k, residual add (read 2, write 1)
    elementwise = stream_time(acc, element_bytes(prec) * t * (2 * h / (tp if shape.sp else 1) + 3 * h))
    return proj + elementwise, core


def mlp_forward(model: ModelSpec, shape: LayerShape, acc: AcceleratorSpec, tokens: float, ffn: int, split: int,
                *, count: int = 1, grouped: bool = False) -> float:
    """``count`` MLPs of width ``ffn`` split ``split`` ways, each over ``tokens`` tokens; ``grouped``
    runs each linear of the ``count`` MLPs as one grouped GEMM (:func:`grouped_gemm_time`) instead of
    ``count`` GEMMs one after the other (Megatron-Core ``SequentialMLP.forward`` loops over the local
    experts, transformer/moe/experts.py)."""
    if ffn == 0 or tokens <= 0:
        return 0.0
    width = ffn * (2 if model.gated_linear_unit else 1) / split
    act = stream_time(acc, element_bytes(shape.precision) * tokens * (width + ffn / split))  # activation function
    if grouped:
        return (linear_time(acc, shape, tokens, width, model.hidden_size, count=count)
                + linear_time(acc, shape, tokens, model.hidden_size, ffn / split, count=count) + count * act)
    one = linear_time(acc, shape, tokens, width, model.hidden_size)
    one += linear_time(acc, shape, tokens, model.hidden_size, ffn / split)
    one += act
    return count * one


GROUPED_GEMM_STREAMS = 4  # Transformer Engine's compute streams (get_num_compute_streams)


def grouped_gemm_time(acc: AcceleratorSpec, precision: str, m: float, n: float, k: float, count: int) -> float:
    """One grouped GEMM of ``count`` m x k by k x n GEMMs (Megatron-Core ``--moe-grouped-gemm``:
    ``TESpecProvider.grouped_mlp_modules``, extensions/transformer_engine_spec_provider.py, builds
    ``TEGroupedMLP``, whose ``linear_fc1``/``linear_fc2`` are Transformer Engine ``GroupedLinear``s).

    The roofline terms add up over the GEMMs; the launches do not: Transformer Engine issues the
    GEMMs from one call on ``GROUPED_GEMM_STREAMS`` compute streams (``multi_stream_cublas_gemm``,
    transformer_engine/common/gemm/cublaslt_gemm.cu, its default on Hopper), so ``count`` launch
    latencies overlap four ways: ``ceil(count / 4)`` of them. (A single CUTLASS kernel --
    ``NVTE_USE_CUTLASS_GROUPED_GEMM``, or the legacy ``GroupedMLP``'s ``gg.ops.gmm`` -- would pay one.)
    """
    if count <= 0:
        return 0.0
    launches = math.ceil(count / GROUPED_GEMM_STREAMS)
    return gemm_time(acc, precision, m, n, k, batch=count) + (launches - 1) * acc.kernel_latency_us * 1e-6


def expert_tokens(model: ModelSpec, shape: LayerShape) -> tuple[float, float]:
    """(tokens per local expert on the busiest GPU, routed tokens that GPU receives).

    Each rank routes its ``s b / cp`` tokens (split over tp by SP) top-k times; the rows the
    busiest GPU receives are those the activation model keeps (``busiest_rows``: padded capacity,
    or dropless skew), gathered over etp.
    """
    local = math.ceil(shape.tokens_for(model) / (shape.tp if shape.sp else 1))
    received, _ = busiest_rows(model, local, shape.ep, shape.etp)
    return received / (model.num_experts / shape.ep), received


def moe_forward(model: ModelSpec, shape: LayerShape, acc: AcceleratorSpec, *, chunks: int = 1) -> tuple[float, float]:
    """(router + permutation + shared-expert time, routed-expert time for ONE of ``chunks`` chunks)."""
    t_local = shape.tokens_for(model) / (shape.tp if shape.sp else 1)
    per_expert, received = expert_tokens(model, shape)
    local = model.num_experts // shape.ep
    router = gemm_time(acc, "fp32", t_local, model.num_experts, model.hidden_size)
    permute = stream_time(acc, 2 * 2 * element_bytes(shape.precision) * received * model.hidden_size)  # permute + unpermute, r + w
    shared = shared_expert_forward(model, shape, acc)
    experts = mlp_forward(model, shape, acc, per_expert / chunks, model.moe_ffn_hidden_size, shape.etp, count=local,
                          grouped=grouped_gemm(shape.grouped_gemm, acc))
    norm = stream_time(acc, element_bytes(shape.precision) * t_local * 5 * model.hidden_size)  # pre-MLP norm + residual
    return router + permute + shared + norm, experts


def shared_expert_forward(model: ModelSpec, shape: LayerShape, acc: AcceleratorSpec) -> float:
    """The shared expert's forward (0 without one): a tp-split MLP over the micro-batch's tokens."""
    return mlp_forward(model, shape, acc, shape.tokens_for(model), model.moe_shared_expert_intermediate_size, shape.tp)


def dense_mlp_forward(model: ModelSpec, shape: LayerShape, acc: AcceleratorSpec) -> float:
    t = shape.tokens_for(model)
    norm = stream_time(acc, element_bytes(shape.precision) * t * 5 * model.hidden_size)
    return norm + mlp_forward(model, shape, acc, t, model.ffn_hidden_size, shape.tp)


def host_overhead_forward(model: ModelSpec, shape: LayerShape, acc: AcceleratorSpec, *, moe: bool, chunks: int = 1) -> float:
    """Seconds of host framework time of one layer's forward (see :class:`AcceleratorSpec`)."""
    t = acc.layer_overhead_us
    if moe:  # one expert call per local expert, or one for all of them as grouped GEMMs
        calls = 1 if grouped_gemm(shape.grouped_gemm, acc) else model.num_experts // shape.ep
        t += acc.moe_overhead_us + acc.expert_overhead_us * calls * chunks
    return t * 1e-6
