"""Parameter counts: total, active per token, and per GPU for each pipeline stage.

Counts follow the modules Megatron-Core's GPTModel builds (``gpt_layer_specs``; the TE and local
specs hold the same parameters): every linear weight, bias, norm and router, with tensor-parallel
splits as ``ColumnParallelLinear``/``RowParallelLinear`` make them. Expert weights are split over
``ep`` (whole experts) and ``etp`` (inside an expert); everything else is dense and split over ``tp``
where Megatron splits it. MLA down-projections are duplicated on every tp rank, as in the TE spec
(``parallel_mode='duplicated'``, megatron/core/transformer/multi_latent_attention.py). Every parameter,
the router's included, is held in the params dtype (see :func:`_layer_params`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from piper_core.specs.compat import mtp_layers, stage_blocks
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamCount:
    """Parameters held by one GPU, split by how Megatron treats them.

    ``dense``: non-expert parameters (gradients reduced over dp); ``expert``: expert parameters
    (reduced over expert-dp).
    """

    dense: int = 0
    expert: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert

    def __add__(self, other: ParamCount) -> ParamCount:
        return ParamCount(dense=self.dense + other.dense, expert=self.expert + other.expert)

    def scaled(self, k: int) -> ParamCount:
        return ParamCount(dense=self.dense * k, expert=self.expert * k)


def _norm(model: ModelSpec, width: int) -> int:
    """RMSNorm holds a weight; LayerNorm a weight and a bias."""
    return width * (1 if model.normalization == "RMSNorm" else 2)


def _column(model: ModelSpec, d_in: int, d_out: int, tp: int, bias: bool) -> int:
    """ColumnParallelLinear: weight [d_out/tp, d_in] (+ bias [d_out/tp])."""
    return d_out // tp * d_in + (d_out // tp if bias else 0)


def _row(model: ModelSpec, d_in: int, d_out: int, tp: int, bias: bool) -> int:
    """RowParallelLinear: weight [d_out, d_in/tp] (+ bias [d_out], not split)."""
    return d_out * (d_in // tp) + (d_out if bias else 0)


def attention_params(model: ModelSpec, tp: int) -> int:
    """Self-attention of one layer on one tp rank, including the input norm."""
    h, bias = model.hidden_size, model.add_bias_linear
    n = _norm(model, h)
    mla = model.mla
    if mla is None:
        d, heads, groups = model.head_dim, model.num_attention_heads, model.query_groups
        n += _column(model, h, (heads + 2 * groups) * d, tp, bias or model.add_qkv_bias)
        if model.qk_layernorm:
            n += 2 * _norm(model, d)
        return n + _row(model, heads * d, h, tp, bias)
    heads, q_head = model.num_attention_heads, mla.qk_head_dim + mla.qk_pos_emb_head_dim
    if mla.q_lora_rank is None:
        n += _column(model, h, heads * q_head, tp, False)
    else:
        n += h * mla.q_lora_rank + _column(model, mla.q_lora_rank, heads * q_head, tp, False)
        n += _norm(model, mla.q_lora_rank) if model.qk_layernorm else 0
    n += h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)
    n += _norm(model, mla.kv_lora_rank) if model.qk_layernorm else 0
    n += _column(model, mla.kv_lora_rank, heads * (mla.qk_head_dim + mla.v_head_dim), tp, False)
    return n + _row(model, heads * mla.v_head_dim, h, tp, bias)


def mlp_params(model: ModelSpec, ffn: int, tp: int) -> int:
    """One MLP (dense, shared expert or a single expert) on one rank of a ``tp``-way split."""
    h, bias = model.hidden_size, model.add_bias_linear
    fc1_out = ffn * (2 if model.gated_linear_unit else 1)
    return _column(model, h, fc1_out, tp, bias) + _row(model, ffn, h, tp, bias)


def layer_params(model: ModelSpec, plan: ParallelPlan, layer: int) -> ParamCount:
    """Layer ``layer`` (0-based) on one GPU: attention, pre-MLP norm, and dense MLP or MoE."""
    return _layer_params(model, plan.tp, plan.ep, plan.etp_size, model.moe_layer_pattern[layer])


@functools.lru_cache(maxsize=4096)
def _layer_params(model: ModelSpec, tp: int, ep: int, etp: int, moe: bool) -> ParamCount:
    h = model.hidden_size
    dense = attention_params(model, tp) + _norm(model, h)
    if not moe:
        return ParamCount(dense=dense + mlp_params(model, model.ffn_hidden_size, tp))
    # The router's weight (and bias) is created in fp32 but cast to config.params_dtype at once
    # (megatron/core/transformer/moe/router.py, Router.reset_parameters), and Float16Module casts the
    # whole model anyway (megatron/training/training.py, get_model); moe_router_dtype='fp32' only
    # changes the dtype the gating GEMM computes in (Router.gating), not the stored weight.
    router = model.num_experts * h + (model.num_experts if model.add_bias_linear else 0)
    shared = model.moe_shared_expert_intermediate_size
    if shared:
        dense += mlp_params(model, shared, tp)
    local_experts = model.num_experts // ep
    expert = local_experts * mlp_params(model, model.moe_ffn_hidden_size, etp)
    return ParamCount(dense=dense + router, expert=expert)


def embedding_params(model: ModelSpec, tp: int) -> int:
    """Word embeddings (vocab-parallel) plus learned absolute positions (replicated)."""
    n = model.padded_vocab(tp) // tp * model.hidden_size
    if model.position_embedding == "learned_absolute":
        n += model.seq_length * model.hidden_size
    return n


def mtp_extra_params(model: ModelSpec, tp: int) -> int:
    """One MTP layer besides its transformer layer, on one tp rank: the embedding and hidden-state
    norms, the ``2h -> h`` column-parallel projection (no bias) and the final norm
    (``MultiTokenPredictionLayer``, megatron/core/transformer/multi_token_prediction.py)."""
    h = model.hidden_size
    return 3 * _norm(model, h) + _column(model, 2 * h, h, tp, False)


def stage_params(model: ModelSpec, plan: ParallelPlan) -> tuple[ParamCount, ...]:
    """Parameters on one GPU of each pipeline rank (all vpp chunks of that rank together).

    The first chunk of rank 0 holds the embedding; the last chunk of the last rank the final norm
    and the output layer. With tied embeddings the output layer owns a copy of the embedding
    unless it sits on the same rank (pp == 1) -- GPTModel ``skip_weight_param_allocation``.
    A rank that runs MTP layers holds their transformer layers (:func:`stage_blocks`), their norms
    and projections (:func:`mtp_extra_params`) and, when it is not rank 0, an embedding of its own
    (GPTModel builds one where ``mtp_process``; its gradient is reduced with the first stage's).
    """
    return _stage_params(model, plan.tp, plan.ep, plan.etp_size, plan.pp, plan.vpp,
                         plan.num_layers_in_first_pipeline_stage, plan.num_layers_in_last_pipeline_stage,
                         plan.pipeline_layout)


@functools.lru_cache(maxsize=16384)
def _stage_params(model: ModelSpec, tp: int, ep: int, etp: int, pp: int, vpp: int | None, first: int | None,
                  last: int | None, layout: str | None = None) -> tuple[ParamCount, ...]:
    out = []
    plan = ParallelPlan(gpus=tp * pp * ep * etp, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, global_batch_size=ep * etp,
                        sequence_parallel=tp > 1, num_layers_in_first_pipeline_stage=first,
                        num_layers_in_last_pipeline_stage=last, pipeline_layout=layout)
    mtp = mtp_layers(model, plan)
    for rank, count in enumerate(_layers_params(model, plan)):
        extra = 0
        if rank == 0:
            extra += embedding_params(model, plan.tp)
        if rank == plan.pp - 1:
            extra += _norm(model, model.hidden_size)
            if not (model.tie_embeddings and plan.pp == 1):
                extra += model.padded_vocab(plan.tp) // plan.tp * model.hidden_size
        if mtp[rank]:
            extra += mtp[rank] * mtp_extra_params(model, plan.tp) + (embedding_params(model, plan.tp) if rank else 0)
        out.append(count + ParamCount(dense=extra))
    return tuple(out)


def _layers_params(model: ModelSpec, plan: ParallelPlan) -> list[ParamCount]:
    """Per pipeline rank: the parameters of its transformer layers, its MTP layers' included (no
    embedding, final norm or output layer)."""
    out = []
    for chunks in stage_blocks(model, plan):
        moe_layers = sum(sum(chunk) for chunk in chunks)
        dense_layers = sum(len(chunk) for chunk in chunks) - moe_layers
        count = ParamCount()
        for moe, n in ((False, dense_layers), (True, moe_layers)):
            if n:
                count += _layer_params(model, plan.tp, plan.ep, plan.etp_size, moe).scaled(n)
        out.append(count)
    return out


def stage_layer_params(model: ModelSpec, plan: ParallelPlan) -> tuple[int, ...]:
    """Per pipeline rank: parameters of its transformer layers on one GPU -- the weights of the
    linears an FP8 plan runs in FP8, with the layers' norms and routers (a few thousandths of them)."""
    return tuple(c.total for c in _layers_params(model, plan))


