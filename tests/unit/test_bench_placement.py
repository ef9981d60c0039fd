"""The placement benchmark's arithmetic (piper_core/bench/placement.py), without training: the case
and skew arguments, the verdict (a failed run or unequal losses fail it; at a busiest rank of 2x the
mean the optimised placement must cut the step by 15 %; below, no target), and the one placement
chosen for every layer."""

from __future__ import annotations

import pytest

from piper_core.bench.placement import (
    Case,
    choose_placement,
    estimate_s,
    parse_cases,
    parse_skew,
    summarize,
)
from piper_core.specs.routing import Routing

DECLARED = {"router_bias": {"0": 0.3}, "predicted_s": {"stock": 1.0, "piper-default": 1.0, "piper-optimized": 0.7},
            "predicted_even_s": 0.6}


def _run(variant, step, losses=(5.0, 4.9), tokens=None, error=None):
    if error:
        return {"variant": variant, "error": error, "wall_s": 1.0}
    run = {"variant": variant, "step_s": step, "losses": list(losses)}
    if tokens is not None:
        run["rank_tokens"] = {"1": list(tokens)}
    return run


def _runs(default=1.0, optimized=0.8, before=(600, 200, 100, 100), after=(300, 300, 200, 200), **kw):
    return [_run("stock", 1.0), _run("piper-default", default, tokens=before),
            _run("piper-optimized", optimized, tokens=after, **kw)]


def test_cases_and_skew_parse_with_clear_errors():
    assert parse_cases("2,4", "2x2", 1000.0) == [Case(nodes=1, ranks_per_node=2), Case(nodes=1, ranks_per_node=4),
                                                 Case(nodes=2, ranks_per_node=2, mbit=1000.0)]
    assert [c.name for c in parse_cases("2", "2x2", 50)] == ["local-2", "emu-2x2-50mbit"]
    with pytest.raises(ValueError, match="rank count >= 2"):
        parse_cases("1", "", 1000.0)
    with pytest.raises(ValueError, match="NODESxRANKS with 2 or more nodes"):
        parse_cases("", "1x4", 1000.0)
    with pytest.raises(ValueError, match="no case"):
        parse_cases("", "", 1000.0)
    assert parse_skew("0:0.5,3:-1") == {0: 0.5, 3: -1.0}
    assert parse_skew("none") == {}
    for bad in ("0:x", "a:1", "0:1,0:2", "0", ""):
        with pytest.raises(ValueError, match="EXPERT:BIAS"):
            parse_skew(bad)
    assert estimate_s([Case(nodes=1, ranks_per_node=2)], 5, per_run_s=10.0) == 210.0  # 1 + 4 variants x 5


def test_a_skewed_case_is_met_when_the_optimised_placement_cuts_15_percent():
    s = summarize(DECLARED, _runs(optimized=0.8))
    v = s["verdict"]
    assert v["measured_max_over_mean_default"] == pytest.approx(2.4) and v["met"] is True
    assert v["step_cut"] == pytest.approx(0.2) and v["losses_equal"] is True
    assert s["load_after"]["total_max_over_mean"] == pytest.approx(1.2)
    assert s["table"]["piper-optimized"]["model_error"] == pytest.approx(0.7 / 0.8 - 1)
    assert summarize(DECLARED, _runs(optimized=0.9))["verdict"]["met"] is False


def test_below_2x_there_is_no_target():
    v = summarize(DECLARED, _runs(before=(350, 250, 200, 200)))["verdict"]
    assert v["met"] is None and "no target" in v["target"]


def test_without_a_router_bias_the_optimised_placement_may_cost_2_percent():
    even = DECLARED | {"router_bias": {}}
    assert summarize(even, _runs(optimized=1.019, before=(300, 300, 200, 200)))["verdict"]["met"] is True
    v = summarize(even, _runs(optimized=1.03, before=(300, 300, 200, 200)))["verdict"]
    assert v["met"] is False and "even load" in v["target"]


