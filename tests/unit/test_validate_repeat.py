"""Repeatability figures over recorded runs of one suite (piper_core/validate/repeat.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from piper_core.errors import SpecError
from piper_core.validate.repeat import figures, load_runs, main

RECORD = Path(__file__).resolve().parents[2] / "docs" / "validation" / "fp32" / "results.json"


def _write(tmp_path: Path, name: str, record: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(record))
    return p


def _slower(record: dict, factor: float) -> dict:
    """The same run with every measured step ``factor`` times longer (errors recomputed)."""
    out = copy.deepcopy(record)
    errs = []
    for row in out["rows"]:
        s = row["step_s"]
        s["measured"] *= factor
        s["error"] = s["predicted"] / s["measured"] - 1
        errs.append(s["error"])
    out["verdict"]["step_mape"] = sum(abs(e) for e in errs) / len(errs)
    out["verdict"]["worst_step_error"] = max(errs, key=abs)
    return out


def test_range_pooled_and_spread(tmp_path):
    base = json.loads(RECORD.read_text())
    paths = [_write(tmp_path, "a.json", base), _write(tmp_path, "b.json", _slower(base, 1.2))]
    f = figures(load_runs(paths))
    n = len(base["rows"])
    assert f["runs"] == 2 and f["rows"] == 2 * n
    lo, hi = f["range"]["step_mape"]
    assert lo == min(base["verdict"]["step_mape"], f["per_run"][1]["step_mape"]) and hi > lo
    # every case measured 1.2x in the second run: spread (1.2 - 1) / median(1, 1.2) = 0.2 / 1.1
    assert all(c["spread"] == pytest.approx(0.2 / 1.1, rel=1e-6) for c in f["cases"])
    pooled = sum(abs(r["step_s"]["error"]) for r in base["rows"]) + sum(
        abs(r["step_s"]["error"]) for r in _slower(base, 1.2)["rows"])
    assert f["pooled_step_mape"] == pytest.approx(pooled / (2 * n))
    assert [len(c["errors"]) for c in f["cases"]] == [2] * n


def test_runs_of_another_suite_or_other_cases_are_refused(tmp_path):
    base = json.loads(RECORD.read_text())
    other = copy.deepcopy(base)
    other["suite"]["sha256"] = "0" * 64
    with pytest.raises(SpecError, match="same registered suite"):
        load_runs([_write(tmp_path, "a.json", base), _write(tmp_path, "b.json", other)])
    fewer = copy.deepcopy(base)
    fewer["rows"] = fewer["rows"][1:]
    with pytest.raises(SpecError, match="other cases"):
        load_runs([_write(tmp_path, "a.json", base), _write(tmp_path, "c.json", fewer)])
    with pytest.raises(SpecError, match="at least 2"):
        load_runs([_write(tmp_path, "a.json", base)])


def test_cli_says_what_is_wrong(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad), str(RECORD)]) == 2
    assert "bad.json" in capsys.readouterr().err
    out = tmp_path / "f.json"
    assert main([str(RECORD), str(RECORD), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["worst_case_spread"] == 0.0
    assert "pooled" in capsys.readouterr().out
