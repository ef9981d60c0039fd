"""Any expert placement runs on Megatron-Core: Piper's dispatcher maps each logical expert (the
router's column) to its physical slot (issue 17, deliverable 2).

On 2 and 4 gloo processes (ep 2 and ep 4; tests/megatron/placement_ranks.py, one spawn each): a real
``MoELayer`` (``SequentialMLP``, fp32, 8 experts) with Megatron's dispatcher and the default placement
is the reference; the same layer with Piper's dispatcher and a placement that moves every expert
off its slot (half of them off their rank at ep 2, all at ep 4), each slot loaded with its logical
expert's weights, must give the same output, input gradient, router gradient and per-logical-expert
weight gradients within 1e-6 (absolute, or relative to the largest reference value where that
exceeds 1), top-1 and top-2, dropless, with token dropping and padded to capacity, flat and
hierarchical, unpipelined, in 2 chunks and with deferred weight gradients. Each slot must receive
the tokens the router sent its logical expert. The control (placement applied, weights left in the
default slots) must differ, so a broken mapping cannot pass. A placement for another ep or expert
count is refused when the layer is built; ``--piper-placement`` files are checked when planning.
"""

from __future__ import annotations

import json

import pytest

from piper_core.errors import SpecError

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

TOL = 1e-6
_RUNS: dict[int, list[dict]] = {}


def _ranks(world: int) -> list[dict]:
    from tests.gloo import run_ranks
    from tests.megatron.placement_ranks import run_rank

    if world not in _RUNS:
        _RUNS[world] = run_ranks(world, run_rank, timeout_s=300)
    return _RUNS[world]


@pytest.mark.parametrize("world", (2, 4))
def test_a_placement_gives_the_default_placements_outputs_and_gradients(world):
    from tests.megatron.placement_ranks import CASES

    for rank, results in enumerate(_ranks(world)):
        assert results["piper_core"].startswith(str(__import__("pathlib").Path(__file__).resolve().parents[2]))
        assert sorted(results["cases"]) == sorted(c.id for c in CASES)
        for case, got in results["cases"].items():
            where = f"rank {rank} ep={world} {case}"
            assert got["dispatcher"] == "PiperTokenDispatcher", where
            assert got["tokens"] == got["want_tokens"], f"{where}: slots got {got['tokens']} tokens"
            for what in ("output", "input_grad", "router_grad", "expert_grads"):
                assert got[what] <= TOL, f"{where}: {what} differs from the default placement by {got[what]:.3g}"
            assert got["output_scale"] > 0.01, f"{where}: outputs of {got['output_scale']:.3g} make 1e-6 a loose bound"
            assert got["control_output"] > 0.01 * got["output_scale"], \
                f"{where}: the placement without its weights gave the default's output ({got['control_output']:.3g})"


@pytest.mark.parametrize("world", (2, 4))
def test_a_placement_for_another_job_is_refused_when_the_layer_is_built(world):
    for results in _ranks(world):
        refused = results["refused"]
        assert f"is for ep={2 * world}, the job runs ep={world}" in refused["ep"], refused
        assert "places 16 experts, the model has 8" in refused["experts"], refused


@pytest.mark.parametrize("world", (2, 4))
def test_a_placement_per_layer_routes_each_layer_by_its_own(world):
    for rank, results in enumerate(_ranks(world)):
        got = results["per_layer"]
        want = {str(n): [list(r) for r in ranks] if ranks is not None else None for n, ranks in got["want"].items()}
        routed = {str(n): [list(r) for r in ranks] if ranks is not None else None for n, ranks in got["routed"].items()}
        assert routed == want, f"rank {rank}: {got['routed']}"
        assert got["output"] <= TOL and got["input_grad"] <= TOL, f"rank {rank} layer 2: {got}"
        assert got["unlisted_output"] <= TOL, f"rank {rank} layer 3 (not in the file): {got}"
        assert got["control_output"] > 0.01 * got["output_scale"], f"rank {rank}: layer 1 unplaced matched: {got}"


@pytest.mark.parametrize("world", (2, 4))
def test_the_placement_reaches_the_dispatcher_through_the_model_parallel_hook(world):
    """What ``--piper-placement`` runs: the request's placement, installed by the hooked
    ``initialize_model_parallel``, gives the stock layer's output once the slots hold their experts."""
    for rank, results in enumerate(_ranks(world)):
        hook = results["hook"]
        assert (hook["dispatcher"], hook["placement"], hook["stock"]) == \
            ("PiperTokenDispatcher", True, "MoEAlltoAllTokenDispatcher"), f"rank {rank}: {hook}"
        assert hook["output"] <= TOL and hook["input_grad"] <= TOL, f"rank {rank}: {hook}"


# ---- --piper-placement (planning; no ranks) ------------------------------------------------------

ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--ffn-hidden-size", "128",
        "--seq-length", "64", "--max-position-embeddings", "64", "--num-experts", "8", "--moe-router-topk", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--global-batch-size", "8",
        "--piper", "--piper-cluster", "cpu-local"]


