"""Activation memory: the bytes one GPU keeps for backward, per micro-batch.

Every term is a tensor (more exactly, a storage) that a Megatron-Core module saves for backward,
read off the module's code and checked against the storages Megatron-Core really keeps on CPU
(``tests/megatron/test_activation_memory.py``, saved-tensor hooks, unique storages). The layer
input is counted in the layer (its input norm saves it), as in Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), Sec. 4.1 / Table 2, whose
``sbh (34 + 5 a s / h)`` this model reproduces for their GPT layer. Parameters, the attention mask
and the RoPE table (model-owned, shared by all layers) are not activations.

Two rules decide the totals beyond the Korthikanti terms:

* **A view keeps its whole storage.** Megatron splits ``linear_qkv``'s output into q, k, v views;
  whoever saves v (or an unrotated q/k) keeps the whole ``[s, b, (a + 2g) d]`` buffer.
* **Only what survives the forward counts.** Tensors saved by graph branches that die inside the
  forward (the aux loss's top-k indices) are freed and are not counted.

Notation: ``T = s b / cp`` tokens of one rank's sequence slice, ``T_l = T / tp`` with sequence
parallelism (``T`` without) the tokens a norm, residual or SP-split linear input holds.
Activations are 2 bytes (bf16/fp16; 4 in fp32 training); fp32 where Megatron computes in fp32 (softmax of the router,
the cross-entropy's softmax, flash-attention's log-sum-exp, norm statistics).

Piper's DeepSpeed builder on the host kernels is priced with its own RoPE, MLP, gate copies and MoE
combine (:func:`_deepspeed_builder`; checked in tests/deepspeed/test_fp32_activations.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from piper_core.errors import Infeasible, SpecError
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

_INT64 = 8
_FP32 = 4
_BOOL = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Kernels:
    """Kernel choices that change what is kept. The defaults are a GPU run with Megatron's defaults.

    ``rope_fusion`` (``apply_rope_fusion``): the unfused RoPE keeps its cos/sin ``[s, 1, 1, d]`` for q
    and for k. ``bias_activation_fusion`` (megatron.training's ``--bias-swiglu-fusion``, on by
    default): the fused SwiGLU keeps only its input; unfused, the SiLU output and the linear half are
    kept too. ``dropout_mask_bytes``: CUDA's ``native_dropout`` keeps a bool mask; CPU's dropout keeps
    the mask in the activation dtype (2). ``norm_stats_bytes``: fp32 mean/rstd on CUDA; torch's CPU
    LayerNorm keeps them in bf16 (2). ``router_aux_loss``: ``moe_aux_loss_coeff > 0`` (Megatron's
    default coefficient is 0) keeps a second fp32 softmax over all experts. ``rms_norm_input_bytes``:
    what an RMSNorm keeps of its input per element; 0 is the input itself in the activation dtype (the
    CUDA kernel, Transformer Engine); torch's host ``rms_norm`` is a decomposition that keeps two fp32
    copies of it instead (8: its fp32 upcast and the normalized product, measured on torch 2.13 with
    saved-tensor hooks, tests/runtime/test_activations_host.py). ``host``: torch's host kernels, where
    the one trainer Piper runs with flash attention is its DeepSpeed builder (torch's
    ``scaled_dot_product_attention``; Megatron-Core's CPU trainers refuse flash,
    piper_megatron/measure.py), priced with its own modules (:func:`_deepspeed_builder`).
    """

    rope_fusion: bool = True
    bias_activation_fusion: bool = True
    dropout_mask_bytes: int = _BOOL
    norm_stats_bytes: int = _FP32
    router_aux_loss: bool = False
    rms_norm_input_bytes: int = 0
    host: bool = False

    def __post_init__(self) -> None:
        for key in ("dropout_mask_bytes", "norm_stats_bytes"):
            if getattr(self, key) not in (1, 2, 4):
                raise SpecError(key, getattr(self, key), "is an element size in bytes", "use 1, 2 or 4")
        if self.rms_norm_input_bytes < 0:
            raise SpecError("rms_norm_input_bytes", self.rms_norm_input_bytes, "is bytes per element (0: the input "
                            "in the activation dtype)", "use 0 or a positive byte count")


GPU_DEFAULTS = Kernels()
HOST_KERNELS = Kernels(rope_fusion=False, bias_activation_fusion=False, dropout_mask_bytes=2, norm_stats_bytes=2,
                       rms_norm_input_bytes=8, host=True)
"""Piper's CPU trainers (piper_megatron.train: no CUDA fusions, ``bias_activation_fusion=False``) on
torch's host kernels."""


