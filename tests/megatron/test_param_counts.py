"""Piper's per-GPU parameter counts equal, to the parameter, those of the GPTModel Megatron builds.

Reference test for :func:`piper_core.resource.params.stage_params`: for every model preset (and a
few variants covering ModelSpec fields the presets leave at their defaults), at several
(tp, pp, ep, etp[, vpp]) settings, real Megatron-Core builds the model in 2 or 4 gloo processes
(``parallel_state.initialize_model_parallel``) through :mod:`piper_megatron.build`, and each rank
counts the parameters of all its model chunks: expert parameters (those of every ``MoELayer``'s
``experts``) and dense ones (everything else, shared experts and routers included). Both must equal
``stage_params(model, plan)[pp_rank]`` exactly, on every rank. The test also checks that Megatron
marks exactly those expert parameters ``allreduce=False`` (its DDP's expert test) when ep > 1.

How it stays cheap (~35 s on 2 cores):
- models are built on the meta device (shapes, no storage), so full widths cost nothing;
- depth is cut to 4 layers (``dataclasses.replace(num_layers=4)``; the other fields are kept):
  enough for pp=2 with vpp=2, and for DeepSeek-V3 (``moe_first_k_dense=3``) still a pipeline stage
  of only dense layers next to one holding dense and MoE layers; the cut does not touch how a layer
  is counted, and one setting, (tp, pp, ep, etp) = (1, 1, 4, 1), builds every preset at full depth;
- one spawn per world size runs all its settings and models (start-up is most of the cost).
Settings a model cannot take (``check_plan``) are skipped when the cases are listed; every
preset still meets every world size. MLA is compared at tp > 1 too: :mod:`piper_megatron.build`
keeps MLA's down-projections whole on every tp rank, as the Transformer Engine spec does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from piper_core.errors import SpecError
from piper_core.presets import load_model, model_names
from piper_core.resource.params import stage_params
from piper_core.specs.compat import check_plan
from piper_core.specs.model import MLASpec, ModelSpec
from piper_core.specs.parallel import ParallelPlan
from tests.gloo import run_ranks

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

REDUCED_LAYERS = 4
FULL_DEPTH = "full"


@dataclasses.dataclass(frozen=True)
class Setting:
    tp: int
    pp: int
    ep: int
    etp: int
    vpp: int | None = None
    first_stage_layers: int | None = None
    depth: str = "reduced"
    layout: str | None = None

    def plan(self, world: int) -> ParallelPlan:
        return ParallelPlan(gpus=world, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, vpp=self.vpp,
                            sequence_parallel=self.tp > 1, global_batch_size=world,
                            num_layers_in_first_pipeline_stage=self.first_stage_layers, pipeline_layout=self.layout)

    @property
    def label(self) -> str:
        extra = (f"-vpp{self.vpp}" if self.vpp else "") + (
            f"-first{self.first_stage_layers}" if self.first_stage_layers else "") + (
            f"-layout{self.layout}" if self.layout else "")
        return f"tp{self.tp}pp{self.pp}ep{self.ep}etp{self.etp}{extra}-{self.depth}"


SETTINGS: dict[int, tuple[Setting, ...]] = {
    2: (Setting(1, 1, 1, 1), Setting(2, 1, 2, 1), Setting(2, 1, 1, 1), Setting(1, 1, 2, 1),
        Setting(1, 2, 1, 1), Setting(1, 2, 1, 1, first_stage_layers=1)),
    4: (Setting(1, 2, 2, 1), Setting(2, 2, 1, 2), Setting(1, 1, 4, 1), Setting(2, 1, 2, 2),
        Setting(4, 1, 4, 1), Setting(1, 2, 2, 1, vpp=2), Setting(2, 2, 2, 1, vpp=2),
        Setting(1, 1, 4, 1, depth=FULL_DEPTH),
        # a layout with one MTP layer (m) in the last stage, for the models with one
        Setting(1, 2, 2, 1, vpp=2, layout="Et|t|t|tmL"), Setting(2, 2, 1, 2, vpp=2, layout="Ett||t|tmL")),
}


def _variants() -> dict[str, ModelSpec]:
    """tiny-moe changed to reach the ModelSpec fields and layer kinds the presets do not."""
    tiny = load_model("tiny-moe")
    return {
        "tiny-moe-tied": dataclasses.replace(tiny, name="tiny-moe-tied", tie_embeddings=True),
        "tiny-moe-gqa": dataclasses.replace(tiny, name="tiny-moe-gqa", num_query_groups=2, kv_channels=32,
                                            add_qkv_bias=True, qk_layernorm=True, tie_embeddings=True),
        "tiny-moe-classic": dataclasses.replace(
            tiny, name="tiny-moe-classic", normalization="LayerNorm", add_bias_linear=True,
            gated_linear_unit=False, position_embedding="learned_absolute", moe_layer_freq=2,
            moe_capacity_factor=1.25),  # no shared expert: Megatron refuses bias in shared experts
        "tiny-mla": dataclasses.replace(
            tiny, name="tiny-mla", qk_layernorm=True, moe_first_k_dense=1, moe_shared_expert_intermediate_size=32,
            mla=MLASpec(q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)),
        "tiny-dense": dataclasses.replace(tiny, name="tiny-dense", num_experts=0, moe_ffn_hidden_size=None,
                                          moe_router_topk=1),
        # multi-token prediction: two MoE MTP layers; one dense MTP layer (the last decoder layer is
        # dense) with tied embeddings, whose last stage then holds the embedding and the output layer
        "tiny-moe-mtp": dataclasses.replace(tiny, name="tiny-moe-mtp", mtp_num_layers=2),
        "tiny-mtp-tied": dataclasses.replace(tiny, name="tiny-mtp-tied", mtp_num_layers=1, moe_layer_freq=2,
                                             tie_embeddings=True),
    }


def _models(depth: str) -> dict[str, ModelSpec]:
    models = {name: load_model(name) for name in model_names()} | _variants()
    if depth == FULL_DEPTH:
        return models
    return {name: dataclasses.replace(m, num_layers=min(m.num_layers, REDUCED_LAYERS)) for name, m in models.items()}


def _cases(world: int) -> list[tuple[str, Setting, ModelSpec, ParallelPlan]]:
    """(case id, setting, model, plan) for every valid pairing at this world size, in build order."""
    cases = []
    for setting in SETTINGS[world]:
        plan = setting.plan(world)
        for name, model in _models(setting.depth).items():
            try:
                check_plan(model, plan)
            except SpecError:
                continue
            cases.append((f"{name}-{setting.label}", setting, model, plan))
    return cases


def _count(chunks: list[Any], expert_parallel: bool) -> dict[str, Any]:
    """Dense and expert parameter counts of one rank's chunks, and whether Megatron's
    ``allreduce=False`` marks (set only with ep > 1) fall on exactly the expert parameters."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    params = {id(p): p for chunk in chunks for p in chunk.parameters()}
    experts = {id(p) for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)
               for p in m.experts.parameters()}
    marked = {key for key, p in params.items() if not getattr(p, "allreduce", True)}
    return {"dense": sum(p.numel() for key, p in params.items() if key not in experts),
            "expert": sum(params[key].numel() for key in experts),
            "marks_match": marked == (experts if expert_parallel else set())}


