"""The measurement floor: how well the measurements of one run predict another's (issue 15).

``python -m piper_core.validate.floor RUN1.json RUN2.json ... [--json OUT]`` reads recorded
``piper validate`` runs (of any suites; only the cases two runs share are compared) and uses each run's
measured step times as the "prediction" of every other run's: an oracle that knows each case's time
exactly as this machine measured it at another hour, from another calibration's minute. No model can
be expected to beat it on this machine; it says what part of a model's error figure is the machine's.

It prints, per ordered pair of runs, the MAPE and worst error of that oracle, judged by the limits the
judged run recorded (step MAPE, worst step); the same with one speed factor per pair taken out (the
median ratio: what a whole-run drift of the machine explains); each single round of a case against its
run's median (the noise inside a run); and beside them each run's own model figure as recorded.

``--speed TOPOLOGY`` asks instead how fast the machine was when each run's calibration probed it,
against how fast it was while that run's cases ran: per run, the host-overhead probe's step times and
the topology's case step times, each as a geometric mean of its ratio to the median over the runs, and
the model's median error on those cases as recorded. A probe that caught the machine in a slow stretch
fits host terms that predict every case too slow; the line through (probe speed / case speed, median
error) at 1.0 is the error a calibration at the cases' own speed would have left: the model's part.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piper_core.errors import SpecError
from piper_core.validate.repeat import emit, read_record


def load(paths: Sequence[Path]) -> list[dict[str, Any]]:
    if len(paths) < 2:
        raise SpecError("runs", len(paths), "the floor compares runs with each other: it needs at least 2",
                        "pass two or more results.json files written by piper validate --json")
    return [read_record(p) for p in paths]


def _measured(run: dict[str, Any]) -> dict[str, float]:
    return {r["case"]: r["step_s"]["measured"] for r in run["rows"]}


def pair(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Run ``a``'s measured steps as the prediction of run ``b``'s, over the cases both ran (pure)."""
    ma, mb = _measured(a), _measured(b)
    common = [c for c in mb if c in ma]
    if not common:
        return None
    errors = {c: ma[c] / mb[c] - 1 for c in common}
    worst = max(errors, key=lambda c: abs(errors[c]))
    factor = statistics.median(mb[c] / ma[c] for c in common)
    lim = b["verdict"]["limits"]
    mape = statistics.mean(abs(e) for e in errors.values())
    return {"from": a["path"], "judged": b["path"], "cases": len(common), "step_mape": mape,
            "worst_step_error": errors[worst], "worst_step_case": worst,
            "passes": mape <= lim["step_mape"] and abs(errors[worst]) <= lim["worst_step"],
            "speed_factor": factor,
            "step_mape_drift_removed": statistics.mean(abs(ma[c] * factor / mb[c] - 1) for c in common)}


def rounds_noise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each single round of a case against the median of its run's rounds (cases measured in >= 3)."""
    devs = [abs(x / statistics.median(rs) - 1) for run in runs for row in run["rows"]
            if len(rs := row["step_s"].get("rounds") or ()) >= 3 for x in rs]
    return {"rounds": len(devs), "mean_abs_deviation": statistics.mean(devs) if devs else None}


def ratio(runs: list[dict[str, Any]], a: str, b: str) -> list[dict[str, Any]]:
    """Per run that has both cases: case ``a``'s step over case ``b``'s, measured and predicted. Both
    are measured in the same run's rounds and predicted from the same calibration, so the machine's
    drift between runs and between calibration and cases cancels: what is left is the model's."""
    out = []
    for run in runs:
        steps = {r["case"]: r["step_s"] for r in run["rows"]}
        if a in steps and b in steps:
            out.append({"run": run["path"], "measured": steps[a]["measured"] / steps[b]["measured"],
                        "predicted": steps[a]["predicted"] / steps[b]["predicted"]})
    if not out:
        raise SpecError("--ratio", f"{a} {b}", "no run has both cases", "name two cases of one run (piper validate --list)")
    return out


def _profile_path(run: dict[str, Any], topology: str) -> Path:
    """The profile a run predicted ``topology`` from: its recorded path, taken from the working
    directory or, failing that, from the repository the record lies in."""
    rec = (run.get("profiles") or {}).get(topology)
    if rec is None:
        raise SpecError("--speed", topology, f"{run['path']} predicted no case from that topology",
                        "name a topology of the runs' cases (the 'topology' of their rows)")
    path = Path(rec["path"])
    for root in (Path.cwd(), *Path(run["path"]).resolve().parents):
        if (root / path).is_file():
            return root / path
    raise SpecError("--speed", str(path), f"the profile {run['path']} predicted from is not on this disk",
                    "run from the repository the record was written in")


