"""`piper validate --quick` in the default test run: a change that breaks the model's agreement with
reality turns CI red.

A quick calibration of 2 local ranks (`piper calibrate --quick`, the host-overhead probe included),
then three alternative plans of one job trained for real with Megatron-Core and Piper's dispatcher
(expert parallel, data parallel, pipeline parallel); the command's own limits must hold: step-time
MAPE <= 10 %, no plan worse than 20 %, parameter + activation memory within 5 %, the scheduler's pick
the measured fastest or within 5 % of it. As root the ranks run under SCHED_FIFO (``--realtime``),
so other work on the machine does not disturb the timings. Timings on a shared 2-core machine still
jitter, so a failing table is measured once more, from a fresh calibration, before the test fails;
both tables are shown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron


def _validate(profiles, out) -> tuple[int, str, dict]:
    cmd = [sys.executable, "-m", "piper_core.cli.main", "validate", "--quick", "--profiles", str(profiles),
           "--json", str(out)]
    if os.geteuid() == 0:
        cmd.append("--realtime")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.exists(), f"piper validate wrote no JSON:\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, proc.stdout, json.loads(out.read_text())


def test_quick_validation_meets_its_limits(tmp_path):
    code, table, result = _validate(tmp_path / "profiles", tmp_path / "first.json")
    tables = [table]
    if code != 0:  # again from a fresh calibration: a profile fitted in a noisy minute is the usual culprit
        code, table, result = _validate(tmp_path / "profiles-2", tmp_path / "second.json")
        tables.append(table)
    v = result["verdict"]
    assert code == 0, "piper validate --quick missed a limit twice:\n" + "\n\n".join(tables)
    assert v["cases"] == 3 and v["step_mape"] <= 0.10 and v["memory_ok"] and v["picks_ok"]
    assert (tmp_path / "profiles" / "local-2.yaml").is_file()
