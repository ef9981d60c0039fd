"""The step-time model of the expert-parallel exchange: the algorithm and the pipeline chunks are
independent; a pipelined exchange is priced as a pipeline whose stages are the link levels and the
experts; shared-expert overlap and Megatron's EP overlap hide what they can and no more."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.presets import load_cluster, load_model
from piper_core.specs import ParallelPlan, check_plan
from piper_core.timing.compute import shared_expert_forward
from piper_core.timing.layer import layer_cost, pipeline_time, shape_of
from piper_core.timing.step import step_time

H100 = load_cluster("dgx-h100")
SWITCH = load_model("switch-1t")
SWITCH_1024 = dict(gpus=1024, tp=2, sequence_parallel=True, ep=256, etp=2, micro_batch_size=4,
                   global_batch_size=2048)


def plan(model, **kw) -> ParallelPlan:
    p = ParallelPlan(**kw)
    check_plan(model, p)
    return p


def test_one_resource_pipeline_is_the_three_stage_formula():
    d, e, c, n = 0.3, 0.5, 0.2, 4
    old = d + e + c + (n - 1) * max(e, d + c)  # the flat pipelined formula the model used before
    assert pipeline_time((("link", d), ("experts", e), ("link", c)), n) == pytest.approx(old)
    assert pipeline_time((("link", d), ("experts", e), ("link", c)), 1) == pytest.approx(d + e + c)


def test_pipeline_period_is_the_busiest_resource_not_the_sum_of_the_links():
    """Hierarchical: the inter-node stage of one chunk overlaps the intra-node stages of the others."""
    stages = (("intra", 0.1), ("inter", 0.4), ("experts", 0.2), ("inter", 0.4), ("intra", 0.1))
    assert pipeline_time(stages, 5) == pytest.approx(1.2 + 4 * 0.8)  # inter carries 0.8 per chunk
    one_link = tuple(("link", t) if r != "experts" else (r, t) for r, t in stages)
    assert pipeline_time(stages, 5) < pipeline_time(one_link, 5)


def _step(model, cluster=H100, **kw):
    return step_time(model, plan(model, **kw), cluster)


def test_switch_1t_at_1024_pipelined_hierarchical_beats_both_parents():
    """The issue's case: at ep 256 every flat chunk pays 255 peers' latency (pipelined flat was
    slower than unpipelined hierarchical); pipelining the hierarchical exchange keeps the aggregated
    inter-node messages and overlaps them with the experts."""
    hier = _step(SWITCH, **SWITCH_1024, a2a="hierarchical")
    flat2 = _step(SWITCH, **SWITCH_1024, a2a="flat", a2a_chunks=2)
    hier2 = _step(SWITCH, **SWITCH_1024, a2a="hierarchical", a2a_chunks=2)
    assert flat2.step > hier.step  # flat chunks: latency-bound
    assert hier2.step < hier.step and hier2.exposed_a2a < hier.exposed_a2a
    # the exposure changes; at a flat GEMM efficiency compute changes by the host time per chunk,
    # and with dgx-h100's shape knee each chunk's half-height expert GEMMs run a little slower too
    flat = dataclasses.replace(H100, accelerator=dataclasses.replace(H100.accelerator, gemm_half_size=0.0))
    flat1, flat2 = (_step(SWITCH, flat, **SWITCH_1024, a2a="hierarchical", a2a_chunks=c) for c in (1, 2))
    assert flat2.compute == pytest.approx(flat1.compute, rel=1e-2)
    assert hier2.compute / hier.compute > flat2.compute / flat1.compute


def test_every_algorithm_takes_every_chunk_count():
    for algo in ("flat", "hierarchical"):
        times = [_step(SWITCH, **SWITCH_1024, a2a=algo, a2a_chunks=c).step for c in (1, 2, 4, 8)]
        assert len(set(times)) == 4  # chunks change the prediction under either algorithm


def test_shared_expert_overlap_hides_at_most_the_shared_forward():
    """Forward only (what Piper's runtime overlaps), unpipelined only (a pipelined exchange runs the
    shared expert after it)."""
    model = load_model("deepseek-v3")
    base = dict(gpus=256, pp=1, ep=32, micro_batch_size=1, global_batch_size=512)
    off = plan(model, **base)
    on = plan(model, **base, shared_expert_overlap=True)
    shape_off, shape_on = shape_of(off), shape_of(on)
    cost_off = layer_cost(model, shape_off, H100, True)
    cost_on = layer_cost(model, shape_on, H100, True)
    shared = shared_expert_forward(model, shape_on, H100.accelerator)
    assert shared > 0
    assert cost_on.a2a_fwd == pytest.approx(max(0.0, cost_off.a2a_fwd - shared))
    assert cost_on.a2a_bwd == cost_off.a2a_bwd
    assert cost_on.compute_fwd == cost_off.compute_fwd  # the shared expert still computes
    piped_off, piped_on = (layer_cost(model, shape_of(dataclasses.replace(p, a2a_chunks=4)), H100, True)
                           for p in (off, on))
    assert piped_on == piped_off
    with pytest.raises(Exception, match="has no shared expert"):
        plan(SWITCH, **SWITCH_1024, shared_expert_overlap=True)


def test_megatron_ep_overlap_needs_micro_batches_to_pair():
    """One micro-batch has no partner to overlap with; with many, the steady state hides the
    exchange up to the paired layer's compute."""
    one = dict(SWITCH_1024)
    assert _step(SWITCH, **one, ep_comm_overlap=True).step == pytest.approx(_step(SWITCH, **one).step)
    many = dict(SWITCH_1024, global_batch_size=16384)  # 8 micro-batches
    plain, overlapped = _step(SWITCH, **many), _step(SWITCH, **many, ep_comm_overlap=True)
    assert overlapped.exposed_a2a < plain.exposed_a2a
    hidden = plain.exposed_a2a - overlapped.exposed_a2a
    assert hidden <= 7 / 8 * plain.exposed_a2a + 1e-9  # the first micro-batch stays exposed