def _unsplit(model: ModelSpec, gpus: int = 1) -> ParallelPlan:
    return ParallelPlan(gpus=gpus, global_batch_size=gpus)


def total_params(model: ModelSpec, *, mtp: bool = True) -> int:
    """All parameters of the model (no parallelism; tied embeddings counted once). ``mtp=False``
    leaves out the MTP layers, as model cards count the main model (DeepSeek-V3's 671B)."""
    if not mtp and model.mtp_num_layers:
        model = dataclasses.replace(model, mtp_num_layers=0)
    return stage_params(model, _unsplit(model))[0].total


def input_embedding_params(model: ModelSpec) -> int:
    """Parameters of the input-embedding lookups: the word embeddings and learned absolute positions.

    With tied embeddings the word-embedding matrix is also the output layer's weight, a GEMM every
    token runs, so it is not counted here (only the positions, if learned, are).
    """
    n = 0 if model.tie_embeddings else model.padded_vocab(1) * model.hidden_size
    if model.position_embedding == "learned_absolute":
        n += model.seq_length * model.hidden_size
    return n


def active_params(model: ModelSpec, *, input_embedding: bool = True, mtp: bool = True) -> int:
    """Parameters one token touches: all but the unrouted experts (top-k of them are used).

    ``input_embedding=False`` leaves out the input-embedding lookups (:func:`input_embedding_params`),
    as some model cards do (a table row read per token is not compute); the output layer stays in.
    The presets' published active counts include it (tests/unit/test_params_flops.py). ``mtp=False``
    leaves out the MTP layers (:func:`total_params`).
    """
    if not mtp and model.mtp_num_layers:
        model = dataclasses.replace(model, mtp_num_layers=0)
    full = _unsplit(model)
    one_expert = mlp_params(model, model.moe_ffn_hidden_size, 1) if model.is_moe else 0
    moe_layers = model.num_moe_layers + (model.mtp_num_layers if model.mtp_is_moe else 0)
    unused = (model.num_experts - model.moe_router_topk) * one_expert * moe_layers
    active = total_params(model) - unused if model.is_moe else stage_params(model, full)[0].total
    return active if input_embedding else active - input_embedding_params(model)