def _probe_steps(profile: Path) -> dict[str, float]:
    """The probe's step per probe run (slowest rank), as the profile stores it."""
    from piper_core.calibrate.probe import slowest_rank
    from piper_core.calibrate.profile import read_profile

    cal = read_profile(profile).calibration
    ranks = ((cal.get("benchmarks") or {}).get("overheads") or {}).get("result", {}).get("ranks")
    if not ranks:
        raise SpecError("calibration.benchmarks.overheads", str(profile), "has no host-overhead probe results",
                        "pass runs whose calibration ran the probe")
    return {run["label"]: step for run, step, _ in slowest_rank(ranks)}


def _relative_speed(steps: list[dict[str, float]]) -> list[float]:
    """Per run: geometric mean over the keys every run has of its time over the median of the runs' times."""
    keys = set.intersection(*(set(s) for s in steps))
    if not keys:
        raise SpecError("runs", len(steps), "share no probe run or case of that topology", "pass runs of one suite")
    median = {k: statistics.median(s[k] for s in steps) for k in keys}
    return [math.exp(statistics.mean(math.log(s[k] / median[k]) for k in keys)) for s in steps]


def _repredicted_errors(run: dict[str, Any], topology: str) -> list[float]:
    """The run's errors on ``topology`` as this version predicts them again (its profiles refitted)."""
    from piper_core.validate.report import repredicted, rows_from_json

    rows, _ = rows_from_json(run)
    return [r.predicted_step_s / r.measured_step_s - 1 for r in repredicted(rows, run) if r.case.topology == topology]


def speed(runs: list[dict[str, Any]], topology: str, *, again: bool = False) -> dict[str, Any]:
    """Per run: the probe's and the cases' relative step times on ``topology``, and the model's median
    error there (as recorded, or ``again``: as this version predicts it from the refitted profiles);
    the least-squares line of that error over the probe/case ratio, at 1."""
    probe = _relative_speed([_probe_steps(_profile_path(r, topology)) for r in runs])
    cases = _relative_speed([{row["case"]: row["step_s"]["measured"] for row in r["rows"] if row["topology"] == topology}
                             for r in runs])
    out = []
    for run, p, c in zip(runs, probe, cases):
        errors = _repredicted_errors(run, topology) if again else \
            [row["step_s"]["error"] for row in run["rows"] if row["topology"] == topology]
        out.append({"run": run["path"], "probe": p, "cases": c, "probe_over_cases": p / c,
                    "median_error": statistics.median(errors), "n": len(errors)})
    xs, ys = [r["probe_over_cases"] for r in out], [r["median_error"] for r in out]
    fit = None
    if len(out) >= 3 and statistics.pvariance(xs) > 0:
        slope = statistics.covariance(xs, ys) / statistics.variance(xs)
        fit = {"slope": slope, "error_at_equal_speed": statistics.mean(ys) + slope * (1 - statistics.mean(xs)),
               "correlation": statistics.correlation(xs, ys)}
    return {"topology": topology, "errors": "re-predicted by this version" if again else "as recorded",
            "runs": out, "fit": fit}


