"""Floating-point operations per training step.

*Model* FLOPs use Megatron's definition (``num_floating_point_operations`` in
megatron/training/training.py): every GEMM counted 3x (forward, weight-grad, data-grad) at 2 FLOPs
per multiply-add, routed experts at top-k, shared experts, GQA, MLA, gated units (x3/2), causal
attention at half the score matrix, and the logit layer; norms, the router and element-wise work
are not counted. MFU divides these by the dense peak.

*Hardware* FLOPs are what the GPUs execute: model FLOPs plus the forward that recompute repeats
(core attention for selective recompute, whole layers for full recompute) plus the router GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

from piper_core.specs.compat import stage_layers
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

_GEMM = 3 * 2  # fwd + wgrad + dgrad, 2 FLOPs per multiply-add


def _mlp(model: ModelSpec, ffn: int) -> float:
    """Per token: two GEMMs h<->ffn (three when gated: the x3/2 multiplier)."""
    gated = 1.5 if model.gated_linear_unit else 1.0
    return _GEMM * 2 * model.hidden_size * ffn * gated


def attention_flops_per_token(model: ModelSpec) -> float:
    """Projections plus causal core attention, per token, fwd+bwd (Megatron's self_attn_term)."""
    h, s, heads = model.hidden_size, model.seq_length, model.num_attention_heads
    mla = model.mla
    if mla is None:
        q = heads * model.head_dim
        proj = 2 * h * q + 2 * h * model.query_groups * model.head_dim  # q + o, k + v
        core = s * q  # QK^T and AV, 2 GEMMs x s*q MACs each, halved for the causal mask
        return _GEMM * (proj + core)
    q_head = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    if mla.q_lora_rank is None:
        q_term = h * heads * q_head
    else:  # down, up, and the q norm (Megatron's "+ 1")
        q_term = mla.q_lora_rank * (h + heads * q_head + 1)
    kv_term = mla.kv_lora_rank * (h + heads * (mla.qk_head_dim + mla.v_head_dim) + 1) + h * mla.qk_pos_emb_head_dim
    out = heads * mla.v_head_dim * h
    core = s * heads * q_head / 2 + s * heads * mla.v_head_dim / 2
    return _GEMM * (q_term + kv_term + out + core)


def layer_flops_per_token(model: ModelSpec, layer: int) -> float:
    """Model FLOPs of layer ``layer`` per token (fwd+bwd)."""
    attn = attention_flops_per_token(model)
    if not model.moe_layer_pattern[layer]:
        return attn + _mlp(model, model.ffn_hidden_size)
    routed = _mlp(model, model.moe_ffn_hidden_size) * model.moe_router_topk
    return attn + routed + _mlp(model, model.moe_shared_expert_intermediate_size)


def logit_flops_per_token(model: ModelSpec, tp: int = 1) -> float:
    """Output layer: h x padded vocab GEMM, fwd+bwd."""
    return _GEMM * model.hidden_size * model.padded_vocab(tp)


def mtp_flops_per_token(model: ModelSpec, tp: int = 1) -> float:
    """One MTP layer per token, as Megatron counts it: a transformer layer of the last decoder layer's
    kind, its norms and ``2h -> h`` projection (``3h + 2h^2`` multiply-adds), and its own logits."""
    h = model.hidden_size
    return (layer_flops_per_token(model, model.num_layers - 1) + _GEMM * (3 * h + 2 * h * h)
            + logit_flops_per_token(model, tp))


def model_flops_per_token(model: ModelSpec, tp: int = 1) -> float:
    """Megatron's model FLOPs per token (all layers, MTP layers included, + logits), fwd+bwd."""
    layers = sum(layer_flops_per_token(model, i) for i in range(model.num_layers))
    return layers + logit_flops_per_token(model, tp) + model.mtp_num_layers * mtp_flops_per_token(model, tp)


def recomputed_layers(model: ModelSpec, plan: ParallelPlan) -> frozenset[int]:
    """Layers whose whole forward runs again under full recompute.

    Megatron ``uniform`` recomputes every layer (checkpointing groups of ``recompute_num_layers``);
    ``block`` recomputes the first ``recompute_num_layers`` layers of each pipeline chunk
    (TransformerBlock._checkpointed_forward).
    """
    if plan.recompute != "full":
        return frozenset()
    if plan.recompute_method == "uniform":
        return frozenset(range(model.num_layers))
    n = plan.recompute_num_layers or 0
    return frozenset(i for stage in stage_layers(model, plan) for chunk in stage for i in chunk[:n])


def _core_attention_forward(model: ModelSpec) -> float:
    """Forward FLOPs of core attention per token (what selective recompute repeats)."""
    mla = model.mla
    width = model.num_attention_heads * (
        model.head_dim if mla is None else (mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim) / 2)
    return 2 * model.seq_length * width  # two GEMMs, 2 FLOPs/MAC, causal half


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFlops:
    """FLOPs for one training step (global batch), summed over all GPUs."""

    model: float
    hardware: float
    tokens: int


def step_flops(model: ModelSpec, plan: ParallelPlan) -> StepFlops:
    """Model and hardware FLOPs of one step of ``global_batch_size`` sequences."""
    tokens = plan.global_batch_size * model.seq_length
    per_token = model_flops_per_token(model, plan.tp)
    extra = 0.0
    mtp = model.mtp_num_layers
    if plan.recompute == "selective":
        extra += _core_attention_forward(model) * (model.num_layers + mtp)
    for i in recomputed_layers(model, plan):
        extra += layer_flops_per_token(model, i) / 3  # one more forward of the layer
    if plan.recompute == "full":  # an MTP layer checkpoints its projection and layer whatever the method
        h = model.hidden_size
        extra += mtp * (layer_flops_per_token(model, model.num_layers - 1) + _GEMM * 2 * h * h) / 3
    moe_layers = model.num_moe_layers + (mtp if model.mtp_is_moe else 0)
    extra += _GEMM * model.hidden_size * model.num_experts * moe_layers  # router GEMM
    return StepFlops(model=per_token * tokens, hardware=(per_token + extra) * tokens, tokens=tokens)
