"""The GEMMs of a training step as the framework runs them, against the price the model puts on them
(issue 15).

``python -m piper_core.validate.gemms CASE --profile PROFILE.yaml [--suite full-fp32] [--steps N] [--json OUT]``
(``--report OUT.json`` prints a recorded result again, measuring nothing) trains a validation case's job (its registered trainer, on its ranks) under ``torch.profiler`` and
groups rank 0's matrix products (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``) by shape. For each shape it
prints the calls per step, the microseconds per call inside the step, the model's price of one call
on ``PROFILE`` (:func:`piper_core.timing.compute.gemm_time`, the curve the calibration's GEMM sweep
fits), and the same product timed on rank 0 after training, alone, twice: with its operands in cache
(one GEMM repeated on the same tensors, as the sweep timed them before 2026-12-08) and with each call
on the next operand pair of a pool larger than the cache (as the sweep times them since:
:func:`piper_core.calibrate.bench.operand_pool`). The totals say how much of the step's GEMM time the
price covers.

A diagnosis, not a validation (the profiler adds about 10 % to each call; the step itself is not
judged). Written after a development check (2026-12-07, docs/validation.md) found the GEMMs of the
suite's 2-rank cases taking about 2.2x their price, and the same product 3x slower cold than hot.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def shape_of(op: str, shapes: Sequence[Sequence[int]]) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of one profiled product from its input shapes (addmm/baddbmm: the bias first)."""
    a, b = (shapes[1], shapes[2]) if op in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    if op in ("aten::bmm", "aten::baddbmm"):
        return int(a[0]), int(a[1]), int(a[2]), int(b[2])
    return 1, int(a[0]), int(a[1]), int(b[1])


def group(rows: Sequence[tuple[str, str, int, float]], steps: int) -> list[dict[str, Any]]:
    """Profiler rows ``(op, input shapes as printed, calls, self seconds)`` summed by (batch, m, k, n):
    calls per step, measured microseconds per call, FLOP per call (pure)."""
    out: dict[tuple[int, int, int, int], dict[str, Any]] = {}
    for op, printed, calls, seconds in rows:
        if op not in GEMM_OPS or calls == 0:
            continue
        key = shape_of(op, ast.literal_eval(printed))
        entry = out.setdefault(key, {"batch": key[0], "m": key[1], "k": key[2], "n": key[3], "calls": 0, "seconds": 0.0})
        entry["calls"] += calls
        entry["seconds"] += seconds
    result = []
    for e in out.values():
        e["calls_per_step"] = e["calls"] / steps
        e["measured_us"] = 1e6 * e["seconds"] / e["calls"]
        e["flop"] = 2 * e["batch"] * e["m"] * e["k"] * e["n"]
        result.append(e)
    return sorted(result, key=lambda e: -e["seconds"])


def rank_main(info: Any, target: str, job_json: dict[str, Any]) -> dict[str, Any]:
    """Rank side: the trainer's ``target`` under the profiler; rank 0 then times each shape alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    module, name = target.split(":")
    train: Callable[[Any, dict[str, Any]], dict[str, Any]] = getattr(importlib.import_module(module), name)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        report = train(info, job_json)
    rows = [(e.key, str(e.input_shapes), e.count, e.self_cpu_time_total * 1e-6)
            for e in prof.key_averages(group_by_input_shape=True) if e.key in GEMM_OPS]
    out: dict[str, Any] = {"rank": info.rank, "rows": rows, "steps": len(report["step_s"])}
    if info.rank == 0:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[job_json["plan"]["precision"]]
        from piper_core.calibrate.bench import make_pool
        from piper_core.calibrate.steps import GEMM_POOL_MIB

        shapes = {shape_of(op, ast.literal_eval(printed)) for op, printed, _, _ in rows}
        pool = make_pool(GEMM_POOL_MIB, dtype)
        out["alone"] = {json.dumps(s): standalone(*s, dtype=dtype, pool=pool) for s in shapes}
    return out


def standalone(batch: int, m: int, k: int, n: int, *, dtype: Any, pool: Any, reps: int = 30) -> dict[str, float]:
    """Median microseconds of one ``[batch,] m x k @ k x n`` product: operands in cache (one pair
    repeated), and out of it (pairs rotated through ``pool``, as the calibration sweep does)."""
    import torch

    from piper_core.calibrate.bench import operand_pool

    def timed(pairs: list[tuple[Any, Any]]) -> float:
        mm = torch.bmm if batch > 1 else torch.mm
        for i in range(3):
            mm(*pairs[i % len(pairs)])
        samples = []
        for i in range(3, 3 + reps):
            start = time.perf_counter()
            mm(*pairs[i % len(pairs)])
            samples.append(time.perf_counter() - start)
        return 1e6 * statistics.median(samples)
    return {"hot_us": timed(operand_pool(None, m, n, k, dtype, batch)),
            "pool_us": timed(operand_pool(pool, m, n, k, dtype, batch))}


def priced_us(cluster: Any, precision: str, batch: int, m: int, k: int, n: int) -> float:
    """The model's microseconds for one call: :func:`~piper_core.timing.compute.gemm_time` (batched
    products as core attention's, at the flat efficiency)."""
    from piper_core.timing.compute import core_attention_gemm_time, gemm_time

    acc = cluster.accelerator
    seconds = core_attention_gemm_time(acc, precision, m, n, k, batch=batch) if batch > 1 else \
        gemm_time(acc, precision, m, n, k)
    return 1e6 * seconds


