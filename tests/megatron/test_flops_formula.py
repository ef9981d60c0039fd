"""Piper's model FLOPs are Megatron-LM's: ``num_floating_point_operations`` (megatron/training/
training.py, the count behind Megatron's reported TFLOP/s and Megatron-Bridge's MFU) run on each
preset, MTP layers included.

The function is read from the Megatron-LM checkout (tag core_v0.16.1, ``../shared/third_party``) and
run as it is: importing ``megatron.training`` needs packages this host lacks (Transformer Engine,
triton), so the test compiles that one function from the file's syntax tree, with the one name it
imports from megatron.core. Nothing of it is copied into the project.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from piper_core.presets import load_model, model_names
from piper_core.resource.flops import model_flops_per_token
from piper_core.specs.model import ModelSpec

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

CHECKOUT = Path(os.environ.get("PIPER_MEGATRON_LM") or Path(__file__).resolve().parents[3] / "shared" / "third_party"
                / "megatron-lm-core_v0.16.1")
TRAINING = CHECKOUT / "megatron" / "training" / "training.py"


@pytest.fixture(scope="module")
def megatron_flops():
    if not TRAINING.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"Megatron-LM checkout not found: {TRAINING} does not exist")
        pytest.skip(f"Megatron-LM checkout not found: {TRAINING}")
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import is_linear_attention_variant

    tree = ast.parse(TRAINING.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "num_floating_point_operations")
    namespace = {"is_linear_attention_variant": is_linear_attention_variant}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(TRAINING), "exec"), namespace)
    return namespace["num_floating_point_operations"]


def _args(model: ModelSpec) -> SimpleNamespace:
    """megatron.training arguments for ``model``, as ``piper_core.export.model_flags`` writes them."""
    mla = model.mla
    return SimpleNamespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size, seq_length=model.seq_length,
        num_attention_heads=model.num_attention_heads, ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.head_dim if mla is None else None,
        group_query_attention=model.query_groups != model.num_attention_heads, num_query_groups=model.query_groups,
        swiglu=model.gated_linear_unit, padded_vocab_size=model.padded_vocab(1),
        num_experts=model.num_experts or None, moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or None,
        moe_layer_freq=[int(m) for m in model.moe_layer_pattern], moe_latent_size=None,
        mtp_num_layers=model.mtp_num_layers or None,
        multi_latent_attention=mla is not None, q_lora_rank=mla and mla.q_lora_rank,
        kv_lora_rank=mla and mla.kv_lora_rank, qk_head_dim=mla and mla.qk_head_dim,
        qk_pos_emb_head_dim=mla and mla.qk_pos_emb_head_dim, v_head_dim=mla and mla.v_head_dim,
        is_hybrid_model=False, experimental_attention_variant=None, attention_output_gate=False,
        linear_attention_freq=None, hybrid_override_pattern=None, save=None,
    )


MODELS = sorted(model_names()) + ["deepseek-v3-mtp3", "tiny-moe-mtp2-dense-last"]


def _model(name: str) -> ModelSpec:
    if name == "deepseek-v3-mtp3":
        return dataclasses.replace(load_model("deepseek-v3"), mtp_num_layers=3)
    if name == "tiny-moe-mtp2-dense-last":  # the MTP layers follow the last decoder layer: dense here
        return dataclasses.replace(load_model("tiny-moe"), mtp_num_layers=2, moe_layer_freq=2)
    return load_model(name)


@pytest.mark.parametrize("name", MODELS)
def test_model_flops_are_megatrons(megatron_flops, name: str):
    model = _model(name)
    batch = 3
    theirs = megatron_flops(_args(model), batch)
    ours = model_flops_per_token(model) * batch * model.seq_length
    assert ours == pytest.approx(theirs, rel=1e-9), f"{name}: Piper {ours:.6e}, Megatron {theirs:.6e}"


def test_mtp_is_counted():
    """The MTP layer adds what it costs: DeepSeek-V3's one MTP layer is a MoE layer and its logits."""
    model = load_model("deepseek-v3")
    without = dataclasses.replace(model, mtp_num_layers=0)
    assert model.mtp_num_layers == 1
    assert 1.01 < model_flops_per_token(model) / model_flops_per_token(without) < 1.05
