"""``piper calibrate --out PROFILE.yaml [--ranks N | --emulate NODESxRANKS --inter-node-mbit R]``:
measure this machine, fit the resource model to it, write a profile for ``--profile``.

Piper spawns the ranks itself (local gloo ranks, or an emulated multi-node cluster of network
namespaces, which needs root); running it under torchrun is not supported yet.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from piper_core.cli.progress import Progress
from piper_core.errors import SpecError

if TYPE_CHECKING:  # the calibrate package loads only when the command runs
    from piper_core.calibrate.run import Calibration, CalibrateOptions
    from piper_core.calibrate.steps import Outcome, Step, Topology

from piper_core.calibrate.steps import FRAMEWORKS, FULL_TIMEOUT_S, QUICK_TIMEOUT_S
ACCELERATOR_FIELDS = ("peak_tflops_bf16", "peak_tflops_fp16", "peak_tflops_fp32", "gemm_efficiency",
                      "gemm_half_size", "hbm_gb_per_s", "hbm_efficiency", "kernel_latency_us", "layer_overhead_us",
                      "moe_overhead_us", "expert_overhead_us", "backward_overhead_factor", "microbatch_overhead_us",
                      "step_overhead_us")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a profile the planner can use",
                       description="Run micro-benchmarks (GEMMs, memory copy, all-to-all, all-reduce, all-gather, "
                                   "point-to-point) on all ranks at once, fit the resource model's hardware terms "
                                   "and write a profile for `piper predict/plan/capacity --profile`. Ranks are "
                                   "spawned here (running under torchrun is not supported yet).")
    p.add_argument("--out", required=True, type=Path, help="profile YAML to write")
    p.add_argument("--ranks", type=int, help="local ranks on this host (default 2)")
    p.add_argument("--emulate", metavar="NODESxRANKS", help="emulated cluster, e.g. 2x2 (needs root)")
    p.add_argument("--inter-node-mbit", type=float, metavar="R", help="inter-node link rate of --emulate, Mbit/s")
    p.add_argument("--base", default="cpu-local", help="preset whose unmeasured terms (memory envelope, host) "
                                                        "are kept (default cpu-local)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, sizes and probe steps (on 2 ranks about a "
                   "minute with native bf16, 2-3 minutes on a CPU without)")
    p.add_argument("--cache", type=Path, help="benchmark cache, to resume an interrupted run "
                                              "(default: <out stem>.cache/ next to --out)")
    p.add_argument("--timeout-per-bench", type=float, metavar="S",
                   help=f"deadline of each benchmark in seconds (default {QUICK_TIMEOUT_S:g} with --quick, "
                        f"else {FULL_TIMEOUT_S:g})")
    p.add_argument("--framework", choices=FRAMEWORKS, default="megatron",
                   help="whose host overheads the probe fits: Megatron-Core (default) or DeepSpeed-MoE with "
                        "Piper's MoE layer")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="the training precision the profile is for: the GEMM efficiency curve, the element-wise "
                        "kernels and the probe's training runs in it (fp32 on a CPU without bf16 instructions)")
    p.add_argument("--probe-rounds", type=int, metavar="N",
                   help="run the host-overhead probe's list N times, in rounds, and fit each probe run's median over "
                        "them (default 1): on a shared machine a slow stretch then moves one round, not the fit")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--realtime", action="store_true",
                   help="run the ranks under SCHED_FIFO (root) so other processes on a shared machine do not "
                        "disturb the timings")
    p.add_argument("--refit", type=Path, metavar="PROFILE.yaml",
                   help="measure nothing: fit PROFILE again from the medians it stores, with this version's "
                        "fits, and write the result to --out (the machine and date stay those of the measurement)")
    p.set_defaults(func=run)


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The ranks to run on, from --ranks / --emulate / --inter-node-mbit (SpecError on a bad mix)."""
    from piper_core.calibrate.steps import Topology
    from piper_core.emulate import emulation_available

    if args.emulate is None:
        if args.inter_node_mbit is not None:
            raise SpecError("--inter-node-mbit", args.inter_node_mbit, "shapes the links of an emulated cluster",
                            "add --emulate NODESxRANKS, or drop --inter-node-mbit")
        ranks = 2 if args.ranks is None else args.ranks
        if ranks < 1:
            raise SpecError("--ranks", ranks, "must be >= 1", "give the number of local ranks, e.g. --ranks 2")
        return Topology(nodes=1, ranks_per_node=ranks, realtime=args.realtime)
    if args.ranks is not None:
        raise SpecError("--ranks", args.ranks, "cannot be combined with --emulate (which sets nodes x ranks)",
                        "drop --ranks, or drop --emulate for local ranks")
    match = re.fullmatch(r"(\d+)x(\d+)", args.emulate)
    if not match or int(match[1]) < 2 or int(match[2]) < 1:
        raise SpecError("--emulate", args.emulate, "must be NODESxRANKS with at least 2 nodes",
                        "write e.g. --emulate 2x2")
    if args.inter_node_mbit is None or args.inter_node_mbit <= 0:
        raise SpecError("--inter-node-mbit", args.inter_node_mbit, "is required with --emulate and must be > 0",
                        "add e.g. --inter-node-mbit 1000")
    why = emulation_available()
    if why is not None:
        raise SpecError("--emulate", args.emulate, f"the emulated cluster cannot be built here: {why}",
                        "run as root with ip and tc, or use --ranks")
    return Topology(nodes=int(match[1]), ranks_per_node=int(match[2]), inter_node_mbit=args.inter_node_mbit,
                    emulated=True, realtime=args.realtime)