def measure(case: Any, cluster: Any, *, steps: int, timeout_s: float = 900.0) -> dict[str, Any]:
    """Train ``case`` under the profiler and price its products on ``cluster`` (module docstring)."""
    from piper_core import trainers
    from piper_core.emulate import run_local
    from piper_core.validate.instrument import TrainJob

    job = TrainJob(model=case.model, plan=case.plan, steps=steps, warmup=min(3, steps - 1), stock=case.stock)
    target = trainers.get(case.framework).rank_target
    reports = run_local(case.plan.gpus, "piper_core.validate.gemms:rank_main", [target, job.to_json()],
                        timeout_s=timeout_s)
    first = reports[0]
    rows = group([tuple(r) for r in first["rows"]], first["steps"])
    for r in rows:
        r["priced_us"] = priced_us(cluster, case.plan.precision, r["batch"], r["m"], r["k"], r["n"])
        r |= first["alone"][json.dumps([r["batch"], r["m"], r["k"], r["n"]])]
    total = {key: sum(r[key] * r["calls_per_step"] for r in rows) / 1e3
             for key in ("measured_us", "priced_us", "hot_us", "pool_us")}
    return {"case": case.name, "cluster": cluster.name, "steps": first["steps"], "rank": 0, "shapes": rows,
            "ms_per_step": total}


def render(result: dict[str, Any]) -> str:
    lines = [f"{result['case']}: rank 0's matrix products per training step ({result['steps']} steps under the "
             f"profiler), priced on {result['cluster']}",
             f"{'[batch x] m x k x n':>24} {'calls':>6} {'in step us':>11} {'priced us':>10} {'alone hot':>10} "
             f"{'alone pool':>11} {'step/priced':>12}"]
    for r in result["shapes"]:
        shape = (f"{r['batch']} x " if r["batch"] > 1 else "") + f"{r['m']} x {r['k']} x {r['n']}"
        lines.append(f"{shape:>24} {r['calls_per_step']:>6.0f} {r['measured_us']:>11.1f} {r['priced_us']:>10.1f} "
                     f"{r['hot_us']:>10.1f} {r['pool_us']:>11.1f} {r['measured_us'] / r['priced_us']:>11.2f}x")
    t = result["ms_per_step"]
    lines.append(f"per step: in the step {t['measured_us']:.1f} ms, priced {t['priced_us']:.1f} ms "
                 f"({t['measured_us'] / t['priced_us']:.2f}x), alone with operands in cache {t['hot_us']:.1f} ms, "
                 f"rotated through the sweep's pool (out of cache) {t['pool_us']:.1f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from piper_core.errors import SpecError
    from piper_core.presets import load_cluster
    from piper_core.validate.suite import load_suite

    p = argparse.ArgumentParser(prog="python -m piper_core.validate.gemms", description=__doc__.split("\n\n")[0])
    p.add_argument("case", nargs="?", help="a case of the suite, e.g. 2r-ep2-mbs2")
    p.add_argument("--profile", help="the calibrated profile (or cluster preset) that prices the products")
    p.add_argument("--report", type=Path, help="print a result --json wrote; measures nothing")
    p.add_argument("--suite", default="full-fp32")
    p.add_argument("--steps", type=int, default=8, help="training steps under the profiler (default 8)")
    p.add_argument("--json", type=Path, help="also write the result here")
    a = p.parse_args(argv)
    if a.report is not None:
        try:
            print(render(json.loads(a.report.read_text())))
        except (OSError, ValueError, KeyError) as exc:
            print(f"gemms: error: --report {a.report}: not a result this tool wrote ({exc}); give a --json file",
                  file=sys.stderr)
            return 2
        return 0
    try:
        if a.case is None or a.profile is None:
            raise SpecError("case and --profile", a.case, "are required to measure", "give both, or --report FILE")
        if a.steps < 2:
            raise SpecError("--steps", a.steps, "must be at least 2 (one untimed warm-up step)", "use e.g. --steps 8")
        cases = {c.name: c for c in load_suite(a.suite).cases}
        if a.case not in cases:
            raise SpecError("case", a.case, f"is not a case of suite {a.suite}", f"use one of {', '.join(sorted(cases))}")
        if cases[a.case].nodes > 1:
            raise SpecError("case", a.case, "runs on emulated nodes; this check trains local ranks",
                            "pick a local case (2r-..., 4r-..., ds-...)")
        cluster = load_cluster(a.profile)
    except SpecError as exc:
        print(f"gemms: error: {exc}", file=sys.stderr)
        return 2
    result = measure(cases[a.case], cluster, steps=a.steps)
    print(render(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