def _in_dtype(k: Kernels, act: int) -> Kernels:
    """``k`` for activations of ``act`` bytes: host kernels keep dropout masks and norm statistics in
    the activation dtype (the 2s of :data:`HOST_KERNELS`), 4 bytes in fp32 training; CUDA's bool
    masks and fp32 statistics do not change."""
    if act == 2:
        return k
    return dataclasses.replace(k, dropout_mask_bytes=act if k.dropout_mask_bytes == 2 else k.dropout_mask_bytes,
                               norm_stats_bytes=act if k.norm_stats_bytes == 2 else k.norm_stats_bytes)


def _deepspeed_builder(plan: ParallelPlan, k: Kernels) -> bool:
    """Price Piper's DeepSpeed builder (piper_deepspeed/builder.py with Piper's MoE layer,
    piper_deepspeed/moe.py) rather than Megatron-Core's modules: flash attention on the host kernels
    (see :class:`Kernels`). It keeps less than Megatron's modules (measured with saved-tensor hooks,
    tests/deepspeed/test_fp32_activations.py): half the RoPE table, no SwiGLU ``glu_linear`` copy,
    and unweighted experts whose outputs Piper's combine gathers and weights (``_decode``); and
    DeepSpeed's gate (``TopKGate.forward``, deepspeed/moe/sharded_moe.py) runs on an fp32 copy of its
    input (``input.float()``) and weight (``self.wg.weight.float()``): copies in bf16, the norm output
    and the parameter themselves in fp32 (:func:`_moe_terms`)."""
    return k.host and plan.attention_backend == "flash"


def kernels_for(accelerator: Any) -> Kernels:
    """The kernels of ``accelerator`` (its ``kernels``: ``cuda`` or ``cpu``)."""
    return HOST_KERNELS if getattr(accelerator, "kernels", "cuda") == "cpu" else GPU_DEFAULTS


@dataclass(frozen=True, slots=True)
class _Dims:
    """Token counts and element sizes of one rank (see the module docstring for ``T``, ``T_l``)."""

    seq: int        # s / cp
    batch: int      # b
    tokens: int     # T = s b / cp
    local: int      # T_l: tokens of a norm / residual / SP-split linear input
    act: int        # bytes per activation element


def _dims(model: ModelSpec, plan: ParallelPlan) -> _Dims:
    seq = math.ceil(model.seq_length / plan.cp)
    tokens = seq * plan.micro_batch_size
    local = math.ceil(tokens / plan.tp) if plan.sequence_parallel else tokens
    return _Dims(seq=seq, batch=plan.micro_batch_size, tokens=tokens, local=local,
                 act=4 if plan.precision == "fp32" else 2)


def _norm_terms(model: ModelSpec, d: _Dims, k: Kernels, name: str, out: dict[str, int]) -> None:
    """A norm keeps its input and its statistics (mean and rstd for LayerNorm, rstd for RMSNorm)."""
    stats = 2 if model.normalization == "LayerNorm" else 1
    kept = k.rms_norm_input_bytes if model.normalization == "RMSNorm" and k.rms_norm_input_bytes else d.act
    out[f"{name}.input"] = d.local * model.hidden_size * kept  # native_layer_norm / TE LayerNorm saves input
    out[f"{name}.stats"] = d.local * stats * k.norm_stats_bytes  # [T_l, 1] mean/rstd


