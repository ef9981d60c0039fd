"""Smoke test: ``python -m piper_core.bench.alltoall --quick`` runs end to end on the emulated
cluster and writes well-formed JSON and two PNGs. It checks structure, not speed (the numbers are
the benchmark's business, recorded in docs/alltoall.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from piper_core.emulate import emulation_available

REASON = emulation_available()
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
def test_quick_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "piper_core.bench.alltoall", "--quick", "--json", str(out),
                           "--plot", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    cfg = result["config"]
    assert [(r["nodes"], r["ranks_per_node"], r["inter_node_mbit"]) for r in result["a2a"]] == [
        (n, q, m) for n, q in cfg["a2a_clusters"] for m in cfg["a2a_mbits"]]
    for row in result["a2a"]:
        assert len(row["sweep"]) == len(cfg["a2a_sizes"])
        for by_alg in row["sweep"].values():
            assert sorted(by_alg) == sorted(cfg["a2a_algorithms"])
            assert all(len(t) == cfg["a2a_rounds"] and min(t) > 0 for t in by_alg.values())
        assert all(p["flat"] > 0 and p["hierarchical"] > 0 for p in row["predicted_ms"].values())
    shaped = result["moe"]["shaped"]
    assert len(shaped["cases"]) == len(cfg["moe_ratios"])
    for case in shaped["cases"] + result["moe"]["unshaped"]["cases"]:
        assert set(case["summary"]["speedup"]) == {f"{a} x{c}" for a in cfg["moe_algorithms"]
                                                   for c in cfg["moe_chunks"]} | {"auto"}
        assert case["summary"]["ratio"] > 0
        assert case["auto"]["chosen"] in cfg["auto_candidates"]
        assert sorted(case["auto"]["medians_ms"]) == sorted(str(c) for c in cfg["auto_candidates"])
    assert [r["inter_node_mbit"] for r in result["moe"]["interference"]] == cfg["interference_mbits"]
    for row in result["moe"]["interference"]:
        for rank in row["ranks"]:
            assert rank["threads"] >= 1
            assert all(rank[k]["wall"] > 0 for k in ("gemm alone", "exchange alone", "gemm during exchange"))
    acc = result["moe"]["acceptance"]
    assert acc["small_comm_auto_cost_pct"] is not None and acc["auto_speedup"] is not None
    for name in ("alltoall_sizes.png", "moe_pipelined.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text", ["0,1", "x", "1,,2", "200"])
def test_bad_ratios_exit_2_naming_the_flag_and_the_rule(text: str, capsys) -> None:
    from piper_core.bench.alltoall import main

    with pytest.raises(SystemExit) as exc:
        main(["--ratios", text])
    assert exc.value.code == 2
    assert f"--ratios {text!r}: give comma-separated numbers in [0.01, 100]" in capsys.readouterr().err
