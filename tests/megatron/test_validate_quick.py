"""`piper validate --quick` in the default test run: the whole chain on fresh measurements, every run
counted, within limits that a broken chain misses and this shared host's calibration noise does not.

A quick calibration of 2 local ranks (`piper calibrate --quick`, the host-overhead probe included),
then the pre-registered quick suite (piper_core/validate/suites/quick.yaml): three alternative plans of
one job trained for real with Megatron-Core and Piper's dispatcher (expert parallel with micro-batch 4,
data parallel, pipeline parallel), and one plan through DeepSpeed-MoE with Piper's layer, from its own
quick calibration. Every run counts in the figures the limits below judge. As root the ranks run under
SCHED_FIFO (``--realtime``), so other work on the machine does not take their cores.

The limits here are much wider than the acceptance limits `piper validate` prints (and `make validate`
holds on the full set, docs/validation.md). This test checks, on fresh measurements, that the whole
chain -- quick calibration, probe fit, real training through both frameworks, prediction -- runs and
lands near reality; it is not the accuracy claim (docs/validation.md states that, from full-suite runs
that count every run), and it is not the regression guard: tests/unit/test_recorded_agreement.py holds
this version to the recorded full-suite runs, deterministically. Why wide: the quick calibration's host
terms trade weight from one calibration to the next (between two fresh quick calibrations, 2026-12-07:
step term 7931 us and 0, per-micro-batch 0 and 4820 us, backward factor 0 and 1.6), so the same
four plans came out at MAPE 28.7 % and 25.4 % in one CI run (2026-12-07, worst +50.2 % on
ds-2r-ep2-mbs2, both tries), and 18.5 %, 4.9 % and 8.7 % in three runs on the session machine that
morning. CI therefore holds MAPE <= 35 %, no plan off by more than 60 %, memory within 5 % (memory
does not move with the machine: it held 0.5 % in every one of those runs) and the pick within 10 % of
the measured fastest. A table that misses is measured once more from a fresh calibration before the
test fails.

On a bf16 AMD EPYC (2026-12-04) this test failed in CI with every plan predicted 12-60 % too slow:
the probe trained its 13 jobs in one process and leaked each job's gloo groups, so its later runs
ran up to 35 % slower and the fitted host terms came out too large. The trainer now destroys them
(``piper_core.runtime.groups.released_groups``; tests/runtime/test_groups.py); two fresh
calibrations after the fix gave MAPE 3.9 % and 11.7 %.

The suite trains in fp32 (registered 2026-12-05), from fp32 calibrations: on CPUs without bf16
instructions (AVX2-only AMD EPYCs, on which CI has run) a bf16 step is torch's emulation, and the bf16
version of this test was skipped there (the quick calibration's bf16 GEMM rate predicted Megatron's
bf16 steps ~2.7x too slow, 2026-12-03). fp32 runs natively on every CPU, so the test runs everywhere.

Since 2026-12-06 the calibration's host-overhead probe trains a model family of its own
(piper_core/calibrate/probe.py: RMSNorm with ungated MLPs at widths 96 and 192), so every run here is
a user's model outside the probe's family, predicted from a calibration that never saw it: this test
is the acceptance check that such a calibration predicts it within the limits above. Three fresh
quick calibrations with a single-width probe (width 96) put DeepSpeed's run 20-28 % too fast; with the
two widths, two fresh ones gave MAPE 5.1 % and 21.0 % (the second calibrated while the machine ran
slow: its probe steps took up to 60 % longer than the first's; the retry below is for that).
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


MAPE, WORST, MEMORY, PICK = 0.35, 0.60, 0.05, 0.10


def _misses(v: dict) -> list[str]:
    out = []
    if v["step_mape"] > MAPE:
        out.append(f"step MAPE {v['step_mape']:.3f} > {MAPE}")
    if abs(v["worst_step_error"]) > WORST:
        out.append(f"{v['worst_step_case']} off by {v['worst_step_error']:+.3f} (> {WORST})")
    if abs(v["worst_memory_error"]) > MEMORY:
        out.append(f"memory of {v['worst_memory_case']} off by {v['worst_memory_error']:+.3f} (> {MEMORY})")
    if "worst_peak_error" in v and abs(v["worst_peak_error"]) > MEMORY:
        out.append(f"peak memory of {v['worst_peak_case']} off by {v['worst_peak_error']:+.3f} (> {MEMORY})")
    out += [f"pick {p['pick']} is {p['pick_slower_by']:.3f} slower than {p['measured_fastest']} (> {PICK})"
            for p in v["picks"].values() if p["pick_slower_by"] > PICK]
    return out


def test_quick_validation_agrees_with_reality(tmp_path):
    _, table, result = _validate(tmp_path / "profiles", tmp_path / "first.json")
    tables, misses = [table], _misses(result["verdict"])
    if misses:  # again from a fresh calibration: a profile fitted in a noisy minute is the usual culprit
        _, table, result = _validate(tmp_path / "profiles-2", tmp_path / "second.json")
        tables.append(table)
        misses = _misses(result["verdict"])
    # every run of the suite is counted: 3 Megatron plans and the DeepSpeed one
    assert result["verdict"]["cases"] == 4 and len(result["verdict"]["picks"]) == 1
    assert result["suite"]["name"] == "quick" and len(result["suite"]["sha256"]) == 64
    assert set(result["profiles"]) == {"local-2-fp32", "local-2-deepspeed-fp32"}  # the suite trains in fp32
    assert result["verdict"]["peak_cases"] == 4  # every run's peak tensor memory measured too
    # every run is out of the probe's family: no model here shares a width with any probe model
    from piper_core.calibrate.probe import PROBE_MODEL, PROBE_WIDE
    from piper_core.validate.cases import select

    probe_widths = {PROBE_MODEL.hidden_size, PROBE_WIDE.hidden_size}
    assert all(c.model.hidden_size not in probe_widths for c in select(None, quick=True))
    assert not misses, "; ".join(misses) + "\n" + "\n\n".join(tables)
    assert (tmp_path / "profiles" / "local-2-fp32.yaml").is_file()
    # the DeepSpeed path: trained through DeepSpeed-MoE with Piper's layer, predicted from its own
    # DeepSpeed-probed profile
    (ds,) = [r for r in result["rows"] if r["framework"] == "deepspeed"]
    assert ds["topology"] == "local-2-deepspeed-fp32", ds
    assert len(ds["losses"]) == 12 and ds["losses"][-1] < ds["losses"][0]
