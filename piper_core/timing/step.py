"""Step time: stage times through the pipeline schedule, plus data-parallel reduction and the
optimizer step; MFU, throughput, a breakdown that sums to the step, and the bottleneck.

Schedule: with ``m`` micro-batches and per-micro-batch stage times ``T_p`` (forward + backward +
p2p), 1F1B is simulated pass by pass (:mod:`piper_core.timing.schedule`); its closed form
``(m - 1) max_p T_p + sum_p T_p`` (Narayanan et al., arXiv 2104.04473, Sec. 2.2; X-MoE's planner)
is exact when the last stage is the slowest and an upper bound otherwise, and serves the search's
fast path. Interleaving over ``vpp`` chunks divides the fill/drain part by ``vpp`` (closed form) and
sends ``vpp`` times as many p2p messages, which Megatron overlaps with the neighbouring chunk's
pass in the steady state (``overlap_p2p_comm``, :func:`p2p_exposed`).
Data-parallel gradient reduce-scatter (all-reduce without the distributed optimizer) overlaps the
last micro-batch's backward and parameter all-gather the first forward, except one bucket each
(Megatron ``overlap_grad_reduce`` / ``overlap_param_gather``, 40M-parameter buckets).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from piper_core.resource.flops import step_flops
from piper_core.resource.params import stage_params
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import mtp_layers, stage_kinds, stage_layers
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.timing import comm
from piper_core.timing.compute import LayerShape, element_bytes, gemm_time, linear_time, stream_time
from piper_core.timing.layer import LayerCost, layer_cost, shape_of
from piper_core.timing.schedule import closed_form, one_f_one_b_order, pass_parts, pipeline_time
from piper_core.timing.topology import Group, dense_groups, expert_groups, slowest_link

BUCKET_PARAMS = 40_000_000
OPTIMIZER_BYTES = 30  # Adam on fp32 master: read param, grad, m, v (16); write param, m, v (12); bf16 copy (2)
FP32_OPTIMIZER_BYTES = 28  # fp32 training: Adam on the parameters themselves, no copy (Megatron FP32Optimizer)


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


def _end_stage(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> float:
    """The last rank's work per micro-batch besides its transformer layers: the output layer and loss
    (:func:`_logits`), and per MTP layer its own output layer and loss, its ``2h -> h`` projection
    (fwd + 2x bwd, in FP8 where the plan is: Megatron runs it in the FP8 context) and, under full
    recompute, the projection's forward again (``MultiTokenPredictionLayer`` checkpoints it with its
    transformer layer, whose repeat the layer's cost holds)."""
    logits = _logits(model, plan, cluster)
    k = model.mtp_num_layers
    if not k:
        return logits
    t = model.seq_length // plan.cp * plan.micro_batch_size
    h = model.hidden_size
    proj = linear_time(cluster.accelerator, shape_of(plan), t, h / plan.tp, 2 * h)
    return (1 + k) * logits + k * proj * (4 if plan.recompute == "full" else 3)


Kinds = tuple[tuple[tuple, int], ...]  # ((moe, recomputed[, load]), layer count) in layer order


def _stage_layer_kinds(model: ModelSpec, plan: ParallelPlan, loads: Mapping[int, float] | None = None) -> tuple[Kinds, ...]:
    """Per pipeline rank: (moe, recomputed) -> layer count, in the order the layers first appear
    (full recompute with the "block" method repeats only the first n layers of each chunk), the
    MTP layers' transformer layers last (full recompute repeats them whatever the method:
    ``MultiTokenPredictionLayer.forward``).

    ``loads`` (Megatron's 1-based ``layer_number`` -> the busiest expert-parallel rank's tokens over
    the mean rank's, issue 17) adds each MoE layer's load to its key, (moe, recomputed, load), None
    for dense layers; a MoE layer it does not name, MTP layers included (``layer_number`` past
    ``num_layers``), keeps the model's ``moe_expert_load_skew``."""
    block = plan.recompute_num_layers if plan.recompute_method == "block" else None
    full = plan.recompute == "full"
    if loads is not None:
        return _loaded_kinds(model, plan, loads, full, block)
    key = (model, plan.pp, plan.vpp, plan.num_layers_in_first_pipeline_stage, plan.num_layers_in_last_pipeline_stage,
           plan.pipeline_layout, full, block)
    kinds = _KINDS.get(key)
    if kinds is None:
        if len(_KINDS) > 4096:
            _KINDS.clear()
        kinds = _KINDS[key] = tuple(
            tuple((Counter((moe, full and (block is None or j < block))
                           for chunk in chunks for j, moe in enumerate(chunk))
                   + Counter({(model.mtp_is_moe, full): mtp})).items())
            for chunks, mtp in zip(stage_kinds(model, plan), mtp_layers(model, plan)))
    return kinds


