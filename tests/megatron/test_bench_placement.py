"""The expert placement benchmark end to end, small (``python -m piper_core.bench.placement``, issue 17).

One round of the ``smoke`` workload on 4 local gloo ranks (ep 4), priced on the ``cpu-local``
preset (no calibration): the measuring run's trace files give the routing histogram, the placement
and predictions are declared (written to the results) before the first timed run, then stock,
Piper's default and Piper's optimised placement each train once, and Piper's default placement
with the live migration decision after the warm-up (``piper-migrate``). Checked: the structure of the
results, every run succeeded, the losses are equal across the four (the same logical model), the
router bias loads the busiest rank at 2x the mean or more with the default placement and the
optimised placement lowers it, the migration moves experts before the timed steps and lowers it too,
the histogram was read from the trace files, the report and the plot are written. No timing is
asserted.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    import piper_core.bench.placement as placement

    tmp = tmp_path_factory.mktemp("bench-placement")
    snapshots: list[dict] = []
    real = placement._write

    def spy(path, data):  # the results as written after each step, to see what was there before the runs
        snapshots.append(copy.deepcopy(data))
        real(path, data)

    placement._write = spy
    try:
        code = placement.main(["--workload", "smoke", "--ranks", "4", "--rounds", "1", "--timed-steps", "2",
                               "--cluster", "cpu-local", "--json", str(tmp / "results.json"),
                               "--work", str(tmp / "work")])
    finally:
        placement._write = real
    return code, json.loads((tmp / "results.json").read_text()), snapshots, tmp


def test_results_hold_one_case_with_every_variant(bench):
    code, results, _, _ = bench
    assert code in (0, 1)  # 1: a verdict not met (timings are not judged here)
    assert results["variants"] == ["stock", "piper-default", "piper-optimized", "piper-migrate"]
    (case,) = results["cases"]
    assert case["case"] == "local-4" and case["world"] == 4
    assert sorted(r["variant"] for r in case["runs"]) == sorted(results["variants"])
    for run in case["runs"]:
        assert "error" not in run, run
        assert run["step_s"] > 0 and len(run["steps_s"]) == run["warmup"] + 2
        assert run["piper_core"].startswith(str(Path(__file__).resolve().parents[2]))
    table = case["summary"]["table"]
    for name, row in table.items():
        assert row["rounds"] == 1 and row["failed"] == 0, name
        assert row["predicted_s"] > 0 and row["predicted_even_s"] > 0 and row["model_error"] is not None, name
    assert case["summary"]["verdict"]["failed_runs"] == 0


def test_the_declaration_is_written_before_the_first_timed_run(bench):
    _, _, snapshots, _ = bench
    first = next(s for s in snapshots if s["cases"] and s["cases"][0]["runs"])
    declared = first["cases"][0]["declared"]
    assert declared["judged"]["baseline"] == "piper-default" and declared["judged"]["candidate"] == "piper-optimized"
    assert set(declared["predicted_s"]) == {"stock", "piper-default", "piper-optimized"}
    assert declared["placement"]["ep"] == 4 and declared["placement"]["moved"] > 0
    assert sorted(declared["histogram"]["layers"]) == ["1", "2"]


def test_losses_are_equal_across_placements(bench):
    _, results, _, _ = bench
    case = results["cases"][0]
    losses = [r["losses"] for r in case["runs"]]
    assert len(losses) == 4 and len(losses[0]) == 4
    assert all(x == pytest.approx(losses[0], rel=1e-6) for x in losses)
    assert case["summary"]["verdict"]["losses_equal"] is True


def test_the_router_bias_skews_the_default_placement_and_the_optimised_one_spreads_it(bench):
    _, results, _, _ = bench
    case = results["cases"][0]
    before, after = case["summary"]["load_before"], case["summary"]["load_after"]
    assert max(before["max_over_mean"].values()) >= 2.0, before
    assert after["total_max_over_mean"] < before["total_max_over_mean"], (before, after)
    # the histogram the declaration used is the measuring run's trace, summed over ranks
    histogram = case["declared"]["histogram"]["layers"]
    traced = case["measure"]["rank_tokens"]
    for layer, counts in histogram.items():
        assert sum(counts) == sum(traced[layer])
        assert [sum(counts[2 * r:2 * r + 2]) for r in range(4)] == traced[layer]  # default placement: 2 a rank
    assert all(Path(f).is_file() for f in case["measure"]["trace_files"])


def test_the_report_and_the_plot_are_written(bench):
    from piper_core.bench.placement_report import report

    _, results, _, tmp = bench
    assert Path(results["plot"]).is_file() and Path(results["plot"]).parent == tmp
    text = report(results)
    assert "| piper-optimized |" in text and "load per rank before (default)" in text
    from piper_core.bench.placement_report import model_table, verdict_table

    verdict = verdict_table(results)  # the table docs/placement-bench.md quotes, one row per case
    assert verdict[0].startswith("| case | busiest rank / mean") and len(verdict) == 2 + len(results["cases"])
    assert all(row.rstrip(" |").split("| ")[-1] in ("met", "**not met**", "no target") for row in verdict[2:])
    rows = model_table(results)[2:]
    assert len(rows) == sum(len(e["summary"]["table"]) for e in results["cases"] if "table" in e.get("summary", {}))


def test_the_migrate_variant_moves_experts_after_the_warm_up_and_evens_the_load(bench):
    _, results, _, _ = bench
    case = results["cases"][0]
    (run,) = [r for r in case["runs"] if r["variant"] == "piper-migrate"]
    first = run["migrations"][0]
    assert first["after_step"] == run["warmup"] and first["moved"] and first["experts_moved"] > 0, first
    assert first["move_s"] > 0 and first["predicted_move_s"] > 0
    assert first["sent_bytes"] > 0  # rank 0's record: it held the hot experts 0 and 1, and gives one away
    assert first["predicted_step_after_s"] < first["predicted_step_before_s"]
    assert len(run["migrations"]) == 1  # 2 warm-up + 2 timed steps: no decision after the last step
    summary = case["summary"]
    assert summary["load_migrated"]["total_max_over_mean"] < summary["load_before"]["total_max_over_mean"]
    assert summary["table"]["piper-migrate"]["predicted_s"] == pytest.approx(first["predicted_step_after_s"])
    assert summary["migration"]["moved_after_warmup"] == 1
    from piper_core.bench.placement_report import report

    assert "migration after the warm-up: moved in 1 of 1 runs" in report(results)
