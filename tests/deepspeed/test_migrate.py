"""Experts move between ranks while DeepSpeed trains, and training does not notice (issue 17,
deliverable 3, on the second framework): :func:`piper_deepspeed.migrate.migrate`.

On 2 gloo processes (ep 2, tiny-moe: 4 MoE layers of 8 experts), one spawn, each run of 6 steps
through ``piper_deepspeed.initialize`` (fp32, ZeRO 0, torch Adam at lr 1e-2, the gate's random draws
seeded per step):

* ``plain``: no move (the reference);
* ``migrate``: 3 steps, then every expert moves (half of them to the other rank) with its weights,
  gradient and Adam state, then 3 steps: losses equal the reference's within 1e-6 (relative);
* ``no-state`` (control): the same move leaving Adam's state in the slots: the losses after it differ;
* ``checkpoint``: 3 steps, the move, ``engine.save_checkpoint`` and the placement beside it, a fresh
  engine built from another seed, ``engine.load_checkpoint`` and the saved placement, 3 steps: the
  reference's last 3 losses within 1e-6; without the placement (control) they differ;
* ``plain-bf16`` / ``migrate-bf16``: the same in bf16, where DeepSpeed steps ``FP16_UnfusedOptimizer``
  (an fp32 master per parameter, which moves with Adam's state on it): equal losses;
* refusals: a placement for 16 experts; the ZeRO stage 1 optimizer (its state is flat and partitioned);
  the block's ``migrate_every`` with ep 1 or at ZeRO stage 1, before DeepSpeed starts;
* ``live``: the block's ``"migrate_every": 2`` (horizon 10^6 steps, so a move that predicts any gain pays):
  decisions after steps 2, 4 and 6, the first moves experts, the losses equal the reference's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gloo import run_ranks

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

SEED, STEPS, AT = 7, 6, 3
RANKS = ((5, 2, 7, 0), (3, 6, 1, 4))  # logical expert ids of each ep rank after the move
TOL = 1e-6
BLOCK = {"cluster": "cpu-local", "model": "tiny-moe", "plan": {"ep": 2, "mbs": 1}}
BF16 = {"bf16": {"enabled": True}}  # ZeRO 0: DeepSpeed's FP16_UnfusedOptimizer, fp32 masters per parameter
LIVE = {"piper": BLOCK | {"migrate_every": 2, "migrate_horizon": 10**6}}
ZERO1 = {"zero_optimization": {"stage": 1}}  # flat, partitioned state: refused
CONFIG = {"train_batch_size": 2, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}


def _engine(world: int, seed: int, extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
    import contextlib
    import io

    import piper_deepspeed
    from piper_deepspeed.builder import build_model
    from piper_deepspeed.initialize import plan_for

    config = CONFIG | {"piper": BLOCK} | (extra or {})
    choice = plan_for(config, world)
    net = build_model(choice.prediction.model, choice.plan, seed=seed, aux_loss_coeff=0.0)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = piper_deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine, choice.prediction.model


def _step(engine: Any, spec: Any, rank: int, step: int) -> float:
    import torch

    from piper_deepspeed.builder import lm_loss

    g = torch.Generator().manual_seed(1000 * step + rank)
    batch = torch.randint(0, spec.vocab_size, (1, 33), generator=g)
    torch.manual_seed(100 + step)  # the gate's random draws, alike in every run
    loss = lm_loss(engine(batch[:, :-1]), batch[:, 1:], aux_loss_coeff=0.0)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _live(rank: int, world: int) -> dict[str, Any]:
    """6 steps with the block's migrate_every 2 (horizon 10^6 steps: a move that predicts any gain pays)."""
    engine, spec = _engine(world, SEED, LIVE)
    live = engine.piper_migration
    lines: list[str] = []
    live.log = lines.append
    losses = [_step(engine, spec, rank, step) for step in range(STEPS)]
    return {"losses": losses, "lines": lines, "numbers": list(live.numbers),
            "decisions": [(o.iteration, o.moved, o.report is not None and o.report.sent_bytes > 0)
                          for o in live.outcomes],
            "placements": {n: p.ranks for n, p in live.placements.items()},
            "routed_now": [int(layer.take_routed_tokens().sum()) for layer in
                           __import__("piper_deepspeed.migrate", fromlist=["x"]).moe_layers(engine, live.numbers).values()]}


