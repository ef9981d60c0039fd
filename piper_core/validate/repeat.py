"""Repeatability: several recorded runs of one suite, read together (issue 15, Deliver 6).

``python -m piper_core.validate.repeat RUN1.json RUN2.json ... [--json OUT]`` takes the ``--json``
records of ``piper validate`` runs of the same pre-registered suite (same sha256, same cases; each run
from its own calibration when made with ``--recalibrate``) and prints:

* each run's headline (every case counted): step-time MAPE, worst step error, worst peak error, worst
  pick regret; then the headline's range over the runs (least, most) and the pooled MAPE over every
  row of every run;
* per case: the measured step's median over the runs and its spread ((most - least) / median), and the
  step error of each run (each against that run's own prediction, from that run's profile).

Nothing is dropped: a run that misses counts in the range as it is. ``make validate-fp32-repeat``
makes the three runs and this report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from piper_core.errors import SpecError

HEADLINE = ("step_mape", "worst_step_error", "worst_peak_error", "worst_pick_regret")


def read_record(path: Path) -> dict[str, Any]:
    """One ``piper validate --json`` record (with ``"path"`` added); a clear error for anything else."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecError("run", str(path), f"is not a readable piper validate --json record ({e})",
                        "pass the file piper validate --json wrote") from e
    if "rows" not in record or "verdict" not in record:
        raise SpecError("run", str(path), "has no rows or verdict (is it a --peak-only record?)",
                        "pass a full piper validate --json record")
    return record | {"path": str(path)}


def load_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The records at ``paths``; they must be runs of one suite (same sha256) with the same cases."""
    if len(paths) < 2:
        raise SpecError("runs", len(paths), "repeatability needs at least 2 recorded runs",
                        "pass two or more results.json files of one suite")
    runs = [read_record(p) for p in paths]
    for r in runs:
        if "suite" not in r:
            raise SpecError("run", r["path"], "records no suite (written before suites were recorded)",
                            "read together only runs that record their suite")
    first = runs[0]
    for r in runs[1:]:
        if r["suite"]["sha256"] != first["suite"]["sha256"]:
            raise SpecError("run", r["path"], f"is of suite {r['suite']['name']} sha256 {r['suite']['sha256'][:12]}, "
                            f"not {first['suite']['name']} {first['suite']['sha256'][:12]} like {first['path']}",
                            "read together only runs of the same registered suite")
        if [x["case"] for x in r["rows"]] != [x["case"] for x in first["rows"]]:
            raise SpecError("run", r["path"], f"has other cases than {first['path']}",
                            "run the whole suite each time (no --cases)")
    return runs


def _worst(values: list[float]) -> float:
    return max(values, key=abs) if values else 0.0


def headline(record: dict[str, Any]) -> dict[str, float]:
    v = record["verdict"]
    return {"step_mape": v["step_mape"], "worst_step_error": v["worst_step_error"],
            "worst_peak_error": v.get("worst_peak_error", 0.0),
            "worst_pick_regret": max((p["pick_slower_by"] for p in v["picks"].values()), default=0.0)}


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-run headlines, their range, the pooled MAPE and the per-case spread (pure)."""
    per_run = [{"path": r["path"], "commit": r["source"]["commit"], "cases": len(r["rows"])} | headline(r)
               for r in runs]
    rng = {k: [min(h[k] for h in per_run), max(h[k] for h in per_run)] for k in ("step_mape", "worst_pick_regret")}
    rng |= {k: [min((h[k] for h in per_run), key=abs), _worst([h[k] for h in per_run])]
            for k in ("worst_step_error", "worst_peak_error")}
    errors = [abs(row["step_s"]["error"]) for r in runs for row in r["rows"]]
    cases = []
    for i, row in enumerate(runs[0]["rows"]):
        measured = [r["rows"][i]["step_s"]["measured"] for r in runs]
        med = statistics.median(measured)
        cases.append({"case": row["case"], "measured_s": measured, "median_s": med,
                      "spread": (max(measured) - min(measured)) / med if med else 0.0,
                      "errors": [r["rows"][i]["step_s"]["error"] for r in runs]})
    spreads = [c["spread"] for c in cases]
    return {"runs": len(runs), "rows": len(errors), "per_run": per_run, "range": rng,
            "pooled_step_mape": sum(errors) / len(errors), "cases": cases,
            "median_case_spread": statistics.median(spreads), "worst_case_spread": max(spreads),
            "worst_spread_case": cases[spreads.index(max(spreads))]["case"],
            "limits": runs[0]["verdict"]["limits"]}


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def lines(f: dict[str, Any]) -> list[str]:
    lim = f["limits"]
    out = [f"{'run':<44} {'cases':>5} {'step MAPE':>9} {'worst step':>10} {'worst peak':>10} {'worst pick':>10}"]
    for h in f["per_run"]:
        out.append(f"{h['path'][-44:]:<44} {h['cases']:>5} {100 * h['step_mape']:>8.1f}% {_pct(h['worst_step_error']):>10} "
                   f"{_pct(h['worst_peak_error']):>10} {100 * h['worst_pick_regret']:>9.1f}%")
    r = f["range"]
    out += ["",
            f"over {f['runs']} runs ({f['rows']} runs of cases, every one counted):",
            f"  step-time MAPE {100 * r['step_mape'][0]:.1f}-{100 * r['step_mape'][1]:.1f}% per run "
            f"(limit {100 * lim['step_mape']:.0f}%), pooled {100 * f['pooled_step_mape']:.1f}%",
            f"  worst step error per run from {_pct(r['worst_step_error'][0])} (least) to {_pct(r['worst_step_error'][1])} (most) "
            f"(limit {100 * lim['worst_step']:.0f}%)",
            f"  worst peak error per run from {_pct(r['worst_peak_error'][0])} (least) to {_pct(r['worst_peak_error'][1])} (most) "
            f"(limit {100 * lim['memory']:.0f}%)",
            f"  worst pick regret {100 * r['worst_pick_regret'][0]:.1f}-{100 * r['worst_pick_regret'][1]:.1f}% "
            f"(limit {100 * lim['pick']:.0f}%)",
            f"  measured step spread per case ((most - least) / median over the runs): median "
            f"{100 * f['median_case_spread']:.1f}%, worst {100 * f['worst_case_spread']:.1f}% on {f['worst_spread_case']}",
            "",
            f"{'case':<32} {'median s':>9} {'spread':>7}  step error per run"]
    for c in f["cases"]:
        out.append(f"{c['case']:<32} {c['median_s']:>9.4f} {100 * c['spread']:>6.1f}%  "
                   + " ".join(f"{_pct(e):>7}" for e in c["errors"]))
    return out


def emit(make: Callable[[], tuple[Any, list[str]]], json_path: Path | None) -> int:
    """Print what ``make`` returns (figures, lines) and write the figures to ``json_path``; a bad input
    (:class:`SpecError`) prints its message and exits 2."""
    try:
        data, text = make()
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(text))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1))
        print(f"wrote {json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_core.validate.repeat", description=__doc__.split("\n\n")[1])
    p.add_argument("runs", nargs="+", type=Path, help="piper validate --json records of one suite")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the figures as JSON")
    args = p.parse_args(argv)

    def make() -> tuple[dict[str, Any], list[str]]:
        f = figures(load_runs(args.runs))
        return f, lines(f)

    return emit(make, args.json)


if __name__ == "__main__":
    sys.exit(main())
