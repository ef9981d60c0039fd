"""ModelSpec: a decoder-only MoE transformer exactly as Megatron-Core's GPTModel builds it.

Field names follow Megatron-Core's ``TransformerConfig`` / ``megatron.training`` arguments so a
Megatron user can read a spec without a glossary. Sizes are element counts, not bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

from piper_core.errors import SpecError
from piper_core.specs._check import freeze_hash, literals, non_negative, positive


@dataclass(frozen=True, kw_only=True, slots=True)
class MLASpec:
    """Multi-latent attention dims (DeepSeek-V2/V3; Megatron ``MLATransformerConfig``).

    ``q_lora_rank`` None means queries are projected directly (no down/up pair).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        positive("mla.q_lora_rank", self.q_lora_rank, allow_none=True)
        for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            positive(f"mla.{key}", getattr(self, key))


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only (MoE) transformer; ``num_experts == 0`` means a dense model.

    Which layers are MoE follows Megatron: layer ``i`` (0-based) is MoE when ``i >= moe_first_k_dense``
    and ``i % moe_layer_freq == 0`` (``moe_layer_freq`` in ``TransformerConfig``).
    Dropout defaults to 0 (as the presets' models train); Megatron's own default is 0.1.
    ``moe_capacity_factor`` None means dropless; then ``moe_expert_load_skew`` (max/mean tokens per
    expert, >= 1) sizes the worst expert's buffers.
    ``moe_router_num_groups`` / ``moe_router_group_topk``: group-limited routing (Megatron's
    ``--moe-router-num-groups`` / ``--moe-router-group-topk``, TransformerConfig): experts fall into
    equal groups and each token picks its experts from ``group_topk`` of them; with one group per node
    of the expert-parallel group this is DeepSeek-V3's node-limited routing (at most 4 nodes a token).
    ``mtp_num_layers``: multi-token-prediction layers after the decoder (Megatron's
    ``--mtp-num-layers``; 0 for none). Each is built from the last decoder layer's spec (MoE when
    that layer is, ``gpt_builders.py``) with two input norms, a ``2h -> h`` projection and a final norm
    (``MultiTokenPredictionLayer``), and runs the output layer and a loss of its own.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    ffn_hidden_size: int
    num_experts: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 1
    moe_shared_expert_intermediate_size: int = 0
    moe_layer_freq: int = 1
    moe_first_k_dense: int = 0
    moe_capacity_factor: float | None = None
    moe_expert_load_skew: float = 1.0
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    mtp_num_layers: int = 0
    vocab_size: int
    make_vocab_size_divisible_by: int = 128
    seq_length: int
    gated_linear_unit: bool = True
    tie_embeddings: bool = False
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    position_embedding: Literal["rope", "learned_absolute", "none"] = "rope"
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    mla: MLASpec | None = None

    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:  # specs key many caches; hash the fields once
        return self._hash

    def __post_init__(self) -> None:
        freeze_hash(self)
        literals(self)
        for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "vocab_size", "seq_length", "make_vocab_size_divisible_by", "moe_layer_freq",
                    "moe_router_topk"):
            positive(key, getattr(self, key))
        positive("num_query_groups", self.num_query_groups, allow_none=True)
        positive("kv_channels", self.kv_channels, allow_none=True)
        for key in ("num_experts", "moe_shared_expert_intermediate_size", "moe_first_k_dense", "mtp_num_layers"):
            non_negative(key, getattr(self, key))
        if self.kv_channels is None and self.mla is None and self.hidden_size % self.num_attention_heads:
            raise SpecError("kv_channels", None, f"hidden_size ({self.hidden_size}) is not divisible by "
                            f"num_attention_heads ({self.num_attention_heads}), so kv_channels cannot default",
                            "set kv_channels explicitly")
        if self.num_attention_heads % self.query_groups:
            raise SpecError("num_query_groups", self.num_query_groups,
                            f"must divide num_attention_heads ({self.num_attention_heads})",
                            "choose a divisor of num_attention_heads")
        for key in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise SpecError(key, getattr(self, key), "must be in [0, 1)", "use 0.0 for no dropout")
        if self.mla is not None and self.position_embedding != "rope":
            raise SpecError("position_embedding", self.position_embedding, "multi-latent attention applies RoPE to "
                            "its qk_pos_emb part (Megatron MLASelfAttention)", "set position_embedding: rope")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts == 0:
            if self.moe_shared_expert_intermediate_size or self.moe_capacity_factor is not None:
                raise SpecError("num_experts", 0, "shared experts / capacity factor need routed experts",
                                "set num_experts > 0 or remove the MoE keys")
            return
        positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        if self.moe_router_topk > self.num_experts:
            raise SpecError("moe_router_topk", self.moe_router_topk,
                            f"must be <= num_experts ({self.num_experts})", "lower moe_router_topk")
        positive("moe_capacity_factor", self.moe_capacity_factor, allow_none=True)
        if self.moe_expert_load_skew < 1.0:
            raise SpecError("moe_expert_load_skew", self.moe_expert_load_skew,
                            "is max/mean tokens per expert and must be >= 1", "use 1.0 for perfect balance")
        self._check_router_groups()
        if self.moe_shared_expert_intermediate_size and self.add_bias_linear:
            raise SpecError("add_bias_linear", True, "Megatron's SharedExpertMLP does not support biases",
                            "set add_bias_linear: false or remove the shared expert")
        if self.moe_first_k_dense >= self.num_layers:
            raise SpecError("moe_first_k_dense", self.moe_first_k_dense,
                            f"must be < num_layers ({self.num_layers}) for a MoE model",
                            "lower it, or set num_experts: 0 for a dense model")

    def _check_router_groups(self) -> None:
        """TransformerConfig.__post_init__'s rules for group-limited routing."""
        groups, picked = self.moe_router_num_groups, self.moe_router_group_topk
        positive("moe_router_num_groups", groups, allow_none=True)
        positive("moe_router_group_topk", picked, allow_none=True)
        if (groups is None) != (picked is None):
            raise SpecError("moe_router_group_topk" if picked is None else "moe_router_num_groups", None,
                            "group-limited routing needs both moe_router_num_groups and moe_router_group_topk",
                            "set both (e.g. 8 and 4, DeepSeek-V3) or neither")
        if groups is None:
            return
        if self.num_experts % groups:
            raise SpecError("moe_router_num_groups", groups, f"must divide num_experts ({self.num_experts})",
                            "choose a divisor of num_experts, e.g. the nodes of the expert-parallel group")
        if picked > groups:
            raise SpecError("moe_router_group_topk", picked, f"must be <= moe_router_num_groups ({groups})",
                            "lower moe_router_group_topk")
        if self.moe_router_topk % picked or self.moe_router_topk > picked * (self.num_experts // groups):
            raise SpecError("moe_router_group_topk", picked,
                            f"must divide moe_router_topk ({self.moe_router_topk}), whose experts the selected "
                            "groups must hold (Megatron group_limited_topk scores each group by its top "
                            "topk/group_topk experts)", "choose a divisor of moe_router_topk")

    # ---- derived quantities -------------------------------------------------------------
    @property
    def query_groups(self) -> int:
        """Key/value heads (GQA); equals the head count for plain multi-head attention."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Per-head q/k/v width for non-MLA attention (``kv_channels``)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Per layer (0-based): True where the FFN is a MoE layer."""
        return _moe_pattern(self.num_layers, self.num_experts, self.moe_first_k_dense, self.moe_layer_freq)

    @property
    def num_moe_layers(self) -> int:
        """MoE layers of the decoder (MTP layers not counted: :attr:`mtp_is_moe`)."""
        return sum(self.moe_layer_pattern)

    @property
    def mtp_is_moe(self) -> bool:
        """Whether the MTP layers' transformer layer is a MoE layer: Megatron builds it from the last
        decoder layer's spec (``gpt_builders.py``: ``decoder_layer_specs[-1]``)."""
        return self.moe_layer_pattern[-1]

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``.

        Source: megatron.training.tokenizer ``_vocab_size_with_padding``.
        """
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple


@functools.cache
def _moe_pattern(layers: int, experts: int, first_k_dense: int, freq: int) -> tuple[bool, ...]:
    if experts == 0:
        return (False,) * layers
    return tuple(i >= first_k_dense and i % freq == 0 for i in range(layers))
