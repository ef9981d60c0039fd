"""The search's grid scanned by forked processes (``search(..., workers=N)``, ``piper plan``).

The outer combinations are grouped by their expert-parallel size (or, in a space with fewer ep
values than ``2 N``, by the outer dimension with the most values): layer shapes, memory states and
every other cache key hold ep, so processes given different groups repeat almost no work. A group
is a set of runs of consecutive combinations (the grid's order). This process and ``N - 1``
forked children take groups from a shared counter, heaviest first (weighed by the cheap structural
rules times the exchange variants), until none are left: a dynamic deal, as the work per group
varies more than any cheap weight tells (deepseek-v3 at 1024 GPUs: 0.09 s for ep 1, 0.46 s for ep 32).

Each process scans its runs in the grid's order with one set of caches and returns, per run, its
counts, its rejections in first-seen order and its scored plans as field tuples; the runs put
back in grid order give exactly the serial scan's result (the same plans, times, memory and
rejection counts, and reasons in the order first seen). Plans come back through
:func:`~piper_core.scheduler.search.plan_from_values`: each passed ``ParallelPlan``'s checks in its
process.

Fork, not spawn: a child starts in microseconds with the model, cluster and space already built.
So the caller must be a process that may fork: no threads holding locks, no CUDA, no process
groups; the adapters plan inside training processes and use ``workers=1``.

A child that fails sends its exception (or, if it cannot be pickled, its traceback) and the search
raises it; one that dies or stays silent past :data:`WAIT_S` is named.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from typing import Any

from piper_core.scheduler.search import Scored, SearchResult, _Scan, plan_from_values, plan_values

WAIT_S = 600.0  # a 1,000-GPU search takes seconds; this only ends a stuck child
EP_DIM = 4  # the outer combination's dimensions: tp, pp, vpp, cp, ep, etp_equals_tp, mbs


def groups(job: _Scan, outer: list[tuple], workers: int) -> list[list[tuple[int, int]]]:
    """Per group (heaviest first): its runs, as (start, stop) slices of ``outer``."""
    dim = EP_DIM
    if len({o[dim] for o in outer}) < 2 * workers:
        dim = max(range(len(outer[0])), key=lambda d: len({o[d] for o in outer})) if outer else 0
    runs: dict[Any, list[tuple[int, int]]] = {}
    weight: dict[Any, int] = {}
    start = 0
    for i in range(1, len(outer) + 1):
        if i == len(outer) or outer[i][dim] != outer[start][dim]:
            runs.setdefault(outer[start][dim], []).append((start, i))
            start = i
    for o in outer:
        weight[o[dim]] = weight.get(o[dim], 0) + job.structural(o) * (1 if o[EP_DIM] == 1 else len(job.space.a2a))
    return [runs[v] for v in sorted(runs, key=lambda v: -weight[v])]


def _take(job: _Scan, outer: list[tuple], work: list[list[tuple[int, int]]], counter: Any, progress=None
          ) -> dict[int, SearchResult]:
    """Scan groups taken from ``counter`` until none are left: run start -> its result."""
    out: dict[int, SearchResult] = {}
    state = job.new_state()
    total = len(outer) * len(job.inner)
    while True:
        with counter.get_lock():
            g = counter.value
            counter.value += 1
        if g >= len(work):
            return out
        for a, b in work[g]:
            out[a] = job.scan_with(outer[a:b], state)
        if progress:
            progress(min(total, g * total // len(work)), total)


def _worker(job: _Scan, outer: list[tuple], work: list[list[tuple[int, int]]], counter: Any, send: Any) -> None:
    try:
        send.send(("ok", {a: (r.candidates, list(r.rejected.items()),
                              [(plan_values(s.plan), s.step_s, s.peak_bytes) for s in r.scored])
                          for a, r in _take(job, outer, work, counter).items()}))
    except BaseException as exc:  # noqa: BLE001 -- every failure goes back to the parent
        try:
            pickle.loads(pickle.dumps(exc))  # what the parent will do with it
            send.send(("error", exc))
        except Exception:  # noqa: BLE001
            send.send(("error", RuntimeError(traceback.format_exc())))
    finally:
        send.close()


def scan_forked(job: _Scan, outer: list[tuple], workers: int, progress=None) -> SearchResult:
    """``job.scan(outer)``'s result, scanned by this process and ``workers - 1`` forked children."""
    work = groups(job, outer, workers)
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("i", 0)
    children = []
    for w in range(1, min(workers, len(work))):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(job, outer, work, counter, send), daemon=True)
        proc.start()
        send.close()
        children.append((w, recv, proc))
    runs = _take(job, outer, work, counter, progress)
    try:
        for w, recv, proc in children:
            runs.update(_receive(w, workers, recv, proc))
    finally:
        for _, recv, proc in children:
            recv.close()
            proc.join(1)
            if proc.is_alive():
                proc.kill()
    if progress:
        progress(len(outer) * len(job.inner), len(outer) * len(job.inner))
    result = SearchResult()
    for a in sorted(runs):
        r = runs[a]
        result.candidates += r.candidates
        result.rejected.update(r.rejected)
        result.scored += r.scored
    return result


def _receive(w: int, workers: int, recv: Any, proc: Any) -> dict[int, SearchResult]:
    where = f"search worker {w + 1} of {workers} (pid {proc.pid})"
    fix = "run piper plan with --workers 1 to search in this process"
    if not recv.poll(WAIT_S):
        raise RuntimeError(f"{where} sent nothing in {WAIT_S:.0f} s (exit code {proc.exitcode}); {fix}")
    try:
        kind, payload = recv.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"{where} died (exit code {proc.exitcode}) before sending its part; {fix}") from None
    if kind == "error":
        raise payload
    out = {}
    for a, (candidates, rejected, scored) in payload.items():
        r = SearchResult(candidates=candidates)
        for reason, count in rejected:
            r.rejected[reason] += count
        r.scored = [Scored(plan=plan_from_values(v), step_s=t, peak_bytes=b) for v, t, b in scored]
        out[a] = r
    return out
