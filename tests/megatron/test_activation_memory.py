"""Activation memory of one transformer layer: Piper's formula against what Megatron-Core keeps.

Acceptance: the activation memory of one transformer layer (dense and MoE, top-1 and top-2,
dropless and capacity factor 1.0, recompute none / selective / full) is within 5 % of the bytes
Megatron-Core actually keeps for backward, measured on CPU with autograd saved-tensor hooks counting
unique storages (:mod:`piper_megatron.measure`). Further cases: GQA, MLA, dropout, q/k norm,
shared experts, the aux loss, unfused SwiGLU, a non-gated (GeLU) MLP.

All layers are built and run in one spawned gloo process (Megatron's process groups are global
state); each test then compares one case. The formula is given the CPU run's kernel differences
(:data:`piper_megatron.measure.CPU_KERNELS`: unfused RoPE, dropout masks and LayerNorm statistics
in bf16); everything else is the GPU formula unchanged.

Flash attention is not measurable here (no GPU). Its formula is derived from the code that keeps
the tensors: Transformer Engine's ``FlashAttention`` passes q, k, v (views, so the linear_qkv buffer
stays alive through v) to ``flash_attn_func``, which saves q, k, v, its output ``[b, s, a, d]`` and
the fp32 log-sum-exp ``[b, a, s]``; TE then returns ``output.transpose(0, 1).contiguous()``, a
second ``[s, b, a d]`` copy that linear_proj saves. Every other term is shared with the unfused path
measured here, so only those three flash terms are unverified.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from piper_core.errors import SpecError
from piper_core.resource.activations import Kernels, layer_activation_terms
from piper_core.specs.model import MLASpec, ModelSpec
from piper_core.specs.parallel import ParallelPlan
from tests.gloo import run_ranks

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
from piper_megatron.measure import CPU_KERNELS, measure_layer_activations  # noqa: E402

pytestmark = pytest.mark.megatron

TOLERANCE = 0.05  # acceptance bound on |predicted - measured| / measured

BASE = ModelSpec(name="act-test", num_layers=1, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512,
                 num_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2, vocab_size=1024, seq_length=128,
                 normalization="LayerNorm")
MLA = MLASpec(q_lora_rank=96, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32)


@dataclasses.dataclass(frozen=True)
class Case:
    model: ModelSpec
    moe: bool
    recompute: str = "none"
    overrides: tuple[tuple[str, Any], ...] = ()  # TransformerConfig fields for the measured layer
    kernels: Kernels = CPU_KERNELS

    @property
    def plan(self) -> ParallelPlan:
        return ParallelPlan(gpus=1, micro_batch_size=2, global_batch_size=2, recompute=self.recompute,
                            recompute_num_layers=1 if self.recompute == "full" else None,
                            attention_backend="unfused")


def _acceptance_cases() -> dict[str, Case]:
    cases = {}
    for recompute in ("none", "selective", "full"):
        cases[f"dense-{recompute}"] = Case(BASE, moe=False, recompute=recompute)
        for topk in (1, 2):
            for cf in (None, 1.0):
                model = dataclasses.replace(BASE, moe_router_topk=topk, moe_capacity_factor=cf)
                cases[f"moe-top{topk}-{'dropless' if cf is None else 'cf1.0'}-{recompute}"] = Case(
                    model, moe=True, recompute=recompute)
    return cases


def _extra_cases() -> dict[str, Case]:
    mla = dataclasses.replace(BASE, mla=MLA, qk_layernorm=True)
    return {
        "gqa-none": Case(dataclasses.replace(BASE, num_query_groups=2), moe=False),
        "gqa-selective": Case(dataclasses.replace(BASE, num_query_groups=2), moe=False, recompute="selective"),
        "gqa-qk-norm": Case(dataclasses.replace(BASE, num_query_groups=2, qk_layernorm=True), moe=False),
        "no-rope": Case(dataclasses.replace(BASE, position_embedding="none"), moe=False),
        "dropout": Case(dataclasses.replace(BASE, attention_dropout=0.1, hidden_dropout=0.1), moe=False),
        "dropout-moe": Case(dataclasses.replace(BASE, hidden_dropout=0.1), moe=True),
        "mla-none": Case(mla, moe=False),
        "mla-selective": Case(mla, moe=False, recompute="selective"),
        "mla-no-q-lora-moe": Case(dataclasses.replace(BASE, mla=dataclasses.replace(MLA, q_lora_rank=None)),
                                  moe=True),
        "shared-experts": Case(dataclasses.replace(BASE, moe_shared_expert_intermediate_size=256), moe=True),
        "aux-loss": Case(BASE, moe=True, overrides=(("moe_aux_loss_coeff", 1e-2),),
                         kernels=dataclasses.replace(CPU_KERNELS, router_aux_loss=True)),
        "unfused-swiglu-moe": Case(BASE, moe=True, overrides=(("bias_activation_fusion", False),),
                                   kernels=dataclasses.replace(CPU_KERNELS, bias_activation_fusion=False)),
        "gelu-dense": Case(dataclasses.replace(BASE, gated_linear_unit=False, num_experts=0,
                                               moe_ffn_hidden_size=None, ffn_hidden_size=1024), moe=False),
    }


ACCEPTANCE = _acceptance_cases()
EXTRA = _extra_cases()
CASES = ACCEPTANCE | EXTRA


def _measure_on_rank(rank: int, world: int, cases: dict[str, Case]) -> dict[str, Any]:
    """Measure every case in this (single) process: name -> (bytes, readable table) or the error."""
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    from megatron.core import parallel_state, tensor_parallel

    from piper_megatron.cpu import install_cpu_shims

    install_cpu_shims()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    out: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            m = measure_layer_activations(case.model, case.plan, moe=case.moe, **dict(case.overrides))
            out[name] = {"bytes": m.activation_bytes, "table": m.table()}
        except Exception as exc:  # reported by the case's test; the other cases still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    return run_ranks(1, _measure_on_rank, CASES, timeout_s=240)[0]


def _predicted(case: Case) -> dict[str, int]:
    return layer_activation_terms(case.model, case.plan, moe=case.moe, kernels=case.kernels)


def _compare(measured: dict[str, Any], name: str) -> None:
    got = measured[name]
    assert "error" not in got, got.get("error")
    terms = _predicted(CASES[name])
    predicted = sum(terms.values())
    error = (predicted - got["bytes"]) / got["bytes"]
    assert abs(error) <= TOLERANCE, (
        f"{name}: predicted {predicted} B, Megatron keeps {got['bytes']} B ({error:+.1%})\n"
        f"terms: {terms}\nkept:\n{got['table']}")


@pytest.mark.parametrize("name", list(ACCEPTANCE))
def test_layer_activations_match_megatron(measured, name):
    _compare(measured, name)


@pytest.mark.parametrize("name", list(EXTRA))
def test_layer_variants_match_megatron(measured, name):
    _compare(measured, name)


def test_selective_recompute_drops_exactly_the_attention_probabilities(measured):
    """Structure, from the measurements alone: 'core_attn' recompute frees the [b, a, s, s] bf16
    softmax output and nothing else (q, k, v are kept by the checkpoint instead of the bmm)."""
    plan = CASES["dense-none"].plan
    scores = plan.micro_batch_size * BASE.num_attention_heads * BASE.seq_length ** 2 * 2
    freed = measured["dense-none"]["bytes"] - measured["dense-selective"]["bytes"]
    assert abs(freed - scores) <= 16  # the checkpoint keeps a 4-byte attn_mask_type tensor


def test_full_recompute_keeps_only_the_layer_input(measured):
    layer_input = BASE.seq_length * 2 * BASE.hidden_size * 2
    for name in ACCEPTANCE:
        if name.endswith("-full"):
            assert measured[name]["bytes"] == layer_input, name


def test_measurement_refuses_what_cpu_cannot_represent():
    plan = CASES["dense-none"].plan
    with pytest.raises(SpecError, match="RMSNorm keeps three fp32 copies"):
        measure_layer_activations(dataclasses.replace(BASE, normalization="RMSNorm"), plan, moe=False)
    with pytest.raises(SpecError, match="flash attention needs a GPU"):
        measure_layer_activations(BASE, dataclasses.replace(plan, attention_backend="flash"), moe=False)
