"""Step time: stage times through the pipeline schedule, plus data-parallel reduction and the
optimizer step; MFU, throughput, a breakdown that sums to the step, and the bottleneck.

Schedule: with ``m`` micro-batches and per-micro-batch stage times ``T_p`` (forward + backward +
p2p), 1F1B is simulated pass by pass (:mod:`piper_core.timing.schedule`); its closed form
``(m - 1) max_p T_p + sum_p T_p`` (Narayanan et al., arXiv 2104.04473, Sec. 2.2; X-MoE's planner)
is exact when the last stage is the slowest and an upper bound otherwise, and serves the search's
fast path. Interleaving over ``vpp`` chunks divides the fill/drain part by ``vpp`` (closed form) and
sends ``vpp`` times as many p2p messages.
Data-parallel gradient reduce-scatter (all-reduce without the distributed optimizer) overlaps the
last micro-batch's backward and parameter all-gather the first forward, except one bucket each
(Megatron ``overlap_grad_reduce`` / ``overlap_param_gather``, 40M-parameter buckets).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from piper_core.resource.flops import step_flops
from piper_core.resource.params import stage_params
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import stage_kinds
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.timing import comm
from piper_core.timing.compute import BYTES, gemm_time, stream_time
from piper_core.timing.compute import LayerShape
from piper_core.timing.layer import LayerCost, layer_cost, shape_of
from piper_core.timing.schedule import pipeline_time
from piper_core.timing.topology import Group, dense_groups, expert_groups, slowest_link

BUCKET_PARAMS = 40_000_000
OPTIMIZER_BYTES = 30  # Adam on fp32 master: read param, grad, m, v (16); write param, m, v (12); bf16 copy (2)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTime:
    """One pipeline rank, per micro-batch (seconds)."""

    stage: int
    compute: float
    a2a: float
    comm: float
    p2p: float

    @property
    def total(self) -> float:
        return self.compute + self.a2a + self.comm + self.p2p


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    step: float
    compute: float
    exposed_a2a: float
    other_comm: float
    bubble: float
    optimizer: float
    pipeline: float  # first forward to last backward (compute + a2a + comm + p2p of all stages, bubble)
    data_parallel: float  # exposed gradient / parameter collectives after the pipeline
    stages: tuple[StageTime, ...]
    slowest_stage: int
    a2a_one_way: float  # one unpipelined dispatch (or combine) of one MoE layer, for reports

    def breakdown(self) -> dict[str, float]:
        return {"compute": self.compute, "exposed_a2a": self.exposed_a2a, "other_comm": self.other_comm,
                "bubble": self.bubble, "optimizer": self.optimizer}


def _layer(model: ModelSpec, shape: LayerShape, cluster: ClusterSpec, moe: bool, full: bool) -> LayerCost:
    """Cost of a dense or MoE layer; ``full`` marks a layer that full recompute repeats."""
    if shape.recompute == "full" and not full:
        shape = dataclasses.replace(shape, recompute="none")
    return layer_cost(model, shape, cluster, moe)


def _logits(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> float:
    """Output GEMM fwd + 2x bwd, and the vocab-parallel cross entropy (element-wise)."""
    acc, t = cluster.accelerator, model.seq_length // plan.cp * plan.micro_batch_size
    vocab = model.padded_vocab(plan.tp) / plan.tp
    gemm = gemm_time(acc, plan.precision, t, vocab, model.hidden_size)
    return 3 * gemm + stream_time(acc, 3 * 4 * t * vocab)


def _stage_times(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> tuple[tuple[StageTime, ...], float]:
    groups = dense_groups(plan)
    shape = shape_of(plan)
    block = plan.recompute_num_layers if plan.recompute_method == "block" else None
    act = model.seq_length // plan.cp * plan.micro_batch_size * model.hidden_size * BYTES
    act //= plan.tp if plan.sequence_parallel else 1
    p2p = 2 * plan.virtual_stages * comm.p2p(groups["pp"], act, cluster) if plan.pp > 1 else 0.0
    out, raw = [], 0.0
    for rank, chunks in enumerate(stage_kinds(model, plan)):
        # (moe, recomputed) -> layer count; full recompute with "block" repeats the first n per chunk
        kinds = Counter((moe, plan.recompute == "full" and (block is None or j < block))
                        for chunk in chunks for j, moe in enumerate(chunk))
        compute = a2a = other = 0.0
        for (moe, full), count in kinds.items():
            cost = _layer(model, shape, cluster, moe, full)
            compute += count * (cost.compute_fwd + cost.compute_bwd)
            a2a += count * (cost.a2a_fwd + cost.a2a_bwd)
            other += count * (cost.comm_fwd + cost.comm_bwd)
            raw = max(raw, cost.a2a_raw)
        if rank == plan.pp - 1:
            compute += _logits(model, plan, cluster)
        # per micro-batch host work (embedding, output layer and loss, the schedule's bookkeeping),
        # fitted at pp = 1; the embedding and the loss sit on the end stages, so the stages share it
        compute += cluster.accelerator.microbatch_overhead_us * 1e-6 / plan.pp
        out.append(StageTime(stage=rank, compute=compute, a2a=a2a, comm=other, p2p=p2p))
    return tuple(out), raw


def _overlapped(t: float, window: float, params: int) -> float:
    """Exposed part of a bucketed collective overlapped with ``window`` seconds of compute."""
    if t == 0.0 or params == 0:
        return 0.0
    last_bucket = t * min(1.0, BUCKET_PARAMS / params)
    return max(t - window, last_bucket)


def _data_parallel(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, stages: tuple[StageTime, ...]) -> float:
    """Exposed gradient reduction + parameter gathering, worst pipeline rank.

    Dense (over dp x cp) and expert (over edp) collectives run one after the other on the same
    stream and share one window: the backward (2/3 of the compute) for gradients, the forward for
    parameters.
    """
    dense_g, expert_g = dense_groups(plan)["dp"], expert_groups(plan)["edp"]
    grad_bytes = 4 if plan.precision == "bf16" and not plan.grad_reduce_in_bf16 else 2
    worst = 0.0
    for params, st in zip(stage_params(model, plan), stages):
        pairs = ((dense_g, params.dense), (expert_g, params.expert))
        if plan.distributed_optimizer:
            grads = sum(comm.ring(g, n * grad_bytes, cluster) for g, n in pairs)
            gather = sum(comm.ring(g, n * BYTES, cluster) for g, n in pairs)
        else:
            grads = sum(comm.ring(g, n * grad_bytes, cluster, passes=2) for g, n in pairs)
            gather = 0.0
        exposed = (_overlapped(grads, 2 / 3 * st.compute, params.total)
                   + _overlapped(gather, 1 / 3 * st.compute, params.total))
        worst = max(worst, exposed)
    return worst


def _optimizer(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> float:
    """Adam over this GPU's shard: on the GPU, streaming ``OPTIMIZER_BYTES`` per parameter through
    HBM; the offloaded share moves fp32 gradients down and bf16 weights up the host link and is
    stepped by the CPU, whose memory bandwidth all GPUs of a node share."""
    worst, acc, f = 0.0, cluster.accelerator, plan.optimizer_offload_fraction
    for p in stage_params(model, plan):
        n = p.dense / (plan.dp * plan.cp) + p.expert / plan.edp if plan.distributed_optimizer else p.total
        t = stream_time(acc, (1 - f) * n * OPTIMIZER_BYTES, elementwise=False)
        if f > 0:
            t += f * n * (4 + BYTES) / (cluster.host_link_gb_per_s * 1e9)
            t += f * n * 28 * cluster.gpus_per_node / (cluster.host_memory_gb_per_s * 1e9)
        worst = max(worst, t)
    return worst + acc.step_overhead_us * 1e-6


def step_time(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, *, exact: bool = True) -> StepTime:
    """Predicted time of one training step and its breakdown (seconds).

    ``exact`` simulates the 1F1B schedule pass by pass; ``exact=False`` uses the closed form, an
    upper bound that is exact when the last stage is the slowest (the search's fast path).
    """
    stages, raw = _stage_times(model, plan, cluster)
    m, slow = plan.num_microbatches, max(stages, key=lambda s: s.total)
    pipeline = pipeline_time(stages, m, plan.virtual_stages, exact=exact)
    dp = _data_parallel(model, plan, cluster, stages)
    opt = _optimizer(model, plan, cluster)
    return StepTime(step=pipeline + dp + opt, compute=m * slow.compute, exposed_a2a=m * slow.a2a,
                    other_comm=m * (slow.comm + slow.p2p) + dp, bubble=pipeline - m * slow.total, optimizer=opt,
                    pipeline=pipeline, data_parallel=dp, stages=stages, slowest_stage=slow.stage, a2a_one_way=raw)


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    mfu: float
    tflops_per_gpu: float
    tokens_per_s: float
    bottleneck: str


def throughput(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, t: StepTime) -> Throughput:
    """MFU = model FLOPs (Megatron's definition) / (step time x GPUs x dense peak of the precision)."""
    flops = step_flops(model, plan)
    per_gpu = flops.model / t.step / plan.gpus
    mfu = per_gpu / cluster.accelerator.peak_flops(plan.precision)
    return Throughput(mfu=mfu, tflops_per_gpu=per_gpu / 1e12, tokens_per_s=flops.tokens / t.step,
                      bottleneck=bottleneck(model, plan, cluster, t))


def bottleneck(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, t: StepTime) -> str:
    """One sentence naming the largest non-compute share of the step (or compute itself)."""
    parts = t.breakdown()
    name = max(parts, key=parts.get)
    share = f"{100 * parts[name] / t.step:.0f}% of the step"
    if name == "exposed_a2a":
        link = slowest_link(expert_groups(plan)["ep"], cluster)
        where = f"over {link.name} at {link.bandwidth_gb_per_s:g} GB/s" if link else "inside one GPU"
        return f"the expert-parallel all-to-all (ep={plan.ep}, {plan.a2a}) is exposed for {share}, {where}"
    if name == "bubble":
        return (f"the pipeline bubble (pp={plan.pp}, vpp={plan.vpp or 1}, {plan.num_microbatches} micro-batches) "
                f"idles {share}")
    if name == "other_comm":
        return f"tensor/context/data-parallel and pipeline communication is exposed for {share}"
    if name == "optimizer":
        return f"the optimizer step takes {share}"
    a2a = 100 * t.exposed_a2a / t.step
    return f"compute-bound: GEMMs and element-wise work are {share} (exposed all-to-all {a2a:.0f}%)"
