"""Parameter and FLOP model: published totals, structural identities, Megatron's FLOP formula."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.presets import load_model
from piper_core.resource.flops import model_flops_per_token, step_flops
from piper_core.resource.params import active_params, stage_params, total_params
from piper_core.specs import ParallelPlan

# Published totals (sources in each preset's YAML header): totals within 1 %. Active counts within
# 1 % except where the vendor's two-digit figure sits below the exact count of the released
# architecture: Qwen3-30B-A3B counts 3.353 B (published "3.3B") and DeepSeek-V3 37.55 B
# (published "37B"); both are within 2 % and the per-tensor count is checked against Megatron.
# The published active counts are those with the input embedding (active_params' default):
# without it Qwen3-30B-A3B would be 3.04 B and Qwen3-235B-A22B 21.57 B.
PUBLISHED = [
    ("mixtral-8x7b", 46.7e9, 12.9e9),
    ("mixtral-8x22b", 141e9, 39e9),
    ("deepseek-v3", 671e9, 37e9),
    ("qwen3-235b-a22b", 235e9, 22e9),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),
]


@pytest.mark.parametrize("name, total, active", PUBLISHED)
def test_preset_totals_match_published(name, total, active):
    """Model cards count the main model: DeepSeek-V3's MTP layer is left out (``mtp=False``)."""
    m = load_model(name)
    assert total_params(m, mtp=False) == pytest.approx(total, rel=0.01)
    loose = name in ("deepseek-v3", "qwen3-30b-a3b")
    assert active_params(m, mtp=False) == pytest.approx(active, rel=0.02 if loose else 0.01)


def test_switch_1t_is_about_one_trillion():
    assert 0.95e12 <= total_params(load_model("switch-1t")) <= 1.05e12


def test_stages_and_shards_add_up_to_total():
    """Summing per-GPU counts over one copy of the model (tp x ep shards, pp stages) gives the total."""
    m = load_model("mixtral-8x7b")
    plan = ParallelPlan(gpus=64, tp=2, pp=4, ep=8, etp=1, sequence_parallel=True, global_batch_size=64)
    stages = stage_params(m, plan)
    # dense weights are split over tp except the replicated pieces (norms, router, row-parallel biases)
    replicated = sum(2 * m.hidden_size + m.num_experts * m.hidden_size for _ in range(m.num_layers)) + m.hidden_size
    dense = sum(s.dense for s in stages)
    assert dense * plan.tp - replicated * (plan.tp - 1) == total_params(m) - sum(s.expert for s in stages) * plan.ep
    assert sum(s.expert for s in stages) * plan.ep * plan.etp_size == total_params(m) - (
        dense * plan.tp - replicated * (plan.tp - 1))


def test_one_expert_top1_moe_equals_dense_model():
    """A MoE with one expert routed top-1 costs a dense model's FLOPs (megablocks' reference idea)."""
    moe = dataclasses.replace(load_model("tiny-moe"), num_experts=1, moe_router_topk=1, moe_ffn_hidden_size=128)
    dense = dataclasses.replace(moe, num_experts=0, moe_ffn_hidden_size=None, moe_router_topk=1)
    assert model_flops_per_token(moe) == model_flops_per_token(dense)
    # parameters differ only by the router (experts x hidden per layer)
    assert total_params(moe) - total_params(dense) == moe.num_layers * moe.hidden_size


def test_dense_gpt_flops_match_narayanan_formula():
    """MHA, non-gated, 4h MLP: 72 B s l h^2 (1 + s/(6h) + V/(12 h l)) (arXiv 2104.04473, Appendix),
    with Megatron's causal halving of the s/(6h) attention term."""
    h, layers, s, vocab = 1024, 8, 2048, 51200
    m = load_model("tiny-moe")
    m = dataclasses.replace(m, num_experts=0, moe_ffn_hidden_size=None, moe_router_topk=1, hidden_size=h,
                            num_attention_heads=16, ffn_hidden_size=4 * h, gated_linear_unit=False,
                            num_layers=layers, seq_length=s, vocab_size=vocab, make_vocab_size_divisible_by=128)
    expected = 72 * s * layers * h**2 * (1 + s / (6 * h) / 2 + vocab / (12 * h * layers)) / s
    assert model_flops_per_token(m) == pytest.approx(expected, rel=1e-12)


def test_hardware_flops_add_recompute():
    m = load_model("mixtral-8x7b")
    base = dict(gpus=64, ep=8, global_batch_size=64)
    none = step_flops(m, ParallelPlan(**base))
    sel = step_flops(m, ParallelPlan(**base, recompute="selective"))
    full = step_flops(m, ParallelPlan(**base, recompute="full", recompute_num_layers=1))
    assert none.model == sel.model == full.model
    assert none.model < none.hardware < sel.hardware < full.hardware
    # full recompute repeats one forward: ~1/3 more than the model FLOPs of the layers
    assert full.hardware / none.model == pytest.approx(4 / 3, rel=0.05)


def test_active_params_with_and_without_the_input_embedding():
    """``input_embedding=False`` drops the input-embedding lookups (word embeddings, learned
    positions); the output layer stays, and with tied embeddings it is the same matrix, so only the
    positions go. ``piper predict --json`` reports both counts."""
    from piper_core.presets import load_cluster
    from piper_core.resource.predict import predict, to_json

    m = load_model("mixtral-8x7b")
    word = m.padded_vocab(1) * m.hidden_size
    assert active_params(m) - active_params(m, input_embedding=False) == word
    classic = dataclasses.replace(load_model("tiny-moe"), position_embedding="learned_absolute")
    positions = classic.seq_length * classic.hidden_size
    tied = dataclasses.replace(classic, tie_embeddings=True)
    classic_word = classic.padded_vocab(1) * classic.hidden_size
    assert active_params(classic) - active_params(classic, input_embedding=False) == positions + classic_word
    assert active_params(tied) - active_params(tied, input_embedding=False) == positions
    out = to_json(predict(m, load_cluster("dgx-h100"), ParallelPlan(gpus=8, ep=8, global_batch_size=8)))
    assert out["params"]["active"] - out["params"]["active_without_input_embedding"] == word
