"""Scheduler search speed: the full default space for deepseek-v3 on 1024 dgx-h100 GPUs.

Run: ``make bench`` (or ``python -m piper_core.bench.search_speed [--repeat N] [--workers 1,2] [--json]``).
Prints the wall time of each repetition, the median, plans searched per second, and the machine's
load average (other work slows a shared machine's runs; quote the load with the times). Each
repetition is a fresh search (no cache outlives a search), so the median is not a warm-cache figure.
Each case runs in one process (``--workers 1``) and with ``piper plan``'s default worker count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from piper_core.cli.plan import default_workers
from piper_core.presets import load_cluster, load_model
from piper_core.scheduler.search import search

CASES = (("deepseek-v3", "dgx-h100", 1024, 4096), ("switch-1t", "dgx-h100", 1024, 2048),
         ("mixtral-8x7b", "dgx-h100", 64, 1024))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", default=f"1,{default_workers()}",
                        help="comma-separated worker counts to time (default: 1 and piper plan's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        counts = sorted({int(w) for w in args.workers.split(",")})
    except ValueError:
        parser.error(f"--workers {args.workers!r}: give comma-separated integers >= 1, e.g. 1,2")
    if not counts or counts[0] < 1:
        parser.error(f"--workers {args.workers!r}: every count must be >= 1, e.g. 1,2")
    rows = []
    for model_name, cluster_name, gpus, gbs in CASES:
        model, cluster = load_model(model_name), load_cluster(cluster_name)
        for workers in counts:
            walls, result = [], None
            for _ in range(args.repeat):
                start = time.perf_counter()
                result = search(model, cluster, gpus, gbs, workers=workers)
                walls.append(time.perf_counter() - start)
            median = statistics.median(walls)
            rows.append({"model": model_name, "cluster": cluster_name, "gpus": gpus, "gbs": gbs, "workers": workers,
                         "candidates": result.candidates, "feasible": result.feasible, "wall_s": walls,
                         "median_s": median, "plans_per_s": result.candidates / median})
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"load_average": load, "cases": rows}, indent=2))
    else:
        print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
        for r in rows:
            print(f"{r['model']:>14} on {r['gpus']:>5} {r['cluster']}, {r['workers']} worker(s): {r['candidates']:,} plans "
                  f"({r['feasible']:,} feasible), median {r['median_s']:.2f} s of "
                  f"{', '.join(f'{w:.2f}' for w in r['wall_s'])} -> {r['plans_per_s']:,.0f} plans/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
