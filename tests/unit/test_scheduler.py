"""The scheduler against an independent brute force, and the behaviour the time model must show."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.resource.predict import predict
from piper_core.scheduler.search import search
from piper_core.scheduler.space import SearchSpace
from piper_core.specs import ParallelPlan, check_plan
from piper_core.timing.step import step_time

MIXTRAL = load_model("mixtral-8x7b")
WIDE = dataclasses.replace(MIXTRAL, num_experts=32, moe_ffn_hidden_size=3584)  # 32 smaller experts: ep up to 32
H100 = load_cluster("dgx-h100")


def valid(model, **kw) -> ParallelPlan:
    plan = ParallelPlan(**kw)
    check_plan(model, plan)
    return plan

SMALL = SearchSpace(tp=(1, 2, 4), pp=(1, 2, 4), vpp=(1, 2), cp=(1, 2), ep=(1, 2, 4, 8), mbs=(1, 2),
                    recompute=("none", "selective", "full"), distributed_optimizer=(True, False),
                    a2a=(("flat", 1), ("hierarchical", 1), ("pipelined", 4)), memory_savers=((False, 0.0),))


def brute_force(model, cluster, gpus, gbs, space):
    """Every combination through the public ParallelPlan/check_plan/predict path; no shared shortcuts."""
    best, feasible = None, set()
    dims = itertools.product(space.tp, space.pp, space.vpp, space.cp, space.ep, space.etp_equals_tp, space.mbs,
                             space.recompute, space.distributed_optimizer, space.a2a)
    for tp, pp, vpp, cp, ep, etp_is_tp, mbs, rc, dopt, (algo, chunks) in dims:
        if ep == 1 and (algo, chunks) != ("flat", 1):
            continue
        try:
            plan = ParallelPlan(gpus=gpus, tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, cp=cp, ep=ep,
                                etp=tp if etp_is_tp else 1, sequence_parallel=tp > 1, micro_batch_size=mbs,
                                global_batch_size=gbs, recompute=rc, recompute_num_layers=1 if rc == "full" else None,
                                distributed_optimizer=dopt, a2a=algo, a2a_chunks=chunks)
            check_plan(model, plan)
        except SpecError:
            continue
        p = predict(model, cluster, plan)
        if not p.feasible:
            continue
        feasible.add(plan)
        if best is None or p.time.step < best.time.step:
            best = p
    return best, feasible


@pytest.mark.parametrize("gpus, gbs", [(16, 64), (32, 256)])
def test_search_matches_brute_force(gpus, gbs):
    model = dataclasses.replace(MIXTRAL, num_layers=8)
    result = search(model, H100, gpus, gbs, space=SMALL)
    best, feasible = brute_force(model, H100, gpus, gbs, SMALL)
    assert {s.plan for s in result.scored} == feasible
    top = result.best(1)[0]
    assert top.step_s == pytest.approx(best.time.step, rel=1e-9)
    chosen = predict(model, H100, top.plan)
    assert chosen.feasible and chosen.peak_stage.total == top.peak_bytes
    assert result.candidates == sum(result.rejected.values()) + result.feasible


def test_rejections_are_counted_by_reason():
    result = search(MIXTRAL, H100, 8, 64, space=SMALL)
    assert result.rejected["experts % ep != 0"] == 0  # 8 experts: every ep in SMALL divides them
    assert result.rejected["exceeds memory"] > 0  # 46.7B on 8 GPUs without sharding does not fit
    many = dataclasses.replace(MIXTRAL, num_experts=6, num_layers=8)
    assert search(many, H100, 16, 64, space=SMALL).rejected["experts % ep != 0"] > 0


def _slow_inter(cluster, factor):
    nv, ib = cluster.links
    return dataclasses.replace(cluster, links=(nv, dataclasses.replace(ib, bandwidth_gb_per_s=ib.bandwidth_gb_per_s * factor)))


@pytest.mark.parametrize("kw", [
    dict(pp=2, ep=16),
    dict(tp=2, sequence_parallel=True, pp=2, ep=8, a2a="hierarchical"),
    dict(pp=4, vpp=2, ep=16, a2a="pipelined", a2a_chunks=4),
    dict(ep=16, cp=2, distributed_optimizer=False, recompute="full", recompute_num_layers=2),
    dict(tp=4, etp=1, sequence_parallel=True, ep=16, a2a="hierarchical"),
])
def test_more_bandwidth_is_never_slower(kw):
    plan = valid(WIDE, gpus=64, global_batch_size=256, **kw)
    times = [step_time(WIDE, plan, _slow_inter(H100, f)).step for f in (0.25, 0.5, 1, 2, 4)]
    assert times == sorted(times, reverse=True)


def test_ep_inside_a_node_beats_ep_across_nodes():
    """Same plan, ep=8: on 8-GPU nodes the all-to-all stays on NVLink; on 2-GPU nodes it crosses IB."""
    plan = valid(MIXTRAL, gpus=64, pp=2, ep=8, global_batch_size=256)
    nv, ib = H100.links
    small_nodes = dataclasses.replace(H100, gpus_per_node=2, links=(dataclasses.replace(nv, domain_gpus=2), ib))
    inside, across = step_time(MIXTRAL, plan, H100), step_time(MIXTRAL, plan, small_nodes)
    assert inside.exposed_a2a < across.exposed_a2a
    assert inside.step < across.step


def test_saturated_interconnect_moves_plans_to_dp_pp():
    """The paper's observation: when the all-to-all saturates a slow inter-node link, the best plan
    keeps experts inside a node (small ep) and scales with data/pipeline parallelism instead."""
    model = dataclasses.replace(WIDE, num_layers=8)
    space = dataclasses.replace(SMALL, ep=(1, 2, 4, 8, 16, 32), tp=(1,), cp=(1,))
    fast = search(model, _slow_inter(H100, 8), 64, 512, space=space).best(1)[0].plan
    slow = search(model, _slow_inter(H100, 1 / 200), 64, 512, space=space).best(1)[0].plan
    assert fast.ep > H100.gpus_per_node  # with a fast fabric, wide EP wins (less expert memory, more dp)
    assert slow.ep <= H100.gpus_per_node  # a saturated fabric keeps the all-to-all on NVLink
    assert slow.dp * slow.pp >= fast.dp * fast.pp // fast.ep * slow.ep or slow.edp > fast.edp


def _a2a_plans(ep=16, chunks=4):
    base = dict(gpus=64, pp=2, ep=ep, global_batch_size=256)
    return valid(WIDE, **base), valid(WIDE, **base, a2a="pipelined", a2a_chunks=chunks)


def test_pipelined_hides_communication_when_comm_matches_compute():
    flat, piped = _a2a_plans()
    cluster = _slow_inter(H100, 0.5)
    t_flat, t_piped = step_time(WIDE, flat, cluster), step_time(WIDE, piped, cluster)
    assert t_flat.exposed_a2a > 0.2 * t_flat.compute  # the case really is communication-heavy
    assert t_piped.step < t_flat.step


def test_pipelined_costs_only_per_chunk_latency_when_comm_is_negligible():
    """With a very fast fabric the pipelined plan can only lose what C chunks add: C-1 more message
    rounds per all-to-all and C-1 more launches of each local expert's kernels."""
    chunks = 4
    flat, piped = _a2a_plans(chunks=chunks)
    nv, ib = H100.links
    fast = dataclasses.replace(H100, links=(dataclasses.replace(nv, bandwidth_gb_per_s=1e6),
                                            dataclasses.replace(ib, bandwidth_gb_per_s=1e6)))
    t_flat, t_piped = step_time(WIDE, flat, fast), step_time(WIDE, piped, fast)
    m, layers = flat.num_microbatches, WIDE.num_layers // flat.pp
    local = WIDE.num_experts // flat.ep
    a2a_rounds = 2 * 3  # dispatch + combine, forward + backward (2 in backward)
    latency = sum((flat.ep - 1) * lvl.latency_us * 1e-6 for lvl in fast.links)  # per round, generous
    kernels = 3 * 3 * local * fast.accelerator.kernel_latency_us * 1e-6  # 3 kernels x (fwd + 2 bwd)
    bound = m * layers * (chunks - 1) * (a2a_rounds * latency + kernels)
    assert t_piped.step - t_flat.step <= bound + 1e-12
    assert t_piped.step >= t_flat.step - 1e-9 or t_flat.exposed_a2a > 0


