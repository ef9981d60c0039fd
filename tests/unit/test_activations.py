"""Activation-memory formula: Korthikanti et al.'s closed forms, splits, recompute, MoE routing.

Pure arithmetic over specs; the comparison with what Megatron-Core keeps is
``tests/megatron/test_activation_memory.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from piper_core.errors import Infeasible, SpecError
from piper_core.resource.activations import (
    Kernels,
    embedding_activation_bytes,
    layer_activation_bytes,
    layer_activation_terms,
    output_activation_bytes,
)
from piper_core.specs.model import MLASpec, ModelSpec
from piper_core.specs.parallel import ParallelPlan

# Korthikanti et al. (arXiv 2205.05198) Table 2 GPT layer: LayerNorm, GeLU MLP of 4h, MHA,
# dropout, no RoPE, unfused attention; their count leaves out the norms' mean/rstd.
GPT = ModelSpec(name="gpt", num_layers=4, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                vocab_size=50257, seq_length=2048, gated_linear_unit=False, normalization="LayerNorm",
                position_embedding="learned_absolute", attention_dropout=0.1, hidden_dropout=0.1)
MOE = ModelSpec(name="moe", num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                ffn_hidden_size=4096, num_experts=16, moe_ffn_hidden_size=512, moe_router_topk=2,
                vocab_size=32000, seq_length=4096)


def plan(**kw) -> ParallelPlan:
    kw.setdefault("gpus", kw.get("tp", 1) * kw.get("cp", 1) * max(kw.get("ep", 1), 1))
    kw.setdefault("global_batch_size", kw["gpus"] * kw.get("micro_batch_size", 1))
    if kw.get("recompute") == "full":
        kw.setdefault("recompute_num_layers", 1)
    return ParallelPlan(**kw)


def _stats(tokens: int) -> int:
    """fp32 mean and rstd of the two LayerNorms, which Korthikanti's count leaves out."""
    return 2 * 2 * 4 * tokens


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_korthikanti_sequence_parallel(tp):
    """Table 2, tensor + sequence parallel: sbh/t (34 + 5as/h)."""
    s, b, h, a = GPT.seq_length, 2, GPT.hidden_size, GPT.num_attention_heads
    p = plan(tp=tp, sequence_parallel=tp > 1, micro_batch_size=b, attention_backend="unfused")
    expected = s * b * h * (34 + 5 * a * s / h) / tp + _stats(s * b // tp)
    assert layer_activation_bytes(GPT, p, moe=False) == expected


@pytest.mark.parametrize("tp", [2, 8])
def test_korthikanti_tensor_parallel_only(tp):
    """Table 2, tensor parallel without SP: sbh (10 + 24/t + 5as/(ht))."""
    s, b, h, a = GPT.seq_length, 1, GPT.hidden_size, GPT.num_attention_heads
    p = plan(tp=tp, attention_backend="unfused")
    expected = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) + _stats(s * b)
    assert layer_activation_bytes(GPT, p, moe=False) == expected


