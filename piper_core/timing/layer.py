"""Time of one transformer layer on one GPU for one micro-batch: compute, exposed all-to-all and
other exposed communication, forward and backward.

Backward runs each GEMM twice (data and weight gradients) and the element-wise work again;
flash attention's core backward is 2.5x its forward (five GEMMs to the forward's two: it recomputes
Q K^T, then dV, dP, dQ, dK -- Dao, "FlashAttention-2", 2023, section 4.1, which counts backward FLOPs
as 2.5x forward), unfused attention's 2x (the scores are kept). Each MoE layer's forward pays the
accelerator's ``moe_sync_us`` (the dispatcher's device-to-host sync of the token counts); recompute adds the repeated forward (core attention for selective, the whole layer -- its
communication included -- for full). Tensor-parallel collectives are counted as exposed (Megatron
overlaps them only with TE user buffers, ``--tp-comm-overlap``, which the model does not assume).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.timing import comm
from piper_core.timing.compute import (LayerShape, element_bytes, attention_forward, dense_mlp_forward, expert_tokens,
                                       host_overhead_forward, moe_forward, shared_expert_forward)
from piper_core.timing.routing import dedup_ratio
from piper_core.timing.topology import Group, members_per_domain


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCost:
    """Seconds, one micro-batch, one GPU. ``a2a_*`` is the exposed all-to-all time;
    ``comm_*`` other exposed communication (tp/sp, etp, cp)."""

    compute_fwd: float
    compute_bwd: float
    a2a_fwd: float = 0.0
    a2a_bwd: float = 0.0
    comm_fwd: float = 0.0
    comm_bwd: float = 0.0
    a2a_raw: float = 0.0  # one direction (dispatch or combine), unpipelined, for reports

    @property
    def fwd(self) -> float:
        return self.compute_fwd + self.a2a_fwd + self.comm_fwd

    @property
    def bwd(self) -> float:
        return self.compute_bwd + self.a2a_bwd + self.comm_bwd


def shape_of(plan: ParallelPlan) -> LayerShape:
    overlap = max(0, plan.num_microbatches - plan.pp) / plan.num_microbatches if plan.ep_comm_overlap else 0.0
    return LayerShape(tp=plan.tp, cp=plan.cp, ep=plan.ep, etp=plan.etp_size, sp=plan.sequence_parallel,
                      mbs=plan.micro_batch_size, recompute=plan.recompute, attention_backend=plan.attention_backend,
                      precision=plan.precision, a2a=plan.a2a, chunks=plan.a2a_chunks,
                      shared_overlap=plan.shared_expert_overlap, ep_overlap=overlap, deferred_wgrad=plan.defer_wgrad,
                      grouped_gemm=plan.moe_grouped_gemm, fp8=plan.fp8 is not None)


def _tp_comm(model: ModelSpec, shape: LayerShape, cluster: ClusterSpec, blocks: int) -> tuple[float, float]:
    """(fwd, bwd) exposed tp time for ``blocks`` column->row GEMM pairs.

    SP: all-gather before the column GEMM and reduce-scatter after the row GEMM; backward re-gathers
    the input for the weight gradient and reduce-scatters / gathers the gradients (3 collectives).
    No SP: one all-reduce per pair in forward and one in backward (Megatron f/g operators).
    """
    if shape.tp == 1:
        return 0.0, 0.0
    group = Group(name="tp", size=shape.tp, stride=1)
    nbytes = shape.tokens_for(model) * model.hidden_size * element_bytes(shape.precision)
    one = comm.ring(group, nbytes, cluster)
    if shape.sp:  # forward: gather + reduce-scatter; backward: two gathers + reduce-scatter
        scatter = comm.reduce_scatter(group, nbytes, cluster)
        return blocks * (one + scatter), blocks * (2 * one + scatter)
    return blocks * 2 * one, blocks * 2 * one


def _cp_comm(model: ModelSpec, shape: LayerShape, cluster: ClusterSpec, core: float) -> tuple[float, float]:
    """Ring attention passes K and V around the cp group, hidden behind the per-step attention."""
    if shape.cp == 1:
        return 0.0, 0.0
    kv_width = (model.mla.kv_lora_rank + model.mla.qk_pos_emb_head_dim if model.mla
                else 2 * model.query_groups * model.head_dim / shape.tp)
    step = comm.p2p(Group(name="cp", size=shape.cp, stride=shape.tp), shape.tokens_for(model) * kv_width * element_bytes(shape.precision),
                     cluster)
    fwd = max(0.0, (shape.cp - 1) * step - core)
    return fwd, max(0.0, 2 * (shape.cp - 1) * step - 2 * core)


Stage = tuple[str, float]  # (resource, seconds for one chunk)


def _dispatch_stages(model: ModelSpec, shape: LayerShape, cluster: ClusterSpec, chunks: int) -> tuple[Stage, ...]:
    """One chunk's dispatch as stages in order, each on the resource it keeps busy: a flat exchange
    is one stage on the expert-parallel links (its levels run at once); a hierarchical one is an
    intra-node stage then an inter-node stage (a deduplicated one sends each token to a node once:
    DeepEP's NVLink forwarding on the far side is priced as the intra-node stage); with etp > 1 the
    etp all-gather of what arrives follows. The combine runs the same stages in reverse order."""
    _, received = expert_tokens(model, shape)
    sent = received / shape.etp
    group = Group(name="ep", size=shape.ep, stride=shape.etp)
    nbytes = sent * model.hidden_size * element_bytes(shape.precision) / chunks
    if shape.a2a in ("hierarchical", "dedup"):
        domains = group.size // members_per_domain(group, cluster.links[0].domain_gpus)  # as hierarchical_stages
        share = dedup_ratio(model, domains) if shape.a2a == "dedup" else 1.0
        stages = tuple(zip(("intra", "inter"), comm.hierarchical_stages(group, nbytes, cluster, inter_share=share)))
    else:
        stages = (("ep-links", comm.all_to_all_flat(group, nbytes, cluster)),)
    if shape.etp > 1:
        gathered = received * model.hidden_size * element_bytes(shape.precision) / chunks
        stages += (("etp-links", comm.ring(Group(name="etp", size=shape.etp, stride=1), gathered, cluster)),)
    return stages


def pipeline_time(stages: tuple[Stage, ...], chunks: int) -> float:
    """Time for ``chunks`` chunks through ``stages`` (each chunk visits every stage in order), where
    each resource serves one chunk at a time: the first chunk's pass through every stage, then one
    more chunk per period of the busiest resource (the flow-shop bound; exact for one resource per
    stage, a close lower bound when a resource serves several stages, as the links do for dispatch
    and combine)."""
    return sum(t for _, t in stages) + (chunks - 1) * max(_loads(stages).values(), default=0.0)


def _loads(stages: tuple[Stage, ...]) -> dict[str, float]:
    """Seconds each resource is busy per chunk."""
    load: dict[str, float] = {}
    for resource, t in stages:
        load[resource] = load.get(resource, 0.0) + t
    return load


def _exchange_exposed(model: ModelSpec, shape: LayerShape, cluster: ClusterSpec, experts_chunk: float,
                      chunks: int) -> float:
    """Exposed exchange time of dispatch -> experts (``experts_chunk`` per chunk) -> combine."""
    way = _dispatch_stages(model, shape, cluster, chunks)
    return pipeline_time(way + (("experts", experts_chunk),) + way[::-1], chunks) - chunks * experts_chunk


def _backward_deferred_exposed(model: ModelSpec, shape: LayerShape, cluster: ClusterSpec, experts_chunk: float,
                               chunks: int) -> float:
    """Exposed exchange time of the backward with the weight gradients deferred (``defer_wgrad``):
    per chunk the combine's gradient, the experts' input gradients (half of ``2 * experts_chunk``),
    then the dispatch's gradient leaves while the experts compute the weight gradients, which are on
    the experts' resource but on no chunk's path. The first chunk's path is therefore the combine's
    stages, the input gradients, then the longer of the dispatch's stages and the weight gradients;
    each further chunk adds a period of the busiest resource (as :func:`pipeline_time`)."""
    way = _dispatch_stages(model, shape, cluster, chunks)
    load = _loads(way + (("experts", 2 * experts_chunk),) + way[::-1])
    one_way = sum(t for _, t in way)
    path = one_way + experts_chunk + max(one_way, experts_chunk)
    return path + (chunks - 1) * max(load.values()) - chunks * 2 * experts_chunk


@functools.lru_cache(maxsize=4096)
def layer_cost(model: ModelSpec, shape: LayerShape, cluster: ClusterSpec, moe: bool) -> LayerCost:
    """Cost of one dense or MoE layer under ``shape`` on ``cluster``."""
    acc = cluster.accelerator
    attn_rest, core = attention_forward(model, shape, acc)
    cp_f, cp_b = _cp_comm(model, shape, cluster, core)
    if not moe:
        mlp = dense_mlp_forward(model, shape, acc)
        tp_f, tp_b = _tp_comm(model, shape, cluster, blocks=2)
        host = host_overhead_forward(model, shape, acc, moe=False)
        fwd = attn_rest + core + mlp + host
        bwd_compute = 2 * (attn_rest + mlp) + core_backward(shape, core) + acc.backward_overhead_factor * host
        return _finish(shape, fwd=fwd, core=core, comm_f=tp_f + cp_f, comm_b=tp_b + cp_b, bwd_compute=bwd_compute)
    rest, experts = moe_forward(model, shape, acc)
    chunks = shape.chunks
    blocks = 1 + (1 if model.moe_shared_expert_intermediate_size else 0)
    tp_f, tp_b = _tp_comm(model, shape, cluster, blocks=blocks)
    _, exp_chunk = moe_forward(model, shape, acc, chunks=chunks)
    exp_f, exp_b = chunks * exp_chunk, 2 * chunks * exp_chunk
    a2a_f = _exchange_exposed(model, shape, cluster, exp_chunk, chunks)
    if shape.deferred_wgrad:
        a2a_b = _backward_deferred_exposed(model, shape, cluster, exp_chunk, chunks)
    else:
        a2a_b = _exchange_exposed(model, shape, cluster, 2 * exp_chunk, chunks)
    if shape.shared_overlap and chunks == 1 and not shape.deferred_wgrad:
        # Megatron's --moe-shared-expert-overlap: the shared expert's forward computes while the
        # forward exchanges are in flight (fc1 beside dispatch, fc2 beside combine, in Megatron-Core's
        # alltoall dispatcher and in Piper's unpipelined one). Backward is priced unhidden: Piper's
        # runtime overlaps the forward only, and Megatron's backward overlap rides on CUDA stream
        # semantics not measured here. A pipelined exchange (chunks > 1) runs the shared expert after it,
        # and so does one whose weight gradients are deferred (Piper's fused call, one chunk included).
        a2a_f = max(0.0, a2a_f - shared_expert_forward(model, shape, acc))
    # the token counts go round the ep group before the dispatch (Megatron's preprocess, Piper's
    # exchange_counts): one small all-gather, latency-bound, forward only
    group = Group(name="ep", size=shape.ep, stride=shape.etp)
    a2a_f += comm.ring(group, shape.ep * model.num_experts * 8, cluster)
    host = host_overhead_forward(model, shape, acc, moe=True, chunks=chunks)
    fwd = attn_rest + core + rest + exp_f + host + acc.moe_sync_us * 1e-6
    bwd_compute = (2 * (attn_rest + rest) + core_backward(shape, core) + exp_b
                   + acc.backward_overhead_factor * host)
    if shape.ep_overlap:
        a2a_f, a2a_b = _megatron_overlap(a2a_f, a2a_b, fwd + bwd_compute, shape.ep_overlap)
    cost = _finish(shape, fwd=fwd, core=core, comm_f=tp_f + cp_f, comm_b=tp_b + cp_b, a2a_f=a2a_f, a2a_b=a2a_b,
                   bwd_compute=bwd_compute)
    one_way = sum(t for _, t in _dispatch_stages(model, shape, cluster, 1))
    return dataclasses.replace(cost, a2a_raw=one_way)


FLASH_BACKWARD = 2.5  # flash attention's core backward / forward (FlashAttention-2, section 4.1)


def core_backward(shape: LayerShape, core: float) -> float:
    """Core attention's backward from its forward time: flash recomputes the scores (2.5x), unfused
    attention keeps them (2x)."""
    return (FLASH_BACKWARD if shape.attention_backend == "flash" else 2.0) * core


def _megatron_overlap(a2a_f: float, a2a_b: float, compute: float, share: float) -> tuple[float, float]:
    """Megatron-Core's EP overlap (``--overlap-moe-expert-parallel-comm``, ``--delay-wgrad-compute``)
    runs one micro-batch's forward beside another's backward in the steady state of the schedule, so
    a layer's exchanges (both directions) hide behind the paired layer's compute (forward and
    backward, wgrad included); ``share`` of the micro-batches are in that steady state, the rest
    (warm-up, cool-down) stay exposed. SM contention between the two streams is not modelled."""
    total = a2a_f + a2a_b
    if total <= 0:
        return a2a_f, a2a_b
    hidden = share * min(total, compute)
    return a2a_f * (1 - hidden / total), a2a_b * (1 - hidden / total)


def _finish(shape: LayerShape, *, fwd: float, core: float, comm_f: float, comm_b: float, a2a_f: float = 0.0,
            a2a_b: float = 0.0, bwd_compute: float | None = None) -> LayerCost:
    bwd = 2 * fwd if bwd_compute is None else bwd_compute
    if shape.recompute == "selective":
        bwd += core
    elif shape.recompute == "full":
        bwd += fwd
        comm_b += comm_f
        a2a_b += a2a_f
    return LayerCost(compute_fwd=fwd, compute_bwd=bwd, a2a_fwd=a2a_f, a2a_bwd=a2a_b, comm_fwd=comm_f, comm_bwd=comm_b)
