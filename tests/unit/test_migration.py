"""Issue 17, deliverable 3, the model's half (piper_core/scheduler/migration.py): which experts move,
the bytes each moves (memory.py's bytes-per-parameter rules), the move's alpha-beta time over the link
levels between source and destination ranks, the decision rule, and ``piper placement --current``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from piper_core.cli.main import main
from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.resource.params import mlp_params
from piper_core.resource.routing import default_placement
from piper_core.scheduler.migration import (align, copy_time, decide, expert_state_bytes, link_between, move_time,
                                            plan_migration, unshard_time)
from piper_core.timing.comm import ring
from piper_core.timing.topology import expert_groups
from piper_core.specs.parallel import ParallelPlan

QWEN = load_model("qwen3-30b-a3b")  # 128 experts, bf16
H100 = load_cluster("dgx-h100")  # nvlink inside 8-GPU nodes, infiniband between them
MIB = 2**20


def test_align_keeps_the_experts_that_stay_on_a_rank_in_their_slot():
    assert align(((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 2, 5, 7), (1, 3, 4, 6))) == ((0, 5, 2, 7), (4, 1, 6, 3))
    m = plan_migration({1: ((0, 1, 2, 3), (4, 5, 6, 7))}, {1: ((0, 2, 5, 7), (1, 3, 4, 6))}, num_experts=8, ep=2)
    assert [(x.expert, x.src_rank, x.src_local, x.dst_rank, x.dst_local) for x in m.moves] == [
        (1, 0, 1, 1, 1), (3, 0, 3, 1, 3), (5, 1, 1, 0, 1), (7, 1, 3, 0, 3)]
    unaligned = plan_migration({1: ((0, 1, 2, 3), (4, 5, 6, 7))}, {1: ((0, 2, 5, 7), (1, 3, 4, 6))},
                               num_experts=8, ep=2, aligned=False)
    assert len(unaligned.moves) > len(unaligned.crossing) == 4  # reordering inside a rank: copies, not links


def test_layers_not_given_are_the_default_and_bad_placements_are_refused():
    m = plan_migration({}, {3: ((1, 0), (2, 3))}, num_experts=4, ep=2)
    assert m.moves == () and dict(m.target)[3] == ((0, 1), (2, 3))  # aligned: a swap inside rank 0 is no move
    with pytest.raises(SpecError, match=r"target.layers.3\[1\]=.*distinct ids"):
        plan_migration({}, {3: ((0, 1), (1, 3))}, num_experts=4, ep=2)


@pytest.mark.parametrize(("changes", "weights", "grads", "optimizer"), [
    ({}, 2, 4, 12),                                           # bf16: fp32 grads, fp32 master + m + v
    ({"grad_reduce_in_bf16": True}, 2, 2, 12),
    ({"precision": "fp32"}, 4, 4, 8),                         # fp32: Adam steps the parameter, m + v only
    ({"distributed_optimizer": True, "gpus": 32}, 2, 4, 12),  # whole states move (assembled over edp first)
])
def test_bytes_per_expert_follow_the_memory_models_rules(changes, weights, grads, optimizer):
    plan = ParallelPlan(**{"gpus": 16, "ep": 16, "global_batch_size": 256, **changes})
    b = expert_state_bytes(QWEN, plan)
    n = mlp_params(QWEN, QWEN.moe_ffn_hidden_size, 1)
    assert b.params == n and (b.weights, b.gradients, b.optimizer) == (weights * n, grads * n, optimizer * n)


def test_the_move_time_is_alpha_beta_over_the_link_between_the_ranks():
    plan = ParallelPlan(gpus=16, ep=16, global_batch_size=256)
    nvlink, ib = H100.links[0], H100.links[1]
    assert link_between(0, 7, 1, H100) is nvlink and link_between(7, 8, 1, H100) is ib
    per = expert_state_bytes(QWEN, plan).total
    layer = default_placement(128, 16)

    def swap(a: int, b: int):
        target = [list(r) for r in layer]
        target[a][0], target[b][0] = target[b][0], target[a][0]
        return plan_migration({}, {1: tuple(map(tuple, target))}, num_experts=128, ep=16)

    inside, across = move_time(swap(0, 1), QWEN, plan, H100), move_time(swap(0, 8), QWEN, plan, H100)
    assert inside.experts == across.experts == 2
    copy = copy_time(2 * per, H100)  # pack what it sends, unpack what it receives
    assert copy == pytest.approx(4 * per / (3350e9 * 0.85))
    assert inside.seconds == pytest.approx(nvlink.latency_us * 1e-6 + per / (nvlink.bandwidth_gb_per_s * 1e9) + copy)
    assert across.seconds == pytest.approx(ib.latency_us * 1e-6 + per / (ib.bandwidth_gb_per_s * 1e9) + copy)
    assert dict(across.levels) == {ib.name: 2 * per} and across.busiest_rank_bytes == per
    # two experts from rank 0 to rank 1: one message of twice the bytes
    two = [list(r) for r in layer]
    two[0][:2], two[1][:2] = two[1][:2], two[0][:2]
    cost = move_time(plan_migration({}, {1: tuple(map(tuple, two))}, num_experts=128, ep=16), QWEN, plan, H100)
    assert cost.seconds == pytest.approx(nvlink.latency_us * 1e-6 + 2 * per / (nvlink.bandwidth_gb_per_s * 1e9)
                                         + copy_time(4 * per, H100))
    # layers on different pipeline stages move at once: the slowest stage, not the sum
    pp = dataclasses.replace(plan, gpus=32, pp=2)
    last = QWEN.num_layers
    both = plan_migration({}, {1: swap(0, 1).target[0][1], last: swap(0, 1).target[0][1]}, num_experts=128, ep=16)
    assert move_time(both, QWEN, pp, H100).seconds == pytest.approx(move_time(swap(0, 1), QWEN, pp, H100).seconds)


def test_a_measured_bulk_rate_prices_the_exchange_and_a_bad_one_is_refused():
    """``bulk_gb_per_s`` (piper calibrate's bulk two-way exchange) replaces the level's bandwidth in a
    move's time; without it the bandwidth prices it (the test above)."""
    plan = ParallelPlan(gpus=16, ep=16, global_batch_size=256)
    per = expert_state_bytes(QWEN, plan).total
    target = [list(r) for r in default_placement(128, 16)]
    target[0][0], target[1][0] = target[1][0], target[0][0]
    swap = plan_migration({}, {1: tuple(map(tuple, target))}, num_experts=128, ep=16)
    nvlink = H100.links[0]
    slow = dataclasses.replace(H100, links=(dataclasses.replace(nvlink, bulk_gb_per_s=nvlink.bandwidth_gb_per_s / 4),)
                               + H100.links[1:])
    assert move_time(swap, QWEN, plan, slow).seconds == pytest.approx(
        nvlink.latency_us * 1e-6 + per / (nvlink.bandwidth_gb_per_s / 4 * 1e9) + copy_time(2 * per, H100))
    with pytest.raises(SpecError, match=r"links\[nvlink\]\.bulk_gb_per_s.*positive"):
        dataclasses.replace(nvlink, bulk_gb_per_s=0.0)
    # a measured copy rate (piper calibrate's copy benchmark) prices the packing and unpacking
    copying = dataclasses.replace(H100, accelerator=dataclasses.replace(H100.accelerator, copy_gb_per_s=1000.0))
    assert copy_time(2 * per, copying) == pytest.approx(4 * per / 1000e9)
    with pytest.raises(SpecError, match=r"accelerator\.copy_gb_per_s.*positive"):
        dataclasses.replace(H100.accelerator, copy_gb_per_s=-1.0)


def test_the_distributed_optimizer_over_several_ranks_first_assembles_the_moved_state():
    plan = ParallelPlan(gpus=16, ep=16, global_batch_size=256)
    dopt = ParallelPlan(gpus=32, ep=16, global_batch_size=256, distributed_optimizer=True)  # edp 2
    layer = [list(r) for r in default_placement(128, 16)]
    layer[0][:2], layer[1][:2] = layer[1][:2], layer[0][:2]
    move = plan_migration({}, {1: tuple(map(tuple, layer))}, num_experts=128, ep=16)
    per = expert_state_bytes(QWEN, dopt)
    extra = unshard_time(2, per, dopt, H100)  # each rank gives 2 experts away
    assert extra > 0 and extra == pytest.approx(ring(expert_groups(dopt)["edp"], 2 * per.optimizer, H100, passes=2))
    assert move_time(move, QWEN, dopt, H100).seconds == pytest.approx(move_time(move, QWEN, plan, H100).seconds + extra)
    assert unshard_time(2, per, dataclasses.replace(dopt, distributed_optimizer=False), H100) == 0.0


def test_the_decision_migrates_only_when_the_gain_over_the_horizon_exceeds_the_move():
    plan = ParallelPlan(gpus=16, ep=16, global_batch_size=256)
    layer = [list(r) for r in default_placement(128, 16)]
    layer[0][0], layer[8][0] = layer[8][0], layer[0][0]
    cost = move_time(plan_migration({}, {1: tuple(map(tuple, layer))}, num_experts=128, ep=16), QWEN, plan, H100)
    saving = cost.seconds / 10  # pays off after 10 steps
    assert not decide(horizon=9, step_before_s=1.0, step_after_s=1.0 - saving, cost=cost).migrate
    yes = decide(horizon=11, step_before_s=1.0, step_after_s=1.0 - saving, cost=cost)
    assert yes.migrate and yes.break_even_steps == pytest.approx(10) and yes.reason().startswith("migrate: gain")
    slower = decide(horizon=10**6, step_before_s=1.0, step_after_s=1.01, cost=cost)
    assert not slower.migrate and slower.break_even_steps is None and "not faster" in slower.reason()
    with pytest.raises(SpecError, match=r"--horizon=0: must be a whole number of steps >= 1"):
        decide(horizon=0, step_before_s=1.0, step_after_s=0.5, cost=cost)


CLI = ["placement", "qwen3-30b-a3b", "--routing", "docs/routing/qwen3-30b-skewed.yaml", "--cluster", "dgx-h100",
       "--gpus", "16", "--parallel", "ep=16,mbs=1,gbs=1024,a2a=dedup,epov=1"]


def test_placement_current_prints_the_moves_the_time_the_gain_and_the_decision(tmp_path, capsys):
    current = tmp_path / "current.json"
    current.write_text(json.dumps({"num_experts": 128, "ep": 16, "layers": {}}))  # Megatron's default
    out = tmp_path / "target.json"
    assert main(CLI + ["--current", str(current), "--horizon", "100", "--out", str(out), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["migration"]
    # 4 hot experts on rank 0 in layers 2-48: swaps move a few experts per layer, not the whole placement
    assert m["candidate"] == "swaps from --current" and m["migrate"] and m["gain_s"] > m["move_s"] > 0
    assert 0 < len(m["moves"]) <= 8 * 48 and m["step_after_s"] < m["step_before_s"]
    assert m["bytes_per_expert"]["total"] == expert_state_bytes(QWEN, ParallelPlan(
        gpus=16, ep=16, global_batch_size=1024)).total
    assert json.loads(out.read_text())["layers"] == m["target"]["layers"]
    # the target as the current placement: nothing left to move
    assert main(CLI + ["--current", str(out), "--horizon", "100"]) == 0
    text = capsys.readouterr().out
    assert "decision: nothing to move" in text
    # a horizon too short to pay for the move
    assert main(CLI + ["--current", str(current), "--horizon", "1", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)["migration"]
    assert short["migrate"] == (short["gain_s"] > short["move_s"])


def test_placement_current_needs_a_plan_and_a_horizon(tmp_path, capsys):
    current = tmp_path / "current.json"
    current.write_text(json.dumps({"num_experts": 128, "ep": 16, "layers": {}}))
    assert main(CLI + ["--current", str(current)]) == 2
    assert "decides only with a horizon" in capsys.readouterr().err
    assert main(["placement", "qwen3-30b-a3b", "--routing", "docs/routing/qwen3-30b-skewed.yaml", "--ep", "16",
                 "--current", str(current), "--horizon", "5"]) == 2
    assert "add --parallel ... --gpus N --cluster C" in capsys.readouterr().err
    assert main(CLI + ["--horizon", "5"]) == 2
    assert "--horizon=5: prices a migration from the current placement" in capsys.readouterr().err


# ---- choose: what piper placement --current and --piper-migrate-every decide with -----------------

def _routing(counts: dict[int, tuple[float, ...]]):
    from piper_core.specs.routing import Routing

    return Routing(num_experts=len(next(iter(counts.values()))), layers=tuple(counts.items()), source="test")


def test_choose_prices_both_candidates_and_keeps_the_larger_net_gain():
    from piper_core.scheduler.migration import OPTIMIZER, SWAPS, choose, layer_range, move_rows

    plan = ParallelPlan(gpus=16, ep=16, global_batch_size=256)
    hot = tuple([4.0] * 4 + [1.0] * 124)  # experts 0-3, all on rank 0 by default
    routing = _routing({n: hot for n in range(1, QWEN.num_layers + 1)})
    current = {n: default_placement(QWEN.num_experts, 16) for n in range(1, QWEN.num_layers + 1)}
    choice = choose(QWEN, H100, plan, routing, current, horizon=100)
    assert [c.name for c in choice.candidates] == [SWAPS, OPTIMIZER]
    chosen = choice.chosen
    assert chosen.net_s == max(c.net_s for c in choice.candidates) and chosen.decision.migrate
    assert chosen.decision.step_after_s < chosen.decision.step_before_s
    rows = move_rows(chosen.migration, max_shown=6)
    assert [layer_range(layers) for layers, _ in rows] == [f"1-{QWEN.num_layers}"]  # the same moves in every layer
    leaving = {m.expert for m in chosen.migration.crossing if m.src_rank == 0}
    assert len(leaving & {0, 1, 2, 3}) == 3  # the busiest rank at its lower bound holds one hot expert
    # once placed, the same routing moves nothing
    again = choose(QWEN, H100, plan, routing, {n: p for n, p in chosen.migration.target}, horizon=100)
    assert not again.chosen.decision.migrate
    with pytest.raises(SpecError, match="--horizon=0: must be a whole number of steps >= 1"):
        choose(QWEN, H100, plan, routing, current, horizon=0)


def test_layer_ranges_and_move_rows_merge_equal_layers():
    from piper_core.scheduler.migration import layer_range, move_rows

    assert (layer_range([3]), layer_range([2, 3, 4]), layer_range([2, 4, 8])) == ("3", "2-4", "2,..,8")
    m = plan_migration({}, {1: ((0, 2), (1, 3)), 2: ((0, 2), (1, 3)), 3: ((0, 3), (1, 2))}, num_experts=4, ep=2)
    assert move_rows(m, max_shown=6) == [([1, 2], "expert 1 rank 0->1, expert 2 rank 1->0"),
                                         ([3], "expert 1 rank 0->1, expert 3 rank 1->0")]
    assert move_rows(m, max_shown=1)[0] == ([1, 2, 3], "2 experts change rank")


_MIGRATION_DOCS = Path(__file__).resolve().parents[2] / "docs" / "migration"
MOVE_COST_RUNS = {"inside a node": sorted(_MIGRATION_DOCS.glob("move-cost-[0-9]*.json")),
                  "across emulated nodes": sorted(_MIGRATION_DOCS.glob("move-cost-nodes-[0-9]*.json"))}


@pytest.mark.parametrize("where", sorted(MOVE_COST_RUNS))
def test_the_recorded_move_costs_are_predicted_within_the_issues_limit(where):
    """Issue 17: "its measured cost per move within 30 % of the model's". The judged runs of ``make
    bench-migrate-cost`` and ``make bench-migrate-cost-nodes`` (docs/migration.md; runs 1-3 of each,
    each on its own fresh calibration) priced again by
    this version's model from each run's profile (checked by sha256): every row's prediction equals
    the recorded one and is within 30 % of what was measured. A model change that moves a prediction
    fails here; one that keeps every row within the limit has its records re-run and this reference
    rewritten, with the reason."""
    import hashlib
    import re

    from piper_megatron.migrate_cost import model_and_plan, swap_placement

    runs = MOVE_COST_RUNS[where]
    assert len(runs) == 3, runs
    root = Path(__file__).resolve().parents[2]
    for path in runs:
        run = json.loads(path.read_text())
        profile = root / run["source"]["profile"]["path"]
        assert hashlib.sha256(profile.read_bytes()).hexdigest() == run["source"]["profile"]["sha256"], profile
        hidden, ffn, experts = map(int, re.fullmatch(r"migrate-(\d+)h-(\d+)f-(\d+)e", run["model"]).groups())
        model, plan = model_and_plan(run["ranks"], hidden, ffn, experts, run["precision"])
        cluster = load_cluster(str(profile))
        for row in run["rows"]:
            move = plan_migration({}, {1: swap_placement(experts, run["ranks"], row["k"])}, num_experts=experts,
                                  ep=run["ranks"])
            predicted = move_time(move, model, plan, cluster).seconds
            assert predicted == pytest.approx(row["predicted_s"], rel=1e-9), (path.name, row["k"])
            assert abs(predicted / row["measured_s"] - 1) <= 0.30, (path.name, row["k"], predicted, row["measured_s"])


@pytest.mark.parametrize("nodes, cluster, match", [
    (3, "cpu-local", r"^--nodes=3: must divide --ranks \(2\)"),
    (2, "cpu-local", r"^--profile='cpu-local': has \d+ ranks per node; the emulated cluster has 1, so the move would "
                     r"be priced on another link; predict with a profile of the same emulated cluster"),
])
def test_migrate_cost_refuses_nodes_it_cannot_price(nodes, cluster, match):
    """Checked before any rank starts (``--nodes``: the move across emulated nodes)."""
    from piper_core.errors import SpecError
    from piper_core.presets import load_cluster
    from piper_megatron.migrate_cost import measure

    with pytest.raises(SpecError, match=match):
        measure(ranks=2, experts=[1], hidden=64, ffn=128, num_experts=4, precision="fp32", repeats=1,
                cluster=load_cluster(cluster), nodes=nodes)