def test_unfused_attention_plans_never_use_context_parallelism():
    """Megatron's DotProductAttention asserts cp == 1; the search counts those plans as rejected
    (it once raised Infeasible from the activation model for them: `piper plan --attention unfused`)."""
    model, cpu = load_model("tiny-moe"), load_cluster("cpu-local")
    result = search(model, cpu, 2, 64, attention_backend="unfused")
    assert any("context parallelism" in reason for reason in result.rejected)
    assert result.scored and all(s.plan.cp == 1 for s in result.scored)


def test_an_infeasible_candidate_is_rejected_with_its_reason_and_the_search_goes_on(monkeypatch):
    """An Infeasible raised by the resource model for one candidate (a host-framework rule the
    structural checks do not know) is counted under its reason; it never aborts the search."""
    from piper_core.errors import Infeasible
    from piper_core.scheduler import search as search_module

    real = search_module.stage_memory

    def stage_memory(model, plan, cluster, *args, **kwargs):
        if plan.pp == 2:
            raise Infeasible("pp=2 is refused by the host framework", rule="stand-in rule")
        return real(model, plan, cluster, *args, **kwargs)

    model = dataclasses.replace(MIXTRAL, num_layers=8)
    plain = search(model, H100, 16, 64, space=SMALL)
    monkeypatch.setattr(search_module, "stage_memory", stage_memory)
    result = search(model, H100, 16, 64, space=SMALL)
    assert any(s.plan.pp == 2 for s in plain.scored)
    assert result.rejected["pp=2 is refused by the host framework"] > 0
    assert result.scored and not any(s.plan.pp == 2 for s in result.scored)
    assert {s.plan for s in result.scored} == {s.plan for s in plain.scored if s.plan.pp != 2}
    assert result.candidates == sum(result.rejected.values()) + result.feasible


def test_sequence_parallel_off_keeps_moe_at_tp1_and_dense_without_it():
    model = dataclasses.replace(MIXTRAL, num_layers=8)
    space = dataclasses.replace(SMALL, sequence_parallel=False)
    moe = search(model, H100, 16, 64, space=space)
    assert moe.scored and all(s.plan.tp == 1 for s in moe.scored)
    assert moe.rejected["invalid sequence_parallel"] > 0  # Megatron-Core's MoE needs it with tp > 1
    dense = dataclasses.replace(model, num_experts=0, moe_ffn_hidden_size=None, moe_router_topk=1)
    plans = search(dense, H100, 16, 64, space=dataclasses.replace(space, ep=(1,), a2a=(("flat", 1),))).scored
    assert any(s.plan.tp > 1 for s in plans) and not any(s.plan.sequence_parallel for s in plans)
