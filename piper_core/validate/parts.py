"""Where the model's step error sits: each prediction split into its host terms, its element-wise work
and the rest, over recorded runs (issue 15).

``python -m piper_core.validate.parts RUN1.json ... [--cases TOPOLOGY] [--json OUT]`` predicts every
row of the recorded ``piper validate`` runs again with this version (each profile refitted from its
stored medians, as ``report --repredict`` does) and prices each prediction twice more:

* without the six probe-fitted host terms (per layer, MoE layer, expert, micro-batch and step, and
  the backward factor on them): what it loses is the **host** part;
* without those and with element-wise bytes free (rate :data:`~piper_core.calibrate.probe.FAST`):
  what it loses more is the **element-wise** part, priced at the probe-fitted rate;
* what is left is **the rest**: GEMMs, communication, the optimizer and the pipeline bubble, at the
  benchmark-fitted rates.

Per topology it prints the median error, the MAPE, each part's median share of the prediction, and
the scales ``a, b, c`` of ``measured ~ a rest + b host + c element-wise`` (least squares of the
relative residuals) with the MAPE they would leave. A scale away from 1 says which part the
calibration prices wrongly for these cases. The scales are fitted to the very measurements they
explain (in sample, and pooled over runs whose calibrations differ): a diagnosis, not a correction to
apply. ``--cases TOPOLOGY`` lists that topology's cases by their median error over the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piper_core.calibrate.probe import FAST, FIELDS, with_accelerator
from piper_core.errors import SpecError
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

PARTS = ("rest", "host", "elementwise")


def split(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> dict[str, float]:
    """The predicted step of ``plan`` and its three parts (seconds; they add up to it)."""
    from piper_core.resource.predict import predict

    full = predict(model, cluster, plan).time.step
    bare = with_accelerator(cluster, **{f: 0.0 for f in FIELDS})
    without_host = predict(model, bare, plan).time.step
    rest = predict(model, with_accelerator(bare, elementwise_gb_per_s=FAST), plan).time.step
    return {"predicted": full, "host": full - without_host, "elementwise": without_host - rest, "rest": rest}


def rows(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Every row of the recorded runs, re-predicted and split (:func:`split`), with its measured step."""
    from piper_core.validate.report import refitted_clusters, rows_from_json
    from piper_core.validate.repeat import read_record

    out = []
    for path in paths:
        data = read_record(path)  # a clear error for a file that is not a full piper validate record
        recorded, _ = rows_from_json(data)
        clusters = refitted_clusters(data)
        for r in recorded:
            out.append({"run": str(path), "case": r.case.name, "topology": r.case.topology,
                        "measured": r.measured_step_s, **split(r.case.model, r.case.plan, clusters[r.case.topology])})
    return out


def _error(r: dict[str, Any]) -> float:
    return r["predicted"] / r["measured"] - 1


def _shares(rs: list[dict[str, Any]]) -> dict[str, float]:
    """Each part's median share of the prediction over ``rs``."""
    return {p: statistics.median(r[p] / r["predicted"] for r in rs) for p in PARTS}


def topology_figures(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One topology's rows: median error, MAPE, each part's median share, the three scales and the MAPE
    they leave (pure)."""
    import numpy as np

    a = np.array([[r[p] / r["measured"] for p in PARTS] for r in rs])
    scales, *_ = np.linalg.lstsq(a, np.ones(len(rs)), rcond=None)
    left = a @ scales - 1
    errors = [_error(r) for r in rs]
    return {"rows": len(rs), "median_error": statistics.median(errors),
            "step_mape": statistics.mean(abs(e) for e in errors),
            "shares": _shares(rs), "scales": dict(zip(PARTS, (float(s) for s in scales))), "mape_with_scales": float(np.mean(np.abs(left)))}


def figures(all_rows: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in all_rows:
        by.setdefault(r["topology"], []).append(r)
    return {topo: topology_figures(rs) for topo, rs in sorted(by.items())}


def case_figures(all_rows: list[dict[str, Any]], topology: str) -> list[dict[str, Any]]:
    """``topology``'s cases, by median error over the runs (pure)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in all_rows:
        if r["topology"] == topology:
            by.setdefault(r["case"], []).append(r)
    if not by:
        known = sorted({r["topology"] for r in all_rows})
        raise SpecError("--cases", topology, f"is not a topology of these runs ({', '.join(known)})",
                        "name one of them")
    out = [{"case": c, "runs": len(rs), "median_error": statistics.median(_error(r) for r in rs),
            "shares": _shares(rs)}
           for c, rs in by.items()]
    return sorted(out, key=lambda c: c["median_error"])


def lines(fig: dict[str, Any], runs: int) -> list[str]:
    out = [f"over {runs} runs, re-predicted by this version; shares and scales are of rest / host / element-wise:",
           f"{'topology':24s} {'rows':>4s} {'median err':>10s} {'MAPE':>6s}   shares            scales             "
           f"MAPE with the scales"]
    for topo, f in fig.items():
        shares = " ".join(f"{f['shares'][p]:.2f}" for p in PARTS)
        scales = " ".join(f"{f['scales'][p]:5.2f}" for p in PARTS)
        out.append(f"{topo:24s} {f['rows']:4d} {f['median_error']:+10.1%} {f['step_mape']:6.1%}   {shares:16s}  "
                   f"{scales:17s}  {f['mape_with_scales']:.1%}")
    return out


def case_lines(cases: list[dict[str, Any]]) -> list[str]:
    out = [f"{'case':34s} {'runs':>4s} {'median err':>10s}   shares rest / host / element-wise"]
    for c in cases:
        out.append(f"{c['case']:34s} {c['runs']:4d} {c['median_error']:+10.1%}   "
                   + " ".join(f"{c['shares'][p]:.2f}" for p in PARTS))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_core.validate.parts", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="results.json files written by piper validate --json")
    p.add_argument("--cases", metavar="TOPOLOGY", help="list this topology's cases by median error instead")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures (and every split row) as JSON")
    a = p.parse_args(argv)
    try:
        all_rows = rows(a.runs)
        cases = case_figures(all_rows, a.cases) if a.cases else None
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fig = figures(all_rows)
    print("\n".join(case_lines(cases) if cases is not None else lines(fig, len(a.runs))))
    if a.json:
        a.json.write_text(json.dumps({"topologies": fig, "cases": cases, "rows": all_rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