def options_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> CalibrateOptions:
    from piper_core.calibrate.run import CalibrateOptions
    from piper_core.presets import load_cluster

    if os.environ.get("TORCHELASTIC_RUN_ID"):
        raise SpecError("launcher", "torchrun", "piper calibrate spawns its ranks itself; running it under "
                        "torchrun is not supported yet", "run it once, without torchrun, with --ranks N or --emulate")
    if args.out.suffix not in (".yaml", ".yml"):
        raise SpecError("--out", str(args.out), "must be a YAML file (.yaml or .yml)", "write e.g. --out me.yaml")
    timeout = args.timeout_per_bench or (QUICK_TIMEOUT_S if args.quick else FULL_TIMEOUT_S)
    rounds = 1 if args.probe_rounds is None else args.probe_rounds
    if not 1 <= rounds <= 9:
        raise SpecError("--probe-rounds", rounds, "must be a whole number from 1 to 9", "give e.g. --probe-rounds 3")
    if timeout <= 0:
        raise SpecError("--timeout-per-bench", timeout, "must be > 0", "give seconds, e.g. 60")
    load_cluster(args.base)  # fail now, not after the benchmarks
    if args.realtime:
        from piper_core.emulate.launch import check_realtime
        check_realtime()  # likewise: not one failed benchmark per step
    command = "piper " + shlex.join(argv if argv is not None else sys.argv[1:])
    return CalibrateOptions(out=args.out, topology=topology_from_args(args), base=args.base, quick=args.quick,
                            cache=args.cache, timeout_per_bench_s=timeout, command=command, framework=args.framework,
                            precision=args.precision, probe_rounds=rounds)


MEASURING = ("ranks", "emulate", "inter_node_mbit", "quick", "cache", "timeout_per_bench", "realtime", "probe_rounds")


def run_refit(args: argparse.Namespace) -> int:
    """``--refit``: the profile fitted again from its stored medians (no benchmark runs)."""
    from piper_core.calibrate.run import CalibrateOptions, recorded_topology, refit

    given = [f"--{k.replace('_', '-')}" for k in MEASURING if getattr(args, k) not in (None, False)]
    if given:
        raise SpecError(given[0], "given", "measures, and --refit measures nothing (the profile's own medians are "
                        "fitted again)", f"drop {', '.join(given)}, or drop --refit to calibrate afresh")
    if not args.refit.is_file():
        raise SpecError("--refit", str(args.refit), "must be an existing profile YAML", "name a profile written by "
                        "`piper calibrate --out`")
    command = "piper " + shlex.join(getattr(args, "argv", None) or sys.argv[1:])
    result = refit(args.refit, args.out, command)
    cal = result.calibration
    options = CalibrateOptions(out=args.out, topology=recorded_topology(cal), base=cal.get("base") or "cpu-local",
                               cache=args.refit.with_name(args.refit.stem + ".cache"), command=command)
    summary = summarize(result, options) | {"refit_of": str(args.refit)}
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


def run(args: argparse.Namespace) -> int:
    from piper_core.calibrate.run import calibrate, default_steps

    if args.refit is not None:
        return run_refit(args)
    options = options_from_args(args, getattr(args, "argv", None))
    steps, probe_missing = default_steps(options)
    if probe_missing and not args.json:
        print(f"calibrate: host overheads will not be fitted: {probe_missing}", file=sys.stderr)
    result = calibrate(options, steps=steps, on_step=_progress(sum(s.weight for s in steps)),
                       probe_missing=probe_missing)
    summary = summarize(result, options)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


def _progress(total: float) -> Callable[[int, Step, Outcome | None], None]:
    """A bar with ETA on a terminal (each benchmark a step, weighted by its expected time); one line
    per finished benchmark otherwise."""
    progress = Progress("calibrate")
    done = [0.0]

    def on_step(i: int, step: Step, outcome: Outcome | None) -> None:
        if outcome is None:
            progress.label = f"calibrate: {step.name:<14}"
            progress(done[0], total)
            return
        done[0] += step.weight
        progress(done[0], total)
        if not progress.enabled:
            state = "cached" if outcome.cached else outcome.status
            print(f"calibrate: {step.name} {state} ({outcome.seconds:.1f} s)", file=sys.stderr)
    return on_step


