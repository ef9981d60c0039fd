"""``calibrate()``: run the benchmarks, fit, write the profile; what ``piper calibrate`` calls.

Steps run in order (:mod:`~piper_core.calibrate.steps`); the fits use whatever succeeded and fall
back to the base preset, saying so, for what did not. The host-overhead probe
(:mod:`~piper_core.calibrate.probe`) is one more step when an adapter has registered the framework's
trainer (:mod:`piper_core.trainers`); if none has, or the probe fails, the overhead fields stay at the base preset's values and the profile records why.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from piper_core.calibrate.assemble import check_collectives, fit_accelerator, fit_bulk, fit_links, fit_reduce_scatter, \
    reduce_outcomes
from piper_core.calibrate.profile import write_profile
from piper_core.calibrate.probe import FIELDS as OVERHEAD_FIELDS
from piper_core.calibrate.probe import fit_overheads
from piper_core.calibrate.steps import Outcome, RunLog, Step, Topology, overhead_probe_available, \
    plan_steps, run_steps
from piper_core.errors import SpecError
from piper_core.presets import load_cluster
from piper_core.specs.cluster import ClusterSpec



@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrateOptions:
    """What ``piper calibrate`` was asked: where to write, on which ranks, from which base preset."""

    out: Path
    topology: Topology
    base: str = "cpu-local"
    quick: bool = False
    cache: Path | None = None
    timeout_per_bench_s: float = 120.0
    command: str = "piper calibrate"
    framework: str = "megatron"  # whose host overheads the probe fits: "megatron" or "deepspeed"
    precision: str = "bf16"  # the training precision the profile is for: bf16 or fp32 (GEMM curve, probe runs)
    probe_rounds: int = 1  # how many times the host-overhead probe runs its list, in rounds (medians over them)

    @property
    def cache_dir(self) -> Path:
        """``--cache``, or ``<out stem>.cache/`` next to the profile."""
        return self.cache if self.cache is not None else self.out.with_name(self.out.stem + ".cache")


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """The outcome: the fitted cluster, the calibration record written with it, each step's outcome."""

    cluster: ClusterSpec
    calibration: dict[str, Any]
    outcomes: tuple[Outcome, ...]
    path: Path


def default_steps(options: CalibrateOptions) -> tuple[list[Step], str | None]:
    """The steps for ``options`` and, when the host-overhead probe cannot run, why not."""
    why_not = overhead_probe_available(options.framework)
    steps = plan_steps(options.topology, quick=options.quick, timeout_s=options.timeout_per_bench_s,
                       overhead_probe=why_not is None, framework=options.framework, precision=options.precision,
                       probe_rounds=options.probe_rounds)
    return steps, why_not


def calibrate(options: CalibrateOptions, *, steps: Sequence[Step] | None = None,
              on_step: Callable[[int, Step, Outcome | None], None] | None = None,
              probe_missing: str | None = None) -> Calibration:
    """Run ``steps`` (default :func:`default_steps`), fit, and write the profile to ``options.out``.
    ``probe_missing``: why the host-overhead probe is not among ``steps`` (recorded)."""
    base = load_cluster(options.base)
    if steps is None:
        steps, probe_missing = default_steps(options)
    log = run_steps(steps, options.topology, timeout_s=options.timeout_per_bench_s, cache=options.cache_dir,
                    on_step=on_step)
    cluster, calibration = assemble(options, base, log, probe_missing)
    write_profile(options.out, cluster, calibration)
    return Calibration(cluster=cluster, calibration=calibration, outcomes=tuple(log.outcomes), path=options.out)


def assemble(options: CalibrateOptions, base: ClusterSpec, log: RunLog,
             probe_missing: str | None) -> tuple[ClusterSpec, dict[str, Any]]:
    """Fit every term from the successful steps; the calibration record to write beside it."""
    medians = reduce_outcomes(log.outcomes)
    topo = options.topology
    failures = {o.name: {"status": o.status, "error": o.error, "wall_s": round(o.seconds, 2)}
                for o in log.outcomes if o.status != "ok"}
    machine = _machine(log)
    cluster, fits = fit_medians(medians, topo, base, _name(topo), probe_missing, failures, options.precision,
                                cores=machine["cores"])
    benchmarks = {o.name: {"wall_s": round(o.seconds, 2), "cached": o.cached, "result": medians[o.name]}
                  for o in log.outcomes if o.status == "ok"}
    calibration = {
        "machine": machine, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": topo.world_size, "nodes": topo.nodes, "ranks_per_node": topo.ranks_per_node,
        "inter_node_mbit": topo.inter_node_mbit, "base": options.base, "command": options.command,
        "precision": options.precision,
        "benchmarks": benchmarks, "failures": failures, "fits": fits,
    }
    return cluster, calibration


def fit_medians(medians: dict[str, Any], topo: Topology, base: ClusterSpec, name: str, probe_missing: str | None,
                failures: dict[str, Any], precision: str = "bf16", cores: int | None = None) -> tuple[ClusterSpec, dict[str, Any]]:
    """Every fit from the benchmarks' medians (pure): the cluster named ``name`` and the fit report.
    ``failures`` (per benchmark) gains the overhead fit's failure, if any; ``precision``: the
    training precision the profile is for; ``cores``: the host's cores, which all of the run's ranks
    shared (local and emulated nodes alike run on this host): ``core_share`` = cores / ranks, at most
    1 (None: unknown, 1)."""
    acc, fits = fit_accelerator(medians, base.accelerator, precision)
    if cores:
        acc = dataclasses.replace(acc, core_share=min(1.0, cores / topo.world_size))
    cluster, links = fit_links(medians, topo, dataclasses.replace(base, accelerator=acc))
    fits["links"] = links
    cluster, fits["reduce_scatter"] = fit_reduce_scatter(medians, cluster)
    cluster, fits["bulk"] = fit_bulk(medians, cluster)
    fits["checks"] = check_collectives(medians, cluster)
    cluster = dataclasses.replace(cluster, name=name)
    cluster, fits["overheads"] = _overheads(cluster, medians.get("overheads"), probe_missing, failures)
    return cluster, fits