def test_korthikanti_selective_and_full_recompute():
    """Sec. 5: selective recompute keeps sbh (34/t) with SP; full recompute keeps 2sbh/t."""
    s, b, h, tp = GPT.seq_length, 1, GPT.hidden_size, 4
    sel = plan(tp=tp, sequence_parallel=True, recompute="selective", attention_backend="unfused")
    assert layer_activation_bytes(GPT, sel, moe=False) == s * b * h * 34 / tp + _stats(s * b // tp)
    full = dataclasses.replace(sel, recompute="full", recompute_num_layers=1)
    assert layer_activation_terms(GPT, full, moe=False) == {"checkpoint.input": 2 * s * b * h // tp}


def test_full_recompute_prices_unrecomputed_layers_like_no_recompute():
    full = plan(recompute="full", recompute_method="block")
    none = dataclasses.replace(full, recompute="none", recompute_num_layers=None)
    for moe in (False, True):
        assert layer_activation_bytes(MOE, full, moe=moe, recomputed=False) == layer_activation_bytes(
            MOE, none, moe=moe)
        assert layer_activation_bytes(MOE, full, moe=moe) < layer_activation_bytes(MOE, none, moe=moe) / 10


@settings(max_examples=40, deadline=None)
@given(seq=st.sampled_from([256, 512, 1024, 4096]), mbs=st.integers(1, 4),
       backend=st.sampled_from(["flash", "unfused"]), recompute=st.sampled_from(["none", "selective", "full"]),
       moe=st.booleans(), cf=st.sampled_from([None, 1.0, 1.5]))
def test_grows_with_sequence_and_micro_batch(seq, mbs, backend, recompute, moe, cf):
    model = dataclasses.replace(MOE, seq_length=seq, moe_capacity_factor=cf)
    base = plan(micro_batch_size=mbs, attention_backend=backend, recompute=recompute)
    n = layer_activation_bytes(model, base, moe=moe)
    assert layer_activation_bytes(dataclasses.replace(model, seq_length=2 * seq), base, moe=moe) > n
    more = plan(micro_batch_size=mbs + 1, attention_backend=backend, recompute=recompute)
    assert layer_activation_bytes(model, more, moe=moe) > n


def test_flash_is_linear_in_tokens_and_unfused_quadratic():
    short, long = MOE, dataclasses.replace(MOE, seq_length=2 * MOE.seq_length)
    flash, unfused = plan(), plan(attention_backend="unfused")
    for moe in (False, True):
        assert layer_activation_bytes(long, flash, moe=moe) == 2 * layer_activation_bytes(short, flash, moe=moe)
        assert layer_activation_bytes(long, unfused, moe=moe) > 2 * layer_activation_bytes(short, unfused, moe=moe)
        assert layer_activation_bytes(MOE, flash, moe=moe) < layer_activation_bytes(MOE, unfused, moe=moe)
    # the only quadratic term is the [b, a/tp, s, s] softmax output, 2 bytes each
    terms = layer_activation_terms(MOE, unfused, moe=False)
    assert terms["core_attn.softmax"] == 2 * MOE.num_attention_heads * MOE.seq_length ** 2


def test_sequence_parallel_divides_everything_by_tp():
    """With SP every kept tensor is split over tp (flash, dropless, etp=1): exactly 1/tp. With
    etp = tp (Megatron's default) the experts all-gather their tokens: the expert input is not split."""
    one = layer_activation_bytes(MOE, plan(), moe=True)
    for tp in (2, 4):
        assert layer_activation_bytes(MOE, plan(tp=tp, sequence_parallel=True, etp=1), moe=True) * tp == one
        default_etp = layer_activation_terms(MOE, plan(tp=tp, sequence_parallel=True), moe=True)
        assert default_etp["experts.input"] == layer_activation_terms(MOE, plan(), moe=True)["experts.input"]
        assert layer_activation_bytes(MOE, plan(tp=tp, sequence_parallel=True), moe=False) * tp == \
            layer_activation_bytes(MOE, plan(), moe=False)


def test_without_sequence_parallel_norm_and_residual_tensors_are_replicated():
    tp = 4
    sp = layer_activation_terms(GPT, plan(tp=tp, sequence_parallel=True), moe=False)
    no_sp = layer_activation_terms(GPT, plan(tp=tp), moe=False)
    for term in ("input_norm.input", "linear_qkv.input", "pre_mlp_norm.input", "mlp.input", "mlp_bda.dropout_mask"):
        assert no_sp[term] == tp * sp[term]
    for term in ("linear_qkv.output", "linear_proj.input", "mlp.fc1_output", "mlp.fc2_input"):
        assert no_sp[term] == sp[term]


def test_context_parallel_splits_the_sequence():
    for moe in (False, True):
        assert layer_activation_bytes(MOE, plan(cp=4), moe=moe) * 4 == layer_activation_bytes(MOE, plan(), moe=moe)
    with pytest.raises(Infeasible, match="unfused attention cannot run with context parallelism"):
        layer_activation_bytes(MOE, plan(cp=2, attention_backend="unfused"), moe=False)


def _experts_input(model: ModelSpec, p: ParallelPlan) -> int:
    return layer_activation_terms(model, p, moe=True)["experts.input"]


def test_capacity_factor_and_dropless_skew():
    tokens, k, h = MOE.seq_length, MOE.moe_router_topk, MOE.hidden_size
    dropless = _experts_input(MOE, plan())
    assert dropless == tokens * k * h * 2
    # padded to capacity: E x ceil(T k / E x cf) rows
    assert _experts_input(dataclasses.replace(MOE, moe_capacity_factor=1.0), plan()) == dropless
    assert _experts_input(dataclasses.replace(MOE, moe_capacity_factor=1.5), plan()) == 1.5 * dropless
    # with every expert on one GPU the total is exact whatever the imbalance; the skew bites with ep
    skewed = dataclasses.replace(MOE, moe_expert_load_skew=3.0)
    assert _experts_input(skewed, plan()) == dropless
    assert _experts_input(skewed, plan(ep=2)) == 2 * dropless
    assert _experts_input(skewed, plan(ep=16)) == 3 * dropless


def test_topk_shared_experts_and_etp():
    top1 = layer_activation_terms(dataclasses.replace(MOE, moe_router_topk=1), plan(), moe=True)
    top2 = layer_activation_terms(MOE, plan(), moe=True)
    for term in ("experts.input", "experts.fc1_output", "experts.fc2_input"):
        assert top2[term] == 2 * top1[term]
    assert top1["router.softmax"] == MOE.seq_length * MOE.num_experts * 4  # top-1: softmax over all experts
    shared = layer_activation_terms(dataclasses.replace(MOE, moe_shared_expert_intermediate_size=1024),
                                    plan(), moe=True)
    added = {t: v for t, v in shared.items() if t not in top2}
    assert added == {"shared_experts.fc1_output": MOE.seq_length * 2048 * 2,
                     "shared_experts.fc2_input": MOE.seq_length * 1024 * 2}
    # expert TP all-gathers the tokens and splits the expert FFN: inputs x etp, FFN tensors unchanged
    etp = layer_activation_terms(MOE, plan(tp=2, sequence_parallel=True, etp=2), moe=True)
    sp = layer_activation_terms(MOE, plan(tp=2, sequence_parallel=True, etp=1), moe=True)
    assert etp["experts.input"] == 2 * sp["experts.input"]
    assert etp["experts.fc1_output"] == sp["experts.fc1_output"]


def test_dropout_adds_masks_and_dropout_output():
    quiet = dataclasses.replace(GPT, attention_dropout=0.0, hidden_dropout=0.0)
    p = plan(micro_batch_size=1, attention_backend="unfused")
    s, h, a = GPT.seq_length, GPT.hidden_size, GPT.num_attention_heads
    added = layer_activation_bytes(GPT, p, moe=False) - layer_activation_bytes(quiet, p, moe=False)
    assert added == 3 * a * s * s + 2 * s * h  # 1-byte mask + 2-byte output of the probs; two residual masks


def test_gqa_and_mla_keep_less_than_mha_under_flash():
    mha = dataclasses.replace(MOE, num_query_groups=None)
    assert layer_activation_bytes(MOE, plan(), moe=False) < layer_activation_bytes(mha, plan(), moe=False)
    mla = dataclasses.replace(mha, mla=MLASpec(q_lora_rank=256, kv_lora_rank=128, qk_head_dim=64,
                                               qk_pos_emb_head_dim=32, v_head_dim=64), qk_layernorm=True)
    terms = layer_activation_terms(mla, plan(), moe=False)
    assert terms["attn.q"] == terms["attn.k"] == MOE.seq_length * 16 * 96 * 2


def test_unfused_kernels_keep_more():
    p = plan()
    base = layer_activation_bytes(MOE, p, moe=True)
    assert layer_activation_bytes(MOE, p, moe=True, kernels=Kernels(rope_fusion=False)) > base
    assert layer_activation_bytes(MOE, p, moe=True, kernels=Kernels(bias_activation_fusion=False)) > base
    assert layer_activation_bytes(MOE, p, moe=True, kernels=Kernels(router_aux_loss=True)) > base


def test_embedding_and_output_stages():
    p = plan(tp=2, sequence_parallel=True)
    tokens = MOE.seq_length
    assert embedding_activation_bytes(MOE, p) == tokens * (8 + 1)  # masked ids + vocab mask
    vocab = MOE.padded_vocab(2) // 2
    logits = tokens * vocab * 4  # fp32 softmax of the vocab-parallel cross entropy
    out = output_activation_bytes(MOE, p)
    assert logits < out < logits * 1.05
    dropout = dataclasses.replace(GPT, hidden_dropout=0.1)
    assert embedding_activation_bytes(dropout, plan()) == GPT.seq_length * (8 + 8 + GPT.hidden_size)


def test_errors_name_the_fix():
    with pytest.raises(SpecError, match="has no experts"):
        layer_activation_bytes(GPT, plan(), moe=True)
    with pytest.raises(SpecError, match="dropout_mask_bytes"):
        Kernels(dropout_mask_bytes=3)


def test_formula_module_does_not_import_torch():
    code = "import sys, piper_core.resource.activations; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
