"""The validation table, its JSON's provenance, and the predicted-vs-measured scatter plot.

``python -m piper_core.validate.report RESULTS.json`` prints the table and verdict of a recorded run
again (its rows, judged by this version's rule: every run in the headline, the suite's subsets beside).
``--repredict`` replaces each recorded prediction with this version's: each profile the run predicted
from is fitted again from the medians it stores (``piper calibrate --refit``, nothing measured) and
each case predicted from it. The measurements stay the run's: it shows what a model change would
have predicted for runs already made (a development check, labelled as such, never a new run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from piper_core.export import plan_label
from piper_core.validate.compare import Row, verdict
from piper_core.validate.peak import PeakRow, peak_from_json, peak_lines, subset_lines
from piper_core.validate.suite import Suite, load_suite


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def table(rows: Sequence[Row], verdict: dict[str, Any]) -> str:
    rounds = max(len(r.round_steps_s) for r in rows)
    head = (f"{'case':<20} {'profile':<16} {'plan':<42} {'measured s':>10} {'predicted s':>11} {'error':>7} "
            f"{'mem MiB meas/pred':>18} {'mem err':>7}" + (f" {'round spread':>12}" if rounds else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = f"{max(r.measured_memory) / 2**20:.1f}/{max(r.predicted_memory) / 2**20:.1f}"
        spread = "" if not rounds else f" {'-' if r.round_spread is None else _pct(r.round_spread):>12}"
        lines.append(f"{r.case.name:<20} {r.case.topology:<16} {plan_label(r.case.plan, gbs=True):<42} "
                     f"{r.measured_step_s:>10.4f} {r.predicted_step_s:>11.4f} {_pct(r.step_error):>7} "
                     f"{mem:>18} {_pct(r.memory_error):>7}{spread}")
    if rounds:
        lines += ["", f"measured: the median over {rounds} interleaved rounds of each round's median step; round "
                      "spread: slowest round over fastest"]
    v, lim = verdict, verdict["limits"]
    ok = {True: "ok", False: "FAIL"}
    lines += ["",
              f"step time MAPE {100 * v['step_mape']:.1f}% (limit {100 * lim['step_mape']:.0f}%): {ok[v['step_mape_ok']]}",
              f"worst step error {_pct(v['worst_step_error'])} on {v['worst_step_case']} "
              f"(limit {100 * lim['worst_step']:.0f}%): {ok[v['worst_step_ok']]}",
              f"worst parameter+activation memory error {_pct(v['worst_memory_error'])} on {v['worst_memory_case']} "
              f"(limit {100 * lim['memory']:.0f}%): {ok[v['memory_ok']]}"]
    if "peak_ok" in v:
        peaks = [r.peak for r in rows if r.peak is not None]
        lines += ["", "peak tensor memory per rank (largest stage; every tensor from creation to free, "
                      "piper_core/validate/peak.py) against the model's peak less its fixed overhead:"]
        lines += peak_lines(peaks, v, v["limits"]["memory"])
        if v["peak_not_measured"]:
            lines.append(f"peak not measured for: {', '.join(v['peak_not_measured'])}")
        lines.append("")
    for g, p in v["picks"].items():
        lines.append(f"scheduler's pick in {g}: {p['pick']} (measured fastest {p['measured_fastest']}; pick slower by "
                     f"{100 * p['pick_slower_by']:.1f}%, limit {100 * lim['pick']:.0f}%): {ok[p['ok']]}")
    if v["subsets"]:
        lines += ["", f"beside the headline (every one of the {v['cases']} runs above), never instead of it: "
                      "the subsets the suite registered"]
    for name, sub in v["subsets"].items():
        lines.append(f"  {name} ({sub['cases']} runs): step MAPE {100 * sub['step_mape']:.1f}%, worst "
                     f"{_pct(sub['worst_step_error'])} on {sub['worst_step_case']}, memory worst "
                     f"{_pct(sub['worst_memory_error'])} -- {sub['why']}")
    return "\n".join(lines)


def scatter(path: Path, rows: Sequence[Row], verdict: dict[str, Any]) -> Path:
    """Predicted vs measured step time, one point per case, with the y = x line and +-10 % band."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 5.6), dpi=110, layout="constrained")
    ax = fig.subplots()
    xs = [r.measured_step_s for r in rows]
    ys = [r.predicted_step_s for r in rows]
    hi = 1.15 * max(xs + ys)
    ax.plot([0, hi], [0, hi], color="black", lw=1, label="predicted = measured")
    ax.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="#7fb3e6", alpha=0.3, label="+-10 %")
    for r in rows:
        marker = "s" if r.case.nodes > 1 else ("^" if r.case.ranks_per_node > 2 else "o")
        color = "tab:orange" if r.case.framework == "deepspeed" else "tab:blue"
        ax.scatter(r.measured_step_s, r.predicted_step_s, marker=marker, color=color, s=42, zorder=3)
        ax.annotate(r.case.name, (r.measured_step_s, r.predicted_step_s),
                    fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"piper validate: {len(rows)} plans (every run), step-time MAPE {100 * verdict['step_mape']:.1f}%\n"
                 "o 2 local ranks, ^ 4 local ranks, s emulated 2 nodes; orange: DeepSpeed-MoE", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def commit_state() -> dict[str, Any]:
    """The checkout's commit and whether files differ from it (None outside a git checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if head.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def profile_record(path: Path) -> dict[str, str]:
    """A profile's path and sha256, taken when predictions are made from it: a record written later
    names what they came from, whatever happens to the file meanwhile."""
    return {"path": str(path), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def provenance(suite: Suite, profiles: Mapping[str, Path | dict[str, str]],
               source: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a results file was produced from: the commit (``source``, as :func:`commit_state` took it
    when the run began; now by default), the suite and each topology's profile (a path, hashed now, or
    the :func:`profile_record` taken when its cases were predicted)."""
    return {"source": source if source is not None else commit_state(), "suite": suite.provenance(),
            "profiles": {t: p if isinstance(p, dict) else profile_record(p) for t, p in profiles.items()}}


def rows_from_json(data: dict[str, Any]) -> tuple[list[Row], Suite]:
    """The rows of a recorded results file, with their cases from the suite it names (``full`` for
    files written before suites were recorded)."""
    suite = load_suite(data.get("suite", {}).get("path") or "full")
    known = {c.name: c for c in suite.cases}
    rows = []
    for r in data["rows"]:
        if r["case"] not in known:
            raise KeyError(f"{r['case']!r} is not a case of the suite {suite.name!r} ({suite.path})")
        rows.append(Row(case=known[r["case"]], measured_step_s=r["step_s"]["measured"],
                        predicted_step_s=r["step_s"]["predicted"], measured_memory=tuple(r["memory_bytes"]["measured"]),
                        predicted_memory=tuple(r["memory_bytes"]["predicted"]), phases=r.get("phases_ms_per_step", {}),
                        losses=tuple(r.get("losses", ())), round_steps_s=tuple(r["step_s"].get("rounds", ())),
                        peak=None if not r.get("peak_tensor_bytes") else peak_from_json(known[r["case"]], r["peak_tensor_bytes"])))
    return rows, suite


def peak_rows_from_json(data: dict[str, Any]) -> list[PeakRow]:
    """The rows of a recorded ``piper validate --peak-only`` file."""
    known = {c.name: c for c in load_suite(data.get("suite", {}).get("path") or "full").cases}
    return [peak_from_json(known[r["case"]], r) for r in data["peak_rows"]]


def refitted_clusters(data: dict[str, Any]) -> dict[str, Any]:
    """The cluster of each topology a recorded run predicted from (``data["profiles"]``), fitted again
    by this version from the profile's stored medians."""
    import tempfile

    from piper_core.calibrate.run import refit

    with tempfile.TemporaryDirectory(prefix="piper-repredict-") as tmp:
        return {topo: refit(Path(rec["path"]), Path(tmp) / f"{topo}.yaml", "validate.report --repredict").cluster
                for topo, rec in data["profiles"].items()}


def repredicted(rows: list[Row], data: dict[str, Any], clusters: dict[str, Any] | None = None) -> list[Row]:
    """``rows`` with each prediction made again by this version: from the profile each row's topology
    was predicted from, fitted again from its stored medians (or from ``clusters``, by topology)."""
    import dataclasses

    from piper_core.resource.predict import predict

    clusters = clusters if clusters is not None else refitted_clusters(data)
    return [dataclasses.replace(r, predicted_step_s=predict(r.case.model, clusters[r.case.topology], r.case.plan).time.step)
            for r in rows]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_core.validate.report", description=__doc__.split("\n\n")[1])
    p.add_argument("results", type=Path, help="a results JSON written by piper validate --json")
    p.add_argument("--plot", type=Path, metavar="DIR", help="also write DIR/validation_scatter.png")
    p.add_argument("--repredict", action="store_true",
                   help="predict every row again with this version's model, from its profile refitted with this "
                        "version's fits (the measurements stay the run's)")
    a = p.parse_args(argv)
    data = json.loads(a.results.read_text())
    if "peak_rows" in data:  # piper validate --peak-only
        print("\n".join(peak_lines(peak_rows_from_json(data), data["peak"], data["peak"]["limit"])
                        + subset_lines(data.get("peak_subsets", {}))))
        return 0
    rows, suite = rows_from_json(data)
    if a.repredict:
        rows = repredicted(rows, data)
        print(f"re-predicted by this version from the run's profiles, refitted (not a run of this version; "
              f"measured at {data.get('source', {}).get('commit') or 'an unrecorded commit'}):")
    v = verdict(rows, suite.subsets)
    print(table(rows, v))
    if a.plot:
        print(f"wrote {scatter(a.plot / 'validation_scatter.png', rows, v)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