def _rope_terms(model: ModelSpec, d: _Dims, k: Kernels, rot_dim: int, out: dict[str, int], *, ds: bool = False) -> None:
    if model.position_embedding == "rope" and not k.rope_fusion:
        # rope_utils._apply_rotary_pos_emb_bshd: cos_/sin_ [s, 1, 1, rot] in t.dtype, saved by the muls, for q and k;
        # the DeepSpeed builder's _rope rotates interleaved pairs with cos/sin [s, rot/2], made per call
        out["rope.cos_sin"] = 4 * d.seq * (rot_dim // 2 if ds else rot_dim) * d.act


def _score_terms(model: ModelSpec, d: _Dims, k: Kernels, heads: int, out: dict[str, int]) -> None:
    """Unfused core attention (DotProductAttention): probabilities and dropout; [b, a/tp, s, s]."""
    scores = d.batch * heads * d.seq * d.seq
    out["core_attn.softmax"] = scores * d.act  # FusedScaleMaskSoftmax keeps its output (Korthikanti 2as^2b)
    if model.attention_dropout > 0:
        out["core_attn.dropout_mask"] = scores * k.dropout_mask_bytes  # Korthikanti as^2b
        out["core_attn.dropout_out"] = scores * d.act  # input of the probs @ V bmm, Korthikanti 2as^2b


def _flash_terms(d: _Dims, heads: int, v_dim: int, out: dict[str, int]) -> None:
    """flash-attn through TE (FlashAttention, qkv_format sbhd): its own [b, s, a, d] output and fp32
    log-sum-exp [b, a, s]; TE returns ``output.transpose(0, 1).contiguous()``, a second copy."""
    out["core_attn.flash_out"] = d.tokens * heads * v_dim * d.act  # flash_attn_func saves out [b, s, a/tp, d]
    out["core_attn.flash_lse"] = d.tokens * heads * _FP32  # ... and softmax_lse [b, a/tp, s] in fp32


def _check_backend(plan: ParallelPlan) -> None:
    if plan.attention_backend == "unfused" and plan.cp > 1:
        raise Infeasible("unfused attention cannot run with context parallelism",
                         rule="DotProductAttention asserts context_parallel_size == 1 (TE only)")


def _gqa_attention(model: ModelSpec, plan: ParallelPlan, d: _Dims, k: Kernels, out: dict[str, int], *,
                   ds: bool = False) -> None:
    """SelfAttention with linear_qkv -> (q/k norm) -> RoPE -> core attention -> linear_proj."""
    tp, hd = plan.tp, model.head_dim
    heads, groups = model.num_attention_heads // tp, max(model.query_groups // tp, 1)
    out["linear_qkv.input"] = d.local * model.hidden_size * d.act  # ColumnParallelLinear saves the SP-local input
    new_qk = model.position_embedding == "rope" or model.qk_layernorm  # RoPE / q-k norm write new q, k
    gqa = heads != groups
    # the DeepSpeed builder's Attention repeat_interleaves k and v for torch's SDPA, as DotProductAttention does
    repeat = plan.recompute != "selective" and (plan.attention_backend == "unfused" or ds) and gqa
    mixed = d.tokens * (heads + 2 * groups) * hd * d.act  # linear_qkv output [T, (a + 2g) d / tp]
    q_bytes = d.tokens * heads * hd * d.act
    if model.qk_layernorm:
        stats = 2 if model.normalization == "LayerNorm" else 1
        out["qk_norm.stats"] = d.tokens * (heads + groups) * stats * k.norm_stats_bytes
        if gqa:  # get_query_key_value_tensors: query.reshape copies in the interleaved GQA layout
            out["q_norm.input"] = q_bytes
    if repeat:
        # DotProductAttention.forward: repeat_interleave gives new k, v with a/tp heads; q is new
        # (RoPE, q norm, or the GQA reshape copy)
        out["attn.q"] = out["attn.k"] = out["attn.v"] = q_bytes
        if model.qk_layernorm:
            out["linear_qkv.output"] = mixed  # k_layernorm saves a view of it
    else:
        out["linear_qkv.output"] = mixed  # v (a view) is saved, so the whole buffer is kept
        if new_qk or gqa:
            out["attn.q"] = q_bytes
        if new_qk:
            out["attn.k"] = d.tokens * groups * hd * d.act
    _rope_terms(model, d, k, hd, out, ds=ds)
    _core_attention(model, plan, d, k, heads, hd, out)


def _core_attention(model: ModelSpec, plan: ParallelPlan, d: _Dims, k: Kernels, heads: int, v_dim: int,
                    out: dict[str, int]) -> None:
    """Inside core attention (nothing under selective recompute: CheckpointFunction keeps only q, k, v)
    and linear_proj's input, the attention output [T, a v_dim / tp]."""
    if plan.recompute != "selective":
        if plan.attention_backend == "unfused":
            _score_terms(model, d, k, heads, out)
        else:
            _flash_terms(d, heads, v_dim, out)
    out["linear_proj.input"] = d.tokens * heads * v_dim * d.act  # RowParallelLinear saves its input (Korthikanti 2sbh)


def _mla_attention(model: ModelSpec, plan: ParallelPlan, d: _Dims, k: Kernels, out: dict[str, int]) -> None:
    """MLASelfAttention: down-projections (whole on every tp rank, SP-local tokens), their norms,
    up-projections, RoPE on the qk_pos_emb part, then q, k, v as new contiguous tensors."""
    mla, heads = model.mla, model.num_attention_heads // plan.tp
    assert mla is not None
    stats = (2 if model.normalization == "LayerNorm" else 1) * k.norm_stats_bytes
    out["linear_q_down/kv_down.input"] = d.local * model.hidden_size * d.act  # both save the norm output
    if mla.q_lora_rank is not None:
        out["q_down.output"] = d.local * mla.q_lora_rank * d.act  # saved by q_layernorm (or linear_q_up_proj)
        if model.qk_layernorm:
            out["q_norm.output"] = d.local * mla.q_lora_rank * d.act  # linear_q_up_proj input
            out["q_norm.stats"] = d.local * stats
    # linear_kv_down_proj output [T_l, kv_r + d_rope]: kv_compressed, a view of it, is saved
    out["kv_down.output"] = d.local * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) * d.act
    if model.qk_layernorm:
        out["kv_norm.output"] = d.local * mla.kv_lora_rank * d.act  # linear_kv_up_proj input
        out["kv_norm.stats"] = d.local * stats
    qk_dim = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    out["attn.q"] = d.tokens * heads * qk_dim * d.act  # torch.cat([q_no_pe, q_pos_emb])
    out["attn.k"] = d.tokens * heads * qk_dim * d.act  # torch.cat([k_no_pe, k_pos_emb.expand])
    out["attn.v"] = d.tokens * heads * mla.v_head_dim * d.act  # value.contiguous() copies the kv view
    _rope_terms(model, d, k, mla.qk_pos_emb_head_dim, out)
    _core_attention(model, plan, d, k, heads, mla.v_head_dim, out)


