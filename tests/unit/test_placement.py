"""Issue 17, the placement optimizer: equal slots, never worse than Megatron's default, the lower
bound reached where it can be, and the model prices the step with the placement it returns."""

from __future__ import annotations

import itertools
import random

import pytest

from piper_core.cli.parse import parse_parallel
from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.resource.routing import check_placement, default_placement, predict_routed, rank_loads
from piper_core.scheduler.placement import greedy, improve, lower_bound, optimize, optimize_layer
from piper_core.specs.routing import Routing


def _random_counts(rng: random.Random, experts: int) -> tuple[float, ...]:
    """Zipf-like loads, shuffled (a few hot experts, a long tail), as routers skew."""
    counts = [1000 / (i + 1) ** rng.uniform(0.3, 1.2) + rng.uniform(0, 50) for i in range(experts)]
    rng.shuffle(counts)
    return tuple(counts)


def _brute_force(counts, ranks):
    """The optimal busiest rank over all equal-slot placements (small instances only)."""
    slots = len(counts) // ranks
    best = float("inf")

    def place(left, loads):
        nonlocal best
        if not left:
            best = min(best, max(loads))
            return
        first, rest = left[0], left[1:]
        for group in itertools.combinations(rest, slots - 1):
            chosen = (first, *group)
            remaining = tuple(e for e in rest if e not in group)
            place(remaining, loads + [sum(counts[e] for e in chosen)])

    place(tuple(range(len(counts))), [])
    return best


@pytest.mark.parametrize("experts, ranks", [(8, 2), (16, 4), (64, 8), (128, 16), (256, 64), (12, 12)])
def test_equal_slots_and_never_worse_than_default(experts, ranks):
    rng = random.Random(experts * 31 + ranks)
    for _ in range(20):
        counts = _random_counts(rng, experts)
        p = optimize_layer(1, counts, ranks)
        assert check_placement(p.placement, experts, ranks) == p.placement  # every expert once, E/ep a rank
        assert max(rank_loads(counts, p.placement)) == p.busiest
        assert p.busiest <= max(rank_loads(counts, default_placement(experts, ranks)))
        assert p.lower_bound <= p.busiest * (1 + 1e-12)
        assert p.gap >= -1e-12


def test_the_lower_bound_is_a_bound_and_the_optimizer_is_near_it():
    """Against the exact optimum of small instances: LB <= OPT <= found; the gap stays small."""
    rng = random.Random(7)
    for experts, ranks in ((8, 2), (8, 4), (9, 3), (12, 3)):
        for _ in range(10):
            counts = _random_counts(rng, experts)
            opt = _brute_force(counts, ranks)
            p = optimize_layer(1, counts, ranks)
            assert lower_bound(counts, ranks) <= opt + 1e-9
            assert p.busiest >= opt - 1e-9
            assert p.busiest <= 1.10 * opt


def test_the_stated_bounds_for_two_and_three_experts_a_rank():
    """Two experts a rank: optimal. Three: within 4/3 - 1/(3m) of the optimum (Kellerer & Woeginger)."""
    rng = random.Random(11)
    for experts, ranks in ((6, 3), (8, 4), (10, 5), (9, 3), (12, 4)):
        slots = experts // ranks
        for _ in range(8):
            counts = tuple(float(rng.randint(1, 30)) for _ in range(experts))
            opt = _brute_force(counts, ranks)
            got = optimize_layer(1, counts, ranks).busiest
            if slots == 2:
                assert got == opt
            else:
                assert got <= (4 / 3 - 1 / (3 * ranks)) * opt + 1e-9
            assert max(rank_loads(counts, greedy(counts, ranks))) >= got  # the later steps never raise it


def test_reaches_the_lower_bound_on_a_constructed_instance():
    """4 hot experts (400) among 128 (the rest 100) on 8 ranks: the default puts all four on rank 0
    (1.6x the mean); the optimum spreads them, one per rank on four ranks: 400 + 15 x 100 = 1900,
    which is the bound largest + the 15 smallest others."""
    counts = (400.0,) * 4 + (100.0,) * 124
    p = optimize_layer(3, counts, 8)
    assert p.default_busiest == 4 * 400 + 12 * 100
    assert p.busiest == p.lower_bound == 1900.0 and p.gap == 0.0
    assert p.rank_max_over_mean == pytest.approx(1900 / 1750)
    assert sorted(sum(1 for e in rank if e < 4) for rank in p.placement) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_swap_descent_fixes_what_greedy_leaves():
    """Greedy with 3 slots on (8, 7, 7, 5, 4, 1) over 2 ranks: 8 | 7, 7 -> rank 1 (14), 5 -> rank 0 (13),
    4 -> rank 0 (17, now full), 1 -> rank 1 (15): busiest 17. Swapping 5 and 1 reaches 16 | 16, the
    lower bound (the mean)."""
    counts = (8.0, 7.0, 7.0, 5.0, 4.0, 1.0)
    first = greedy(counts, 2)
    assert max(rank_loads(counts, first)) == 17.0
    better = improve(counts, first)
    assert max(rank_loads(counts, better)) == 16.0 == lower_bound(counts, 2)
    assert optimize_layer(1, counts, 2).busiest == 16.0


