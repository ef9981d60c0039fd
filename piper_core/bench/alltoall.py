"""All-to-all benchmarks on the emulated cluster (:mod:`piper_core.emulate`; needs root).

Run: ``python -m piper_core.bench.alltoall [--quick] [--json FILE] [--plot DIR]``.

(a) flat vs hierarchical vs aggregated all-to-all, time vs per-rank message size, on 2x2 and 2x4
    clusters at two inter-node bandwidths, beside the resource model's predictions
    (``piper_core.timing.comm``) for a ClusterSpec of the same cluster;
(b) a MoE layer (dispatch -> experts -> combine, forward + backward): the flat unchunked path vs
    ``moe_alltoall`` at 1, 2, 4, 8 chunks and with the chunk count chosen at run time
    (``auto``: :class:`piper_core.runtime.AutoChunks`), across communication/compute ratios ~0.3
    to ~3 on a 2-node cluster (one rank per node), plus one run on the unshaped link where
    communication is small and one at ratio ~1 on a 4x faster link (the contrast: there the
    network's kernel work takes the cores the experts need). Reported: medians of side-by-side
    rounds, the ratio actually measured, speedups;
(c) interference: how much an exchange in flight slows a GEMM loop on the same rank, per link rate.

Prints tables; ``--json`` writes every measurement, ``--plot`` writes PNGs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from piper_core.emulate import SUBNET, EmulatedCluster, emulated_cluster_spec, emulation_available, tbf_burst_bytes
from piper_core.emulate.netns import TBF_LATENCY_MS
from piper_core.presets import load_cluster
from piper_core.timing.comm import all_to_all_flat, all_to_all_hierarchical
from piper_core.timing.topology import Group

RANKS = "piper_core.bench.alltoall_ranks"


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """What one benchmark run measures (``FULL`` or ``QUICK``)."""

    a2a_clusters: tuple[tuple[int, int], ...]
    a2a_mbits: tuple[float, ...]
    a2a_sizes: tuple[int, ...]
    a2a_algorithms: tuple[str, ...]
    a2a_rounds: int
    moe_mbit: float
    moe_tokens: int
    moe_hidden: int
    moe_experts_per_rank: int
    moe_ratios: tuple[float, ...]
    moe_chunks: tuple[int, ...]
    moe_algorithms: tuple[str, ...]
    moe_rounds: int
    small_comm_ffn: int
    small_comm_rounds: int
    auto_candidates: tuple[int, ...]
    auto_trials: int
    contrast_mbit: float | None
    contrast_ratio: float
    interference_mbits: tuple[float | None, ...]
    interference_bytes: int
    interference_gemm: tuple[int, int, int]
    interference_reps: int


FULL = Config(a2a_clusters=((2, 2), (2, 4)), a2a_mbits=(100.0, 1000.0),
              a2a_sizes=(16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20),
              a2a_algorithms=("flat", "hierarchical", "aggregated"), a2a_rounds=7,
              moe_mbit=50.0, moe_tokens=2048, moe_hidden=256, moe_experts_per_rank=2,
              moe_ratios=(0.3, 0.6, 0.8, 1.0, 1.25, 1.5, 3.0), moe_chunks=(1, 2, 4, 8),
              moe_algorithms=("flat",), moe_rounds=6, small_comm_ffn=4096, small_comm_rounds=25,
              auto_candidates=(1, 2, 4, 8), auto_trials=3, contrast_mbit=200.0, contrast_ratio=1.0,
              interference_mbits=(50.0, 200.0, None), interference_bytes=1 << 20,
              interference_gemm=(512, 256, 4096), interference_reps=9)
QUICK = Config(a2a_clusters=((2, 2),), a2a_mbits=(100.0, 1000.0), a2a_sizes=(64 << 10, 1 << 20),
               a2a_algorithms=("flat", "hierarchical", "aggregated"), a2a_rounds=3,
               moe_mbit=200.0, moe_tokens=512, moe_hidden=256, moe_experts_per_rank=2, moe_ratios=(1.0,),
               moe_chunks=(1, 2, 4), moe_algorithms=("flat",), moe_rounds=3, small_comm_ffn=2048,
               small_comm_rounds=3, auto_candidates=(1, 2), auto_trials=1, contrast_mbit=None,
               contrast_ratio=1.0, interference_mbits=(200.0,), interference_bytes=256 << 10,
               interference_gemm=(256, 256, 1024), interference_reps=3)


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def run_a2a(cfg: Config, timeout_s: float) -> list[dict[str, Any]]:
    """One row per (cluster, bandwidth): the sweep, the measured link parameters, the predictions."""
    rows = []
    for nodes, per_node in cfg.a2a_clusters:
        with EmulatedCluster(nodes=nodes, ranks_per_node=per_node, inter_node_mbit=cfg.a2a_mbits[0]) as cluster:
            for mbit in cfg.a2a_mbits:
                cluster.set_inter_node_mbit(mbit)
                start = time.perf_counter()
                out = cluster.run(f"{RANKS}:a2a_sweep", [list(cfg.a2a_sizes), list(cfg.a2a_algorithms),
                                                         cfg.a2a_rounds], timeout_s=timeout_s)[0]
                row = {"nodes": nodes, "ranks_per_node": per_node, "inter_node_mbit": mbit,
                       "links": out["links"], "sweep": out["sweep"], "wall_s": time.perf_counter() - start}
                row["predicted_ms"] = predict(row)
                rows.append(row)
    return rows


def predict(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The resource model's flat and hierarchical times (ms) for each size of ``row``.

    Link parameters: inter-node bandwidth from the shaping (``rate x 0.96 / ranks_per_node``, see
    :mod:`piper_core.emulate.spec`); latencies and the intra-node bandwidth from the ping-pong and
    4 MiB send measured in the same run (``links``); copy bandwidth from the cpu-local preset.
    """
    links = row["links"]
    spec = emulated_cluster_spec(
        nodes=row["nodes"], ranks_per_node=row["ranks_per_node"], inter_node_mbit=row["inter_node_mbit"],
        accelerator=load_cluster("cpu-local").accelerator, intra_node_gb_per_s=links["intra_gb_per_s"],
        intra_node_latency_us=links["intra_latency_us"], inter_node_latency_us=links["inter_latency_us"])
    group = Group(name="ep", size=row["nodes"] * row["ranks_per_node"], stride=1)
    return {size: {"flat": all_to_all_flat(group, int(size), spec) * 1e3,
                   "hierarchical": all_to_all_hierarchical(group, int(size), spec) * 1e3}
            for size in row["sweep"]}


