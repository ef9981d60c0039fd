"""Step time with a load per MoE layer (issue 17): each MoE layer priced at its own busiest rank.

:func:`piper_core.timing.step.step_time` prices every MoE layer alike, at the model's
``moe_expert_load_skew``. Here each MoE layer (Megatron's 1-based ``layer_number``) has its own
load ``f`` = the busiest expert-parallel rank's routed tokens over the mean rank's
(:mod:`piper_core.resource.routing`), and is priced as the same layer of a model whose
``moe_expert_load_skew`` is ``f``: the busiest rank's expert GEMMs, its receive buffer and the
exchange it waits for all scale with it (``busiest_rows`` in resource/activations.py, the one place
the load enters). ``f <= ep`` always, so ``busiest_rows``' ``min(skew, ep)`` keeps it unchanged.

Everything else is :func:`step_time`'s own terms, summed in the same order: with every load equal
to the model's skew (even routing on the default placement: ``f = 1``) the result is the same
floats as ``step_time`` (tests/unit/test_routing.py checks it for pipelined and interleaved plans).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import stage_layers
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.timing.layer import LayerCost, shape_of
from piper_core.timing.step import (StageTime, StepTime, _data_parallel, _layer, _logits, _optimizer, _p2p_message,
                                    _pipeline, p2p_exposed, shared_cores)

Key = tuple[bool, bool, float | None]  # (moe, recomputed, load of a MoE layer)


def with_load(model: ModelSpec, load: float) -> ModelSpec:
    """``model`` whose MoE layers' busiest rank gets ``load`` times the mean rank's tokens."""
    if load == model.moe_expert_load_skew:
        return model
    return dataclasses.replace(model, moe_expert_load_skew=load)


def _stage_keys(model: ModelSpec, plan: ParallelPlan, loads: Mapping[int, float]) -> tuple[tuple[Key, int], ...]:
    """Per pipeline rank: (moe, recomputed, load) -> layer count, in the order the layers first
    appear (as step._stage_layer_kinds, with the load of each MoE layer beside it)."""
    block = plan.recompute_num_layers if plan.recompute_method == "block" else None
    full = plan.recompute == "full"
    pattern = model.moe_layer_pattern
    out = []
    for chunks in stage_layers(model, plan):
        counts: dict[Key, int] = {}
        for chunk in chunks:
            for j, index in enumerate(chunk):
                moe = pattern[index]
                load = loads.get(index + 1, model.moe_expert_load_skew) if moe else None
                key = (moe, full and (block is None or j < block), load)
                counts[key] = counts.get(key, 0) + 1
        out.append(tuple(counts.items()))
    return tuple(out)


def _layer_cost(model: ModelSpec, shape, cluster: ClusterSpec, key: Key) -> LayerCost:
    moe, recomputed, load = key
    return _layer(with_load(model, load) if moe else model, shape, cluster, moe, recomputed)


def loaded_stage_times(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec,
                       loads: Mapping[int, float]) -> tuple[tuple[StageTime, ...], float]:
    """As step._stage_times, each MoE layer at its load (``loads``: layer_number -> busiest/mean rank)."""
    shape = shape_of(plan)
    message = _p2p_message(model, plan, cluster)
    stages = _stage_keys(model, plan, loads)
    costs = {key: _layer_cost(model, shape, cluster, key) for kinds in stages for key, _ in kinds}
    overhead = cluster.accelerator.microbatch_overhead_us * 1e-6 / plan.pp
    raw = max([0.0] + [cost.a2a_raw for cost in costs.values()])
    out = []
    for rank, kinds in enumerate(stages):
        compute = a2a = other = 0.0
        for key, count in kinds:
            cost = costs[key]
            compute += count * (cost.compute_fwd + cost.compute_bwd)
            a2a += count * (cost.a2a_fwd + cost.a2a_bwd)
            other += count * (cost.comm_fwd + cost.comm_bwd)
        if rank == plan.pp - 1:
            compute += _logits(model, plan, cluster)
        compute += overhead
        p2p = p2p_exposed(message, plan, rank, compute, a2a + other)
        out.append(StageTime(stage=rank, compute=compute, a2a=a2a, comm=other, p2p=p2p))
    return tuple(out), raw


def loaded_step_time(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, loads: Mapping[int, float], *,
                     exact: bool = True) -> StepTime:
    """:func:`piper_core.timing.step.step_time` with each MoE layer at its own load."""
    stages, raw = loaded_stage_times(model, plan, cluster, loads)
    m, slow = plan.num_microbatches, max(stages, key=lambda s: s.total)
    pipeline = shared_cores(_pipeline(stages, m, plan.virtual_stages, exact), m, slow.total,
                            cluster.accelerator.core_share)
    dp = _data_parallel(model, plan, cluster, stages)
    opt = _optimizer(model, plan, cluster)
    return StepTime(step=pipeline + dp + opt, compute=m * slow.compute, exposed_a2a=m * slow.a2a,
                    other_comm=m * (slow.comm + slow.p2p) + dp, bubble=pipeline - m * slow.total, optimizer=opt,
                    pipeline=pipeline, data_parallel=dp, stages=stages, slowest_stage=slow.stage, a2a_one_way=raw)
