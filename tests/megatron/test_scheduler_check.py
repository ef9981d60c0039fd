"""The scheduler check end to end (piper_core.validate.scheduler): the search's pick and one drawn
plan of the validation job, trained by Megatron-Core on two real gloo ranks, judged and recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

PROFILES = Path(__file__).resolve().parents[2] / "docs" / "validation" / "fp32" / "profiles"


def test_pick_and_a_drawn_plan_train_and_are_judged(tmp_path, capsys):
    from piper_core.validate import scheduler as sc

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    shutil.copy(PROFILES / "local-2-fp32.yaml", profiles)
    out = tmp_path / "r.json"
    rc = sc.main(["--jobs", "val-moe/2r/gbs8", "--top", "1", "--random", "1", "--repeats", "1",
                  "--steps", "4",
                  "--profiles", str(profiles), "--json", str(out)])
    data = json.loads(out.read_text())
    job = data["jobs"][0]
    assert [r["kind"] for r in job["runs"]] == ["top1", "random1"]
    assert all("failure" not in r and r["measured_s"] > 0 and r["predicted_s"] > 0 for r in job["runs"])
    assert job["tau"] in (1.0, -1.0) and job["regret"] >= 0
    assert rc == (0 if data["headline"]["ok"] else 1)
    assert data["suite"]["name"] == "full-fp32" and data["profiles"]["local-2-fp32"]["sha256"]
    assert "val-moe/2r/gbs8" in capsys.readouterr().out