def _mlp_terms(model: ModelSpec, k: Kernels, rows: int, width: int, act: int, prefix: str,
               out: dict[str, int], *, weighted: bool, ds: bool = False) -> None:
    """fc1 -> activation -> fc2 of one MLP on ``rows`` tokens, ``width`` = FFN width on this rank.

    ``weighted``: routed experts multiply by the router probability inside the activation
    (MLP.forward ``per_token_scale``). ``ds``: the DeepSpeed builder's MLP (unweighted: Piper's
    combine weights the experts' outputs, :func:`_moe_terms`).
    """
    glu = model.gated_linear_unit
    out[f"{prefix}.fc1_output"] = rows * width * (2 if glu else 1) * act  # saved by SwiGLUFunction / GeLU
    if glu and not k.bias_activation_fusion:
        out[f"{prefix}.silu_output"] = rows * width * act  # mlp.glu: silu(x_glu) * (x_linear + offset)
        if not ds:  # the builder's MLP: silu(gate) * up, up a view of fc1's output (h.chunk)
            out[f"{prefix}.glu_linear"] = rows * width * act  # x_linear + glu_linear_offset is a new tensor
    if weighted and not ds and (not glu or not k.bias_activation_fusion):
        out[f"{prefix}.activation_output"] = rows * width * act  # saved by `* per_token_scale`
    out[f"{prefix}.fc2_input"] = rows * width * act  # RowParallelLinear saves its input (Korthikanti 8sbh)


def busiest_rows(model: ModelSpec, local_tokens: int, ep: int, etp: int) -> tuple[int, int | None]:
    """Token copies the busiest GPU's experts receive, and the per-expert capacity (None: dropless).

    ``local_tokens`` is what one rank routes (``T_l``). Capacity (``get_capacity``):
    ``ceil(T_l k / E x cf)`` per source rank; inputs are padded to it
    (``moe_pad_expert_input_to_capacity``, the convention modelled), so a GPU receives ``E x cap``
    from its ep peers. Dropless: ``T_l k`` on average; the worst GPU ``min(skew, ep)`` times that
    (exact for ep = 1 and for one expert per GPU, an upper bound between). The expert-TP all-gather
    multiplies by etp. The time model (``piper_core.timing``) uses the same rows.
    """
    assigned = local_tokens * model.moe_router_topk
    if model.moe_capacity_factor is not None:
        cap = min(math.ceil(assigned / model.num_experts * model.moe_capacity_factor), local_tokens)
        return model.num_experts * cap * etp, cap
    skew = min(model.moe_expert_load_skew, ep)
    return math.ceil(assigned * skew) * etp, None