def recorded_topology(cal: dict[str, Any]) -> Topology:
    """The ranks a calibration record was measured on (emulated where it names a link rate)."""
    nodes, per_node = int(cal["nodes"]), int(cal.get("ranks_per_node") or cal["ranks"] // cal["nodes"])
    mbit = cal.get("inter_node_mbit")
    return Topology(nodes=nodes, ranks_per_node=per_node, inter_node_mbit=mbit, emulated=mbit is not None)


def refit(source: Path, out: Path, command: str, *, overheads: dict[str, Any] | None = None,
          note: dict[str, Any] | None = None) -> Calibration:
    """Fit the profile at ``source`` again from the medians it stores, with this version's fits, and
    write it to ``out``: nothing is measured (after a Piper upgrade that changes a fit, old
    calibrations need not be re-run). The record keeps the machine, date and benchmarks, and says
    where it came from (``refit``). ``overheads``: host-overhead probe results measured since
    (:mod:`.interleave`) in place of the stored ones; ``note``: keys added to the record."""
    from piper_core.calibrate.profile import read_profile

    old = read_profile(source)
    cal = old.calibration
    if out.suffix not in (".yaml", ".yml"):
        raise SpecError("--out", str(out), "must be a YAML file (.yaml or .yml)", "write e.g. --out refit.yaml")
    try:
        medians = {name: b["result"] for name, b in cal["benchmarks"].items()}
        if overheads is not None:
            medians["overheads"] = overheads
            cal = {**cal, "benchmarks": {**cal["benchmarks"],
                                         "overheads": {**cal["benchmarks"].get("overheads", {}), "result": overheads}}}
    except (AttributeError, KeyError, TypeError) as exc:
        raise SpecError("calibration.benchmarks", type(cal["benchmarks"]).__name__,
                        "must map each benchmark to its record with its 'result' (the medians)",
                        "refit a profile written by `piper calibrate`", where=str(source)) from exc
    topo = recorded_topology(cal)
    base = load_cluster(cal.get("base") or "cpu-local")
    failures = {k: dict(v) for k, v in (cal.get("failures") or {}).items() if k != "overheads"}
    probe_missing = None if "overheads" in medians else (cal.get("failures") or {}).get("overheads", {}).get(
        "error") or "the profile has no host-overhead probe results"
    cluster, fits = fit_medians(medians, topo, base, old.cluster.name, probe_missing, failures,
                                cal.get("precision", "bf16"), cores=(cal.get("machine") or {}).get("cores"))
    record = {**cal, "failures": failures, "fits": fits,
              "command": f"{command} (refit of: {cal['command']})", **(note or {})}
    write_profile(out, cluster, record)
    return Calibration(cluster=cluster, calibration=record, outcomes=(), path=out)


def _overheads(cluster: ClusterSpec, probe: dict[str, Any] | None, missing: str | None,
               failures: dict[str, Any]) -> tuple[ClusterSpec, dict[str, Any]]:
    """Fit the host-overhead fields from the probe's results (the probe's own pure fit, given the
    cluster with every other term already fitted)."""
    acc = cluster.accelerator
    kept = {f: getattr(acc, f) for f in OVERHEAD_FIELDS}
    if missing is not None:
        failures.setdefault("overheads", {"status": "skipped", "error": missing, "wall_s": 0.0})
        return cluster, {"source": f"not fitted ({missing}); base values kept", "values": kept}
    if probe is None:
        why = failures.get("overheads", {}).get("error") or "the probe did not run"
        return cluster, {"source": f"not fitted (the probe failed: {why.splitlines()[0]}); base values kept",
                     "values": kept}
    try:
        fields, info = fit_overheads(cluster, list(probe["ranks"]))
        fitted = dataclasses.replace(acc, **fields)
    except Exception as exc:  # noqa: BLE001 - a broken fit is recorded, like a broken benchmark
        failures["overheads"] = {"status": "failed", "error": f"fit_overheads: {type(exc).__name__}: {exc}",
                                 "wall_s": 0.0}
        return cluster, {"source": "not fitted (fit_overheads failed); base values kept", "values": kept}
    return dataclasses.replace(cluster, accelerator=fitted), {"source": f"fitted by {fit_overheads.__module__}.fit_overheads",
                    "values": {f: getattr(fitted, f) for f in (*OVERHEAD_FIELDS, "elementwise_gb_per_s")}, "fit": info}


def _name(topo: Topology) -> str:
    host = platform.node().split(".")[0] or "host"
    rate = f"-{topo.inter_node_mbit:g}mbit" if topo.inter_node_mbit is not None else ""
    return f"calibrated-{host}-{topo.nodes}x{topo.ranks_per_node}{rate}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _machine(log: RunLog) -> dict[str, Any]:
    torch_version = next((o.results[0].get("torch") for o in log.outcomes
                          if o.status == "ok" and o.results and isinstance(o.results[0], dict)
                          and "torch" in o.results[0]), None)
    return {"hostname": platform.node(), "cpu": _cpu_model(), "cores": os.cpu_count(),
            "kernel": platform.release(), "python": sys.version.split()[0], "torch": torch_version}
