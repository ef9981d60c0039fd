"""``piper predict``: JSON contract, human output, errors, speed, and no torch import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from piper_core.cli.main import main
from tests.speed import machine_factor

DEEPSEEK = ["predict", "deepseek-v3", "--cluster", "dgx-h100", "--gpus", "1024", "--parallel",
            "tp=1,pp=16,last_stage_layers=1,ep=64,etp=1,mbs=1,gbs=4096,recompute=selective"]


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_contract_keys(capsys):
    out = run_json(capsys, DEEPSEEK)
    for key in ("total", "active"):
        assert isinstance(out["params"][key], int)
    assert out["flops_per_step"]["model"] > 0 and out["flops_per_step"]["hardware"] > out["flops_per_step"]["model"]
    mem = out["memory_gib"]
    assert len(mem["stages"]) == 16
    assert mem["peak"] == max(s["total"] for s in mem["stages"])
    assert mem["capacity"] == pytest.approx(79.65 * 0.95, abs=1e-3)
    assert out["feasible"] is (mem["peak"] <= mem["capacity"])
    for stage in mem["stages"]:
        parts = sum(stage[k] for k in ("weights", "gradients", "optimizer", "activations", "buffers", "overhead"))
        assert stage["total"] == pytest.approx(parts, abs=1e-3)


def test_infeasible_plan_says_by_how_much(capsys):
    argv = ["predict", "mixtral-8x22b", "--cluster", "dgx-a100", "--gpus", "8", "--parallel", "ep=8,mbs=4,gbs=32,dist_opt=0"]
    out = run_json(capsys, argv)
    assert out["feasible"] is False and out["memory_gib"]["headroom"] < 0
    assert main(argv) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_human_output_is_a_table(capsys):
    assert main(["predict", "switch-1t", "--cluster", "frontier", "--gpus", "256",
                 "--parallel", "pp=4,ep=64,mbs=1,gbs=256,recompute=full,recompute_layers=1"]) == 0
    text = capsys.readouterr().out
    assert "memory per GPU (GiB)" in text and "peak" in text
    assert len([ln for ln in text.splitlines() if ln.strip().split(" ")[0] in "0123"]) >= 4


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "2", "--parallel", "tp=1,ppp=2,gbs=8"], r"--parallel ppp='2': is not a parallel key; did you mean 'pp'\?"),
    (["--gpus", "2", "--parallel", "tp=1"], r"--parallel gbs=None: the global batch size is required"),
    (["--gpus", "6", "--parallel", "ep=3,gbs=12"], r"ep=3: must divide num_experts \(8\); choose ep in \{1, 2, 4, 8\}"),
    (["--gpus", "2", "--parallel", "ep=4,gbs=8"], r"ep=4: etp\*ep = 1\*4 = 4 must divide tp\*cp\*dp = 2"),
    (["--gpus", "2", "--parallel", "tp=2,gbs=8"], r"MoE with tp=2 > 1 requires sequence parallelism"),
    (["--gpus", "2", "--parallel", "sp=maybe,gbs=8"], r"--parallel sp='maybe': must be a boolean"),
])
def test_bad_input_exits_2_with_message(capsys, argv, message):
    assert main(["predict", "tiny-moe", "--cluster", "cpu-local"] + argv) == 2
    import re
    assert re.search(message, capsys.readouterr().err)


def test_deepseek_predict_answers_under_one_second_and_without_torch():
    """Under a second of wall time on the reference machine (interpreter start included), scaled by
    how much slower this machine runs Python (:mod:`tests.speed`)."""
    code = ("import sys, time; t = time.perf_counter(); from piper_core.cli.main import main; "
            f"rc = main({DEEPSEEK + ['--json']!r}); "
            "assert 'torch' not in sys.modules, 'planning imported torch'; "
            "print('ELAPSED', time.perf_counter() - t, file=sys.stderr); sys.exit(rc)")
    bound = 1.0 * machine_factor()
    walls = []
    for _ in range(3):  # the best of up to 3: other jobs on a shared machine only ever add time
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        walls.append(time.perf_counter() - start)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["model"] == "deepseek-v3"
        if walls[-1] < bound:
            break
    assert min(walls) < bound, f"piper predict deepseek-v3 took {walls} s wall (interpreter start included; " \
        f"bound {bound:.2f} s)"


# Issue 14: ``piper plan deepseek-v3 --cluster dgx-h100 --gpus 1024`` searches the whole default space
# quickly. Timed as the command reports it (``search.elapsed_s``), with its default workers (one per
# CPU: 2 here). History: 1.58-1.85 s on 2026-12-05 (AMD EPYC), 1.36-1.43 s after pricing each chunk
# structure once; Megatron's pipeline layouts (issue 16) made vpp > 1 searchable for 61 layers and took
# it to 3.50-3.59 s at the same cost per feasible plan (45-47 us). That bound (5 s and 65 us) failed CI
# at 6.5-7.6 s on a slower copy of the machine with no change in the code, so the bounds are now set on
# one machine and scaled by how much slower the machine running the test is (tests/speed.py). On the
# reference machine (Intel Xeon, 2 cores, 2026-12-07, quiet): 4.58 and 4.68 s for 76,703 feasible
# plans, 60-61 us each. Bounds: 1.5x those, on each.
PLAN_BOUND_S, PLAN_BOUND_US = 7.0, 91.0


def test_deepseek_plan_searches_the_whole_space_within_the_bound():
    factor = machine_factor(processes=min(2, os.cpu_count() or 1))
    bound_s, bound_us = PLAN_BOUND_S * factor, PLAN_BOUND_US * factor
    searches = []
    for _ in range(3):  # the best of up to 3: other jobs on a shared machine only ever add time
        proc = subprocess.run([sys.executable, "-m", "piper_core.cli.main", "plan", "deepseek-v3", "--cluster",
                               "dgx-h100", "--gpus", "1024", "--json"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["candidates"] > 700_000 and out["feasible"] > 70_000
        searches.append((out["search"]["elapsed_s"], out["search"]["elapsed_s"] / out["feasible"] * 1e6))
        if searches[-1][0] <= bound_s and searches[-1][1] <= bound_us:
            break
    assert any(elapsed <= bound_s and us <= bound_us for elapsed, us in searches), \
        f"piper plan deepseek-v3 --gpus 1024 searched for (s, us per feasible plan) {searches}; bounds " \
        f"{bound_s:.1f} s and {bound_us:.0f} us (machine factor {factor:.2f})"