def _routed_rows(model: ModelSpec, plan: ParallelPlan, d: _Dims) -> tuple[int, int | None]:
    return busiest_rows(model, d.local, plan.ep, plan.etp_size)


def routed_rows(model: ModelSpec, plan: ParallelPlan) -> int:
    """Token copies the busiest GPU's experts receive in one MoE layer for one micro-batch."""
    return _routed_rows(model, plan, _dims(model, plan))[0]


def _router_terms(model: ModelSpec, d: _Dims, k: Kernels, cap: int | None, out: dict[str, int]) -> None:
    """TopKRouter + moe_utils.permute on the T_l local tokens (alltoall dispatcher, unfused permute)."""
    n, e, topk = d.local, model.num_experts, model.moe_router_topk
    out["router.topk_indices"] = n * topk * _INT64  # torch.topk saves its indices (scatter reuses them)
    if topk == 1:
        out["router.softmax"] = n * e * _FP32  # pre-softmax (required for top-1): softmax over E in fp32
    else:
        out["router.softmax"] = n * topk * _FP32  # softmax over the top-k logits in fp32
    if k.router_aux_loss:
        out["router.aux_scores"] = n * e * _FP32 + e * _INT64  # compute_routing_scores_for_aux_loss softmax
    if cap is None:
        out["permute.routing_map"] = e * n * _BOOL  # masked_select keeps routing_map.T [E, T_l]
        out["permute.probs"] = e * n * d.act  # ... and probs.T [E, T_l] (in the logits' dtype)
        out["permute.indices"] = n * topk * _INT64  # index_select's sorted_indices
    else:
        out["router.capacity_mask"] = n * e * _BOOL  # routing_probs * final_map saves the bool map
        out["permute.indices"] = 2 * e * cap * _INT64  # drop_and_pad: indices_1D (probs) and sorted_indices