def run_moe(cfg: Config, timeout_s: float) -> dict[str, Any]:
    """The MoE-layer comparison on the shaped 2-node link, the contrast at a faster link, the
    unshaped link (small communication), and the interference probe at each link rate."""
    base = [cfg.moe_tokens, cfg.moe_hidden, cfg.moe_experts_per_rank]
    auto = {"auto_candidates": list(cfg.auto_candidates), "auto_trials": cfg.auto_trials}

    def sweep(cluster: EmulatedCluster, mbit: float | None, ratios: list[float], rounds: int,
              ffns: list[int] | None = None) -> dict[str, Any]:
        cluster.set_inter_node_mbit(mbit)
        start = time.perf_counter()
        args = [*base, ratios, list(cfg.moe_chunks), list(cfg.moe_algorithms), rounds, ffns,
                auto["auto_candidates"], auto["auto_trials"]]
        got = cluster.run(f"{RANKS}:moe_sweep", args, timeout_s=timeout_s)[0]
        return {**got, "inter_node_mbit": mbit, "wall_s": time.perf_counter() - start}

    out: dict[str, Any] = {"interference": []}
    with EmulatedCluster(nodes=2, ranks_per_node=1, inter_node_mbit=cfg.moe_mbit) as cluster:
        for mbit in cfg.interference_mbits:
            cluster.set_inter_node_mbit(mbit)
            ranks = cluster.run(f"{RANKS}:interference", [cfg.interference_bytes, list(cfg.interference_gemm), 7,
                                                          cfg.interference_reps], timeout_s=timeout_s)
            out["interference"].append({"inter_node_mbit": mbit, "bytes": cfg.interference_bytes,
                                        "gemm": list(cfg.interference_gemm), "ranks": ranks})
        out["shaped"] = sweep(cluster, cfg.moe_mbit, list(cfg.moe_ratios), cfg.moe_rounds)
        if cfg.contrast_mbit is not None:
            out["contrast"] = sweep(cluster, cfg.contrast_mbit, [cfg.contrast_ratio], cfg.moe_rounds)
        out["unshaped"] = sweep(cluster, None, [], cfg.small_comm_rounds, [cfg.small_comm_ffn])
    for key in ("shaped", "contrast", "unshaped"):
        for case in out.get(key, {}).get("cases", []):
            case["summary"] = summarize_case(case["times"])
    out["acceptance"] = acceptance(out)
    return out