def _loaded_kinds(model: ModelSpec, plan: ParallelPlan, loads: Mapping[int, float], full: bool,
                  block: int | None) -> tuple[Kinds, ...]:
    pattern, skew = model.moe_layer_pattern, model.moe_expert_load_skew
    out = []
    for chunks, mtp in zip(stage_layers(model, plan), mtp_layers(model, plan)):
        counts: Counter = Counter()
        for chunk in chunks:
            for j, index in enumerate(chunk):
                moe = pattern[index]
                counts[(moe, full and (block is None or j < block), loads.get(index + 1, skew) if moe else None)] += 1
        for i in range(mtp):  # MTP layer_number: after the decoder's (MultiTokenPredictionLayer)
            moe = model.mtp_is_moe
            counts[(moe, full, loads.get(model.num_layers + 1 + i, skew) if moe else None)] += 1
        out.append(tuple(counts.items()))
    return tuple(out)


def with_load(model: ModelSpec, load: float | None) -> ModelSpec:
    """``model`` whose MoE layers' busiest expert-parallel rank gets ``load`` times the mean rank's
    tokens (``moe_expert_load_skew``, which ``activations.busiest_rows`` reads; None: unchanged)."""
    if load is None or load == model.moe_expert_load_skew:
        return model
    return dataclasses.replace(model, moe_expert_load_skew=load)


def _key_cost(model: ModelSpec, shape: LayerShape, cluster: ClusterSpec, key: tuple) -> LayerCost:
    """The cost of a layer of :func:`_stage_layer_kinds`' key (at its load, where the key has one)."""
    moe, full = key[0], key[1]
    return _layer(with_load(model, key[2]) if len(key) > 2 else model, shape, cluster, moe, full)


_KINDS: dict[tuple, tuple[Kinds, ...]] = {}