def test_the_default_wins_ties():
    counts = (1.0,) * 16
    assert optimize_layer(1, counts, 4).placement == default_placement(16, 4)


def test_ep_must_divide_the_experts():
    routing = Routing(num_experts=8, layers=((1, (1.0,) * 8),))
    with pytest.raises(SpecError, match=r"ep=3: must divide num_experts \(8\)"):
        optimize(routing, 3)


def test_the_model_prices_the_optimised_placement_no_slower():
    model, cluster = load_model("qwen3-30b-a3b"), load_cluster("dgx-h100")
    rng = random.Random(3)
    routing = Routing(num_experts=128, layers=tuple((n, _random_counts(rng, 128)) for n in range(1, 49)))
    for parallel in ("ep=8,mbs=1,gbs=512", "ep=16,mbs=1,gbs=512", "pp=2,ep=32,mbs=1,gbs=512"):
        plan = parse_parallel(parallel, 64)
        found = {p.layer: p.placement for p in optimize(routing, plan.ep)}
        default = predict_routed(model, cluster, plan, routing)
        chosen = predict_routed(model, cluster, plan, routing, found)
        assert chosen.prediction.time.step <= default.prediction.time.step
        assert chosen.max_load.rank_max_over_mean < default.max_load.rank_max_over_mean


def test_a_shared_placement_balances_every_layer_not_their_sum():
    """optimize_shared: one placement for every layer, judged by the sum of the layers' busiest ranks.
    Here two layers with opposite hot experts sum to an even histogram: balancing the sum would
    leave the default (every layer at 2 of 4 experts hot on one rank); per layer the hot pairs split."""
    from piper_core.scheduler.placement import optimize_shared

    routing = Routing(num_experts=4, layers=((1, (10, 10, 1, 1)), (2, (1, 1, 10, 10))))
    shared = optimize_shared(routing, 2)
    assert shared.default_objective == 40 and shared.objective == 22 and shared.gap == 0.0
    assert {frozenset(r) for r in shared.placement} in ({frozenset({0, 2}), frozenset({1, 3})},
                                                        {frozenset({0, 3}), frozenset({1, 2})})
    even = Routing(num_experts=4, layers=((1, (5, 5, 5, 5)),))
    assert optimize_shared(even, 2).placement == default_placement(4, 2)  # ties keep the default
    rng = random.Random(7)
    for _ in range(20):  # never worse than the default, never below the bound
        layers = tuple((n, _random_counts(rng, 8)) for n in (1, 2, 3))
        got = optimize_shared(Routing(num_experts=8, layers=layers), 4)
        assert got.lower_bound - 1e-9 <= got.objective <= got.default_objective + 1e-9
        check_placement(got.placement, 8, 4)
    with pytest.raises(SpecError, match="must divide num_experts"):
        optimize_shared(routing, 3)


def test_piper_placement_shared_writes_the_runtimes_file(tmp_path, capsys):
    """``piper placement --shared --out F``: one placement for every layer, in the format Megatron's
    --piper-placement and the DeepSpeed block read (runtime.placement), predicted no slower than
    Megatron's contiguous placement; on the docs' skewed Qwen3-30B it reaches the lower bound."""
    import json

    from piper_core.cli.main import main
    from piper_core.runtime.placement import read_placement

    out = tmp_path / "placement.json"
    argv = ["placement", "qwen3-30b-a3b", "--routing", "docs/routing/qwen3-30b-skewed.yaml", "--ep", "16", "--shared",
            "--out", str(out), "--cluster", "dgx-h100", "--gpus", "16", "--parallel", "tp=1,pp=1,ep=16,mbs=1,gbs=1024",
            "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    placement = read_placement(out)
    assert (placement.num_experts, placement.ep) == (128, 16) and not placement.is_default
    assert [list(r) for r in placement.ranks] == report["placement"]["ranks"]
    assert report["objective"] <= report["default_objective"] and report["gap"] == pytest.approx(0.0, abs=1e-9)
    steps = report["predicted"]
    assert steps["optimized"]["time_s"]["step"] < steps["default"]["time_s"]["step"]
