"""Incremental expert migration on Megatron-Core (issue 17, deliverable 3; piper_megatron.migrate).

On 2 and 4 gloo ranks (ep = world; tests/megatron/migrate_ranks.py): a GPTModel with 2 MoE layers of 8
experts, Megatron's DDP and schedule, Piper's dispatcher, trains 2 steps, migrates every layer to
``P`` (every expert changes slot, half of them or more change rank), trains 2 steps, migrates the
layers to two different placements ``Q`` (per layer), trains 2 more. The 6 losses must equal those of
the same job without migration within :data:`TOL` (fp32 training; measured: bit-identical, 0.0,
with Piper's FP32Adam, Megatron's DistributedOptimizer and bf16 with fp32 master weights). On 4 ranks
with ep 2 the distributed optimizer shards each expert's state over 2 expert data-parallel ranks
(its pieces assembled before the move and split after it): bit-identical too, fp32 and bf16.

Controls (a test that cannot fail is a defect): migrating the weights and gradients without the
optimizer state gives different losses after the first migration (measured 2.6e-3 on losses near 7;
2.5e-3 with the distributed optimizer at edp 2, bf16), with the host Adam and with the distributed
optimizer; a checkpoint saved after the migrations and loaded into
a fresh model without its placement file gives different losses.

A checkpoint saved after the migrations (model and optimizer state dicts per rank, and
``piper_placement.json``) loads into a freshly built model with other initial weights, routed by the
saved placement, and resumes to the same losses.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

TOL = 1e-6  # on losses of about 7: relative 1.4e-7; measured 0.0
CONTROL = 1e-3  # a control must differ by more than this (measured 2.6e-3 and 5.4e-3)
SEGMENTS = [2, 2, 2]
TARGETS = {2: [{"ranks": [[5, 2, 7, 0], [3, 6, 1, 4]]},
               {"layers": {"1": [[0, 1, 2, 3], [4, 5, 6, 7]], "2": [[4, 1, 2, 3], [0, 5, 6, 7]]}}],
           4: [{"ranks": [[5, 2], [7, 0], [3, 6], [1, 4]]},
               {"layers": {"1": [[0, 1], [2, 3], [4, 5], [6, 7]], "2": [[7, 1], [2, 6], [4, 0], [3, 5]]}}]}
_RUNS: dict[tuple, list[dict]] = {}


def _run(world: int, mode: str, **job):
    from tests.gloo import run_ranks
    from tests.megatron.migrate_ranks import run_rank

    key = (world, mode, tuple(sorted((k, str(v)) for k, v in job.items() if k != "dir")))
    if key not in _RUNS:
        _RUNS[key] = run_ranks(world, run_rank, {"mode": mode, "segments": SEGMENTS,
                                                 "targets": TARGETS[job.get("ep", world)], "lr": 1e-3, **job},
                               timeout_s=300)
    return _RUNS[key]


def _diff(a: list[dict], b: list[dict]) -> float:
    return max(abs(x - y) for x, y in zip(a[0]["losses"], b[0]["losses"], strict=True))


@pytest.mark.parametrize(("world", "job"), [(2, {}), (4, {}), (2, {"dopt": True}), (2, {"precision": "bf16"}),
                                            (4, {"ep": 2, "dopt": True}),
                                            (4, {"ep": 2, "dopt": True, "precision": "bf16"})],
                         ids=["2r-fp32-adam", "4r-fp32-adam", "2r-fp32-distributed-optimizer", "2r-bf16-masters",
                              "4r-ep2-edp2-fp32-distributed-optimizer", "4r-ep2-edp2-bf16-distributed-optimizer"])
def test_migration_keeps_the_losses_of_the_same_job_without_it(world, job):
    plain, moved = _run(world, "plain", **job), _run(world, "migrate", **job)
    from pathlib import Path
    assert moved[0]["piper_core"].startswith(str(Path(__file__).resolve().parents[2])), moved[0]["piper_core"]
    assert all(r["losses"] == moved[0]["losses"] for r in moved)  # every rank reports the global mean
    assert _diff(plain, moved) <= TOL, (plain[0]["losses"], moved[0]["losses"])
    first, second = moved[0]["reports"]
    assert first["moves"] >= 4 and second["moves"] >= 2 and first["sent"] > 0 and first["received"] > 0
    # the dispatchers route by the last target, aligned: experts that stayed on a rank kept their slot
    want = TARGETS[job.get("ep", world)][1]["layers"]
    for r in moved:
        for n, ranks in r["placements"].items():
            assert [sorted(x) for x in ranks] == [sorted(x) for x in want[str(n)]]
    if world == 2 and not job:
        assert moved[0]["placements"][2] == ((1, 3, 2, 4), (0, 5, 6, 7))  # 4 took slot 0's place of 0, ...


@pytest.mark.parametrize(("world", "job"), [(2, {}), (2, {"dopt": True}),
                                            (4, {"ep": 2, "dopt": True, "precision": "bf16"})],
                         ids=["adam", "distributed-optimizer", "distributed-optimizer-edp2"])
def test_moving_the_weights_without_the_optimizer_state_changes_the_losses(world, job):
    plain, control = _run(world, "plain", **job), _run(world, "migrate", move_optimizer=False, **job)
    assert plain[0]["losses"][:2] == control[0]["losses"][:2]
    assert _diff(plain, control) > CONTROL, (plain[0]["losses"], control[0]["losses"])


def test_a_checkpoint_saved_after_migrations_resumes_to_the_same_losses(tmp_path):
    from piper_megatron.migrate import read_placements

    plain = _run(2, "plain")
    resumed = _run(2, "checkpoint", dir=str(tmp_path / "a"))
    assert _diff(plain, resumed) <= TOL, (plain[0]["losses"], resumed[0]["losses"])
    saved = read_placements(tmp_path / "a")
    assert {n: p.ranks for n, p in saved.items()} == resumed[0]["placements"]
    assert not all(p.is_default for p in saved.values())
    blind = _run(2, "checkpoint", dir=str(tmp_path / "b"), apply=False)  # its placement file not applied
    assert _diff(plain, blind) > CONTROL, (plain[0]["losses"], blind[0]["losses"])


def test_a_rank_that_does_not_migrate_fails_the_others_in_time_naming_the_operation_and_ranks():
    (first, _) = _run(2, "straggler")
    assert first["seconds"] < 5, first
    assert first["error"].startswith("expert migration barrier (before the exchange; every rank of the "
                                     "expert-parallel group must call migrate), barrier, on global ranks [0, 1]: "
                                     "rank 0 did not complete it within 2 s"), first["error"]


# ---- no ranks --------------------------------------------------------------------------------------

def test_placement_files_round_trip_and_bad_ones_are_refused(tmp_path):
    import json

    from piper_core.errors import SpecError
    from piper_core.runtime.placement import ExpertPlacement
    from piper_megatron.migrate import read_placements, write_placements

    placements = {1: ExpertPlacement(num_experts=4, ep=2, ranks=((1, 0), (3, 2))), 2: ExpertPlacement.default(4, 2)}
    assert read_placements(write_placements(tmp_path, placements)) == placements
    (tmp_path / "bad.json").write_text(json.dumps({"num_experts": 4, "ep": 2, "layers": {"1": [[0, 1], [1, 3]]}}))
    with pytest.raises(SpecError, match=r"bad.json layer 1: ranks\[1\]=\[1, 3\]: holds expert 1, which rank 0"):
        read_placements(tmp_path / "bad.json")
    (tmp_path / "keys.json").write_text(json.dumps({"num_experts": 4, "layers": {"1": [[0, 1], [2, 3]]}}))
    with pytest.raises(SpecError, match=r"keys.json: ep=None: is required; a per-layer placement file holds "
                                        r"num_experts, ep, layers"):
        read_placements(tmp_path / "keys.json")
    (tmp_path / "shared.json").write_text(json.dumps({"num_experts": 4, "ep": 2, "ranks": [[0, 1], [2, 3]]}))
    with pytest.raises(SpecError, match=r"holds one placement for every layer \(ranks\); a checkpoint's placement "
                                        r"file lists each MoE layer"):
        read_placements(tmp_path / "shared.json")


def test_an_optimizer_whose_state_migration_does_not_know_is_refused():
    import torch

    from piper_core.errors import SpecError
    from piper_megatron.migrate import optimizer_state

    with pytest.raises(SpecError, match=r"optimizer='object': is not one whose per-parameter state migration knows"):
        optimizer_state(object(), [torch.nn.Parameter(torch.zeros(2))])
    adam = torch.optim.Adam([p := torch.nn.Parameter(torch.zeros(2))])
    p.grad = torch.ones(2)
    adam.step()
    assert sorted(optimizer_state(adam, [p])(p)) == ["exp_avg", "exp_avg_sq", "step"]


def test_the_job_placements_live_migration_starts_from_and_resumes_with(tmp_path):
    """--piper-migrate-every's record of every MoE layer's placement (piper_megatron.live): from
    --piper-placement (one for every layer, or per layer) or the default, and from a checkpoint's
    piper_placement.json (a layer it leaves out: the default; no file: None, the slots hold the default)."""
    from piper_core.errors import SpecError
    from piper_core.runtime.placement import ExpertPlacement, LayerPlacements
    from piper_core.specs.model import ModelSpec
    from piper_megatron.live import job_placements, saved_placements
    from piper_megatron.migrate import write_placements

    model = ModelSpec(name="m", num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                      num_experts=4, moe_ffn_hidden_size=128, moe_router_topk=2, vocab_size=128, seq_length=32,
                      moe_first_k_dense=1)
    default, swapped = ExpertPlacement.default(4, 2), ExpertPlacement(num_experts=4, ep=2, ranks=((0, 2), (1, 3)))
    assert job_placements(model, 2, None) == {2: default, 3: default}
    assert job_placements(model, 2, swapped) == {2: swapped, 3: swapped}
    per_layer = LayerPlacements(num_experts=4, ep=2, layers={3: swapped})
    assert job_placements(model, 2, per_layer) == {2: default, 3: swapped}
    assert saved_placements(tmp_path, model, 2) is None
    write_placements(tmp_path, {3: swapped})
    assert saved_placements(tmp_path, model, 2) == {2: default, 3: swapped}
    with pytest.raises(SpecError, match="piper_placement.json: layer 3"):
        saved_placements(tmp_path, model, 4)