def test_a_failed_run_or_unequal_losses_fail_the_verdict():
    v = summarize(DECLARED, _runs(error="RankFailure: rank 1 died"))["verdict"]
    assert v["met"] is False and v["failed_runs"] == 1
    v = summarize(DECLARED, _runs(losses=(5.0, 4.8)))["verdict"]
    assert v["met"] is False and v["losses_equal"] is False and v["loss_max_rel_diff"] == pytest.approx(0.1 / 4.9)


def test_the_placement_puts_each_layers_hot_experts_apart():
    routing = Routing(num_experts=8, layers=((1, (40, 30, 5, 5, 5, 5, 5, 5)), (2, (30, 40, 5, 5, 5, 5, 5, 5))))
    placement, chosen = choose_placement(routing, 4)
    assert placement.ep == 4 and sorted(placement.logical_at) == list(range(8))
    rank_of = {e: r for r, experts in enumerate(placement.ranks) for e in experts}
    assert rank_of[0] != rank_of[1]  # the two hot experts apart
    assert chosen.objective < chosen.default_objective and chosen.placement == placement.ranks


def test_the_model_summary_judges_every_prediction_of_every_run():
    """Issue 17's model acceptance over several runs: the histogram's MAPE and worst error against the
    suite's limits, and even routing's MAPE at least 5 points worse; every case and variant counts."""
    from piper_core.bench.placement_report import model_summary

    def run(*pairs):
        table = {f"v{i}": {"model_error": h, "model_error_even": e} for i, (h, e) in enumerate(pairs)}
        return {"cases": [{"case": "local-2", "summary": {"table": table}}]}

    met = model_summary([("a", run((0.05, -0.30), (-0.08, -0.25))), ("b", run((0.10, 0.20)))])
    assert "| the measured histogram | 3 | 7.7% | +10.0% |" in met and met[-1].endswith("verdict: met.")
    worst = model_summary([("a", run((0.02, -0.30), (-0.26, -0.25)))])  # MAPE 14 %, worst beyond 25 %
    assert "limits (MAPE <= 10%, worst <= 25%): no" in worst[-1]
    assert worst[-1].endswith("verdict: not met.")
    same = model_summary([("a", run((0.05, 0.06), (0.05, 0.07)))])  # within, but even routing as good
    assert "visibly worse (MAPE 5% or more above): no" in same[-1] and same[-1].endswith("not met.")
    missing = model_summary([("a", run((0.05, -0.30), (None, None)))])  # a failed variant: counted as missing
    assert "| the measured histogram | 1 |" in missing[2] and missing[-1].startswith("1 variant(s)")
    assert missing[-2].endswith("verdict: not met.")


def _decision(after_step, moved, *, before=1.0, after=0.8, move_s=0.05, predicted_move_s=0.04):
    return {"after_step": after_step, "moved": moved, "experts_moved": 2 if moved else 0, "seconds": 0.2,
            "predicted_step_before_s": before, "predicted_step_after_s": after, "move_s": move_s if moved else None,
            "predicted_move_s": predicted_move_s if moved else 0.0, "line": f"decision after {after_step}"}