def acceptance(moe: dict[str, Any]) -> dict[str, Any]:
    """The issue's two criteria, read off the measurements: at the shaped case whose measured
    ratio is nearest 1, the best pipelined (chunks >= 2) speedup over flat unchunked (target
    >= 1.3x) and ``auto``'s; on the unshaped link (communication small), the cost of ``auto`` and
    of the best fixed chunk count >= 2 (target <= 3 %). The unchunked ``moe_alltoall`` (``x1``) is
    reported beside them."""
    near = min(moe["shaped"]["cases"], key=lambda c: abs(c["summary"]["ratio"] - 1.0))["summary"]
    small = moe["unshaped"]["cases"][0]["summary"]
    x1 = {k: v for k, v in small["speedup"].items() if k.endswith(" x1")}

    def cost(speedup: float | None) -> float | None:
        return None if speedup is None else (1 / speedup - 1) * 100

    auto_cost = cost(small["speedup"].get("auto"))
    return {"ratio_near_1": near["ratio"], "best_chunked": near["best_chunked"],
            "best_chunked_speedup": near["best_chunked_speedup"], "best_any": near["best"],
            "best_any_speedup": near["best_speedup"], "auto_speedup": near["speedup"].get("auto"),
            "meets_1_3x": near["best_chunked_speedup"] >= 1.3,
            "small_comm_ratio": small["ratio"], "small_comm_best_chunked": small["best_chunked"],
            "small_comm_chunked_cost_pct": cost(small["best_chunked_speedup"]),
            "small_comm_auto_cost_pct": auto_cost,
            "small_comm_x1_cost_pct": {k: cost(v) for k, v in x1.items()},
            "meets_3pct_fixed_chunks": cost(small["best_chunked_speedup"]) <= 3.0,
            "meets_3pct_auto": auto_cost is not None and auto_cost <= 3.0}