def _p2p_message(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> float:
    """One model chunk's boundary activation ``[s/cp, b, h]`` (split over tp with SP) sent to the
    neighbouring pipeline rank (seconds; 0 without pipeline parallelism)."""
    act = model.seq_length // plan.cp * plan.micro_batch_size * model.hidden_size * element_bytes(plan.precision)
    act //= plan.tp if plan.sequence_parallel else 1
    return comm.p2p(dense_groups(plan)["pp"], act, cluster) if plan.pp > 1 else 0.0


def plain_1f1b_waits(pp: int, rank: int, m: int) -> float:
    """Blocking p2p calls per micro-batch on pipeline rank ``rank`` of Megatron-Core's 1F1B without
    interleaving (``forward_backward_pipelining_without_interleaving``, ``m`` micro-batches, ``w``
    warm-up forwards). First stage: ``w`` warm-up ``send_forward``, ``m - w`` steady
    ``send_forward_recv_backward``, ``w`` cool-down ``recv_backward`` (its ``recv_forward`` and
    ``send_backward`` are no-ops): ``m + w``. Last stage: one ``recv_forward`` before the steady
    loop and ``m`` ``send_backward_recv_forward``: ``m + 1``. A middle stage: two per warm-up and
    cool-down micro-batch, the ``recv_forward`` before the steady loop, two per steady micro-batch:
    ``2 m + 2 w + 1``. Each call is one message's time: a batched send and receive on one link run
    in opposite directions at once."""
    if pp == 1 or m == 0:
        return 0.0
    warmup = min(pp - rank - 1, m)
    steady = m - warmup
    if rank == 0:
        calls = warmup + steady + warmup
    elif rank == pp - 1:
        calls = 1 + m
    else:
        calls = 2 * warmup + (1 if steady else 0) + 2 * steady + 2 * warmup
    return calls / m


def p2p_exposed(message: float, plan: ParallelPlan, rank: int, compute: float, other: float) -> float:
    """Exposed p2p seconds per micro-batch on pipeline rank ``rank``, whose compute and other exposed
    communication per micro-batch are ``compute`` and ``other``; ``message`` is one send.

    Without interleaving (Megatron-Core ``forward_backward_pipelining_without_interleaving``) every
    p2p call is waited for, and :func:`plain_1f1b_waits` counts them per rank: an end stage has one
    neighbour, so each steady step's ``send_forward_recv_backward`` (first stage) or
    ``send_backward_recv_forward`` (last stage) is one batched exchange whose two messages cross the
    link in opposite directions at once, one message's time; a middle stage makes both calls, to two
    neighbours, one after the other. With interleaving but ``--no-overlap-p2p-communication`` every
    chunk's forward and backward send is waited for: ``2 vpp`` messages. With interleaving and
    ``overlap_p2p_comm``
    (Megatron-Core ``forward_backward_pipelining_with_interleaving``, pipeline_parallel/schedules.py),
    in the steady state ``pp_post_forward`` posts a forward chunk's send/recv and the next
    ``pp_pre_forward`` waits for it after one backward chunk has run, and ``pp_post_backward``'s wait
    comes after one forward chunk: each exposes ``max(0, message - that pass)``. The warm-up forwards
    and the cool-down backwards (``get_pp_rank_microbatches``: ``2 (pp - rank - 1) + (vpp - 1) pp`` of
    the ``m vpp`` chunk passes) send and wait (no ``--overlap-p2p-communication-warmup-flush``).
    """
    vpp = plan.virtual_stages
    if message == 0.0:
        return 0.0
    if vpp == 1:
        return plain_1f1b_waits(plan.pp, rank, plan.num_microbatches) * message
    if not plan.overlap_p2p_comm:
        return 2 * vpp * message
    m = plan.num_microbatches
    passes = m * vpp
    warmup = min(2 * (plan.pp - rank - 1) + (vpp - 1) * plan.pp, passes)
    fwd = (compute / 3 + other / 2) / vpp  # one chunk's passes, split as pass_parts splits a stage
    bwd = (2 * compute / 3 + other / 2) / vpp
    steady = max(0.0, message - bwd) + max(0.0, message - fwd)
    return (2 * warmup * message + (passes - warmup) * steady) / m


def _sums(kinds: Kinds, costs: dict[tuple[bool, bool], LayerCost]) -> tuple[float, float, float]:
    """(compute, exposed all-to-all, other communication) of one stage, per micro-batch."""
    compute = a2a = other = 0.0
    for key, count in kinds:
        cost = costs[key]
        compute += count * (cost.compute_fwd + cost.compute_bwd)
        a2a += count * (cost.a2a_fwd + cost.a2a_bwd)
        other += count * (cost.comm_fwd + cost.comm_bwd)
    return compute, a2a, other


def _stage_times(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec,
                 loads: Mapping[int, float] | None = None) -> tuple[tuple[StageTime, ...], float]:
    shape = shape_of(plan)
    message = _p2p_message(model, plan, cluster)
    stage_kinds_ = _stage_layer_kinds(model, plan, loads)
    costs = {key: _key_cost(model, shape, cluster, key) for kinds in stage_kinds_ for key, _ in kinds}
    # per micro-batch host work (embedding, output layer and loss, the schedule's bookkeeping),
    # fitted at pp = 1; the embedding and the loss sit on the end stages, so the stages share it
    overhead = cluster.accelerator.microbatch_overhead_us * 1e-6 / plan.pp
    raw = max([0.0] + [cost.a2a_raw for cost in costs.values()])  # one way, for reports
    out = []
    for rank, kinds in enumerate(stage_kinds_):
        compute, a2a, other = _sums(kinds, costs)
        if rank == plan.pp - 1:
            compute += _end_stage(model, plan, cluster)
        compute += overhead
        p2p = p2p_exposed(message, plan, rank, compute, a2a + other)
        out.append(StageTime(stage=rank, compute=compute, a2a=a2a, comm=other, p2p=p2p))
    return tuple(out), raw


def _overlapped(t: float, window: float, params: int) -> float:
    """Exposed part of a bucketed collective overlapped with ``window`` seconds of compute."""
    if t == 0.0 or params == 0:
        return 0.0
    last_bucket = t * min(1.0, BUCKET_PARAMS / params)
    return max(t - window, last_bucket)


def _dp_collectives(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> tuple[tuple[float, float, int], ...]:
    """Per pipeline rank: (gradient reduction, parameter gathering, parameters) before overlap.

    Dense (over dp x cp) and expert (over edp) collectives run one after the other on the same
    stream and share one window (see :func:`_data_parallel`).
    """
    dense_g, expert_g = dense_groups(plan)["dp"], expert_groups(plan)["edp"]
    grad_bytes, weight_bytes = plan.grad_bytes, element_bytes(plan.precision)
    out = []
    for params in stage_params(model, plan):
        pairs = ((dense_g, params.dense), (expert_g, params.expert))
        if plan.distributed_optimizer:
            grads = sum(comm.reduce_scatter(g, n * grad_bytes, cluster) for g, n in pairs)
            gather = sum(comm.ring(g, n * weight_bytes, cluster) for g, n in pairs)
        else:
            grads = sum(comm.ring(g, n * grad_bytes, cluster, passes=2) for g, n in pairs)
            gather = 0.0
        out.append((grads, gather, params.total))
    return tuple(out)


def _exposed_dp(collectives, computes) -> float:
    """Worst exposed (gradients, parameters) over the ranks: the backward (2/3 of a rank's compute)
    hides the gradients, the forward the parameters, except one bucket each."""
    worst = 0.0
    for (grads, gather, total), compute in zip(collectives, computes):
        exposed = _overlapped(grads, 2 / 3 * compute, total) + _overlapped(gather, 1 / 3 * compute, total)
        worst = max(worst, exposed)
    return worst


def _data_parallel(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, stages: tuple[StageTime, ...]) -> float:
    """Exposed gradient reduction + parameter gathering, worst pipeline rank.

    Dense (over dp x cp) and expert (over edp) collectives run one after the other on the same
    stream and share one window: the backward (2/3 of the compute) for gradients, the forward for
    parameters.
    """
    return _exposed_dp(_dp_collectives(model, plan, cluster), [st.compute for st in stages])


def _optimizer(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> float:
    """Adam over this GPU's shard: on the GPU, streaming ``OPTIMIZER_BYTES`` per parameter through
    HBM; the offloaded share moves fp32 gradients down and bf16 weights up the host link and is
    stepped by the CPU, whose memory bandwidth all GPUs of a node share."""
    worst, acc, f = 0.0, cluster.accelerator, plan.optimizer_offload_fraction
    for p in stage_params(model, plan):
        n = p.dense / (plan.dp * plan.cp) + p.expert / plan.edp if plan.distributed_optimizer else p.total
        per = FP32_OPTIMIZER_BYTES if plan.precision == "fp32" else OPTIMIZER_BYTES
        t = stream_time(acc, (1 - f) * n * per, elementwise=False)
        if f > 0:  # bf16 only (ParallelPlan refuses offload in fp32)
            t += f * n * (4 + element_bytes(plan.precision)) / (cluster.host_link_gb_per_s * 1e9)
            t += f * n * 28 * cluster.gpus_per_node / (cluster.host_memory_gb_per_s * 1e9)
        worst = max(worst, t)
    return worst + acc.step_overhead_us * 1e-6


def _exact_pipeline(stages: tuple[StageTime, ...], m: int) -> float:
    """:func:`pipeline_time` with ``exact=True`` (the 1F1B simulation, vpp = 1, pp > 1), computed
    without recording the passes: the same start/end recurrence per pass (start = max(the stage is
    free, its dependency is done), end = start + pass), so the same floats; the makespan is the
    latest stage's last end. ``simulate_1f1b`` keeps the passes for the timeline plot."""
    n = len(stages)
    fwd, bwd = [], []
    for st in stages:
        f, b = pass_parts(st)
        fwd.append(sum(f.values()))
        bwd.append(sum(b.values()))
    orders = [one_f_one_b_order(n, p, m) for p in range(n)]
    end_f = [[None] * m for _ in range(n)]
    end_b = [[None] * m for _ in range(n)]
    free, nxt = [0.0] * n, [0] * n
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for p in range(n):
            order, free_p, k = orders[p], free[p], nxt[p]
            f_p, b_p = fwd[p], bwd[p]
            done_f, done_b = end_f[p], end_b[p]
            prev_f = end_f[p - 1] if p > 0 else None
            next_b = end_b[p + 1] if p + 1 < n else None
            while k < len(order):
                kind, i = order[k]
                if kind == "F":
                    ready = prev_f[i] if prev_f is not None else 0.0
                    if ready is None:
                        break
                    free_p = done_f[i] = max(free_p, ready) + f_p
                else:
                    ready = next_b[i] if next_b is not None else 0.0
                    if ready is None:
                        break
                    free_p = done_b[i] = max(free_p, ready) + b_p
                k += 1
            if k != nxt[p]:
                remaining -= k - nxt[p]
                progressed = True
            free[p], nxt[p] = free_p, k
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen for Megatron's order
    return max(free)


def shared_cores(pipeline: float, m: int, slowest: float, share: float) -> float:
    """The pipeline's time on a host whose ranks share its cores (``core_share`` < 1; 1 leaves it).

    ``pipeline`` is the schedule at the calibrated rates, those of a host whose every rank is busy.
    In fill and drain only some stages run, and a rank that waits gives its core away, so those
    passes run faster, at most by ``1 / share`` (a full core each): the schedule takes no less than
    ``share x pipeline``. Nor less than ``m x slowest``: the slowest rank's own passes at the
    all-busy rate (the host's work over its cores while every rank runs). Why (4 ranks on 2 cores,
    the 3-round run of 2026-12-06, docs/validation/fp32/rounds3/1): the unshared schedule predicted
    pp 4 with 8 micro-batches at 1.65x its measured step and pp 2 with 4 at 1.47x, against 1.22-1.27x
    for the same host's plans without a pipeline; re-predicted with this term from the same profiles,
    1.22x and 1.20x."""
    if share >= 1.0:
        return pipeline
    return max(m * slowest, share * pipeline)


def _pipeline(stages: tuple[StageTime, ...], m: int, vpp: int, exact: bool) -> float:
    if exact and vpp == 1 and len(stages) > 1:
        return _exact_pipeline(stages, m)
    return pipeline_time(stages, m, vpp, exact=exact)


def step_time(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, *, exact: bool = True,
              loads: Mapping[int, float] | None = None) -> StepTime:
    """Predicted time of one training step and its breakdown (seconds).

    ``exact`` simulates the 1F1B schedule pass by pass; ``exact=False`` uses the closed form, an
    upper bound that is exact when the last stage is the slowest (the search's fast path).
    ``loads`` prices each MoE layer at its own load (:func:`_stage_layer_kinds`; issue 17's routing
    input, :mod:`piper_core.resource.routing`): with every load at the model's skew, the same floats.
    """
    stages, raw = _stage_times(model, plan, cluster, loads)
    m, slow = plan.num_microbatches, max(stages, key=lambda s: s.total)
    pipeline = shared_cores(_pipeline(stages, m, plan.virtual_stages, exact), m, slow.total,
                            cluster.accelerator.core_share)
    dp = _data_parallel(model, plan, cluster, stages)
    opt = _optimizer(model, plan, cluster)
    return StepTime(step=pipeline + dp + opt, compute=m * slow.compute, exposed_a2a=m * slow.a2a,
                    other_comm=m * (slow.comm + slow.p2p) + dp, bubble=pipeline - m * slow.total, optimizer=opt,
                    pipeline=pipeline, data_parallel=dp, stages=stages, slowest_stage=slow.stage, a2a_one_way=raw)


class ExchangeVariants:
    """Closed-form step times (``step_time(..., exact=False).step``, the same floats) of plans that
    differ from ``base`` only in the exchange: ``a2a``, ``a2a_chunks``, ``shared_expert_overlap``,
    ``ep_comm_overlap`` (the search's variants of one base plan).

    Those fields change the MoE layers' cost and nothing else: the dense layers, the logits, the p2p
    message, the data-parallel collectives and the optimizer are priced once here, and :meth:`step`
    re-prices the MoE layer, exposes the p2p per rank (:func:`p2p_exposed`, which reads the rank's
    compute) and sums the same terms in the same order as :func:`step_time`. Pipeline ranks
    with the same layers share their sums. ``cache`` (a dict the caller keeps for one search, i.e.
    one model and cluster) memoises layer costs and the other terms across base plans, each keyed
    by the plan fields its function reads.
    """

    __slots__ = ("model", "cluster", "base", "m", "vpp", "p2p", "sends", "logits", "overhead", "opt", "groups", "rank_group",
                 "dense", "moe_keys", "dp_terms", "layers", "exchange")

    def __init__(self, model: ModelSpec, base: ParallelPlan, cluster: ClusterSpec, cache: dict | None = None) -> None:
        cache = {} if cache is None else cache
        self.model, self.cluster, self.base = model, cluster, base
        self.m, self.vpp = base.num_microbatches, base.virtual_stages
        tp, cp, dp, mbs = base.tp, base.cp, base.dp, base.micro_batch_size
        sizes = (model, cluster, tp, cp, dp, base.pp, base.vpp, base.num_layers_in_first_pipeline_stage,
                 base.num_layers_in_last_pipeline_stage, base.pipeline_layout, base.ep, base.etp_size)
        self.p2p = _memo(cache, ("p2p", sizes, mbs, base.sequence_parallel), _p2p_message, model, base, cluster)
        self.sends = (tuple(p2p_exposed(self.p2p, base, rank, 0.0, 0.0) for rank in range(base.pp))
                      if self.vpp == 1 or not base.overlap_p2p_comm else ())
        self.logits = _memo(cache, ("logits", model, cluster, tp, cp, mbs, base.precision, base.fp8, base.recompute),
                            _end_stage, model, base, cluster)
        self.overhead = cluster.accelerator.microbatch_overhead_us * 1e-6 / base.pp
        self.opt = _memo(cache, ("optimizer", sizes, base.distributed_optimizer, base.optimizer_offload_fraction),
                         _optimizer, model, base, cluster)
        collectives = _memo(cache, ("dp", sizes, base.precision, base.grad_reduce_in_bf16, base.distributed_optimizer),
                            _dp_collectives, model, base, cluster)
        kinds = _stage_layer_kinds(model, base)
        shape = shape_of(base)
        self.layers = layers = cache.setdefault("layers", {})  # (model, cluster, shape, moe, full) -> LayerCost
        keys = list(dict.fromkeys(key for k in kinds for key, _ in k))
        self.dense = {}
        for key in keys:
            if not key[0]:
                lkey = (model, cluster, shape, False, key[1])
                cost = layers.get(lkey)
                if cost is None:
                    cost = layers[lkey] = _layer(model, shape, cluster, *key)
                self.dense[key] = cost
        self.moe_keys = tuple(key for key in keys if key[0])
        # the MoE costs of plans whose shape is this base's but for the exchange fields
        self.exchange = cache.setdefault(("exchange", model, cluster, shape), {})
        # ranks with the same layers (and the same end-stage work) share their sums
        index: dict[tuple, int] = {}
        self.rank_group = tuple(index.setdefault((k, rank == base.pp - 1), len(index))
                                for rank, k in enumerate(kinds))
        self.groups = tuple(index)
        # ranks with the same sums and the same collectives expose the same data-parallel time
        self.dp_terms = tuple(dict.fromkeys(zip(self.rank_group, collectives)))

    def _moe(self, plan: ParallelPlan, full: bool) -> LayerCost:
        if plan.ep_comm_overlap:  # its share of hidden micro-batches depends on more than the base shape
            shape = shape_of(plan)
            key = (self.model, self.cluster, shape, True, full)
            cost = self.layers.get(key)
            if cost is None:
                cost = self.layers[key] = _layer(self.model, shape, self.cluster, True, full)
            return cost
        key = (plan.a2a, plan.a2a_chunks, plan.shared_expert_overlap, full)
        cost = self.exchange.get(key)
        if cost is None:
            cost = self.exchange[key] = _layer(self.model, shape_of(plan), self.cluster, True, full)
        return cost

    def step(self, plan: ParallelPlan) -> float:
        costs = self.dense.copy()
        for key in self.moe_keys:
            costs[key] = self._moe(plan, key[1])
        computes, sums = [], []
        logits, overhead, base, message = self.logits, self.overhead, self.base, self.p2p
        for kinds, last in self.groups:
            compute, a2a, other = _sums(kinds, costs)
            if last:
                compute += logits
            compute += overhead
            computes.append(compute)
            sums.append((compute, a2a, other))
        if self.vpp == 1 or not base.overlap_p2p_comm:  # a rank's waited sends do not depend on its passes
            group_totals = [compute + a2a + other for compute, a2a, other in sums]
            totals = [group_totals[g] + p2p for g, p2p in zip(self.rank_group, self.sends)]
        else:  # overlapped sends: the exposed part depends on the rank's passes and warm-up
            totals = []
            for rank, g in enumerate(self.rank_group):
                compute, a2a, other = sums[g]
                totals.append(compute + a2a + other + p2p_exposed(message, base, rank, compute, a2a + other))
        pipeline = shared_cores(closed_form(totals, self.m, self.vpp), self.m, max(totals),
                                self.cluster.accelerator.core_share)
        dp = _exposed_dp([c for _, c in self.dp_terms], [computes[g] for g, _ in self.dp_terms])
        return pipeline + dp + self.opt


def _memo(cache: dict, key: tuple, fn, *args):
    value = cache.get(key)
    if value is None:
        value = cache[key] = fn(*args)
    return value


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
