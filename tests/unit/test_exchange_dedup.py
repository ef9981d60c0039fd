"""An exchange that sends each token to a node once (DeepEP/HybridEP, Megatron's flex dispatcher),
priced beside the one that sends a copy per expert (issue 15, Deliver 9); group-limited routing."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.errors import SpecError
from piper_core.export import megatron_args, parallel_flags, plan_label
from piper_core.presets import load_cluster, load_model
from piper_core.resource.predict import predict
from piper_core.runners import RUNNERS
from piper_core.scheduler.search import search
from piper_core.scheduler.space import default_space
from piper_core.specs import ParallelPlan, check_plan
from piper_core.timing import comm
from piper_core.timing.layer import layer_cost, shape_of
from piper_core.timing.routing import dedup_ratio, nodes_per_token
from piper_core.timing.topology import Group

H100 = load_cluster("dgx-h100")
DSV3 = load_model("deepseek-v3")
UNGROUPED = dataclasses.replace(DSV3, moe_router_num_groups=None, moe_router_group_topk=None)
SPLIT = dict(num_layers_in_first_pipeline_stage=7, num_layers_in_last_pipeline_stage=6)


def plan(**kw) -> ParallelPlan:
    p = ParallelPlan(**{**dict(gpus=1024, pp=8, ep=64, etp=1, global_batch_size=8192, **SPLIT), **kw})
    check_plan(DSV3, p)
    return p


def test_nodes_per_token_closed_forms():
    # one node: nothing crosses; top-1: one node; top-k over as many nodes as experts: k distinct nodes
    assert nodes_per_token(DSV3, 1) == 1.0
    assert nodes_per_token(load_model("switch-1t"), 64) == pytest.approx(1.0)
    k = UNGROUPED.moe_router_topk
    every = UNGROUPED.num_experts
    assert nodes_per_token(UNGROUPED, every) == pytest.approx(k)
    # two nodes, plain top-8 of 256: a node is missed only when all 8 picks land on the other half
    from math import comb
    assert nodes_per_token(UNGROUPED, 2) == pytest.approx(2 * (1 - comb(128, 8) / comb(256, 8)))
    # DeepSeek-V3's node-limited routing at one group per node: exactly its 4 nodes
    assert nodes_per_token(DSV3, 8) == pytest.approx(4.0)
    assert nodes_per_token(UNGROUPED, 8) > 5.0
    assert dedup_ratio(DSV3, 8) == pytest.approx(0.5)


@pytest.mark.parametrize("nodes", [2, 4, 8, 16, 32])
def test_dedup_never_sends_more_than_one_copy_per_expert(nodes):
    for model in (DSV3, UNGROUPED):
        assert 1.0 / model.moe_router_topk <= dedup_ratio(model, nodes) <= 1.0
    assert nodes_per_token(DSV3, nodes) <= nodes_per_token(UNGROUPED, nodes) + 1e-9  # limiting only helps


def test_dedup_shrinks_only_the_inter_node_stage():
    group = Group(name="ep", size=64, stride=1)
    one = comm.hierarchical_stages(group, 64e6, H100)
    half = comm.hierarchical_stages(group, 64e6, H100, inter_share=0.5)
    assert half[0] == one[0] and half[1] < one[1]
    inner = Group(name="ep", size=8, stride=1)  # one node: nothing to deduplicate
    assert comm.hierarchical_stages(inner, 64e6, H100, inter_share=0.5) == comm.hierarchical_stages(inner, 64e6, H100)


def test_deepseek_v3_exchange_priced_both_ways():
    costs = {a2a: layer_cost(DSV3, shape_of(plan(a2a=a2a)), H100, True) for a2a in ("flat", "hierarchical", "dedup")}
    assert costs["dedup"].a2a_raw < costs["hierarchical"].a2a_raw
    assert costs["dedup"].a2a_fwd < costs["hierarchical"].a2a_fwd
    steps = {a2a: predict(DSV3, H100, plan(a2a=a2a)).time.step for a2a in ("hierarchical", "dedup")}
    assert steps["dedup"] < steps["hierarchical"]
    # without node-limited routing the same exchange saves less
    plain = layer_cost(UNGROUPED, shape_of(plan(a2a="dedup")), H100, True)
    assert costs["dedup"].a2a_raw < plain.a2a_raw < costs["hierarchical"].a2a_raw


@pytest.mark.parametrize("kw, key", [(dict(a2a_chunks=2), "a2a_chunks"),
                                     (dict(shared_expert_overlap=True), "shared_expert_overlap"),
                                     (dict(defer_wgrad=True), "defer_wgrad")])
def test_dedup_refuses_what_the_flex_dispatcher_does_not_run(kw, key):
    with pytest.raises(SpecError, match=rf"{key}.*a2a=dedup .*set"):
        plan(a2a="dedup", **kw)


def test_only_megatrons_stock_flex_dispatcher_runs_dedup():
    p = ParallelPlan(gpus=1024, ep=64, etp=1, global_batch_size=8192, a2a="dedup")  # even pp for DeepSpeed
    why = {name: rule(p) for name, rule in RUNNERS.items()}
    assert why["megatron stock"] is None
    for name in ("megatron --piper", "deepspeed piper", "deepspeed stock"):
        assert why[name] and "flex" in why[name], name


def test_dedup_exports_the_flex_dispatcher_and_no_piper_flags():
    p = plan(a2a="dedup")
    flags = dict(parallel_flags(DSV3, p))
    assert flags["--moe-token-dispatcher-type"] == "flex" and flags["--moe-flex-dispatcher-backend"] == "deepep"
    text = megatron_args(predict(DSV3, H100, p))
    assert text.count("--moe-token-dispatcher-type") == 1 and "--moe-token-dispatcher-type flex" in text
    assert "--moe-router-num-groups 8" in text and "--moe-router-group-topk 4" in text
    assert "PIPER_ARGS=()" in text and "--piper-a2a" not in text
    assert plan_label(p).endswith(" dedup")
    stock = megatron_args(predict(DSV3, H100, plan()))
    assert "--moe-token-dispatcher-type alltoall" in stock and "--piper-a2a flat" in stock


def test_the_search_offers_dedup_and_keeps_it_from_piper_runtimes():
    space = dataclasses.replace(default_space(DSV3, H100, 1024), tp=(1,), pp=(8,), vpp=(1,), cp=(1,), ep=(64,),
                                mbs=(1,), recompute=("full",), distributed_optimizer=(True,))
    result = search(DSV3, H100, 1024, 8192, space=space)
    plans = [s.plan for s in result.scored]
    dedup = [p for p in plans if p.a2a == "dedup"]
    assert dedup and all(not p.shared_expert_overlap and p.a2a_chunks == 1 for p in dedup)
    assert result.best(1)[0].plan.a2a == "dedup"  # on 8 nodes with node-limited routing it wins


def test_router_group_rules_name_the_key():
    for kw, key in ((dict(moe_router_num_groups=8), "moe_router_group_topk"),
                    (dict(moe_router_num_groups=7, moe_router_group_topk=4), "moe_router_num_groups"),
                    (dict(moe_router_num_groups=8, moe_router_group_topk=9), "moe_router_group_topk"),
                    (dict(moe_router_num_groups=8, moe_router_group_topk=3), "moe_router_group_topk")):
        with pytest.raises(SpecError, match=key):
            dataclasses.replace(UNGROUPED, **kw)