def test_more_inter_node_bandwidth_never_slows_a_pipelined_hierarchical_plan():
    nv, ib = H100.links
    times = []
    for f in (0.25, 0.5, 1, 2, 4):
        cluster = dataclasses.replace(H100, links=(nv, dataclasses.replace(ib, bandwidth_gb_per_s=ib.bandwidth_gb_per_s * f)))
        times.append(_step(SWITCH, cluster, **SWITCH_1024, a2a="hierarchical", a2a_chunks=4).step)
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_deferred_weight_gradients_hide_at_most_themselves_and_only_in_backward():
    """``defer_wgrad``: the dispatch gradient leaves before the weight GEMMs. Unpipelined it hides
    min(the dispatch gradient's exchange, the experts' weight gradients) of the backward and nothing
    else; pipelined it never prices a chunk count slower than without it."""
    from piper_core.cli.parse import parse_parallel
    from piper_core.export import plan_label
    from piper_core.runners import RUNNERS
    from piper_core.timing.compute import moe_forward

    for model, cluster, kw in ((SWITCH, H100, SWITCH_1024),
                               (load_model("tiny-moe"), load_cluster("cpu-local"), dict(gpus=2, ep=2, global_batch_size=8))):
        for a2a in ("flat", "hierarchical"):
            for chunks in (1, 2, 4, 8):
                base = plan(model, **kw, a2a=a2a, a2a_chunks=chunks)
                deferred = dataclasses.replace(base, defer_wgrad=True)
                was = layer_cost(model, shape_of(base), cluster, True)
                now = layer_cost(model, shape_of(deferred), cluster, True)
                assert (now.a2a_fwd, now.compute_fwd, now.compute_bwd) == (was.a2a_fwd, was.compute_fwd, was.compute_bwd)
                assert now.a2a_bwd <= was.a2a_bwd + 1e-15, (model.name, a2a, chunks)
                if chunks == 1:
                    wgrad = moe_forward(model, shape_of(base), cluster.accelerator)[1]  # one GEMM pass of the experts
                    assert was.a2a_bwd - now.a2a_bwd == pytest.approx(min(was.a2a_raw, wgrad), rel=1e-9)
    p = parse_parallel("tp=2,sp=1,ep=256,etp=2,mbs=4,gbs=2048,a2a=hierarchical,dwg=1", 1024)
    assert p.defer_wgrad and plan_label(p).endswith("hierarchical+dwg")
    assert step_time(SWITCH, p, H100).step < step_time(SWITCH, dataclasses.replace(p, defer_wgrad=False), H100).step
    reasons = {name: rule(p) for name, rule in RUNNERS.items()}
    assert reasons["megatron stock"].startswith("defer_wgrad: ") and reasons["deepspeed stock"].startswith("defer_wgrad")
    assert reasons["megatron --piper"] is None  # both adapters run it (tests/megatron, tests/deepspeed)
    assert reasons["deepspeed piper"] is None or not reasons["deepspeed piper"].startswith("defer_wgrad"), reasons
    with pytest.raises(Exception, match="defer_wgrad=True: and ep_comm_overlap both move"):
        ParallelPlan(gpus=8, ep=8, global_batch_size=8, ep_comm_overlap=True, defer_wgrad=True)
    with pytest.raises(Exception, match=r"defer_wgrad=True: needs expert parallelism \(ep > 1\)"):
        ParallelPlan(gpus=8, ep=1, global_batch_size=8, defer_wgrad=True)