def _run(rank: int, world: int, mode: str, directory: str) -> dict[str, Any]:
    from piper_core.runtime.placement import ExpertPlacement
    from piper_deepspeed import migrate as mig

    extra = BF16 if mode.endswith("-bf16") else None
    engine, spec = _engine(world, SEED, extra)
    losses, report = [], None
    for step in range(STEPS):
        if step == AT and not mode.startswith("plain"):
            target = ExpertPlacement(num_experts=spec.num_experts, ep=2, ranks=RANKS)
            r = mig.migrate(engine, engine.optimizer, target, move_optimizer=mode != "no-state")
            report = {"moves": len(r.plan.crossing), "sent": r.sent_bytes, "received": r.received_bytes,
                      "placements": {n: p.ranks for n, p in r.placements.items()}}
            if mode.startswith("checkpoint"):
                engine.save_checkpoint(directory, tag="moved")
                mig.save_placements(Path(directory) / "moved", engine)
                import torch.distributed as dist

                dist.barrier()
                engine, spec = _engine(world, SEED + 99)
                engine.load_checkpoint(directory, tag="moved")
                if mode == "checkpoint":
                    mig.load_placements(Path(directory) / "moved", engine)
        losses.append(_step(engine, spec, rank, step))
    return {"losses": losses, "report": report, "optimizer": type(engine.optimizer).__name__,
            "placements": {n: p.ranks for n, p in mig.current_placements(engine).items()}}


def _refusals(rank: int, world: int) -> dict[str, str]:
    from piper_core.errors import SpecError
    from piper_core.runtime.placement import ExpertPlacement
    from piper_deepspeed import migrate as mig

    out = {}
    engine, spec = _engine(world, SEED)
    try:
        mig.migrate(engine, engine.optimizer, ExpertPlacement.default(16, 2))
    except SpecError as exc:
        out["experts"] = str(exc)
    zero, _ = _engine(world, SEED, ZERO1)
    try:
        mig.migrate(zero, zero.optimizer, ExpertPlacement(num_experts=spec.num_experts, ep=2, ranks=RANKS))
    except SpecError as exc:
        out["zero"] = str(exc)
    out["zero_unmoved"] = str(mig.current_placements(zero)[1].is_default)
    for name, extra in (("block-ep1", {"piper": BLOCK | {"plan": {"ep": 1, "mbs": 1}, "migrate_every": 2}}),
                        ("block-zero1", ZERO1 | LIVE)):
        try:
            _engine(world, SEED, extra)
        except SpecError as exc:
            out[name] = str(exc)
    return out


def _all(rank: int, world: int, directory: str) -> dict[str, Any]:
    import warnings

    from tests.deepspeed import deepspeed_comm

    warnings.filterwarnings("ignore")
    deepspeed_comm()
    runs = {mode: _run(rank, world, mode, str(Path(directory) / mode))
            for mode in ("plain", "migrate", "no-state", "checkpoint", "checkpoint-unplaced", "plain-bf16",
                         "migrate-bf16")}
    return runs | {"refusals": _refusals(rank, world), "live": _live(rank, world)}


_RESULTS: list[dict[str, Any]] = []


def _results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not _RESULTS:
        _RESULTS.extend(run_ranks(2, _all, str(tmp_path_factory.mktemp("ds-migrate")), timeout_s=600))
    return _RESULTS


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(a))


def test_moving_experts_mid_training_leaves_the_losses_unchanged(tmp_path_factory):
    for rank, r in enumerate(_results(tmp_path_factory)):
        ref, got = r["plain"]["losses"], r["migrate"]["losses"]
        assert len(ref) == len(got) == STEPS
        worst = max(_rel(a, b) for a, b in zip(ref, got))
        assert worst <= TOL, f"rank {rank}: losses {got} differ from the reference {ref} by {worst:.3g}"
        report = r["migrate"]["report"]
        assert report["moves"] == 4 * 4, report  # 4 of each layer's 8 experts change rank, in 4 layers
        assert report["sent"] > 0 and report["received"] > 0
        for layer, ranks in r["migrate"]["placements"].items():  # the target, aligned: who stays keeps its slot
            assert [sorted(x) for x in ranks] == [sorted(x) for x in RANKS], (layer, ranks)
        assert ref[AT:] != ref[:STEPS - AT], "the reference did not train"


def test_the_control_without_optimizer_state_changes_the_losses(tmp_path_factory):
    for rank, r in enumerate(_results(tmp_path_factory)):
        ref, got = r["plain"]["losses"], r["no-state"]["losses"]
        assert max(_rel(a, b) for a, b in zip(ref[:AT + 1], got[:AT + 1])) <= TOL  # the first step after: same weights
        assert max(_rel(a, b) for a, b in zip(ref[AT + 1:], got[AT + 1:])) > 1e-4, \
            f"rank {rank}: Adam's state left behind changed nothing ({got} vs {ref})"


