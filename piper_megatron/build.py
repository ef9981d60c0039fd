"""Build Megatron-Core objects from Piper specs: the TransformerConfig, the layer specs, the GPTModel.

One mapping, ModelSpec + ParallelPlan -> Megatron, used by the tests (predicted parameter counts ==
the GPTModel Megatron builds) and by the ``--piper`` adapter. Megatron's own builders do the work
(``get_gpt_decoder_block_spec`` picks and slices the layers of a pipeline stage, ``GPTModel`` builds
them), with the local (non-Transformer-Engine) modules so that it runs anywhere, including CPU.

Changes to the stock local spec, each because the stock one cannot build or differs from the
Transformer Engine spec production runs use:
- norms run under sequence parallelism (the local torch norm refuses it; see :class:`LocalNorm`);
- multi-latent attention (MLA): its core attention takes MLA's distinct key and value head widths
  (0.16.1's local ``DotProductAttention`` rejects the ``k_channels``/``v_channels`` MLA passes), and
  its q/kv *down*-projections are whole on every tp rank, as in the TE spec
  (``parallel_mode='duplicated'``), instead of split over tp.

Process groups must exist first (``parallel_state.initialize_model_parallel``). Building with
``device="meta"`` allocates no memory: a full-size layer of any preset builds in milliseconds. On a
CPU-only host, call :func:`piper_megatron.cpu.install_cpu_shims` before building MoE layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.post_training.modelopt.layers import Linear as WholeLinear
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from piper_core.errors import SpecError
from piper_core.specs.compat import check_plan
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

Device = Literal["cuda", "cpu", "meta"]

# Parameter dtype per precision: bf16/fp16 as Float16Module casts the model; fp32 (neither --bf16 nor
# --fp16) keeps Megatron's fp32 parameters, with TransformerConfig.bf16 = fp16 = False.
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Config settings each build device needs. meta: tensors without storage, so nothing to initialise
# (and Megatron's GPU path passes device=current_device explicitly, which would escape the meta
# context). cpu: the fused weight-gradient accumulation is a CUDA kernel.
_DEVICE_CONFIG: dict[str, dict[str, Any]] = {
    "cuda": {},
    "cpu": {"use_cpu_initialization": True, "gradient_accumulation_fusion": False},
    "meta": {"use_cpu_initialization": True, "perform_initialization": False,
             "gradient_accumulation_fusion": False},
}


def _model_fields(model: ModelSpec) -> dict[str, Any]:
    """TransformerConfig fields for the model's shape (everything but the parallel sizes)."""
    fields: dict[str, Any] = dict(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, ffn_hidden_size=model.ffn_hidden_size,
        gated_linear_unit=model.gated_linear_unit, normalization=model.normalization,
        add_bias_linear=model.add_bias_linear, add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm, attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout, mtp_num_layers=model.mtp_num_layers or None,
    )
    if model.gated_linear_unit:
        fields["activation_func"] = F.silu  # SwiGLU, as megatron.training's --swiglu sets it
    if model.mla is None:
        fields.update(num_query_groups=model.num_query_groups, kv_channels=model.kv_channels)
    else:
        if model.position_embedding != "rope":
            raise SpecError("position_embedding", model.position_embedding,
                            "Megatron-Core's multi-latent attention always applies RoPE to its "
                            "qk_pos_emb_head_dim part", "use position_embedding: rope with mla")
        mla = model.mla
        fields.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                      qk_head_dim=mla.qk_head_dim, qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
                      v_head_dim=mla.v_head_dim, rope_type="rope")
    if model.is_moe:
        fields.update(_moe_fields(model))
    return fields