def summarize(result: Calibration, options: CalibrateOptions) -> dict[str, Any]:
    """The summary ``--json`` prints: fitted values (and the base's), fit quality per curve, steps."""
    from piper_core.presets import load_cluster

    base = load_cluster(options.base)
    cal, acc = result.calibration, result.cluster.accelerator
    fits = cal["fits"]
    quality: dict[str, Any] = {}
    for dtype, entry in fits["gemm"].items():
        if isinstance(entry, dict) and "r2" in entry:
            quality[f"gemm-{dtype}"] = {k: entry[k] for k in ("points", "r2", "max_rel_residual")}
    scatter = fits.get("reduce_scatter") or {"factor": result.cluster.reduce_scatter_factor,
                                             "source": "not fitted (a profile written before the fit existed)"}
    for group in ("curves", "checks"):
        src = fits["links"]["curves"] if group == "curves" else fits["checks"]
        for name, entry in src.items():
            fitted = group == "curves" or (name == "reducescatter" and "points" in scatter)
            quality[name] = {k: entry[k] for k in ("points", "r2", "max_rel_residual")} | {"fitted": fitted}
    return {
        "profile": str(result.path), "cache": str(options.cache_dir), "cluster": result.cluster.name,
        "topology": {"nodes": options.topology.nodes, "ranks_per_node": options.topology.ranks_per_node,
                     "inter_node_mbit": options.topology.inter_node_mbit, "emulated": options.topology.emulated},
        "accelerator": {f: {"value": getattr(acc, f), "base": getattr(base.accelerator, f)}
                        for f in ACCELERATOR_FIELDS},
        "links": fits["links"]["levels"], "reduce_scatter": scatter, "quality": quality, "overheads": fits["overheads"]["source"],
        "gemm_operands": fits["gemm"].get("operands"),
        "steps": [{"name": o.name, "status": o.status, "cached": o.cached, "wall_s": round(o.seconds, 2),
                   "error": o.error} for o in result.outcomes],
        "failures": cal["failures"],
    }


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f} %"


def render(s: dict[str, Any]) -> str:
    t = s["topology"]
    where = (f"emulated {t['nodes']}x{t['ranks_per_node']} at {t['inter_node_mbit']:g} Mbit/s" if t["emulated"]
             else f"{t['ranks_per_node']} local ranks")
    steps = s["steps"]
    wall = sum(x["wall_s"] for x in steps if not x["cached"])
    lines = [f"piper calibrate: {s['cluster']} ({where}); {len(steps)} benchmarks, "
             f"{sum(x['cached'] for x in steps)} from the cache, {sum(x['status'] != 'ok' for x in steps)} failed, "
             f"{wall:.1f} s measuring", "", f"{'accelerator':<26}{'fitted':>12}{'base':>12}"]
    if s.get("refit_of"):
        lines[0] = (f"piper calibrate --refit: {s['cluster']} ({where}) fitted again from the medians stored in "
                    f"{s['refit_of']}; nothing measured")
    for name, v in s["accelerator"].items():
        lines.append(f"{name:<26}{v['value']:>12.5g}{v['base']:>12.5g}")
    lines += ["", f"{'link level':<14}{'latency_us':>12}{'GB/s':>12}  from"]
    for name, v in s["links"].items():
        fit = f" (R^2 {v['r2']:.3f}, max residual {_pct(v['max_rel_residual'])})" if "r2" in v else ""
        lines.append(f"{name:<14}{v['latency_us']:>12.5g}{v['bandwidth_gb_per_s']:>12.5g}  {v['source']}{fit}")
        if v.get("left_out"):
            lines.append(f"{'':<14}left out of the fit: {v['left_out']}")
    rs = s.get("reduce_scatter")
    if rs:
        lines.append(f"reduce-scatter factor {rs['factor']:g} (bytes moved over a ring's): {rs['source']}")
    lines += ["", f"{'curve (model vs measured)':<28}{'points':>7}{'R^2':>9}{'max |residual|':>16}"]
    for name, q in s["quality"].items():
        tag = "" if q.get("fitted", True) else "  (check, not fitted)"
        lines.append(f"{name:<28}{q['points']:>7}{q['r2']:>9.3f}{_pct(q['max_rel_residual']):>16}{tag}")
    lines += ["", f"host overheads: {s['overheads']}"]
    for name, f in s["failures"].items():
        first = (f["error"] or "").strip().splitlines()[0] if f["error"] else ""
        lines.append(f"{f['status']}: {name}: {first}")
    lines += ["", f"profile written to {s['profile']} (cache {s['cache']})"]
    return "\n".join(lines)
