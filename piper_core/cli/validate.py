"""``piper validate [--quick | --suite NAME|FILE] [--cases A,B] [--profiles DIR] [--json FILE] [--plot DIR]``.

Trains each case of a pre-registered validation suite (:mod:`piper_core.validate.suite`; built in:
``full``, and ``quick`` for ``--quick``) for a few real steps with Megatron-Core and Piper's
dispatcher, or DeepSpeed-MoE with Piper's layer, on CPU ranks (local, or on the emulated 2-node
cluster), instrumented, and compares step time, memory and the all-to-all phases with what the
calibrated profile of the case's topology predicts. Every run counts in the headline; the suite's
subsets are shown beside it. Profiles are read from ``DIR/<topology>.yaml``; a missing one is
calibrated first (``piper calibrate``) and written there, so a second run reuses it. The JSON
records the commit, the suite (path, sha256) and each profile (path, sha256). Exit status 1 when the
headline misses an acceptance limit (MAPE, worst case, memory, scheduler's pick).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_PROFILES = Path(".piper/profiles")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="measure real training steps on CPU ranks against the model's prediction",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--quick", action="store_true", help="the quick suite: three Megatron plans and one DeepSpeed plan "
                   "on 2 local ranks (the default test run's check)")
    p.add_argument("--suite", help="a built-in suite name (full, full-fp32, quick) or a suite YAML (default full; --quick: quick)")
    p.add_argument("--cases", help="comma-separated case names of the suite (default: all of them)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--no-peak", action="store_true", help="skip each case's memory job (peak tensor bytes per rank)")
    p.add_argument("--peak-only", action="store_true",
                   help="only the memory jobs: peak tensor bytes per rank against the predicted peak (the memory "
                        "model needs no calibration: predicted from the cpu-local preset, no profile needed)")
    p.add_argument("--profiles", type=Path, default=DEFAULT_PROFILES,
                   help=f"directory of calibrated profiles, one per topology (default {DEFAULT_PROFILES})")
    p.add_argument("--recalibrate", action="store_true", help="calibrate again, measuring everything afresh (no cached benchmarks), even where a profile exists")
    p.add_argument("--steps", type=int, default=None, help="training steps per case (default 12; the first 3 untimed)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the rows and the verdict as JSON")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write DIR/validation_scatter.png")
    p.add_argument("--realtime", action="store_true",
                   help="run the ranks (calibration too) under SCHED_FIFO (root), so other processes on a shared "
                        "machine do not disturb the timings")
    p.set_defaults(func=run)


def profiles_for(topologies: list[str], directory: Path, *, recalibrate: bool, quick: bool,
                 realtime: bool = False, probe_rounds: int = 1) -> dict:
    """The ClusterSpec of each topology: the profile in ``directory``, calibrated first if missing
    (its host-overhead probe in ``probe_rounds`` rounds)."""
    from piper_core.calibrate.api import calibrate_topology
    from piper_core.presets import load_cluster

    out = {}
    for topo in topologies:
        path = directory / f"{topo}.yaml"
        if recalibrate or not path.is_file():
            print(f"piper: calibrating {topo} -> {path} (piper calibrate{' --quick' if quick else ''}"
                  f"{f' --probe-rounds {probe_rounds}' if probe_rounds > 1 else ''})", file=sys.stderr)
            calibrate_topology(topo, path, quick=quick, realtime=realtime, fresh=recalibrate, probe_rounds=probe_rounds)
        out[topo] = load_cluster(str(path))
    return out


def run(args: argparse.Namespace) -> int:
    from piper_core.calibrate.interleave import ProbeRounds
    from piper_core.cli.progress import Progress
    from piper_core.export import plan_label
    from piper_core.validate.cases import select, suite_for
    from piper_core.validate.compare import passed, row_json, verdict
    from piper_core.validate.report import commit_state, profile_record, provenance, scatter, table
    from piper_core.validate.run import STEPS, WARMUP, run_cases

    suite = suite_for(args.suite, quick=args.quick)
    cases = select(args.cases.split(",") if args.cases else None, suite=suite)
    if args.list:
        for c in cases:
            print(f"{c.name:<20} {c.topology:<18} {c.model.name:<18} {plan_label(c.plan, gbs=True)}"
                  + ("  (stock exchange)" if c.stock else ""))
        return 0
    if args.peak_only:
        return _peak_only(args, suite, cases)
    if args.realtime:
        from piper_core.emulate.launch import check_realtime
        check_realtime()  # before any calibration or run
    topologies = sorted({c.topology for c in cases})
    steps = args.steps or STEPS
    progress = Progress("piper validate")
    # one topology at a time, its calibration right before its cases: a shared machine's speed
    # drifts over minutes, and the profile should describe the machine the cases meet
    # with ``probe: interleaved`` the calibration probes once and each later round of the cases
    # runs one more probe round first; the profile is refitted from all of them after the last
    rows = []
    interleaved = suite.probe == "interleaved"
    source, records = commit_state(), {}  # the code and each profile as the cases were predicted
    for topo in topologies:
        fresh = args.recalibrate or not (args.profiles / f"{topo}.yaml").is_file()
        profiles = profiles_for([topo], args.profiles, recalibrate=args.recalibrate, quick=args.quick,
                                realtime=args.realtime, probe_rounds=1 if interleaved else suite.rounds)
        probe = ProbeRounds(topo, args.profiles / f"{topo}.yaml", fresh=fresh, realtime=args.realtime,
                            quick=args.quick) if interleaved else None
        records[topo] = profile_record(args.profiles / f"{topo}.yaml")  # as loaded, before its cases run
        mine = [c for c in cases if c.topology == topo]
        rows += run_cases(mine, probe.profiles if probe else profiles, steps=steps, warmup=min(WARMUP, steps - 1),
                          rounds=suite.rounds, realtime=args.realtime, peak=not args.no_peak,
                          before_round=probe.before_round if probe else None,
                          progress=lambda i, n, done=len(rows), k=len(mine): progress(done + k * i / n, len(cases)))
        if interleaved:  # refitted from every probe round after the last round of cases
            records[topo] = profile_record(args.profiles / f"{topo}.yaml")
    order = {c.name: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: order[r.case.name])
    v = verdict(rows, suite.subsets)
    print(table(rows, v))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = provenance(suite, records, source)
        args.json.write_text(json.dumps(record | {"rows": [row_json(r) for r in rows], "verdict": v}, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {scatter(args.plot / 'validation_scatter.png', rows, v)}")
    return 0 if passed(v) else 1


def _peak_only(args: argparse.Namespace, suite: Any, cases: tuple) -> int:
    """``--peak-only``: each case's memory job, against the model's peak (cpu-local preset)."""
    from piper_core.cli.progress import Progress
    from piper_core.presets import load_cluster
    from piper_core.resource.predict import predict
    from piper_core.validate.compare import MEMORY_LIMIT
    from piper_core.validate.peak import measure_peak, peak_figures, peak_json, peak_lines, peak_subsets, subset_lines
    from piper_core.validate.report import provenance

    cluster = load_cluster("cpu-local")
    progress = Progress("piper validate --peak-only")
    rows = []
    for i, case in enumerate(cases):
        progress(i, len(cases))
        rows.append(measure_peak(case, predict(case.model, cluster, case.plan)))
    progress(len(cases), len(cases))
    figures = peak_figures(rows, MEMORY_LIMIT)
    subsets = peak_subsets(rows, suite.subsets, MEMORY_LIMIT)
    print("\n".join(peak_lines(rows, figures, MEMORY_LIMIT) + subset_lines(subsets)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = provenance(suite, {}) | {"cluster": cluster.name,
                                          "peak_rows": [{"case": r.case.name} | peak_json(r) for r in rows],
                                          "peak": figures | {"limit": MEMORY_LIMIT}, "peak_subsets": subsets}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    return 0 if figures["peak_ok"] else 1