def _moe_fields(model: ModelSpec) -> dict[str, Any]:
    """MoE fields. Piper's executors use the all-to-all dispatcher and per-expert MLPs."""
    fields: dict[str, Any] = dict(
        num_moe_experts=model.num_experts, moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        # Megatron takes a per-layer list for patterns an integer frequency cannot express
        # (dense first layers); 1 = MoE layer, as in get_gpt_decoder_layer_specs.
        moe_layer_freq=[int(moe) for moe in model.moe_layer_pattern],
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or None,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        # Top-1 routing gates by the softmax over all experts (Switch Transformer, Sec. 2.1);
        # TransformerConfig rejects topk=1 otherwise.
        moe_router_pre_softmax=model.moe_router_topk == 1,
        moe_router_num_groups=model.moe_router_num_groups, moe_router_group_topk=model.moe_router_group_topk,
    )
    if model.moe_capacity_factor is not None:
        # Piper sizes a capacity-bound expert's buffers at capacity, which is what padding gives;
        # Megatron's default policy drops the lowest-probability tokens above capacity.
        fields.update(moe_expert_capacity_factor=model.moe_capacity_factor,
                      moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="probs")
    return fields


def _plan_fields(plan: ParallelPlan) -> dict[str, Any]:
    """TransformerConfig fields for the parallel sizes, precision and recomputation of ``plan``.

    Not here, because TransformerConfig does not hold them: batch sizes (the training loop),
    ``distributed_optimizer`` (DDP/optimizer config), ``attention_backend`` (chosen by the layer
    spec; the local spec has one), ``a2a``/``a2a_chunks`` (Piper's dispatcher).
    """
    dtype = _DTYPES[plan.precision]
    fields: dict[str, Any] = dict(
        tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
        virtual_pipeline_model_parallel_size=plan.vpp, expert_model_parallel_size=plan.ep,
        expert_tensor_parallel_size=plan.etp_size, context_parallel_size=plan.cp,
        sequence_parallel=plan.sequence_parallel,
        num_layers_in_first_pipeline_stage=plan.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=plan.num_layers_in_last_pipeline_stage,
        pipeline_model_parallel_layout=plan.pipeline_layout,
        params_dtype=dtype, bf16=plan.precision == "bf16", fp16=plan.precision == "fp16",
    )
    if plan.pp > 1:
        fields["pipeline_dtype"] = dtype  # required by ModelParallelConfig with pp > 1
        # Megatron-LM always sets it (megatron/training/arguments.py, core_args_from_args): a stage's
        # output tensor is freed once sent, its .grad_fn kept for the backward
        fields["deallocate_pipeline_outputs"] = True
    if plan.recompute != "none":
        fields["recompute_granularity"] = plan.recompute
    if plan.recompute == "full":
        fields.update(recompute_method=plan.recompute_method, recompute_num_layers=plan.recompute_num_layers)
    return fields


def transformer_config(model: ModelSpec, plan: ParallelPlan, **overrides: Any) -> TransformerConfig:
    """Megatron's config for ``model`` under ``plan`` (``MLATransformerConfig`` when ``model.mla``).

    ``overrides`` are TransformerConfig fields that win over the mapping (e.g. ``params_dtype`` for
    fp32 CPU runs). Raises :class:`SpecError` first for plans Megatron would reject for this model
    (:func:`piper_core.specs.compat.check_plan`).

    ModelSpec fields that are not config fields: ``vocab_size``/``make_vocab_size_divisible_by``
    (the padded vocabulary), ``seq_length``, ``tie_embeddings`` and ``position_embedding`` are
    GPTModel arguments (see :func:`gpt_model`); ``moe_expert_load_skew`` is Piper's assumption about
    routing, with no Megatron counterpart. ModelSpec names no activation: gated models get SwiGLU,
    others Megatron's default GeLU (parameter counts do not depend on it).
    """
    check_plan(model, plan)
    fields = _model_fields(model) | _plan_fields(plan) | overrides
    cls = TransformerConfig if model.mla is None else MLATransformerConfig
    return cls(**fields)


