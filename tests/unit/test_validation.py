"""One test per validation rule: each rule raises SpecError with its own message."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.specs import ClusterSpec, LinkLevel, ModelSpec, ParallelPlan, check_plan

TINY = load_model("tiny-moe")  # 4 layers, hidden 64, 4 heads, 8 experts, moe ffn 64


def plan(**kw) -> ParallelPlan:
    kw.setdefault("global_batch_size", 64)
    kw.setdefault("gpus", 8)
    return ParallelPlan(**kw)


def model(**kw) -> ModelSpec:
    return dataclasses.replace(TINY, **kw)


# ---- plan-only rules ------------------------------------------------------------------------
PLAN_RULES = [
    (dict(gpus=6, tp=4), r"gpus=6: must be a multiple of tp\*pp\*cp = 4\*1\*1 = 4"),
    (dict(gpus=8, tp=2, pp=2, ep=8, etp=1), r"ep=8: etp\*ep = 1\*8 = 8 must divide tp\*cp\*dp = 4"),
    (dict(gpus=8, micro_batch_size=3, global_batch_size=64), r"micro_batch_size\*dp=24: must divide global_batch_size \(64\)"),
    (dict(vpp=2), r"vpp=2: interleaving needs pipeline parallelism"),
    (dict(sequence_parallel=True), r"sequence_parallel=True: has no effect with tp=1"),
    (dict(recompute="full"), r"recompute_num_layers=None: full recompute needs a layer count"),
    (dict(recompute="selective", recompute_num_layers=2), r"recompute_num_layers=2: applies only to recompute=full"),
    (dict(gpus=8, ep=8, ep_comm_overlap=True, a2a_chunks=4),
     r"a2a='flat/4': ep_comm_overlap \(--overlap-moe-expert-parallel-comm\) Megatron's overlap runs its own"),
    (dict(ep_comm_overlap=True), r"ep=1: ep_comm_overlap .* needs expert parallelism"),
    (dict(gpus=8, pp=2, ep=4, ep_comm_overlap=True), r"vpp=None: ep_comm_overlap .* needs interleaving \(vpp\) when pp > 1"),
    (dict(gpus=8, ep=8, ep_comm_overlap=True, shared_expert_overlap=True), r"shared_expert_overlap=True: "
     "ep_comm_overlap .* is refused by Megatron"),
    (dict(tp=0), r"tp=0: must be a positive number"),
    (dict(recompute="fulll"), r"recompute='fulll': must be one of \['none', 'selective', 'full'\]; did you mean 'full'"),
    (dict(a2a="hierachical"), r"a2a='hierachical': must be one of .*did you mean 'hierarchical'"),
]


@pytest.mark.parametrize("kwargs, message", PLAN_RULES, ids=[m[:30] for _, m in PLAN_RULES])
def test_plan_rule(kwargs, message):
    with pytest.raises(SpecError, match=message):
        plan(**kwargs)


def test_divisor_suggestion_lists_valid_choices():
    with pytest.raises(SpecError, match=r"choose ep in \{1, 2, 4, 8\}"):
        check_plan(TINY, plan(gpus=16, ep=16, global_batch_size=64))


# ---- rules that tie the plan to the model ---------------------------------------------------
COMPAT_RULES = [
    (model(), dict(gpus=8, tp=8, sequence_parallel=True), r"tp=8: must divide num_attention_heads \(4\)"),
    (model(num_attention_heads=8, num_query_groups=2, kv_channels=8), dict(gpus=8, tp=4, sequence_parallel=True),
     r"tp=4: must divide num_query_groups \(2\)"),
    (model(ffn_hidden_size=130), dict(gpus=8, tp=4, sequence_parallel=True), r"tp=4: must divide ffn_hidden_size \(130\)"),
    (model(), dict(gpus=16, ep=16, global_batch_size=64), r"ep=16: must divide num_experts \(8\); choose ep in \{1, 2, 4, 8\}"),
    (model(moe_ffn_hidden_size=66), dict(gpus=8, tp=1, etp=4, ep=2), r"etp=4: must divide moe_ffn_hidden_size \(66\)"),
    (model(moe_shared_expert_intermediate_size=66), dict(gpus=8, tp=4, sequence_parallel=True),
     r"tp=4: must divide moe_shared_expert_intermediate_size \(66\)"),
    (model(), dict(gpus=8, tp=2), r"sequence_parallel=False: MoE with tp=2 > 1 requires sequence parallelism"),
    (model(add_bias_linear=True), dict(gpus=8, tp=2, sequence_parallel=True),
     r"etp=2: MoE experts with add_bias_linear support only etp=1"),
    (model(num_experts=0, moe_ffn_hidden_size=None), dict(gpus=8, ep=2), r"ep=2: expert parallelism needs a MoE model"),
    (model(seq_length=66), dict(gpus=8, cp=4, global_batch_size=16), r"cp=4: seq_length \(66\) must be divisible by 2\*cp"),
    (model(num_layers=6), dict(gpus=8, pp=4, global_batch_size=16), r"pp=4: must divide the 6 layers"),
    (model(num_layers=8), dict(gpus=8, pp=2, vpp=3, global_batch_size=16), r"pp\*vpp=6: must divide the 8 layers"),
    (model(num_layers=8), dict(gpus=8, pp=4, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=2,
                               global_batch_size=16),
     r"pp=4: leaves 2 middle stage chunks, which must divide the 5 layers left after the first \(1\) and last \(2\)"),
    (model(num_layers=8), dict(gpus=8, pp=2, vpp=2, num_layers_in_first_pipeline_stage=3, global_batch_size=16),
     r"num_layers_in_first_pipeline_stage=3: must be divisible by vpp \(2\)"),
    (model(num_layers=8), dict(gpus=8, num_layers_in_first_pipeline_stage=3), r"an uneven pipeline split needs pp > 1"),
    (model(num_layers=8), dict(gpus=8, pp=2, num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=3,
                               global_batch_size=16), r"2 layers remain for 0 middle pipeline stages"),
    (model(), dict(recompute="full", recompute_method="uniform", recompute_num_layers=9),
     r"recompute_num_layers=9: must be <= num_layers \(4\) with the uniform method"),
    (model(), dict(gpus=8, pp=2, recompute="full", recompute_method="block", recompute_num_layers=3, global_batch_size=16),
     r"recompute_num_layers=3: must be <= layers per pipeline chunk \(2\)"),
]


@pytest.mark.parametrize("spec, kwargs, message", COMPAT_RULES, ids=[m[:30] for *_, m in COMPAT_RULES])
def test_compat_rule(spec, kwargs, message):
    with pytest.raises(SpecError, match=message):
        check_plan(spec, plan(**kwargs))


def test_valid_plans_pass():
    check_plan(TINY, plan(gpus=8, tp=2, sequence_parallel=True, ep=4, etp=1))
    check_plan(model(num_layers=8), plan(gpus=8, pp=2, vpp=2, ep=4, global_batch_size=16))
    check_plan(model(num_layers=7), plan(gpus=8, pp=2, num_layers_in_first_pipeline_stage=3, global_batch_size=16))


# ---- model spec rules -----------------------------------------------------------------------
MODEL_RULES = [
    (dict(hidden_size=65), r"kv_channels=None: hidden_size \(65\) is not divisible by num_attention_heads \(4\)"),
    (dict(num_query_groups=3), r"num_query_groups=3: must divide num_attention_heads \(4\)"),
    (dict(moe_router_topk=9), r"moe_router_topk=9: must be <= num_experts \(8\)"),
    (dict(moe_expert_load_skew=0.5), r"moe_expert_load_skew=0.5: is max/mean tokens per expert and must be >= 1"),
    (dict(moe_first_k_dense=4), r"moe_first_k_dense=4: must be < num_layers \(4\)"),
    (dict(num_experts=0, moe_shared_expert_intermediate_size=64), r"num_experts=0: shared experts / capacity factor need routed experts"),
    (dict(hidden_dropout=1.0), r"hidden_dropout=1.0: must be in \[0, 1\)"),
    (dict(moe_ffn_hidden_size=None), r"moe_ffn_hidden_size=None: must be a positive number"),
    (dict(normalization="rmsnorm"), r"normalization='rmsnorm': must be one of \['RMSNorm', 'LayerNorm'\]; did you mean 'RMSNorm'"),
    (dict(num_layers=0), r"num_layers=0: must be a positive number"),
    (dict(moe_shared_expert_intermediate_size=64, add_bias_linear=True),
     r"add_bias_linear=True: Megatron's SharedExpertMLP does not support biases"),
    (dict(position_embedding="learned_absolute", mla=load_model("deepseek-v3").mla),
     r"position_embedding='learned_absolute': multi-latent attention applies RoPE"),
]


@pytest.mark.parametrize("kwargs, message", MODEL_RULES, ids=[m[:30] for _, m in MODEL_RULES])
def test_model_rule(kwargs, message):
    with pytest.raises(SpecError, match=message):
        model(**kwargs)


# ---- cluster spec rules ---------------------------------------------------------------------
H100 = load_cluster("dgx-h100")
NV, IB = H100.links


CLUSTER_RULES = [
    (dict(links=()), r"links=0: needs 1 to 3 link levels"),
    (dict(links=(dataclasses.replace(NV, domain_gpus=4), IB)), r"links\[nvlink\].domain_gpus=4: the first \(fastest\) level must span whole nodes: gpus_per_node \(8\) or a multiple"),
    (dict(links=(NV, dataclasses.replace(IB, domain_gpus=64))), r"links\[infiniband\].domain_gpus=64: the last level must span the whole system"),
    (dict(links=(NV, LinkLevel(name="group", domain_gpus=12, bandwidth_gb_per_s=25, latency_us=5), IB)),
     r"links.domain_gpus=\[8, 12\]: each level's domain must be a multiple"),
    (dict(usable_memory_fraction=1.5), r"usable_memory_fraction=1.5: must be in \(0, 1\]"),
    (dict(gpus_per_node=0), r"gpus_per_node=0: must be a positive number"),
]


@pytest.mark.parametrize("kwargs, message", CLUSTER_RULES, ids=[m[:30] for _, m in CLUSTER_RULES])
def test_cluster_rule(kwargs, message):
    with pytest.raises(SpecError, match=message):
        dataclasses.replace(H100, **kwargs)


def test_link_bandwidth_must_be_positive():
    with pytest.raises(SpecError, match=r"links\[ib\].bandwidth_gb_per_s=0: must be a positive number"):
        LinkLevel(name="ib", domain_gpus=None, bandwidth_gb_per_s=0, latency_us=1)


def test_specs_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.num_layers = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ParallelPlan(8, 1)  # type: ignore[misc]
    assert isinstance(ClusterSpec.__slots__, tuple)
