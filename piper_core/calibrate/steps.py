"""The calibration run, launcher side: which benchmarks, with which settings, each launched on all
ranks under its own deadline, cached so an interrupted run resumes, recorded when it fails.

One step is one launch of :func:`piper_core.calibrate.bench.run` (or of the host-overhead probe)
on every rank (:func:`piper_core.emulate.run_local` / :func:`~piper_core.emulate.run_emulated`):
a step that raises, dies or overruns its ``timeout_s`` kills only its own ranks, so the next step
starts clean. A finished step's ranks' results are written to ``<cache>/<name>-<key>.json``, the key
hashing the step's name, target and settings (ranks, nodes, link rate, shapes, sizes); a failed
step is not cached (a resumed run tries it again). No torch here.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from piper_core.emulate import RankFailure, run_emulated, run_local
from piper_core.emulate.netns import EmulationError

BENCH_TARGET = "piper_core.calibrate.bench:run"
BENCH_VERSION = 5
"""Part of every cache key: bump it when :mod:`.bench` or the probe changes what a result means
(5: the probe trains its own two-width family, 2026-12-06)."""
PROBE_TARGET = "piper_core.calibrate.probe:probe_rank"
"""The host-overhead probe's rank side (:mod:`.probe`): it trains through the framework's trainer,
which an adapter registers (:mod:`piper_core.trainers`); without one the probe is skipped."""

Status = Literal["ok", "failed", "skipped"]
QUICK_TIMEOUT_S, FULL_TIMEOUT_S = 120.0, 240.0
"""Default deadline of one benchmark (launch, process groups, the measurement), seconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Where the ranks run: ``nodes`` x ``ranks_per_node``; ``inter_node_mbit`` None is one local node."""

    nodes: int
    ranks_per_node: int
    inter_node_mbit: float | None = None
    emulated: bool = False
    realtime: bool = False  # ranks under SCHED_FIFO (piper_core.emulate.launch), for a shared machine

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One benchmark launch: ``args`` are passed after the rank info to ``target``; ``weight`` is
    its expected share of the run's time (for the ETA); ``rounds``: how many times it runs its
    measurements (its deadline is the run's per-benchmark deadline times this)."""

    name: str
    target: str
    args: tuple[Any, ...]
    weight: float = 1.0
    rounds: int = 1

    def key(self, topology: Topology) -> str:
        text = json.dumps({"version": BENCH_VERSION, "name": self.name, "target": self.target, "args": self.args,
                           "topology": [topology.nodes, topology.ranks_per_node, topology.inter_node_mbit,
                                        topology.emulated]}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """What one step gave: ``results`` (each rank's JSON, in rank order) or ``error``."""

    name: str
    status: Status
    seconds: float
    cached: bool = False
    results: tuple[Any, ...] = ()
    error: str | None = None


# ---- what to measure -------------------------------------------------------------------------------

def _sizes(lo_exp: int, hi_exp: int, step: int) -> list[int]:
    return [2 ** e for e in range(lo_exp, hi_exp + 1, step)]


def gemm_shapes(quick: bool, precision: str = "bf16") -> dict[str, list[list[int]]]:
    """[m, n, k] per dtype: square-ish GEMMs and skinny expert GEMMs (m from 16 to 4096 tokens over
    the up and down projections of hidden 256 / ffn 1024 and hidden 64 / ffn 256), bf16 for the curve;
    a few compute-bound ones in fp32 (the router) and fp16 for their peaks. ``precision`` fp32: the
    curve in fp32, and the few compute-bound ones in bf16."""
    shapes = _gemm_shapes(quick)
    if precision == "fp32":
        shapes["bf16"], shapes["fp32"] = shapes["fp32"], shapes["bf16"]
    return shapes


def _gemm_shapes(quick: bool) -> dict[str, list[list[int]]]:
    if quick:
        square = [64, 256, 1024]
        skinny = [[m, n, k] for m in (16, 128, 1024, 4096) for n, k in ((1024, 256), (256, 1024))]
        return {"bf16": [[s, s, s] for s in square] + skinny, "fp32": [[256, 256, 256], [512, 512, 512]],
                "fp16": [[256, 256, 256], [512, 512, 512]]}
    square = [64, 128, 256, 512, 1024]
    skinny = [[m, n, k] for m in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
              for n, k in ((1024, 256), (256, 1024), (256, 64), (64, 256))]
    return {"bf16": [[s, s, s] for s in square] + skinny,
            "fp32": [[128, 128, 128], [256, 256, 256], [512, 512, 512], [1024, 1024, 1024]],
            "fp16": [[256, 256, 256], [512, 512, 512]]}


FRAMEWORKS = ("megatron", "deepspeed")
# The GEMM sweep's operand pool (:func:`piper_core.calibrate.bench.operand_pool`): every call reads
# operands out of cache, as a training step's GEMMs do. Larger than the caches a GEMM sees here (the
# time steps up between an 8 and a 64 MiB pool on the development host, docs/validation.md) and than
# a GPU's L2 (50 MiB on an H100); at most 1 GiB over 4 ranks.
GEMM_POOL_MIB = 256


def plan_steps(topology: Topology, *, quick: bool, timeout_s: float, overhead_probe: bool,
               framework: str = "megatron", precision: str = "bf16", probe_rounds: int = 1) -> list[Step]:
    """The benchmarks of a run, cheapest first. Collectives use ``timeout_s / 3`` as each
    operation's deadline (well inside the step's, so the failure names the operation).
    ``framework``: whose host overheads the probe fits (Megatron-Core or DeepSpeed-MoE);
    ``precision``: the training precision (the GEMM curve's, the element-wise kernels' and the
    probe runs' dtype; bf16 steps keep the settings, so the cache keys, of earlier versions);
    ``probe_rounds``: how many times the probe runs its whole list, in rounds (:func:`.probe.probe_rank`)."""
    dtype = {} if precision == "bf16" else {"dtype": precision}
    op_timeout = max(1.0, timeout_s / 3)
    base = {"timeout_s": op_timeout, "budget_s": 0.05 if quick else 0.2, "max_reps": 15 if quick else 31}
    coll = base | {"sizes": _sizes(10, 22, 2) if quick else _sizes(10, 24, 1), "stop_s": 0.5 if quick else 2.0,
                   "budget_s": 0.1 if quick else 0.4}
    if quick:
        coll["max_reps"] = 9
    steps = [Step(name="gemm", target=BENCH_TARGET,
                  args=("gemm", base | {"shapes": gemm_shapes(quick, precision), "pool_mib": GEMM_POOL_MIB}), weight=3),
             Step(name="memory", target=BENCH_TARGET, args=("memory", base | {"copy_mib": 32 if quick else 128} | dtype))]
    if topology.world_size > 1:
        # with one rank per node the intra-node groups are single ranks and "inter" is the whole job
        scopes = ["all"] + (["intra", "inter"] if topology.nodes > 1 and topology.ranks_per_node > 1 else [])
        steps += [Step(name=f"alltoall-{sc}", target=BENCH_TARGET, args=("alltoall", coll | {"scope": sc}), weight=2)
                  for sc in scopes]
        # checks of the fitted links (not fitted themselves): fewer sizes when quick
        check = coll | ({"sizes": _sizes(10, 22, 4), "budget_s": 0.05} if quick else {})
        if topology.nodes > 1 and topology.ranks_per_node > 1:
            steps.append(Step(name="alltoall-hier", target=BENCH_TARGET,
                              args=("alltoall", check | {"scope": "all", "algorithm": "hierarchical"})))
        steps += [Step(name=name, target=BENCH_TARGET, args=(name, check))
                  for name in ("allreduce", "allgather", "reducescatter")]
        p2p_scopes = (["intra"] if topology.ranks_per_node > 1 else []) + (["inter"] if topology.nodes > 1 else [])
        steps += [Step(name=f"p2p-{sc}", target=BENCH_TARGET, args=("p2p", check | {"scope": sc})) for sc in p2p_scopes]
        if topology.ranks_per_node > 1:
            # bulk two-way exchanges inside a node (a move of experts): the links' ``bulk_gb_per_s``
            bulk = coll | {"sizes": _sizes(23, 25, 2) if quick else _sizes(23, 27, 2), "scope": "intra",
                           "mode": "exchange", "stop_s": 2.0, "budget_s": 0.5 if quick else 2.0}
            steps.append(Step(name="exchange-intra", target=BENCH_TARGET, args=("p2p", bulk)))
    if overhead_probe:
        settings = {"quick": quick} | ({"framework": framework} if framework != "megatron" else {}) | \
            ({"precision": precision} if precision != "bf16" else {}) | ({"rounds": probe_rounds} if probe_rounds > 1 else {})
        steps.append(Step(name="overheads", target=PROBE_TARGET, args=(settings,), weight=4 * probe_rounds,
                          rounds=probe_rounds))
    return steps


def overhead_probe_available(framework: str = "megatron") -> str | None:
    """None when the host-overhead probe can train ``framework``'s models here, else why not
    (recorded in the profile)."""
    from piper_core import trainers

    return trainers.unavailable(framework)


# ---- running ---------------------------------------------------------------------------------------

def _launch(topology: Topology, step: Step, timeout_s: float) -> list[Any]:
    if topology.emulated:
        return run_emulated(topology.nodes, topology.ranks_per_node, topology.inter_node_mbit, step.target,
                            list(step.args), timeout_s=timeout_s, collective_timeout_s=max(1.0, timeout_s / 3),
                            realtime=topology.realtime)
    return run_local(topology.world_size, step.target, list(step.args), timeout_s=timeout_s,
                     collective_timeout_s=max(1.0, timeout_s / 3), realtime=topology.realtime)


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 4000 else text[:4000] + " ..."


def run_step(step: Step, topology: Topology, *, timeout_s: float, cache: Path | None) -> Outcome:
    """Run one step (or take it from ``cache``); failures are returned, never raised."""
    path = cache / f"{step.name}-{step.key(topology)}.json" if cache is not None else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text())
            return Outcome(name=step.name, status="ok", seconds=data["seconds"], cached=True,
                           results=tuple(data["results"]))
        except (ValueError, KeyError):
            pass  # a torn write from an interrupted run: measure again
    start = time.perf_counter()
    try:
        results = _launch(topology, step, timeout_s * step.rounds)
    except (RankFailure, EmulationError, ValueError, OSError) as exc:
        return Outcome(name=step.name, status="failed", seconds=time.perf_counter() - start, error=_error_text(exc))
    seconds = time.perf_counter() - start
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"name": step.name, "target": step.target, "args": step.args,
                                   "seconds": seconds, "results": results}))
        tmp.replace(path)
    return Outcome(name=step.name, status="ok", seconds=seconds, results=tuple(results))


@dataclass(frozen=True, kw_only=True, slots=True)
class RunLog:
    """Each step's outcome, in step order."""

    outcomes: tuple[Outcome, ...]


def run_steps(steps: Sequence[Step], topology: Topology, *, timeout_s: float, cache: Path | None,
              on_step: Callable[[int, Step, Outcome | None], None] | None = None) -> RunLog:
    """Run ``steps`` in order; ``on_step(i, step, None)`` before and ``on_step(i, step, outcome)``
    after each (progress display)."""
    outcomes = []
    for i, step in enumerate(steps):
        if on_step is not None:
            on_step(i, step, None)
        outcome = run_step(step, topology, timeout_s=timeout_s, cache=cache)
        outcomes.append(outcome)
        if on_step is not None:
            on_step(i, step, outcome)
    return RunLog(outcomes=tuple(outcomes))