def summarize_case(times: dict[str, list[float]]) -> dict[str, Any]:
    """Medians (ms), the measured ratio (flat communication / compute), and each pipelined
    variant's speedup over the flat unchunked layer (>1: faster)."""
    med = {k: _median_ms(v) for k, v in times.items()}
    piped = {k: v for k, v in med.items() if " x" in k or k == "auto"}
    best = min(piped, key=piped.get)
    best_multi = min((k for k in piped if " x" in k and not k.endswith(" x1")), key=piped.get, default=best)
    return {"median_ms": med, "ratio": med["comm flat"] / med["compute"],
            "speedup": {k: med["flat"] / v for k, v in piped.items()},
            "best": best, "best_speedup": med["flat"] / piped[best],
            "best_chunked": best_multi, "best_chunked_speedup": med["flat"] / piped[best_multi]}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    def cmd(*argv: str) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    import torch
    model = next((ln.split(":", 1)[1].strip() for ln in cmd("lscpu").splitlines() if ln.startswith("Model name")), "")
    return {"nproc": cmd("nproc"), "cpu": model, "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "loadavg_at_start": os.getloadavg()}


def print_a2a(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        links = row["links"]
        print(f"\n(a) all-to-all on {row['nodes']}x{row['ranks_per_node']} at {row['inter_node_mbit']:g} Mbit/s "
              f"(inter latency {links['inter_latency_us']:.0f} us, p2p {links['inter_gb_per_s'] * 1e3:.1f} MB/s; "
              f"intra {links['intra_latency_us']:.0f} us, {links['intra_gb_per_s']:.2f} GB/s)")
        algs = list(next(iter(row["sweep"].values())))
        print(f"{'bytes/rank':>10} " + " ".join(f"{a:>13}" for a in algs) + f" {'model flat':>11} {'model hier':>11}")
        for size, by_alg in row["sweep"].items():
            pred = row["predicted_ms"][size]
            print(f"{int(size):>10} " + " ".join(f"{_median_ms(by_alg[a]):>10.2f} ms" for a in algs)
                  + f" {pred['flat']:>8.2f} ms {pred['hierarchical']:>8.2f} ms")


def print_moe(moe: dict[str, Any]) -> None:
    for row in moe["interference"]:
        link = f"{row['inter_node_mbit']:g} Mbit/s" if row["inter_node_mbit"] else "unshaped veth"
        print(f"\n(c) interference, 2x1, {link}: GEMM loop vs a {row['bytes'] / 2**20:g} MiB exchange each way")
        for rank, r in enumerate(row["ranks"]):
            g, e, d = r["gemm alone"], r["exchange alone"], r["gemm during exchange"]
            print(f"  rank {rank}: gemm alone {g['wall']:.1f} ms (cpu {g['cpu']:.1f}, waiting {g['wait']:.1f}); exchange "
                  f"alone {e['wall']:.1f} ms; gemm during exchange {d['wall']:.1f} ms (cpu {d['cpu']:.1f}, waiting "
                  f"{d['wait']:.1f}); torch threads {r['threads']}, inter-op {r['interop_threads']}")
    for key in ("shaped", "contrast", "unshaped"):
        if key not in moe:
            continue
        run = moe[key]
        link = f"{run['inter_node_mbit']:g} Mbit/s" if run["inter_node_mbit"] else "unshaped veth"
        print(f"\n(b) MoE layer fwd+bwd on 2x1, {link}: {run['tokens']} tokens/rank x {run['hidden']} fp32, "
              f"{run['experts_per_rank']} experts/rank, {run['bytes_per_a2a'] / 2**20:.2f} MiB per all-to-all")
        for case in run["cases"]:
            s = case["summary"]
            med = s["median_ms"]
            variants = " ".join(f"{k}={med[k]:.0f}" for k in s["speedup"])
            chosen = f"; auto chose x{case['auto']['chosen']}" if "auto" in case else ""
            print(f"  ffn {case['ffn']:>6}: ratio {s['ratio']:.2f} (comm {med['comm flat']:.0f} / compute "
                  f"{med['compute']:.0f} ms); flat {med['flat']:.0f} ms; {variants}; best {s['best']} "
                  f"{s['best_speedup']:.2f}x, best chunked {s['best_chunked']} {s['best_chunked_speedup']:.2f}x{chosen}")


def print_acceptance(acc: dict[str, Any]) -> None:
    auto_near = "" if acc["auto_speedup"] is None else f"; auto {acc['auto_speedup']:.2f}x"
    auto_small = ("" if acc["small_comm_auto_cost_pct"] is None else
                  f"; auto costs {acc['small_comm_auto_cost_pct']:+.1f} % "
                  f"(target <= 3 %: {'met' if acc['meets_3pct_auto'] else 'NOT met'})")
    print(f"\nacceptance: at ratio {acc['ratio_near_1']:.2f} best chunked {acc['best_chunked']} "
          f"{acc['best_chunked_speedup']:.2f}x over flat (target 1.3x: {'met' if acc['meets_1_3x'] else 'NOT met'}; "
          f"best of all {acc['best_any']} {acc['best_any_speedup']:.2f}x{auto_near}); small communication "
          f"(ratio {acc['small_comm_ratio']:.2f}): best fixed chunked {acc['small_comm_best_chunked']} costs "
          f"{acc['small_comm_chunked_cost_pct']:+.1f} % (<= 3 %: "
          f"{'yes' if acc['meets_3pct_fixed_chunks'] else 'no'}){auto_small}")


def _ratios(text: str) -> tuple[float, ...]:
    try:
        ratios = tuple(float(part) for part in text.split(","))
    except ValueError:
        ratios = ()
    if not ratios or any(not 0.01 <= r <= 100 for r in ratios):
        raise argparse.ArgumentTypeError(f"--ratios {text!r}: give comma-separated numbers in [0.01, 100], "
                                         "e.g. 0.8,1.0,1.25")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small subset (about a minute)")
    parser.add_argument("--json", type=Path, help="write all measurements to this file")
    parser.add_argument("--plot", type=Path, help="write PNG plots into this directory")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per emulated run")
    parser.add_argument("--part", choices=("all", "a2a", "moe"), default="all",
                        help="run only (a), or only (b) and (c) (default: all)")
    parser.add_argument("--ratios", type=_ratios, default=None, metavar="R,R,...",
                        help="(b): the communication/compute ratios to aim at on the shaped link "
                             f"(default {','.join(map(str, FULL.moe_ratios))})")
    args = parser.parse_args(argv)
    reason = emulation_available()
    if reason is not None:
        print(f"cannot run the all-to-all benchmark: {reason}", file=sys.stderr)
        return 2
    cfg = QUICK if args.quick else FULL
    if args.ratios is not None:
        cfg = replace(cfg, moe_ratios=args.ratios)
    start = time.perf_counter()
    result = {"command": " ".join(["python -m piper_core.bench.alltoall", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "config": asdict(cfg),
              "emulation": {"subnet": str(SUBNET), "tbf_latency_ms": TBF_LATENCY_MS,
                            "tbf_burst_bytes": {str(m): tbf_burst_bytes(m) for m in
                                                {*cfg.a2a_mbits, cfg.moe_mbit, *cfg.interference_mbits,
                                                 cfg.contrast_mbit} if m is not None}}}
    if args.part in ("all", "a2a"):
        result["a2a"] = run_a2a(cfg, args.timeout)
        print_a2a(result["a2a"])
    if args.part in ("all", "moe"):
        result["moe"] = run_moe(cfg, args.timeout)
        print_moe(result["moe"])
    if "moe" in result:
        print_acceptance(result["moe"]["acceptance"])
    result["wall_s"] = time.perf_counter() - start
    print(f"\ntotal {result['wall_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        from piper_core.bench.alltoall_plot import plot_all
        for path in plot_all(result, args.plot):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