class DuplicatedDownProjMLASelfAttention(MLASelfAttention):
    """MLA whose q/kv down-projections hold the whole weight on every tp rank.

    The TE spec builds them as ``TELinear(parallel_mode='duplicated')``; the local spec builds
    ``ColumnParallelLinear`` (split over tp), and ``MLASelfAttention`` accepts Megatron's unsplit
    ``Linear`` (post_training.modelopt.layers) only where its Transformer Engine import succeeded.
    So the split projections are built, then replaced by that ``Linear``, which MLA's forward
    already handles (the output has the full width, so no gather is done). At tp = 1 nothing changes.
    """

    def __init__(self, config: MLATransformerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if config.tensor_model_parallel_size == 1:
            return
        if config.q_lora_rank is not None:
            self.linear_q_down_proj = self._whole_linear(config.q_lora_rank)
        self.linear_kv_down_proj = self._whole_linear(config.kv_lora_rank + config.qk_pos_emb_head_dim)

    def _whole_linear(self, out_features: int) -> WholeLinear:
        device = self.linear_kv_up_proj.weight.device
        with torch.device(device):
            linear = WholeLinear(self.config.hidden_size, out_features, config=self.config,
                                 init_method=self.config.init_method, bias=False, tp_group=None)
        if self.config.perform_initialization and device.type != "meta":
            with torch.no_grad():
                self.config.init_method(linear.weight)  # torch.nn.Linear's own init otherwise
        return linear


class MLADotProductAttention(DotProductAttention):
    """Megatron's unfused attention, accepting MLA's key/value head widths.

    ``MLASelfAttention`` passes ``k_channels`` (qk_head_dim + qk_pos_emb_head_dim) and ``v_channels``
    (v_head_dim) to its core attention and always its own ``softmax_scale``. The unfused kernel is
    already width-agnostic (scores from q.k over k's width, context from v's width); only the
    output width, heads x ``v_channels``, has to be set from ``v_channels`` instead of kv_channels.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


class LocalNorm:
    """Megatron's local torch LayerNorm/RMSNorm, also under sequence parallelism.

    ``WrappedTorchNorm`` asserts ``not config.sequence_parallel`` (and the local spec uses it for
    RMSNorm even where Apex is installed), so tp > 1 with sequence parallelism, which Megatron
    requires for MoE, would not build. Under sequence parallelism each tp rank normalises other
    tokens (or, for q/k norms, other heads), so the weights' gradients must be summed over tp:
    Megatron's ``finalize_model_grads`` does that for parameters marked ``sequence_parallel``, the
    mark Apex's and TE's norms set.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization={config.normalization!r}: LocalNorm supports {sorted(norms)}")
        norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def _local_fix(node: Any) -> Any:
    """One spec node with the changes of this module's docstring (other nodes are returned as is)."""
    if node is WrappedTorchNorm:
        return LocalNorm
    if isinstance(node, ModuleSpec) and node.module is MLASelfAttention:
        sub = dataclasses.replace(node.submodules, core_attention=MLADotProductAttention)
        return dataclasses.replace(node, module=DuplicatedDownProjMLASelfAttention, submodules=sub)
    return node


def _local_fixes(node: Any) -> Any:
    """A layer or block spec with :func:`_local_fix` applied throughout, top-down. Specs are rebuilt
    (``dataclasses.replace``), never mutated: Megatron shares one spec object between layers."""
    node = _local_fix(node)
    if isinstance(node, list):
        return [_local_fixes(item) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: _local_fixes(getattr(node, f.name))
                                            for f in dataclasses.fields(node) if f.init})
    return node


def layer_spec(model: ModelSpec, *, moe: bool | None = None) -> ModuleSpec:
    """Local-module spec of one transformer layer: MoE (``SequentialMLP`` experts) or dense MLP.

    ``moe`` None means "MoE if the model has experts". A model with dense layers among MoE ones
    needs both kinds; :func:`block_spec` picks the kind per layer.
    """
    moe = model.is_moe if moe is None else moe
    spec = get_gpt_layer_local_spec(num_experts=model.num_experts if moe else None, moe_grouped_gemm=False,
                                    qk_layernorm=model.qk_layernorm, multi_latent_attention=model.mla is not None,
                                    normalization=model.normalization)
    return _local_fixes(spec)


