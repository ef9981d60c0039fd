"""Skewed routing and expert placement in the CPU trainer (issue 17, the measured deliverable).

Two real gloo ranks train one small dropless top-1 MoE model (fp32, ep 2, 8 experts) with a fixed
bias on the router logits of logical experts 0 and 1 (both on rank 0 under Megatron's placement):
with Piper's dispatcher and the default placement, with Piper's dispatcher and a placement that
moves every expert off its slot (half of them off their rank), and with Megatron's own dispatcher.
The placed job builds the default model and loads each slot with its logical expert's weights
(``piper_megatron.experts.move_experts``), so the three train the same logical model: their losses
must agree within 1e-6 relative (measured: bit-identical, 2026-12-07), each physical slot must
receive the tokens the default run's slot of its logical expert received (so the placement ran),
and the bias must load rank 0 well above the mean. Bad jobs are refused before any process starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from piper_core.errors import SpecError
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

MODEL = ModelSpec(name="skew-test", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                  num_experts=8, moe_ffn_hidden_size=128, moe_router_topk=1, moe_capacity_factor=None,
                  vocab_size=256, seq_length=64, normalization="LayerNorm", gated_linear_unit=False)
PLAN = ParallelPlan(gpus=2, ep=2, micro_batch_size=2, global_batch_size=8, distributed_optimizer=False,
                    attention_backend="unfused", precision="fp32")
BIAS = {0: 0.3, 1: 0.3}
RANKS = ((5, 2, 7, 0), (3, 6, 1, 4))  # every expert off its slot; 0 and 1 (the hot ones) on different ranks
TOL = 1e-6


def _placement():
    from piper_core.runtime.placement import ExpertPlacement

    return ExpertPlacement(num_experts=8, ep=2, ranks=RANKS)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return {name: tmp_path_factory.mktemp(f"trace-{name}") for name in ("default", "placed")}


@pytest.fixture(scope="module")
def runs(traces):
    from piper_megatron.train import TrainJob, run

    jobs = {"default": TrainJob(model=MODEL, plan=PLAN, steps=3, warmup=1, router_bias=BIAS,
                                trace_dir=str(traces["default"])),
            "placed": TrainJob(model=MODEL, plan=PLAN, steps=3, warmup=1, router_bias=BIAS, placement=_placement(),
                               trace_dir=str(traces["placed"])),
            "stock": TrainJob(model=MODEL, plan=PLAN, steps=3, warmup=1, router_bias=BIAS, stock=True)}
    return {name: run(job, timeout_s=300) for name, job in jobs.items()}


def _slots(reports, layer: str) -> list[int]:
    """Tokens per physical slot over the expert-parallel group (rank order), timed steps."""
    return [t for r in reports for t in r["expert_tokens"][layer]["tokens"]]


def test_ranks_import_this_checkout(runs):
    here = Path(__file__).resolve().parents[2]
    for reports in runs.values():
        assert all(r["piper_core"].startswith(str(here)) for r in reports), reports[0]["piper_core"]


def test_every_placement_trains_the_same_model(runs):
    want = runs["default"][0]["losses"]
    assert len(want) == 3
    for name in ("placed", "stock"):
        got = runs[name][0]["losses"]
        assert len(got) == len(want), name
        for step, (a, b) in enumerate(zip(want, got)):
            assert abs(a - b) <= TOL * abs(a), f"{name} step {step}: loss {b!r} against the default's {a!r}"


def test_each_slot_gets_its_logical_experts_tokens(runs):
    placement = _placement()
    layers = sorted(runs["default"][0]["expert_tokens"])
    assert layers == ["1", "2"]
    for layer in layers:
        default, placed = _slots(runs["default"], layer), _slots(runs["placed"], layer)
        assert placed == [default[e] for e in placement.logical_at], layer
        assert placed != default, f"layer {layer}: the placement moved no tokens"


def test_the_bias_loads_the_default_busiest_rank(runs):
    for layer in ("1", "2"):
        tokens = _slots(runs["default"], layer)
        ranks = [sum(tokens[:4]), sum(tokens[4:])]
        assert ranks[0] / (sum(ranks) / 2) >= 1.5, f"layer {layer}: rank loads {ranks}"
        placed = _slots(runs["placed"], layer)
        assert max(sum(placed[:4]), sum(placed[4:])) < ranks[0], f"layer {layer}: the placement did not spread it"


def test_a_placed_runs_trace_reads_back_as_logical_experts(runs, traces):
    """--piper-trace under a placement records each slot's logical expert, so the histogram read
    from it (piper --routing) is the default run's, expert for expert, not the physical slots'."""
    from piper_core.specs.routing import load_routing

    read = {name: load_routing(sorted(str(p) for p in traces[name].glob("trace.rank*.jsonl")), MODEL)
            for name in traces}
    assert read["placed"].layers == read["default"].layers
    hot = read["default"].layers[0][1]
    assert hot[0] + hot[1] > 2 * sum(hot) / 4  # the biased experts 0 and 1 carry the skew, by logical id


def test_bad_jobs_are_refused():
    from piper_megatron.train import TrainJob

    with pytest.raises(SpecError, match=r"router_bias\[8\].*0 \.\. 7"):
        TrainJob(model=MODEL, plan=PLAN, router_bias={8: 1.0})
    with pytest.raises(SpecError, match=r"router_bias\[0\].*finite"):
        TrainJob(model=MODEL, plan=PLAN, router_bias={0: float("nan")})
    with pytest.raises(SpecError, match="placement.*Piper's dispatcher only"):
        TrainJob(model=MODEL, plan=PLAN, placement=_placement(), stock=True)
    from piper_core.runtime.placement import ExpertPlacement

    with pytest.raises(SpecError, match="is for ep=4, the job runs ep=2"):
        TrainJob(model=MODEL, plan=PLAN, placement=ExpertPlacement.default(8, 4))


def test_a_job_round_trips_through_json():
    from piper_megatron.train import TrainJob

    job = TrainJob(model=MODEL, plan=PLAN, router_bias=BIAS, placement=_placement(), trace_dir="/tmp/x")
    again = TrainJob.from_json(job.to_json())
    assert again == job and again.router_bias == ((0, 0.3), (1, 0.3))
