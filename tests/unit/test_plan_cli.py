"""``piper plan``: table, JSON contract, rejection counts, no-fit message, bad input."""

from __future__ import annotations

import json

import pytest

from piper_core.cli.main import main


def test_plan_json_contract(capsys):
    assert main(["plan", "tiny-moe", "--cluster", "cpu-local", "--gpus", "4", "--gbs", "16", "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidates"] == out["feasible"] + sum(out["rejected"].values())
    assert 1 <= len(out["plans"]) <= 3
    steps = [p["time_s"]["step"] for p in out["plans"]]
    assert steps == sorted(steps)
    for p in out["plans"]:
        assert p["feasible"] and 0 < p["mfu"] < 1 and p["gpus"] == 4
        assert p["plan"]["global_batch_size"] == 16
    assert out["search"]["plans_per_s"] > 0


def test_plan_table_names_best_and_why(capsys):
    assert main(["plan", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "16", "--gbs", "128", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "plans/s" in text and "rejected:" in text and "best:" in text and "why:" in text
    assert "bottleneck:" in text


def test_no_fit_exits_1_with_lower_bound(capsys):
    assert main(["plan", "switch-1t", "--cluster", "frontier", "--gpus", "64"]) == 1
    text = capsys.readouterr().out
    assert "0 feasible" in text and "exceeds memory" in text
    assert "needs at least" in text


def test_lower_bound_counts_the_hosts_that_hold_the_offloaded_optimizer():
    """64 GCDs could hold 1.03 T bf16 weights and gradients (69 GCDs), but the offloaded fp32
    optimizer (16 bytes per parameter) needs 32 Frontier nodes of host memory: 256 GCDs, which is
    also the smallest Frontier job the search finds a plan for."""
    from piper_core.cli.plan import min_gpus
    from piper_core.presets import load_cluster, load_model

    need, what = min_gpus(load_model("switch-1t"), load_cluster("frontier"))
    assert need == 256 and "offloaded optimizer state" in what
    assert main(["plan", "switch-1t", "--cluster", "frontier", "--gpus", "248", "--json"]) == 1
    assert main(["plan", "switch-1t", "--cluster", "frontier", "--gpus", "256", "--json"]) == 0


def test_memory_headroom_tightens(capsys):
    args = ["plan", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "32", "--gbs", "128", "--json"]
    assert main(args) == 0
    loose = json.loads(capsys.readouterr().out)
    assert main(args + ["--memory-headroom", "0.2"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["feasible"] < loose["feasible"]
    assert all(p["memory_gib"]["peak"] <= 0.8 * p["memory_gib"]["capacity"] + 1e-3 for p in tight["plans"])


@pytest.mark.parametrize("extra, message", [
    (["--memory-headroom", "1.5"], r"--memory-headroom=1.5: must be in \[0, 1\)"),
    (["--gpus", "0"], r"--gpus=0: must be a positive number"),
    (["--workers", "0"], r"--workers=0: must be at least 1; use 1 to search in this process"),
])
def test_bad_input(capsys, extra, message):
    import re
    argv = ["plan", "tiny-moe", "--cluster", "cpu-local", "--gpus", "4"] + extra
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_exports_and_plots_for_the_1t_model_on_64_h100(tmp_path, capsys):
    """The issue's example: both exports and the three PNGs; the DeepSpeed export takes the best
    plan DeepSpeed-MoE can run when the overall best needs Megatron's tensor parallelism."""
    mega, ds, plots = tmp_path / "m.sh", tmp_path / "d.json", tmp_path / "plots"
    assert main(["plan", "switch-1t", "--cluster", "dgx-h100", "--gpus", "64", "--export-megatron", str(mega),
                 "--export-deepspeed", str(ds), "--plot", str(plots)]) == 0
    out = capsys.readouterr().out
    assert "--tensor-model-parallel-size" in mega.read_text()
    config = json.loads(ds.read_text())
    plan = config["piper"]["plan"]
    assert plan["tp"] == 1 and plan["cp"] == 1 and plan["etp"] == 1
    if "DeepSpeed export: the best plan needs Megatron" in out:
        assert "best:" in out
    assert sorted(p.name for p in plots.iterdir()) == ["memory.png", "pareto.png", "timeline.png"]