def block_spec(model: ModelSpec, config: TransformerConfig, *, pp_rank: int | None = None,
               vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Specs of the layers one pipeline rank (one virtual chunk of it) builds, in Megatron's layout.

    Megatron's ``get_gpt_decoder_block_spec`` chooses dense/MoE per layer from
    ``config.moe_layer_freq`` and slices by ``get_transformer_layer_offset``; ``pp_rank`` None means
    this process's rank.
    """
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=model.normalization,
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    return _local_fixes(block)


def mtp_spec(model: ModelSpec, config: TransformerConfig, *, pp_rank: int,
             vp_stage: int | None = None) -> Any:
    """The MTP block one pipeline rank's chunk builds (None where it runs no MTP layer): Megatron's
    ``get_gpt_mtp_block_spec`` over the last decoder layer's spec, as Megatron-LM's
    ``gpt_builders.py`` passes it, with this module's local-spec fixes."""
    if not model.mtp_num_layers:
        return None
    spec = get_gpt_mtp_block_spec(config, layer_spec(model, moe=model.mtp_is_moe), use_transformer_engine=False,
                                  vp_stage=vp_stage, pp_rank=pp_rank)
    return None if spec is None else _local_fixes(spec)


def _stage_flags(plan: ParallelPlan, pp_rank: int, vp_stage: int | None) -> tuple[bool, bool]:
    """(pre_process, post_process): embedding on the first chunk of rank 0, head on the last chunk
    of the last rank (parallel_state.is_pipeline_first_stage / is_pipeline_last_stage)."""
    if plan.vpp is not None and vp_stage is None:
        raise SpecError("vp_stage", None, f"is required with vpp={plan.vpp}", f"pass vp_stage in 0..{plan.vpp - 1}")
    first_chunk = vp_stage in (None, 0)
    last_chunk = vp_stage is None or vp_stage == plan.virtual_stages - 1
    return pp_rank == 0 and first_chunk, pp_rank == plan.pp - 1 and last_chunk


def gpt_model(model: ModelSpec, plan: ParallelPlan, *, device: Device = "cuda", pp_rank: int | None = None,
              vp_stage: int | None = None, **overrides: Any) -> GPTModel:
    """The GPTModel chunk that pipeline rank ``pp_rank`` (default: this process's) builds.

    ``vp_stage`` selects the virtual chunk (required when ``plan.vpp`` is set). ``overrides`` go to
    :func:`transformer_config`. On ``device="meta"`` the model has shapes but no storage and the
    first/last-stage copy of tied embeddings is skipped (meta tensors hold no values to copy).
    """
    config = transformer_config(model, plan, **(_DEVICE_CONFIG[device] | overrides))
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pre_process, post_process = _stage_flags(plan, pp_rank, vp_stage)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if device == "meta":
        pg_collection.embd = None  # LanguageModule skips the embedding all-reduce without a group
    with torch.device(device):
        return GPTModel(
            config=config, transformer_layer_spec=block_spec(model, config, pp_rank=pp_rank, vp_stage=vp_stage),
            vocab_size=model.padded_vocab(plan.tp), max_sequence_length=model.seq_length,
            pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type=model.position_embedding, pg_collection=pg_collection, vp_stage=vp_stage,
            mtp_block_spec=mtp_spec(model, config, pp_rank=pp_rank, vp_stage=vp_stage),
        )


def gpt_model_chunks(model: ModelSpec, plan: ParallelPlan, *, device: Device = "cuda", pp_rank: int | None = None,
                     **overrides: Any) -> list[GPTModel]:
    """All model chunks of one pipeline rank: one per virtual stage (one without vpp)."""
    stages: list[int | None] = list(range(plan.vpp)) if plan.vpp else [None]
    return [gpt_model(model, plan, device=device, pp_rank=pp_rank, vp_stage=v, **overrides) for v in stages]