def _moe_terms(model: ModelSpec, plan: ParallelPlan, d: _Dims, k: Kernels, out: dict[str, int], *,
               ds: bool = False) -> None:
    """MoELayer: router, permutation, the routed experts and the shared experts. ``ds``: Piper's MoE
    layer in DeepSpeed (piper_deepspeed/moe.py), whose combine weights the gathered expert outputs."""
    rows, cap = _routed_rows(model, plan, d)
    # DeepSpeed's gate keeps fp32 [T_l, E] tensors (top2gating: its softmax, two one-hot masks) where
    # Megatron's router keeps [T_l, k] ones: priced as Megatron's router (val-moe: 12 KB a layer short)
    _router_terms(model, d, k, cap, out)
    assert model.moe_ffn_hidden_size is not None
    out["experts.input"] = rows * model.hidden_size * d.act  # fc1 inputs are views of the dispatched buffer
    if ds:
        # PiperMOELayer.forward: tokens.index_select(0, token_of_row) keeps the index of the kept routes
        # (at most k T_l); _decode: index_select(0, row_of_route) keeps [k T_l] int64, and
        # `routed * gates` the gathered outputs [k, T_l, h] and the fp32 gates [k, T_l, 1]
        n = d.local * model.moe_router_topk
        if d.act != _FP32:  # TopKGate.forward: input.float() and wg.weight.float() are copies in bf16
            out["gate.input_fp32"] = d.local * model.hidden_size * _FP32
            out["gate.weight_fp32"] = model.hidden_size * model.num_experts * _FP32
            if not model.moe_shared_expert_intermediate_size:
                # the bf16 norm output itself: only the gate reads it (through its copy) and the
                # dispatch's index_select keeps no input, so nothing saves it
                del out["mlp.input"]
        out["dispatch.indices"] = n * _INT64
        out["combine.indices"] = n * _INT64
        out["combine.outputs"] = n * model.hidden_size * d.act
        out["combine.gates"] = n * _FP32
    else:
        out["experts.probs"] = rows * d.act  # permuted probs, saved by WeightedSwiGLUFunction / the scale mul
        if plan.a2a_chunks > 1:
            out[PIPELINED_EXPERT_OUTPUT] = rows * model.hidden_size * d.act
    _mlp_terms(model, k, rows, model.moe_ffn_hidden_size // plan.etp_size, d.act, "experts", out, weighted=True, ds=ds)
    if model.moe_shared_expert_intermediate_size:
        # SharedExpertMLP: a dense MLP on the same norm output (already counted as the router input)
        _mlp_terms(model, k, d.tokens, model.moe_shared_expert_intermediate_size // plan.tp, d.act,
                   "shared_experts", out, weighted=False, ds=ds)


PIPELINED_EXPERT_OUTPUT = "pipelined.expert_output"
"""Megatron-Core with Piper's dispatcher in chunks > 1 runs dispatch, experts and combine in one
:func:`piper_core.runtime.moe_alltoall`, which keeps each chunk's expert output (with its graph) until
that chunk's backward (``_Run.saved``, piper_core/runtime/pipelined.py); unpipelined, Megatron's experts
module hands it to the combine, which frees it. Kept outside autograd's saved tensors, so no
saved-tensor hook sees it (:data:`UNSAVED`). Measured (full suite, fp32, 2026-12-06): the peak of
2r-ep2-pipelined2 is 1.0 MiB above 2r-ep2-mbs2's, the 4 layers' expert outputs (512 rows x 128 x 4 B
each). Piper's DeepSpeed layer runs moe_alltoall in one chunk too and keeps the same tensor there;
that is not priced yet: plans priced with Megatron's modules (the GPU presets) get the term in
chunks > 1 only, and the CPU builder's (``ds``) not at all, as DeepSpeed's CPU peaks carry other
errors (its state priced 33 % high, the micro-batch-4 peak +4.6 %) and the term alone would put
ds-2r-ep2-mbs4 at +8.7 %."""
UNSAVED = (PIPELINED_EXPERT_OUTPUT,)
"""Terms a layer keeps for backward outside autograd's saved tensors (counted in the peak, not in the
validation's "parameters + saved activations", which saved-tensor hooks measure)."""


def layer_activation_terms(model: ModelSpec, plan: ParallelPlan, *, moe: bool, recomputed: bool = True,
                           kernels: Kernels = GPU_DEFAULTS) -> dict[str, int]:
    """Bytes kept for backward by one transformer layer on one GPU, per micro-batch, by term.

    ``moe`` selects a MoE or a dense FFN. ``recomputed`` matters only for ``recompute == "full"``:
    True prices a layer inside a checkpointed group (``CheckpointFunction`` keeps only its input
    ``[T_l, h]``; ``distribute_saved_activations`` off, Megatron's default), False a layer that
    ``recompute_method="block"`` leaves un-recomputed (everything, as with ``recompute="none"``).
    """
    _check_backend(plan)
    if moe and not model.is_moe:
        raise SpecError("moe", moe, f"model {model.name!r} has no experts", "price a dense layer (moe=False)")
    d = _dims(model, plan)
    ds = _deepspeed_builder(plan, kernels)
    kernels = _in_dtype(kernels, d.act)
    out: dict[str, int] = {}
    if plan.recompute == "full" and recomputed:
        out["checkpoint.input"] = d.local * model.hidden_size * d.act  # CheckpointFunction.save_for_backward
        return out
    _norm_terms(model, d, kernels, "input_norm", out)  # includes the layer input (Korthikanti 2sbh)
    if model.mla is not None:
        _mla_attention(model, plan, d, kernels, out)
    else:
        _gqa_attention(model, plan, d, kernels, out, ds=ds)
    if model.hidden_dropout > 0:
        out["attn_bda.dropout_mask"] = d.local * model.hidden_size * kernels.dropout_mask_bytes  # Korthikanti sbh
    _norm_terms(model, d, kernels, "pre_mlp_norm", out)
    out["mlp.input"] = d.local * model.hidden_size * d.act  # fc1 / router input: the norm output (Korthikanti 2sbh)
    if moe:
        _moe_terms(model, plan, d, kernels, out, ds=ds)
    else:
        _mlp_terms(model, kernels, d.tokens, model.ffn_hidden_size // plan.tp, d.act, "mlp", out, weighted=False,
                   ds=ds)
    if model.hidden_dropout > 0:
        out["mlp_bda.dropout_mask"] = d.local * model.hidden_size * kernels.dropout_mask_bytes  # Korthikanti sbh
    if plan.fp8 is not None and not ds:
        for key in FP8_SAVED_INPUTS + (() if moe else ("mlp.input",)):
            if key in out:
                out[key] //= d.act  # the quantized input, 1 byte an element
    return out


FP8_SAVED_INPUTS = ("linear_qkv.input", "linear_proj.input", "linear_q_down/kv_down.input", "q_norm.output",
                    "kv_norm.output", "experts.input", "experts.fc2_input", "shared_experts.fc2_input",
                    "mlp.fc2_input")
"""The inputs of FP8 linears a layer keeps for backward: in an FP8 plan Transformer Engine's linears
(``LayerNormLinear``, ``Linear``, ``GroupedLinear``) save the input they quantized, 1 byte an
element, not the bf16 tensor. A dense layer's ``mlp.input`` (fc1's) is one of them; a MoE layer's
stays bf16, as the router (fp32 GEMM) keeps it too. Norm inputs, attention's q/k/v and softmax, the
activation function's input and the router's tensors stay in the plan's precision."""


def layer_activation_bytes(model: ModelSpec, plan: ParallelPlan, *, moe: bool, recomputed: bool = True,
                           kernels: Kernels = GPU_DEFAULTS, saved_only: bool = False) -> int:
    """Total of :func:`layer_activation_terms`: bytes one layer keeps for backward per micro-batch
    (``saved_only``: without the :data:`UNSAVED` terms)."""
    terms = layer_activation_terms(model, plan, moe=moe, recomputed=recomputed, kernels=kernels)
    return sum(v for k, v in terms.items() if not (saved_only and k in UNSAVED))


def embedding_activation_bytes(model: ModelSpec, plan: ParallelPlan, *, kernels: Kernels = GPU_DEFAULTS) -> int:
    """Bytes the first stage's embedding keeps per micro-batch (its output is layer 0's input).

    LanguageModelEmbedding: ``F.embedding`` keeps the token ids ([b, s/cp] int64; with tp > 1
    VocabParallelEmbedding's masked copy plus its bool mask), learned absolute positions keep the
    position ids, and the embedding dropout its mask on the SP-local tokens.
    """
    d = _dims(model, plan)
    kernels = _in_dtype(kernels, d.act)
    n = d.tokens * _INT64  # VocabParallelEmbedding: F.embedding saves the (masked) ids
    if plan.tp > 1:
        n += d.tokens * _BOOL  # output_parallel[input_mask, :] = 0 saves the mask
    if model.position_embedding == "learned_absolute":
        n += d.tokens * _INT64  # position_embeddings: F.embedding saves position_ids
    if model.hidden_dropout > 0:
        n += d.local * model.hidden_size * kernels.dropout_mask_bytes  # embedding_dropout after the SP scatter
    return n


def output_activation_bytes(model: ModelSpec, plan: ParallelPlan, *, kernels: Kernels = GPU_DEFAULTS) -> int:
    """Bytes the last stage's final norm, output layer and loss keep per micro-batch.

    The bf16 logits are not kept: ``vocab_parallel_cross_entropy`` works on an fp32 copy and saves
    its softmax ``exp_logits`` [s/cp, b, V/tp] in fp32 (with the target mask and masked targets).
    The logits themselves, and their gradient, are transient (:func:`logits_transient_bytes`).
    """
    d = _dims(model, plan)
    kernels = _in_dtype(kernels, d.act)
    out: dict[str, int] = {}
    _norm_terms(model, d, kernels, "final_norm", out)
    out["output_layer.input"] = d.local * model.hidden_size * d.act  # ColumnParallelLinear saves its input
    vocab = model.padded_vocab(plan.tp) // plan.tp
    out["cross_entropy.softmax"] = d.tokens * vocab * _FP32  # _VocabParallelCrossEntropy: exp_logits
    out["cross_entropy.targets"] = d.tokens * (_BOOL + _INT64)  # target_mask, masked_target_1d
    return sum(out.values())


def mtp_activation_bytes(model: ModelSpec, plan: ParallelPlan, *, kernels: Kernels = GPU_DEFAULTS) -> int:
    """Bytes one MTP layer keeps per micro-batch besides its transformer layer (whose activations
    are a decoder layer's: :func:`layer_activation_bytes`).

    ``MultiTokenPredictionLayer``: an embedding lookup of the shifted tokens
    (:func:`embedding_activation_bytes`), the embedding and hidden-state norms, the ``[s, b, 2h]``
    concatenation the ``2h -> h`` column-parallel projection saves (SP-local with sequence
    parallelism), and its final norm, output layer and loss (:func:`output_activation_bytes`). Under
    full recompute the projection, its norms and the final norm run inside the checkpoint, which
    keeps its two inputs instead (the transformer layer's is counted with the layer).
    """
    d = _dims(model, plan)
    k = _in_dtype(kernels, d.act)
    h = model.hidden_size
    out: dict[str, int] = {}
    if plan.recompute == "full":
        out["checkpoint.decoder_input"] = d.local * h * d.act
        final: dict[str, int] = {}
        _norm_terms(model, d, k, "final_norm", final)
        out["output"] = output_activation_bytes(model, plan, kernels=kernels) - sum(final.values())
    else:
        _norm_terms(model, d, k, "enorm", out)
        _norm_terms(model, d, k, "hnorm", out)
        out["eh_proj.input"] = d.local * 2 * h * d.act
        out["output"] = output_activation_bytes(model, plan, kernels=kernels)
    return sum(out.values()) + embedding_activation_bytes(model, plan, kernels=kernels)


def local_spec(plan: ParallelPlan, k: Kernels) -> bool:
    """Megatron-Core's local (non-Transformer-Engine) layer spec: what the CPU trainer builds
    (host kernels with unfused attention, ``DotProductAttention`` and the ``tensor_parallel`` linears)."""
    return k.host and plan.attention_backend == "unfused"


def workspace_bytes(model: ModelSpec, plan: ParallelPlan, k: Kernels) -> int:
    """Megatron's global memory buffer under the local spec: bytes held from the first forward for
    the rest of training (through the optimizer step), outside the model state and the activations.

    ``parallel_state.get_global_memory_buffer()`` (``GlobalMemoryBuffer`` in megatron/core/utils.py)
    keeps one tensor per (name, dtype), grown to the largest request and never freed.
    ``DotProductAttention.forward`` takes a ``[b np/tp, s, s]`` view of the ``"mpu"`` one as
    ``baddbmm``'s input (beta 0; the scores themselves are a new tensor), and with sequence
    parallelism ``LinearWithGradAccumulationAndAsyncCommunication`` all-gathers the column-parallel
    input ``[s b, h]`` into the same buffer. Transformer Engine's spec (the GPU presets) and the
    DeepSpeed builder use neither: 0 there. Measured in the fp32 suite's memory jobs
    (piper_core/validate/peak.py): 512 KiB of every Megatron rank's after-step bytes at b 2, s 128,
    4 heads, which the state did not account for.
    """
    if not local_spec(plan, k):
        return 0
    d = _dims(model, plan)
    scores = d.batch * (model.num_attention_heads // plan.tp) * d.seq * d.seq
    gathered = d.tokens * model.hidden_size if plan.sequence_parallel else 0
    return max(scores, gathered) * d.act


def logits_transient_bytes(model: ModelSpec, plan: ParallelPlan) -> int:
    """Bytes the last stage holds per micro-batch beyond its saved activations while the loss runs.

    The output layer returns the logits [s/cp, b, V/tp] in the activation dtype; the loss casts
    them to fp32 (``logits.float()`` in ``calculate_logits_max``, megatron/core/tensor_parallel/
    cross_entropy.py, the default unfused path; the native fused one, fusions/fused_cross_entropy.py,
    does the same) and keeps that copy as its softmax (:func:`output_activation_bytes`), while
    ``GPTModel._postprocess`` still holds the 2-byte logits until the forward returns. In backward
    the loss's gradient is the fp32 softmax, turned back into a 2-byte gradient of the logits (the
    cast's backward; the fused path's ``grad_input.to(torch.bfloat16)``) before the fp32 one is freed.
    Either way one 2-byte [s/cp, b, V/tp] tensor sits beside the saved fp32 softmax.
    """
    d = _dims(model, plan)
    return d.tokens * (model.padded_vocab(plan.tp) // plan.tp) * d.act