def speed_lines(f: dict[str, Any]) -> list[str]:
    out = [f"{f['topology']}: {'probe':>6} {'cases':>6} {'probe/cases':>11} {'median error':>12}  (times relative to the "
           f"median over the runs; error {f['errors']})"]
    out += [f"  {_short(r['run']):<28} {r['probe']:>6.3f} {r['cases']:>6.3f} {r['probe_over_cases']:>11.3f} "
            f"{100 * r['median_error']:>+11.1f}%" for r in f["runs"]]
    if f["fit"]:
        fit = f["fit"]
        out.append(f"  error = {100 * fit['error_at_equal_speed']:+.1f}% at equal speed, {fit['slope']:+.2f} per unit of "
                   f"probe/cases (correlation {fit['correlation']:+.2f}, least squares over {len(f['runs'])} runs)")
    return out


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = [p for a, b in itertools.permutations(runs, 2) if (p := pair(a, b)) is not None]
    if not pairs:
        raise SpecError("runs", len(runs), "share no case", "pass runs of suites with cases in common")
    mapes = [p["step_mape"] for p in pairs]
    model = [{"path": r["path"], "cases": r["verdict"]["cases"], "step_mape": r["verdict"]["step_mape"],
              "worst_step_error": r["verdict"]["worst_step_error"]} for r in runs]
    rows = sum(m["cases"] for m in model)
    return {"runs": len(runs), "pairs": pairs, "limits": runs[0]["verdict"]["limits"],
            "floor_step_mape": {"mean": statistics.mean(mapes), "least": min(mapes), "most": max(mapes)},
            "floor_drift_removed_mean": statistics.mean(p["step_mape_drift_removed"] for p in pairs),
            "pairs_passing": sum(p["passes"] for p in pairs), "within_run": rounds_noise(runs),
            "model": model, "model_pooled_step_mape": sum(m["step_mape"] * m["cases"] for m in model) / rows}


def _short(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[-3:-1]) if len(parts) >= 3 else path


def lines(f: dict[str, Any]) -> list[str]:
    lim = f["limits"]
    out = [f"{'measured in':<22} {'judged run':<22} {'cases':>5} {'MAPE':>6} {'worst':>7} {'on':<28} {'drift out':>9}  limits"]
    for p in f["pairs"]:
        out.append(f"{_short(p['from']):<22} {_short(p['judged']):<22} {p['cases']:>5} {100 * p['step_mape']:>5.1f}% "
                   f"{100 * p['worst_step_error']:>+6.1f}% {p['worst_step_case']:<28} {100 * p['step_mape_drift_removed']:>8.1f}%  "
                   f"{'pass' if p['passes'] else 'miss'}")
    fl, w = f["floor_step_mape"], f["within_run"]
    out += ["",
            f"the oracle (another run's measurement of the same case) over {len(f['pairs'])} ordered pairs of "
            f"{f['runs']} runs: MAPE {100 * fl['mean']:.1f}% on average ({100 * fl['least']:.1f}-{100 * fl['most']:.1f}%), "
            f"{f['pairs_passing']} of {len(f['pairs'])} pairs within the limits (MAPE {100 * lim['step_mape']:.0f}%, "
            f"worst {100 * lim['worst_step']:.0f}%)",
            f"  with one speed factor per pair taken out (whole-run drift): MAPE {100 * f['floor_drift_removed_mean']:.1f}% "
            "on average",
            (f"  inside a run: a single round against its run's median, {100 * w['mean_abs_deviation']:.1f}% on average "
             f"({w['rounds']} rounds)") if w["mean_abs_deviation"] is not None else "  inside a run: no run recorded rounds",
            f"the model over the same runs (each from its own calibration, as recorded): MAPE "
            + ", ".join(f"{100 * m['step_mape']:.1f}%" for m in f["model"])
            + f"; pooled {100 * f['model_pooled_step_mape']:.1f}%"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_core.validate.floor", description=__doc__.split("\n\n")[1])
    p.add_argument("runs", nargs="+", type=Path, help="piper validate --json records")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the figures as JSON")
    p.add_argument("--ratio", nargs=2, metavar=("CASE_A", "CASE_B"),
                   help="instead: CASE_A's step over CASE_B's in each run, measured and predicted")
    p.add_argument("--speed", metavar="TOPOLOGY",
                   help="instead: the machine's speed when each run's calibration probed TOPOLOGY against while its "
                        "cases ran, and the model's median error there")
    p.add_argument("--repredict", action="store_true",
                   help="with --speed: the model's errors as this version predicts the runs again (profiles refitted "
                        "from their stored medians), not as recorded")
    args = p.parse_args(argv)

    def make() -> tuple[Any, list[str]]:
        if args.ratio:
            rows = ratio(load(args.runs), *args.ratio)
            return rows, [f"{args.ratio[0]} / {args.ratio[1]}: {'measured':>8} {'predicted':>9}"] + [
                f"  {_short(r['run']):<28} {r['measured']:>8.3f} {r['predicted']:>9.3f}" for r in rows]
        if args.speed:
            f = speed(load(args.runs), args.speed, again=args.repredict)
            return f, speed_lines(f)
        f = figures(load(args.runs))
        return f, lines(f)

    return emit(make, args.json)


if __name__ == "__main__":
    sys.exit(main())