def _count_on_rank(rank: int, world: int) -> dict[str, Any]:
    """Build every case of this world size on this rank; per case its pp rank and counts, or the error."""
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    from megatron.core import parallel_state

    from piper_megatron.build import gpt_model_chunks
    from piper_megatron.cpu import install_cpu_shims

    install_cpu_shims()
    out: dict[str, Any] = {}
    cases = _cases(world)
    for setting in SETTINGS[world]:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=setting.tp, pipeline_model_parallel_size=setting.pp,
            virtual_pipeline_model_parallel_size=setting.vpp, expert_model_parallel_size=setting.ep,
            expert_tensor_parallel_size=setting.etp)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        for case_id, _, model, plan in (c for c in cases if c[1] == setting):
            try:
                chunks = gpt_model_chunks(model, plan, device="meta")
                out[case_id] = {"pp_rank": pp_rank, **_count(chunks, setting.ep > 1)}
            except Exception as exc:  # reported per case by the test, other cases still run
                out[case_id] = {"error": f"{type(exc).__name__}: {exc}"}
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def megatron_counts():
    """world size -> per-rank results of :func:`_count_on_rank` (one spawn per world size)."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            cache[world] = run_ranks(world, _count_on_rank, timeout_s=240)
        return cache[world]

    return get


# (world, case id) -> (model, plan), listed once at import (loading the presets is not free).
CASES = {(world, case_id): (model, plan) for world in SETTINGS for case_id, _, model, plan in _cases(world)}


def test_every_preset_meets_every_world_size():
    covered = {(world, model.name) for (world, _), (model, _) in CASES.items()}
    assert {(world, name) for world in SETTINGS for name in model_names()} <= covered


@pytest.mark.parametrize(("world", "case_id"), CASES, ids=[f"w{w}-{c}" for w, c in CASES])
def test_stage_params_match_megatron(megatron_counts, world: int, case_id: str):
    model, plan = CASES[world, case_id]
    expected = stage_params(model, plan)
    for rank, results in enumerate(megatron_counts(world)):
        got = results[case_id]
        assert "error" not in got, f"rank {rank}: Megatron build failed: {got.get('error')}"
        want = expected[got["pp_rank"]]
        assert (got["dense"], got["expert"]) == (want.dense, want.expert), (
            f"rank {rank} (pp rank {got['pp_rank']}): Megatron dense/expert {got['dense']}/{got['expert']}, "
            f"Piper {want.dense}/{want.expert}")
        assert got["marks_match"], f"rank {rank}: allreduce=False marks differ from the MoE experts' parameters"
