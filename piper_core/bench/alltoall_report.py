"""Markdown tables from a :mod:`piper_core.bench.alltoall` JSON result (the tables of docs/alltoall.md).

Run: ``python -m piper_core.bench.alltoall_report RESULT.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def a2a_tables(rows: list[dict[str, Any]]) -> str:
    """Per (cluster, bandwidth): measured medians of each algorithm, the model's flat and
    hierarchical predictions, and the model's error relative to the measurement."""
    out = []
    for row in rows:
        links = row["links"]
        algs = list(next(iter(row["sweep"].values())))
        out.append(f"\n**{row['nodes']}x{row['ranks_per_node']} ranks, {row['inter_node_mbit']:g} Mbit/s** "
                   f"(measured: inter-node one-way latency {links['inter_latency_us']:.0f} us, p2p "
                   f"{links['inter_gb_per_s'] * 1e3:.1f} MB/s; intra-node {links['intra_latency_us']:.0f} us, "
                   f"{links['intra_gb_per_s']:.2f} GB/s)\n")
        out.append("| bytes/rank | " + " | ".join(f"{a} (ms)" for a in algs)
                   + " | model flat (ms) | model hier. (ms) | flat error | hier. error |")
        out.append("|---:|" + "---:|" * (len(algs) + 4))
        for size, by_alg in row["sweep"].items():
            meas = {a: _ms(by_alg[a]) for a in algs}
            pred = row["predicted_ms"][size]
            err = {a: (pred[a] - meas[a]) / meas[a] * 100 for a in ("flat", "hierarchical")}
            best = min(meas, key=meas.get)
            cells = [f"**{meas[a]:.2f}**" if a == best else f"{meas[a]:.2f}" for a in algs]
            out.append(f"| {int(size):,} | " + " | ".join(cells) + f" | {pred['flat']:.2f} | "
                       f"{pred['hierarchical']:.2f} | {err['flat']:+.0f} % | {err['hierarchical']:+.0f} % |")
    return "\n".join(out)


def moe_tables(moe: dict[str, Any]) -> str:
    """Per run: one row per expert width with the measured ratio, medians and speedups, and what
    ``auto`` chose; then the interference probe."""
    out = []
    for key in ("shaped", "contrast", "unshaped"):
        if key not in moe:
            continue
        run = moe[key]
        link = f"{run['inter_node_mbit']:g} Mbit/s" if run["inter_node_mbit"] else "unshaped veth"
        cases = sorted(run["cases"], key=lambda c: c["summary"]["ratio"])
        variants = list(cases[0]["summary"]["speedup"])
        out.append(f"\n**2x1, {link}**: {run['tokens']} tokens/rank, hidden {run['hidden']}, "
                   f"{run['experts_per_rank']} experts/rank, {run['bytes_per_a2a'] / 2**20:.2f} MiB per rank "
                   "per all-to-all; times are medians (ms) of side-by-side rounds; speedup = flat / variant.\n")
        out.append("| ffn | comm/compute | comm flat | compute | flat | " + " | ".join(variants)
                   + " | best chunked (>=2) | auto chose (its medians, ms) |")
        out.append("|---:|---:|---:|---:|---:|" + "---:|" * len(variants) + "---|---|")
        for case in cases:
            s, med = case["summary"], case["summary"]["median_ms"]
            cells = [f"{med[v]:.0f} ({s['speedup'][v]:.2f}x)" for v in variants]
            auto = case.get("auto")
            chose = "-" if auto is None else (f"x{auto['chosen']} ("
                                              + ", ".join(f"x{c} {t:.0f}" for c, t in auto["medians_ms"].items()) + ")")
            out.append(f"| {case['ffn']} | {s['ratio']:.2f} | {med['comm flat']:.0f} | {med['compute']:.0f} | "
                       f"{med['flat']:.0f} | " + " | ".join(cells)
                       + f" | {s['best_chunked']} {s['best_chunked_speedup']:.2f}x | {chose} |")
    if moe.get("interference"):
        out.append("\n**Interference** (2x1; per rank: medians (ms) of a GEMM loop alone, an exchange alone, "
                   "the GEMM loop with the exchange in flight; cpu = the GEMM thread's CPU time, wait = its "
                   "time runnable but not running):\n")
        out.append("| link | rank | GEMM alone (cpu / wait) | exchange alone | GEMM during exchange (cpu / wait) "
                   "| GEMM slowed by |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for row in moe["interference"]:
            link = f"{row['inter_node_mbit']:g} Mbit/s" if row["inter_node_mbit"] else "unshaped"
            for rank, r in enumerate(row["ranks"]):
                g, e, d = r["gemm alone"], r["exchange alone"], r["gemm during exchange"]
                out.append(f"| {link}, {row['bytes'] / 2**20:g} MiB each way | {rank} | {g['wall']:.1f} "
                           f"({g['cpu']:.1f} / {g['wait']:.1f}) | {e['wall']:.1f} | {d['wall']:.1f} "
                           f"({d['cpu']:.1f} / {d['wait']:.1f}) | {d['wall'] - g['wall']:+.1f} ms |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m piper_core.bench.alltoall_report RESULT.json", file=sys.stderr)
        return 2
    result = json.loads(Path(args[0]).read_text())
    if "a2a" in result:
        print(a2a_tables(result["a2a"]))
    if "moe" in result:
        print(moe_tables(result["moe"]))
    if "moe_repeat" in result:  # a merged file's second run of (b) and (c)
        print(f"\n**Repeat** (`{result['moe_repeat_run']['command']}`):")
        print(moe_tables(result["moe_repeat"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
