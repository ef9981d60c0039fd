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
