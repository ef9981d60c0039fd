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
"""

from __future__ import annotations

import argparse
import itertools
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
    args = p.parse_args(argv)

    def make() -> tuple[Any, list[str]]:
        if args.ratio:
            rows = ratio(load(args.runs), *args.ratio)
            return rows, [f"{args.ratio[0]} / {args.ratio[1]}: {'measured':>8} {'predicted':>9}"] + [
                f"  {_short(r['run']):<28} {r['measured']:>8.3f} {r['predicted']:>9.3f}" for r in rows]
        f = figures(load(args.runs))
        return f, lines(f)

    return emit(make, args.json)


if __name__ == "__main__":
    sys.exit(main())
