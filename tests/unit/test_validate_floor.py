"""``python -m piper_core.validate.floor``: one run's measurements as the prediction of another's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from piper_core.errors import SpecError
from piper_core.validate.floor import figures, load, main, pair

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"step_mape": 0.10, "worst_step": 0.20, "memory": 0.05, "pick": 0.05}


def _run(path: str, measured: dict[str, float], rounds: dict[str, list[float]] | None = None, mape: float = 0.1) -> dict:
    rows = [{"case": c, "step_s": {"measured": t, **({"rounds": rounds[c]} if rounds and c in rounds else {})}}
            for c, t in measured.items()]
    return {"path": path, "rows": rows,
            "verdict": {"limits": LIMITS, "cases": len(rows), "step_mape": mape, "worst_step_error": mape}}


def test_identical_runs_have_a_floor_of_zero_and_pass():
    a, b = _run("a/1/results.json", {"x": 1.0, "y": 2.0}), _run("b/1/results.json", {"x": 1.0, "y": 2.0})
    p = pair(a, b)
    assert p["step_mape"] == 0.0 and p["passes"] and p["cases"] == 2


def test_one_case_off_is_the_worst_and_a_whole_run_drift_is_taken_out_separately():
    a = _run("a", {"x": 1.3, "y": 2.0, "z": 3.0})
    b = _run("b", {"x": 1.0, "y": 2.0, "z": 3.0})
    p = pair(a, b)
    assert p["worst_step_case"] == "x" and p["worst_step_error"] == pytest.approx(0.3)
    assert p["step_mape"] == pytest.approx(0.1) and not p["passes"]  # worst 30 % > 20 %
    slow = _run("s", {"x": 1.1, "y": 2.2, "z": 3.3})  # everything 10 % slower: drift, no per-case noise
    q = pair(slow, b)
    assert q["step_mape"] == pytest.approx(0.1) and q["step_mape_drift_removed"] == pytest.approx(0.0, abs=1e-12)


def test_only_shared_cases_count_and_rounds_give_the_noise_inside_a_run():
    a = _run("a", {"x": 1.0, "only-a": 5.0}, rounds={"x": [0.9, 1.0, 1.1]})
    b = _run("b", {"x": 1.0, "only-b": 7.0}, mape=0.3)
    f = figures([a, b])
    assert all(p["cases"] == 1 for p in f["pairs"]) and len(f["pairs"]) == 2
    assert f["within_run"]["rounds"] == 3 and f["within_run"]["mean_abs_deviation"] == pytest.approx(0.2 / 3)
    assert f["model_pooled_step_mape"] == pytest.approx(0.2)  # 0.1 and 0.3, two cases each


def test_bad_input_is_refused_with_the_fix(tmp_path):
    with pytest.raises(SpecError, match="at least 2"):
        load([tmp_path / "one.json"])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SpecError, match="not a readable"):
        load([bad, bad])
    with pytest.raises(SpecError, match="share no case"):
        figures([_run("a", {"x": 1.0}), _run("b", {"y": 1.0})])


def test_the_recorded_runs_floor_and_json(tmp_path, capsys):
    runs = [ROOT / f"docs/validation/fp32/{r}/results.json" for r in ("rounds3-dopt/1", "rounds3-dopt/2")]
    out = tmp_path / "floor.json"
    assert main([str(r) for r in runs] + ["--json", str(out)]) == 0
    f = json.loads(out.read_text())
    assert len(f["pairs"]) == 2 and all(p["cases"] == 40 for p in f["pairs"])
    assert 0.05 < f["floor_step_mape"]["mean"] < 0.2  # the two runs' measurements disagree by ~10 %
    assert "the oracle (another run's measurement of the same case)" in capsys.readouterr().out


def test_a_ratio_of_two_cases_inside_each_run_measured_and_predicted(capsys):
    from piper_core.validate.floor import ratio

    def run(path, a, b):
        return {"path": path, "verdict": {}, "rows": [{"case": "a", "step_s": {"measured": a[0], "predicted": a[1]}},
                                                       {"case": "b", "step_s": {"measured": b[0], "predicted": b[1]}}]}

    rows = ratio([run("r1", (3.0, 2.0), (2.0, 2.0)), run("r2", (1.5, 1.0), (1.0, 1.0))], "a", "b")
    assert [(r["measured"], r["predicted"]) for r in rows] == [(1.5, 1.0), (1.5, 1.0)]
    with pytest.raises(SpecError, match="no run has both cases"):
        ratio([run("r1", (1.0, 1.0), (1.0, 1.0))], "a", "zzz")
    recorded = [str(ROOT / f"docs/validation/fp32/rounds3-dopt/{i}/results.json") for i in (1, 2)]
    assert main(recorded + ["--ratio", "emu2x1-ep1-dopt", "emu2x1-ep1"]) == 0
    assert "emu2x1-ep1-dopt / emu2x1-ep1" in capsys.readouterr().out


def _speed_run(path: str, cases: dict[str, float], errors: dict[str, float]) -> dict:
    rows = [{"case": c, "topology": "t", "step_s": {"measured": t, "error": errors[c]}} for c, t in cases.items()]
    return {"path": path, "rows": rows, "verdict": {}, "profiles": {"t": {"path": f"{path}.yaml"}}}


def test_speed_finds_the_error_a_probe_in_a_slow_stretch_leaves(monkeypatch):
    """Three runs whose cases ran at one speed while their probes caught the machine 20 % slow, at
    speed and 20 % fast; the model's error moves with it, and the line through them gives back the
    error at equal speed (+5 %) and the slope (1: host terms fitted 20 % slow predict 20 % slow)."""
    from piper_core.validate import floor

    probes = {"r1": {"p": 1.2, "q": 2.4}, "r2": {"p": 1.0, "q": 2.0}, "r3": {"p": 0.8, "q": 1.6}}
    monkeypatch.setattr(floor, "_profile_path", lambda run, topology: run["path"])
    monkeypatch.setattr(floor, "_probe_steps", lambda path: probes[path])
    runs = [_speed_run(r, {"x": 1.0, "y": 3.0}, {"x": e, "y": e}) for r, e in (("r1", 0.25), ("r2", 0.05), ("r3", -0.15))]
    f = floor.speed(runs, "t")
    assert [round(r["probe_over_cases"], 6) for r in f["runs"]] == [1.2, 1.0, 0.8]
    assert f["fit"]["error_at_equal_speed"] == pytest.approx(0.05) and f["fit"]["slope"] == pytest.approx(1.0)
    assert f["fit"]["correlation"] == pytest.approx(1.0)
    assert "+5.0% at equal speed" in "\n".join(floor.speed_lines(f))


def test_speed_on_the_recorded_runs_and_its_errors(capsys):
    """The six recorded 3-round runs: on local-2 the probe's speed against the cases' explains the
    model's median error from run to run (it went from -14.5 % to +26.5 % as the probe ran 17 % fast
    to 18 % slow); a topology no run has is refused with the fix."""
    from piper_core.validate.floor import speed

    names = ("rounds3-shared/1", "rounds3-shared/2", "rounds3-interleaved/1", "rounds3-dopt/1", "rounds3-dopt/2",
             "rounds3-core/1")
    runs = load([ROOT / f"docs/validation/fp32/{r}/results.json" for r in names])
    f = speed(runs, "local-2-fp32")
    assert len(f["runs"]) == 6 and all(r["n"] >= 17 for r in f["runs"])
    assert f["fit"]["correlation"] > 0.9
    assert f["fit"]["error_at_equal_speed"] < min(abs(r["median_error"]) for r in f["runs"][2:])
    with pytest.raises(SpecError, match="--speed"):
        speed(runs, "no-such-topology")
    assert main([str(ROOT / f"docs/validation/fp32/{r}/results.json") for r in names[:3]] + ["--speed", "local-2-fp32"]) == 0
    assert "at equal speed" in capsys.readouterr().out