def test_the_migrate_variant_is_predicted_by_its_own_decision_and_its_moves_are_reported():
    """piper-migrate: its predicted step is what the live decision after the warm-up predicted for the
    placement it moved to (the median over runs), its load after the move is kept, its moves counted,
    and its losses must equal the others' like every variant's."""
    migrate = [dict(_run("piper-migrate", 0.82, tokens=(300, 300, 200, 200)),
                    migrations=[_decision(2, True, after=0.78), _decision(4, False)]),
               dict(_run("piper-migrate", 0.84, tokens=(300, 300, 200, 200)),
                    migrations=[_decision(2, True, after=0.80), _decision(4, False)])]
    s = summarize(DECLARED, _runs() + migrate)
    row = s["table"]["piper-migrate"]
    assert row["median_s"] == pytest.approx(0.83) and row["predicted_s"] == pytest.approx(0.79)
    assert row["model_error"] == pytest.approx(0.79 / 0.83 - 1)
    assert s["load_migrated"]["total_max_over_mean"] == pytest.approx(1.2)
    m = s["migration"]
    assert m["runs"] == 2 and m["moved_after_warmup"] == 2 and m["later_moves"] == 0
    assert m["move_s"] == [0.05, 0.05] and m["predicted_move_s"] == [0.04, 0.04]
    kept = summarize(DECLARED, _runs() + [dict(_run("piper-migrate", 1.0), migrations=[_decision(2, False)])])
    assert kept["table"]["piper-migrate"]["predicted_s"] == 1.0 and kept["migration"]["moved_after_warmup"] == 0
    unequal = [dict(_run("piper-migrate", 0.8, losses=(5.0, 4.7)), migrations=[_decision(2, True)])]
    assert summarize(DECLARED, _runs() + unequal)["verdict"]["losses_equal"] is False
    from piper_core.bench.placement_report import _migration_lines

    assert "moved in 2 of 2 runs" in _migration_lines(m)[0]


def test_the_verdict_table_shows_the_migrated_variant_beside_the_judged_cut():
    """docs/placement-bench.md's verdict table: the migrated variant's median, its load and its cut
    against Piper's default stand beside the judged cut (default -> optimised), which they do not change;
    a results file from before the variant shows "-" there."""
    from piper_core.bench.placement_report import verdict_table

    migrate = [dict(_run("piper-migrate", 0.75, tokens=(300, 300, 200, 200)), migrations=[_decision(2, True)])]
    with_it = summarize(DECLARED, _runs() + migrate)
    without = summarize(DECLARED, _runs())
    without.pop("load_migrated"), without.pop("migration")
    without["table"].pop("piper-migrate", None)
    rows = verdict_table({"cases": [{"case": "a", "summary": with_it}, {"case": "b", "summary": without},
                                    {"case": "c", "summary": {}}]})
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[5:8] == ["Piper migrated s", "step cut (judged)", "cut by migration"], header
    a, b, c = ([x.strip() for x in r.strip("|").split("|")] for r in rows[2:])
    assert a[1] == "2.40 -> 1.20 -> 1.20" and a[5] == "0.750" and a[6] == "20.0%" and a[7] == "25.0%", a
    assert b[1] == "2.40 -> 1.20" and b[5] == "-" and b[7] == "-" and b[6] == a[6], b
    assert len(c) == len(header) and c[-1] == "not measured", c


def test_a_job_that_migrates_names_what_it_is_missing():
    from piper_core.errors import SpecError
    from piper_core.presets import load_cluster
    from piper_core.bench.placement import SMOKE
    from piper_core.specs.parallel import ParallelPlan
    from piper_core.validate.instrument import TrainJob

    plan = ParallelPlan(gpus=2, ep=2, global_batch_size=4, micro_batch_size=2, precision="fp32",
                        distributed_optimizer=False)
    cluster = load_cluster("cpu-local")
    job = TrainJob(model=SMOKE, plan=plan, migrate_every=2, migrate_cluster=cluster)
    assert TrainJob.from_json(job.to_json()) == job
    for kw, match in ((dict(migrate_every=2), "migrate_cluster.*must be given with migrate_every"),
                      (dict(migrate_every=0, migrate_cluster=cluster), "migrate_every.*whole number of steps"),
                      (dict(migrate_every=2, migrate_horizon=-1, migrate_cluster=cluster), "migrate_horizon"),
                      (dict(migrate_horizon=4), "migrate_horizon.*makes none without migrate_every"),
                      (dict(migrate_every=2, migrate_cluster=cluster, stock=True), "needs Piper's dispatcher")):
        with pytest.raises(SpecError, match=match):
            TrainJob(model=SMOKE, plan=plan, **kw)
    from piper_deepspeed.measure import ds_config

    with pytest.raises(SpecError, match="migrate_every.*DeepSpeed trainer runs no skewed router, placement, migration"):
        ds_config(job)
