"""Build a Switch-style decoder on DeepSpeed-MoE from a Piper ModelSpec and the plan it runs under.

A DeepSpeed ``MoE`` layer fixes its expert-parallel size when it is built (``ep_size`` is a
constructor argument, not a config key), and a ``PipelineModule`` its stage count, so the model has
to be built for the plan: :func:`build_model` takes it (``plan.ep`` for every MoE layer,
``plan.pp`` stages). :func:`piper_deepspeed.initialize` then finds the model consistent with the
plan it computes, or names the layer that is not.

The model: token embedding (vocabulary padded as Megatron pads it), ``num_layers`` pre-norm decoder
layers (causal self-attention with GQA and RoPE or learned positions; an FFN that is DeepSpeed's
``MoE`` on the layers ``spec.moe_layer_pattern`` marks, plus a shared expert if the spec has one,
else a dense MLP), a final norm and the LM head. ``forward(tokens [B, T])`` returns
``(logits [B, T, V_padded], aux)`` where ``aux`` is the sum of the MoE layers' load-balancing
losses (Switch Transformer, arXiv 2101.03961, Sec. 2.2); :func:`lm_loss` adds it with a coefficient.

Initialisation is independent of the parallel layout: dense weights come from ``seed`` (identical on
every rank) and each expert's from (seed, layer, global expert index), so a model built with ep=2
computes the same function as one built with ep=4 (DeepSpeed's ``Experts`` deep-copies one expert,
which would start every expert identical). Expert-parallel ranks follow DeepSpeed's default layout
(consecutive ranks, ``use_data_before_expert_parallel_`` off).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

from piper_core.errors import SpecError
from piper_core.export import deepspeed_compatible
from piper_core.runtime.placement import ExpertPlacement
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

MODEL_SPEC_ATTR = "piper_model_spec"  # set on built models; initialize reads the shape from it


def _norm(spec: ModelSpec) -> nn.Module:
    return nn.RMSNorm(spec.hidden_size) if spec.normalization == "RMSNorm" else nn.LayerNorm(spec.hidden_size)


class MLP(nn.Module):
    """FFN: SwiGLU when ``gated`` (``w_in`` holds gate and up halves), else GeLU."""

    def __init__(self, hidden: int, ffn: int, *, gated: bool, bias: bool):
        super().__init__()
        self.gated = gated
        self.w_in = nn.Linear(hidden, 2 * ffn if gated else ffn, bias=bias)
        self.w_out = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_in(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.w_out(h)


def _rope(x_BHTD: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim, base 10000 (RoFormer, arXiv 2104.09864, Sec. 3.4.2)."""
    t, d = x_BHTD.shape[-2], x_BHTD.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x_BHTD.device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(t, device=x_BHTD.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x_BHTD.dtype), ang.sin().to(x_BHTD.dtype)
    x1, x2 = x_BHTD[..., 0::2], x_BHTD[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal self-attention with ``num_query_groups`` key/value heads (GQA)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.heads, self.groups, self.head_dim = spec.num_attention_heads, spec.query_groups, spec.head_dim
        self.rope, self.dropout = spec.position_embedding == "rope", spec.attention_dropout
        qkv_bias = spec.add_qkv_bias or spec.add_bias_linear
        self.qkv = nn.Linear(spec.hidden_size, (self.heads + 2 * self.groups) * self.head_dim, bias=qkv_bias)
        self.proj = nn.Linear(self.heads * self.head_dim, spec.hidden_size, bias=spec.add_bias_linear)
        self.q_norm = nn.RMSNorm(self.head_dim) if spec.qk_layernorm else None
        self.k_norm = nn.RMSNorm(self.head_dim) if spec.qk_layernorm else None

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_BTH.shape
        q, k, v = self.qkv(x_BTH).split([self.heads * self.head_dim, self.groups * self.head_dim,
                                         self.groups * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.groups, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.groups, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = _rope(q), _rope(k)
        if self.groups != self.heads:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; ``forward(x) -> (x, l_aux)`` (l_aux 0 for a dense FFN)."""

    def __init__(self, spec: ModelSpec, index: int, ep_size: int, *, seed: int, min_capacity: int,
                 placement: ExpertPlacement | None = None):
        super().__init__()
        self.norm1, self.attn, self.norm2 = _norm(spec), Attention(spec), _norm(spec)
        self.drop = nn.Dropout(spec.hidden_dropout)
        self.shared: MLP | None = None
        self.moe: MoE | None = None
        self.mlp: MLP | None = None
        if spec.moe_layer_pattern[index]:
            self.moe = moe_layer(spec, ep_size, min_capacity=min_capacity)
            init_experts(self.moe, seed=seed, layer=index, placement=placement)
            if spec.moe_shared_expert_intermediate_size:
                self.shared = MLP(spec.hidden_size, spec.moe_shared_expert_intermediate_size,
                                  gated=spec.gated_linear_unit, bias=False)
        else:
            self.mlp = MLP(spec.hidden_size, spec.ffn_hidden_size, gated=spec.gated_linear_unit,
                           bias=spec.add_bias_linear)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.drop(self.attn(self.norm1(x)))
        h = self.norm2(x)
        if self.moe is None:
            return x + self.drop(self.mlp(h)), x.new_zeros(())
        out, l_aux, _counts = self.moe(h)
        if self.shared is not None:
            out = out + self.shared(h)
        return x + self.drop(out), l_aux


def moe_layer(spec: ModelSpec, ep_size: int, *, min_capacity: int = 4) -> MoE:
    """DeepSpeed ``MoE`` for one layer of ``spec``: top-``moe_router_topk``, capacity factor
    ``moe_capacity_factor`` (None: no token dropping, DeepSpeed's ``drop_tokens=False``)."""
    expert = MLP(spec.hidden_size, spec.moe_ffn_hidden_size, gated=spec.gated_linear_unit, bias=spec.add_bias_linear)
    cf = spec.moe_capacity_factor
    return MoE(spec.hidden_size, expert, num_experts=spec.num_experts, ep_size=ep_size, k=spec.moe_router_topk,
               capacity_factor=cf or 1.0, eval_capacity_factor=cf or 1.0, min_capacity=min_capacity,
               drop_tokens=cf is not None)


def init_experts(moe: MoE, *, seed: int, layer: int, placement: ExpertPlacement | None = None) -> None:
    """Re-initialise each local expert's Linear layers as ``nn.Linear`` does (U(+-1/sqrt(fan_in))),
    drawn from a generator seeded by (seed, layer, logical expert index): the logical expert of each
    physical slot in ``placement`` (None: the default, slot ``s`` holds logical expert ``s``), so a
    model built with a placement holds the default model's experts, moved (docs/placement.md)."""
    ep_rank = dist.get_rank() % moe.ep_size if dist.is_initialized() else 0
    local = moe.deepspeed_moe.experts.deepspeed_experts
    logical_at = tuple(range(moe.num_experts)) if placement is None else placement.logical_at
    if placement is not None:
        placement.check(num_experts=moe.num_experts, ep=moe.ep_size, key="placement")
    with torch.no_grad():
        for e, expert in enumerate(local):
            logical = logical_at[ep_rank * len(local) + e]
            g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 10_007 + logical)
            for m in expert.modules():
                if isinstance(m, nn.Linear):
                    bound = 1.0 / math.sqrt(m.in_features)
                    for p in (m.weight, m.bias):
                        if p is not None and not p.is_meta:
                            p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))


class SwitchDecoder(nn.Module):
    """The whole model on one pipeline stage; ``forward(tokens) -> (logits, aux)``."""

    def __init__(self, spec: ModelSpec, ep_size: int, *, seed: int = 1234, min_capacity: int = 4,
                 placement: ExpertPlacement | None = None):
        super().__init__()
        self.embed = Embedding(spec)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, ep_size, seed=seed, min_capacity=min_capacity,
                                                 placement=placement)
                                    for i in range(spec.num_layers))
        self.head = Head(spec, tied=self.embed.tokens if spec.tie_embeddings else None)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.embed(tokens)
        for layer in self.layers:
            x, l_aux = layer(x)
            aux = aux + l_aux
        return self.head((x, aux))