def _plan(argv: list[str], world: int = 4):
    from piper_megatron.args import parse_megatron_args, parse_piper_options
    from piper_megatron.install import plan_job

    return plan_job(parse_megatron_args(argv), argv, parse_piper_options(argv), world_size=world)


def _write(tmp_path, data) -> str:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_the_placement_file_sets_ep_and_reaches_the_dispatcher(tmp_path):
    from piper_megatron.dispatcher import DispatchSettings

    path = _write(tmp_path, {"num_experts": 8, "ep": 2, "ranks": [[5, 2, 7, 0], [3, 6, 1, 4]]})
    job = _plan(ARGV + ["--piper-placement", path])
    assert job.result.scored and all(s.plan.ep == 2 for s in job.result.scored)
    assert job.placement.ranks == ((5, 2, 7, 0), (3, 6, 1, 4))
    assert any(n.startswith(f"--piper-placement {path}: ep=2 as the placement says; 4 of 8 experts off") for n in
               job.notes)
    settings = DispatchSettings.from_plan("flat", 1, placement=job.placement)
    assert settings.describe().endswith("expert placement: 4 of 8 experts off their default rank over 2 ranks")


def test_a_placement_per_layer_file_reaches_the_dispatcher_and_prices_each_layer(tmp_path):
    from piper_core.runtime.placement import LayerPlacements
    from piper_megatron.dispatcher import DispatchSettings

    path = _write(tmp_path, {"num_experts": 8, "ep": 2, "layers": {"2": [[5, 2, 7, 0], [3, 6, 1, 4]]}})
    job = _plan(ARGV + ["--piper-placement", path])
    assert isinstance(job.placement, LayerPlacements) and all(s.plan.ep == 2 for s in job.result.scored)
    assert job.placement.for_layer(2).ranks == ((5, 2, 7, 0), (3, 6, 1, 4)) and job.placement.for_layer(1) is None
    note = f"--piper-placement {path}: ep=2 as the placement says; per MoE layer over 2 ranks: layers 2 placed"
    assert any(n.startswith(note) for n in job.notes), job.notes
    settings = DispatchSettings.from_plan("flat", 1, placement=job.placement)
    assert "expert placement: per MoE layer over 2 ranks: layers 2 placed (4 experts off" in settings.describe()
    # with measured routing, each layer is priced under its own placement (layer 1: the default)
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"num_experts": 8, "layers": {"1": [9, 1, 1, 1, 9, 1, 1, 1],
                                                                "2": [9, 9, 9, 9, 1, 1, 1, 1]}}))
    routed = _plan(ARGV + ["--piper-placement", path, "--piper-routing", str(routing)])
    assert routed.result.scored and "experts placed as --piper-placement says" in " ".join(routed.notes)


@pytest.mark.parametrize(("data", "extra", "message"), [
    ({"num_experts": 16, "ep": 2, "ranks": [list(range(8)), list(range(8, 16))]}, [],
     r"--piper-placement='.*placement.json': places 16 experts, the model has 8"),
    ({"num_experts": 8, "ep": 2, "ranks": [[0, 1, 2, 3], [4, 5, 6, 7]]}, ["--expert-model-parallel-size", "4"],
     r"--piper-placement='.*placement.json': is for ep=2, which this job cannot run .*\[4\]\); write a placement "
     r"for one of \[4\], or drop or change --expert-model-parallel-size"),
    ({"num_experts": 8, "ep": 2, "ranks": [[0, 1, 2, 3], [4, 5, 6, 6]]}, [],
     r"placement.json: ranks\[1\]=\[4, 5, 6, 6\]: holds expert 6, which rank 1 holds too"),
    ({"num_experts": 8, "ep": 2, "ranks": [[0, 1, 2], [3, 4, 5, 6, 7]]}, [],
     r"placement.json: ranks=.*slots per rank are \[3, 5\]"),
    ({"num_experts": 8, "ep": 2, "layers": {"5": [[0, 1, 2, 3], [4, 5, 6, 7]]}}, [],
     r"--piper-placement='.*placement.json': places layers \[5\], which are not MoE layers of this model "
     r"\(its MoE layer numbers: 1..2, 2 layers\)"),
    ({"num_experts": 8, "ep": 2, "layers": {"2": [[0, 1, 2, 3], [4, 5, 6, 6]]}}, [],
     r"placement.json layer 2: ranks\[1\]=\[4, 5, 6, 6\]: holds expert 6, which rank 1 holds too"),
])
def test_a_wrong_placement_file_is_refused_with_the_reason(tmp_path, data, extra, message):
    with pytest.raises(SpecError, match=message):
        _plan(ARGV + extra + ["--piper-placement", _write(tmp_path, data)])


def test_the_flag_needs_piper_and_a_readable_file(tmp_path):
    from piper_megatron.args import parse_piper_options

    with pytest.raises(SpecError, match=r"--piper-placement=.*only together with --piper"):
        parse_piper_options(["--piper-placement", "p.json"])
    with pytest.raises(SpecError, match=r"placement='.*nowhere.json': cannot be read"):
        _plan(ARGV + ["--piper-placement", str(tmp_path / "nowhere.json")])
