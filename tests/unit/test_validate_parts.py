"""``python -m piper_core.validate.parts``: each prediction split into host, element-wise and the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from piper_core.validate.parts import PARTS, case_figures, figures, main, rows, split

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs/validation/fp32/rounds3-p2p/1/results.json"


def _row(case: str, topology: str, rest: float, host: float, elementwise: float, measured: float) -> dict:
    return {"run": "r", "case": case, "topology": topology, "measured": measured, "rest": rest, "host": host,
            "elementwise": elementwise, "predicted": rest + host + elementwise}


def test_the_scales_give_back_a_planted_mispricing_of_one_part():
    """Measured = rest + half the host part + the element-wise part: the scales say so, and leave no error."""
    planted = [_row(f"c{i}", "t", rest, host, elem, rest + 0.5 * host + elem)
               for i, (rest, host, elem) in enumerate([(1, 2, 1), (2, 1, 1), (1, 1, 3), (3, 2, 2), (1, 3, 1)])]
    f = figures(planted)["t"]
    assert f["scales"] == pytest.approx({"rest": 1.0, "host": 0.5, "elementwise": 1.0}, abs=1e-9)
    assert f["mape_with_scales"] == pytest.approx(0.0, abs=1e-9) and f["median_error"] > 0
    assert f["rows"] == 5 and all(0 < share < 1 for share in f["shares"].values())  # medians: no sum


def test_cases_come_by_median_error_and_an_unknown_topology_is_named():
    rs = [_row("slow", "t", 1, 1, 0, 1.0), _row("slow", "t", 1, 1, 0, 1.0), _row("fast", "t", 1, 1, 0, 4.0)]
    cases = case_figures(rs, "t")
    assert [c["case"] for c in cases] == ["fast", "slow"] and cases[1]["runs"] == 2
    assert cases[1]["median_error"] == pytest.approx(1.0) and cases[0]["median_error"] == pytest.approx(-0.5)
    with pytest.raises(Exception, match="--cases.*local-9.*one of"):
        case_figures(rs, "local-9")


def test_a_recorded_run_splits_into_parts_that_add_up_to_its_prediction(tmp_path, capsys):
    recorded = json.loads(RUN.read_text())
    split_rows = rows([RUN])
    assert len(split_rows) == len(recorded["rows"])
    for r in split_rows:
        assert all(r[p] >= -1e-12 for p in PARTS) and r["host"] > 0, r
        assert sum(r[p] for p in PARTS) == pytest.approx(r["predicted"], rel=1e-9)
    # the version under test predicts the run as tests/unit/test_recorded_agreement.py holds it
    by_case = {r["case"]: r for r in recorded["rows"]}
    moved = [r["case"] for r in split_rows if abs(r["predicted"] / by_case[r["case"]]["step_s"]["predicted"] - 1) > 0.02]
    assert len(moved) <= len(split_rows) // 4, moved
    out = tmp_path / "parts.json"
    assert main([str(RUN), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "local-2-fp32" in printed and "MAPE with the scales" in printed
    data = json.loads(out.read_text())
    assert set(data["topologies"]) == {r["topology"] for r in split_rows} and len(data["rows"]) == len(split_rows)
    assert main([str(RUN), "--cases", "nowhere"]) == 2
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "is not a readable piper validate --json record" in capsys.readouterr().err


def test_a_gpu_preset_splits_too():
    from piper_core.presets import load_cluster, load_model
    from piper_core.specs.parallel import ParallelPlan

    cluster, model = load_cluster("dgx-h100"), load_model("mixtral-8x7b")
    plan = ParallelPlan(gpus=64, tp=2, pp=4, ep=8, sequence_parallel=True, micro_batch_size=1,
                        global_batch_size=1024)
    parts = split(model, plan, cluster)
    assert parts["predicted"] == pytest.approx(parts["rest"] + parts["host"] + parts["elementwise"])
    assert parts["rest"] > 0 and parts["host"] >= 0