class Embedding(nn.Module):
    """tokens [B, T] -> (hidden [B, T, H], aux zeros [1]) (shape [1], not a scalar: the pipeline
    engine sends tensors between stages with their shapes)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tokens = nn.Embedding(spec.padded_vocab(1), spec.hidden_size)
        self.positions = nn.Embedding(spec.seq_length, spec.hidden_size) \
            if spec.position_embedding == "learned_absolute" else None
        self.drop = nn.Dropout(spec.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tokens(tokens)
        if self.positions is not None:
            x = x + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.drop(x)
        return x, x.new_zeros(1)


class Head(nn.Module):
    """(hidden, aux) -> (logits [B, T, V_padded], aux)."""

    def __init__(self, spec: ModelSpec, *, tied: nn.Embedding | None = None):
        super().__init__()
        self.norm = _norm(spec)
        self.tied = tied is not None
        self.out = None if tied is not None else nn.Linear(spec.hidden_size, spec.padded_vocab(1), bias=False)
        self._tied_ref = [tied]  # a list keeps the module out of this module's children

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = inputs
        h = self.norm(x)
        weight = self._tied_ref[0].weight if self.tied else self.out.weight
        return F.linear(h, weight), aux


def _pack(x_BTH: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Hidden states and the running load-balancing loss as one flat tensor ``[B*T*H + 1]``.

    DeepSpeed's pipeline engine backs each tensor a stage sends through its own ``backward`` call
    (``retain_graph`` for all but the last); a layer whose graph can be run backward only once (Piper's
    pipelined all-to-all) then fails, so stages exchange this single tensor. The aux loss stays in the
    autograd graph, so gradient accumulation and fp16 loss scaling apply to it as to the LM loss."""
    return torch.cat([x_BTH.reshape(-1), aux.reshape(1)])


