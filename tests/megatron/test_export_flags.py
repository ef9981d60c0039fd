"""The model flags Piper exports pass Megatron-Core's own TransformerConfig checks (the real class)."""

from __future__ import annotations

import pytest

from piper_core.export import model_flags
from piper_core.presets import load_model

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("preset", ["switch-1t", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_exported_router_flags_pass_transformer_config(preset: str) -> None:
    """Top-1 routing needs --moe-router-pre-softmax (TransformerConfig.__post_init__: "Please use
    --moe-router-pre-softmax when topk is 1"); the recipe's launch script failed there without it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = load_model(preset)
    flags = dict(model_flags(model))
    TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                      moe_router_topk=int(flags["--moe-router-topk"]),
                      moe_router_pre_softmax="--moe-router-pre-softmax" in flags,
                      use_cpu_initialization=True)


OVERLAP_PLANS = {
    "shared-expert-overlap": ("deepseek-v3", dict(gpus=256, ep=32, global_batch_size=256, shared_expert_overlap=True)),
    "megatron-ep-overlap": ("mixtral-8x7b", dict(gpus=64, pp=2, vpp=2, ep=8, global_batch_size=256,
                                                 ep_comm_overlap=True)),
}


@pytest.mark.parametrize("name", sorted(OVERLAP_PLANS))
def test_exported_overlap_flags_pass_transformer_config(name: str) -> None:
    """The overlap options a plan can carry export as the flags Megatron-Core's own config accepts
    (``--moe-shared-expert-overlap``; ``--overlap-moe-expert-parallel-comm`` with
    ``--delay-wgrad-compute``, whose rules the plan mirrors: ep > 1, vpp when pp > 1, bf16)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from piper_core.export import parallel_flags
    from piper_core.specs import ParallelPlan, check_plan

    preset, kw = OVERLAP_PLANS[name]
    model, plan = load_model(preset), ParallelPlan(**kw)
    check_plan(model, plan)
    flags = dict(parallel_flags(model, plan))
    overlap = "--overlap-moe-expert-parallel-comm" in flags
    assert overlap == plan.ep_comm_overlap and ("--delay-wgrad-compute" in flags) == overlap
    assert ("--moe-shared-expert-overlap" in flags) == plan.shared_expert_overlap
    TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                      moe_shared_expert_intermediate_size=64 if plan.shared_expert_overlap else None,
                      moe_shared_expert_overlap="--moe-shared-expert-overlap" in flags,
                      overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute="--delay-wgrad-compute" in flags,
                      expert_model_parallel_size=plan.ep, pipeline_model_parallel_size=plan.pp,
                      virtual_pipeline_model_parallel_size=plan.vpp, moe_token_dispatcher_type="alltoall",
                      bf16="--bf16" in flags, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                      use_cpu_initialization=True)


def test_exported_dedup_and_group_routing_flags_pass_transformer_config() -> None:
    """A plan whose exchange sends each token to a node once exports Megatron's flex dispatcher with
    DeepEP, and DeepSeek-V3's node-limited routing its group flags; the real config takes both."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from piper_core.export import parallel_flags
    from piper_core.specs import ParallelPlan, check_plan

    model = load_model("deepseek-v3")
    plan = ParallelPlan(gpus=1024, ep=64, etp=1, global_batch_size=8192, a2a="dedup")
    check_plan(model, plan)
    flags = dict(model_flags(model)) | dict(parallel_flags(model, plan))
    TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=model.num_experts,
                      moe_router_topk=int(flags["--moe-router-topk"]),
                      moe_router_num_groups=int(flags["--moe-router-num-groups"]),
                      moe_router_group_topk=int(flags["--moe-router-group-topk"]),
                      moe_token_dispatcher_type=flags["--moe-token-dispatcher-type"],
                      moe_flex_dispatcher_backend=flags["--moe-flex-dispatcher-backend"],
                      expert_model_parallel_size=plan.ep, use_cpu_initialization=True)


@pytest.mark.parametrize("grouped", [True, False])
def test_nodes_per_token_matches_megatrons_router(grouped: bool) -> None:
    """The expected nodes a token reaches (piper_core.timing.routing) against Megatron-Core's own
    router (topk_routing_with_score_function, group-limited or not) on random scores, DeepSeek-V3's
    256 experts top-8, at 2-16 nodes: within 7 %."""
    import dataclasses

    import torch
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from piper_core.timing.routing import nodes_per_token

    model = load_model("deepseek-v3")
    if not grouped:
        model = dataclasses.replace(model, moe_router_num_groups=None, moe_router_group_topk=None)
    tokens = 8192
    torch.manual_seed(0)
    _, routing_map = topk_routing_with_score_function(
        torch.randn(tokens, model.num_experts), model.moe_router_topk, num_groups=model.moe_router_num_groups,
        group_topk=model.moe_router_group_topk, score_function="sigmoid")
    for nodes in (2, 4, 8, 16):
        measured = routing_map.view(tokens, nodes, -1).any(-1).sum(-1).float().mean().item()
        assert nodes_per_token(model, nodes) == pytest.approx(measured, rel=0.07), nodes


def test_exported_fp8_flags_are_megatron_cores_own():
    """An FP8 plan exports ``--fp8-format`` / ``--fp8-recipe`` (TransformerConfig's ``fp8`` and
    ``fp8_recipe``, the first named by its argparse metadata) and ``--fp8-param-gather`` (Megatron-LM's
    flag for ``fp8_param``); the real config accepts the values, and refuses ``fp8_param`` without FP8
    as the plan does."""
    import dataclasses

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from piper_core.export import parallel_flags
    from piper_core.specs import ParallelPlan

    plan = ParallelPlan(gpus=64, ep=8, global_batch_size=256, fp8="hybrid", fp8_recipe="tensorwise", fp8_param=True)
    flags = dict(parallel_flags(load_model("qwen3-30b-a3b"), plan))
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    assert fields["fp8"].metadata["argparse_meta"]["arg_names"] == ["--fp8-format"]
    assert "fp8_recipe" in fields and "fp8_param" in fields
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8=flags["--fp8-format"],
                               fp8_recipe=flags["--fp8-recipe"], fp8_param="--fp8-param-gather" in flags, bf16=True,
                               params_dtype=torch.bfloat16, use_cpu_initialization=True)
    assert (config.fp8, config.fp8_recipe, config.fp8_param) == ("hybrid", "tensorwise", True)
    with pytest.raises(ValueError, match="fp8_param must be used together with fp8 mode"):
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8_param=True,
                          use_cpu_initialization=True)


@pytest.mark.parametrize("preset, gpus, gbs", [("deepseek-v3", 1024, 8192), ("qwen3-235b-a22b", 256, 8192),
                                               ("switch-1t", 1024, 2048)])
def test_searched_layouts_are_megatron_cores(preset: str, gpus: int, gbs: int) -> None:
    """Every pipeline layout the search emits for these jobs is one Megatron-Core's own parser
    (``PipelineParallelLayerLayout``) accepts for the model (DeepSeek-V3's MTP layer included), and
    puts the same number of layers and MTP layers in every (pipeline rank, virtual stage) as Piper
    prices; the exported flag builds a TransformerConfig."""
    import torch
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_config import TransformerConfig

    from piper_core.export import parallel_flags
    from piper_core.presets import load_cluster
    from piper_core.scheduler.search import search
    from piper_core.specs.compat import mtp_layers, stage_layers

    model = load_model(preset)
    plans = {s.plan.pipeline_layout: s.plan for s in search(model, load_cluster("dgx-h100"), gpus, gbs).scored
             if s.plan.pipeline_layout is not None}
    assert plans, f"the search emitted no layout for {preset}"
    for text, plan in plans.items():
        layout = PipelineParallelLayerLayout(text, plan.pp)
        assert layout.validate_layer_layout(model.num_layers, model.mtp_num_layers or None) is False  # not standalone
        assert layout.virtual_pipeline_model_parallel_size == plan.vpp
        ours = stage_layers(model, plan)
        assert [[layout.layout[p][v].count(LayerType.decoder) for v in range(plan.vpp)] for p in range(plan.pp)] == \
            [[len(chunk) for chunk in rank] for rank in ours], text
        assert [layout.layout[p][-1].count(LayerType.mtp) for p in range(plan.pp)] == list(mtp_layers(model, plan))
    plan = next(iter(plans.values()))
    flags = dict(parallel_flags(model, plan))
    config = TransformerConfig(num_layers=model.num_layers, hidden_size=64, num_attention_heads=4,
                               mtp_num_layers=model.mtp_num_layers or None, pipeline_model_parallel_size=plan.pp, virtual_pipeline_model_parallel_size=plan.vpp,
                               pipeline_model_parallel_layout=flags["--pipeline-model-parallel-layout"],
                               pipeline_dtype=torch.bfloat16, bf16=True, params_dtype=torch.bfloat16,
                               use_cpu_initialization=True)
    assert config.pipeline_model_parallel_layout.virtual_pipeline_model_parallel_size == plan.vpp
