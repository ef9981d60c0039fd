"""How fast this machine runs pure Python, against the machine the time bounds were set on.

The search-speed tests bound a wall-clock time. CI runs on a fresh copy of a machine whose speed per
core varies from run to run (the same commit's unit tier took 5 min on one copy and 7 min on another,
and the DeepSeek-V3 search 3.5 s and 6.5-7.6 s). A fixed bound then fails on a slow copy without any
change in the code, or has to be so loose that it catches nothing. So each bound is stated on the
reference machine and scaled by :func:`machine_factor`: how much longer a fixed pure-Python workload
(small objects, dict lookups and float arithmetic, as the model's pricing does) takes here than it
took there, never below 1. A change that makes the search slower still fails, since the workload does
not call the model. The workload runs in as many processes at once as the timed code uses, so a copy
whose cores are shared shows it.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass

# The workload's best time on the reference machine (AMD EPYC, 2 cores, the one the bounds' figures
# were measured on, 2026-12-07, nothing else running): one process, and two at once.
REFERENCE_S = {1: 0.137, 2: 0.138}


@dataclass(frozen=True)
class _Item:
    a: float
    b: float
    key: str


def _workload() -> float:
    table = {f"k{i}": float(i) for i in range(64)}
    total = 0.0
    for i in range(120_000):
        item = _Item(a=i * 0.5, b=table[f"k{i % 64}"], key=f"k{(i * 7) % 64}")
        total += (item.a * 1.0001 + item.b) / (1.0 + table[item.key]) + max(item.a, item.b) ** 0.5
    return total


def _best_of(repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _workload()
        best = min(best, time.perf_counter() - start)
    return best


def _timed(_: int) -> float:
    return _best_of(5)


def workload_s(processes: int = 1) -> float:
    """The workload's best of 5 in each of ``processes`` processes running at once; the slowest one."""
    if processes == 1:
        return _best_of(5)
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return max(pool.map(_timed, range(processes)))


def machine_factor(processes: int = 1) -> float:
    """This machine's workload time over the reference machine's, never below 1."""
    return max(1.0, workload_s(processes) / REFERENCE_S[processes])


if __name__ == "__main__":
    for n in (1, 2):
        print(n, round(workload_s(n), 4))