def _unpack(buf: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    return buf[:-1].view(-1, spec.seq_length, spec.hidden_size), buf[-1:]


class EmbeddingPipe(Embedding):
    """First pipeline element: tokens -> packed (hidden, aux)."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.spec = spec

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _pack(*super().forward(tokens))


class DecoderPipe(DecoderLayer):
    """A decoder layer as a pipeline element: packed (x, aux) -> packed (x', aux + l_aux)."""

    def __init__(self, spec: ModelSpec, index: int, ep_size: int, *, seed: int, min_capacity: int,
                 placement: ExpertPlacement | None = None):
        super().__init__(spec, index, ep_size, seed=seed, min_capacity=min_capacity, placement=placement)
        self.spec = spec

    def forward(self, buf: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, aux = _unpack(buf, self.spec)
        x, l_aux = super().forward(x)
        return _pack(x, aux + l_aux)


class HeadPipe(Head):
    """Last pipeline element: packed (x, aux) -> (logits, aux) for the loss."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.spec = spec

    def forward(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(_unpack(buf, self.spec))


def lm_loss(outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor, *,
            aux_loss_coeff: float = 0.01) -> torch.Tensor:
    """Next-token cross-entropy (mean over tokens) + ``aux_loss_coeff`` x the load-balancing loss
    (Switch Transformer's alpha = 1e-2, Sec. 2.2)."""
    logits, aux = outputs
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    return ce + aux_loss_coeff * aux.sum()


def build_model(spec: ModelSpec, plan: ParallelPlan, *, pipeline: bool | None = None, seed: int = 1234,
                min_capacity: int = 4, aux_loss_coeff: float = 0.01,
                placement: ExpertPlacement | None = None) -> nn.Module:
    """The model for ``plan``: a :class:`SwitchDecoder`, or with ``pipeline`` (default: when
    ``plan.pp > 1``) a DeepSpeed ``PipelineModule`` of ``plan.pp`` stages (an equal number of decoder
    layers each, embedding on the first, head and loss on the last; needs torch.distributed and
    LOCAL_RANK, as PipelineModule does). MoE layers get ``ep_size = plan.ep``. A model planned with
    ``plan_for(..., pipeline=True)`` must be built with ``pipeline=True`` even when pp is 1.
    ``placement``: each expert slot gets its logical expert's initial weights (:func:`init_experts`),
    for the block's ``placement`` (``PiperConfig.expert_placement``)."""
    _check_buildable(spec, plan)
    if pipeline is None:
        pipeline = plan.pp > 1
    if plan.pp > 1 and not pipeline:
        raise SpecError("pp", plan.pp, "pipeline stages need a PipelineModule", "build with pipeline=True")
    torch.manual_seed(seed)
    if not pipeline:
        model: nn.Module = SwitchDecoder(spec, plan.ep, seed=seed, min_capacity=min_capacity, placement=placement)
    else:
        if spec.tie_embeddings:
            raise SpecError("tie_embeddings", True, "the pipeline builder keeps embedding and head on different "
                            "stages without DeepSpeed's TiedLayerSpec", "set tie_embeddings: false or use pp=1")
        layers: list[Any] = [LayerSpec(EmbeddingPipe, spec)]
        layers += [LayerSpec(DecoderPipe, spec, i, plan.ep, seed=seed, min_capacity=min_capacity, placement=placement)
                   for i in range(spec.num_layers)]
        layers.append(LayerSpec(HeadPipe, spec))
        model = PipelineModule(layers=layers, num_stages=plan.pp, partition_method="type:DecoderPipe",
                               loss_fn=_PipeLoss(aux_loss_coeff))
    setattr(model, MODEL_SPEC_ATTR, spec)
    return model


class _PipeLoss:
    """PipelineModule's ``loss_fn(outputs, labels)`` (a picklable callable, not a lambda)."""

    def __init__(self, aux_loss_coeff: float):
        self.aux_loss_coeff = aux_loss_coeff

    def __call__(self, outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(outputs, labels, aux_loss_coeff=self.aux_loss_coeff)


def _check_buildable(spec: ModelSpec, plan: ParallelPlan) -> None:
    reason = deepspeed_compatible(plan)
    if reason is not None:
        raise SpecError("plan", plan, f"cannot run on DeepSpeed ({reason})", "plan with piper_deepspeed.plan_for")
    if spec.mla is not None:
        raise SpecError("mla", spec.mla, "the DeepSpeed training model has no multi-latent attention",
                        "use a model spec without mla")
    if spec.num_layers % plan.pp:
        raise SpecError("pp", plan.pp, f"must divide num_layers ({spec.num_layers}) for an even pipeline split",
                        "choose pp among the divisors of num_layers")
    if spec.is_moe and spec.num_experts % plan.ep:
        raise SpecError("ep", plan.ep, f"must divide num_experts ({spec.num_experts})", "lower ep")
