"""``piper predict``: JSON contract, human output, errors, speed, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from piper_core.cli.main import main

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
    code = ("import sys, time; t = time.perf_counter(); from piper_core.cli.main import main; "
            f"rc = main({DEEPSEEK + ['--json']!r}); "
            "assert 'torch' not in sys.modules, 'planning imported torch'; "
            "print('ELAPSED', time.perf_counter() - t, file=sys.stderr); sys.exit(rc)")
    walls = []
    for _ in range(3):  # the best of up to 3: other jobs on a shared machine only ever add time
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        walls.append(time.perf_counter() - start)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["model"] == "deepseek-v3"
        if walls[-1] < 1.0:
            break
    assert min(walls) < 1.0, f"piper predict deepseek-v3 took {walls} s wall (interpreter start included)"


def test_deepseek_plan_searches_the_whole_space_within_the_bound():
    """Issue 14: ``piper plan deepseek-v3 --cluster dgx-h100 --gpus 1024`` searches the whole default
    space (772,848 plans) quickly: the search's own time as the command reports it
    (``search.elapsed_s``), with the command's default workers (one per CPU: 2 here). On 2026-12-05
    (AMD EPYC without bf16 instructions, slower per core than the 2026-12-04 machine) that was
    1.58-1.85 s; one worker (``--workers 1``) took 2.6-3.0 s there. Pricing the stage workspace
    (f83c0aa) took it to 1.8-2.3 s on 2026-12-06 and failed CI at 2.08 s; pricing each distinct chunk
    structure once per plan (``memory._chunk_activations``) brought it to 1.36-1.43 s the same day.
    On 2026-12-07 Megatron's pipeline layouts (issue 16) made the plans with vpp > 1 that 61 layers
    could not split evenly searchable: 30,354 -> 78,486 feasible plans, 1.44 s -> 3.50-3.59 s on a
    quiet machine, the same time per feasible plan (47 and 45 us). So the bound is on both: the whole
    search within 5 s, and at most 65 us per feasible plan (the old 2 s bound's margin over 1.44 s,
    1.39x, on each). The best of up to 3 runs: other jobs on a shared machine only ever add time."""
    searches = []
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-m", "piper_core.cli.main", "plan", "deepseek-v3", "--cluster",
                               "dgx-h100", "--gpus", "1024", "--json"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["candidates"] > 700_000 and out["feasible"] > 70_000
        searches.append((out["search"]["elapsed_s"], out["search"]["elapsed_s"] / out["feasible"] * 1e6))
        if searches[-1][0] <= 5.0 and searches[-1][1] <= 65.0:
            break
    assert any(elapsed <= 5.0 and us <= 65.0 for elapsed, us in searches), \
        f"piper plan deepseek-v3 --gpus 1024 searched for (s, us per feasible plan) {searches}"