def test_a_checkpoint_saved_after_the_move_resumes_to_the_same_losses(tmp_path_factory):
    for rank, r in enumerate(_results(tmp_path_factory)):
        ref, got = r["plain"]["losses"], r["checkpoint"]["losses"]
        worst = max(_rel(a, b) for a, b in zip(ref, got))
        assert worst <= TOL, f"rank {rank}: resumed losses {got} differ from {ref} by {worst:.3g}"
        unplaced = r["checkpoint-unplaced"]["losses"]
        assert max(_rel(a, b) for a, b in zip(ref[AT:], unplaced[AT:])) > 1e-4, \
            f"rank {rank}: loading without the saved placement changed nothing"


def test_bad_targets_and_partitioned_optimizers_are_refused(tmp_path_factory):
    for r in _results(tmp_path_factory):
        refused = r["refusals"]
        assert "placement of layer 1" in refused["experts"] and "16" in refused["experts"], refused["experts"]
        assert refused["zero"].startswith("optimizer='DeepSpeedZeroOptimizer'"), refused["zero"]
        assert "a job at ZeRO stage 0" in refused["zero"], refused["zero"]
        assert refused["zero_unmoved"] == "True"  # refused before anything moved
        assert refused["block-ep1"].startswith("piper.migrate_every=2: moves experts between expert-parallel ranks, "
                                               "and the plan has ep=1"), refused["block-ep1"]
        assert refused["block-zero1"].startswith("piper.migrate_every=2: moves each expert's optimizer state, which "
                                                 "ZeRO stage 1 keeps"), refused["block-zero1"]


def test_in_bf16_the_fp32_masters_move_with_their_experts(tmp_path_factory):
    for rank, r in enumerate(_results(tmp_path_factory)):
        assert r["migrate-bf16"]["optimizer"] == "FP16_UnfusedOptimizer", r["migrate-bf16"]["optimizer"]
        ref, got = r["plain-bf16"]["losses"], r["migrate-bf16"]["losses"]
        worst = max(_rel(a, b) for a, b in zip(ref, got))
        assert worst <= TOL, f"rank {rank}: bf16 losses {got} differ from the reference {ref} by {worst:.3g}"
        # per moved parameter: its bf16 weight, its fp32 master and Adam's two fp32 moments and step,
        # more than the fp32 run's weight and three state tensors
        assert r["migrate-bf16"]["report"]["sent"] > r["migrate"]["report"]["sent"]


def test_the_blocks_migrate_every_decides_and_moves_without_changing_the_losses(tmp_path_factory):
    for rank, r in enumerate(_results(tmp_path_factory)):
        live = r["live"]
        assert live["numbers"] == [1, 2, 3, 4]
        assert [d[0] for d in live["decisions"]] == [2, 4, 6], live["decisions"]
        assert live["decisions"][0][1] and live["decisions"][0][2], f"rank {rank}: the first decision moved nothing"
        assert any(any(sorted(x) != sorted(y) for x, y in zip(ranks, ((0, 1, 2, 3), (4, 5, 6, 7))))
                   for ranks in live["placements"].values()), live["placements"]
        ref = r["plain"]["losses"]
        worst = max(_rel(a, b) for a, b in zip(ref, live["losses"]))
        assert worst <= TOL, f"rank {rank}: losses {live['losses']} differ from the reference {ref} by {worst:.3g}"
        assert live["routed_now"] == [0, 0, 0, 0]  # each decision took the counts
        if rank == 0:
            assert len(live["lines"]) == 3 and live["lines"][0].startswith(
                "piper: migration decision after iteration 2 (tokens of iterations 1-2): moved "), live["lines"]
        else:
            assert live["lines"] == []


@pytest.mark.parametrize("block, match", [
    ({"migrate_every": 0}, r"^piper\.migrate_every=0: must be an int >= 1"),
    ({"migrate_horizon": 10}, r"^piper\.migrate_horizon=10: is the horizon of the migration decisions that "
                              r"piper\.migrate_every turns on; set \"migrate_every\": N too"),
    ({"migrate_every": "often"}, r"^piper\.migrate_every='often': must be an int >= 1"),
])
def test_a_wrong_migration_key_is_refused_naming_it(block, match):
    from piper_core.errors import SpecError
    from piper_deepspeed.config import PiperConfig

    with pytest.raises(SpecError, match=match):
        PiperConfig.from_block(BLOCK | block)
