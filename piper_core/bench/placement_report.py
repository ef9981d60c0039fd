"""Tables and the plot of :mod:`piper_core.bench.placement` results (``results.json``).

Run: ``python -m piper_core.bench.placement_report FILE [--plot PNG]``: per case, every variant's
median step, spread, rounds, the model's predicted step with the measured histogram and with even
routing (and its error each way), the losses; then the measured load per rank before (default
placement) and after (optimised), and the verdict. The plot: per case, each rank's tokens over the
mean rank's, summed over the MoE layers, with the default and the optimised placement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _s(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _case_report(entry: dict[str, Any]) -> list[str]:
    lines = [f"## {entry['case']} ({entry['world']} ranks, ep {entry['world']})"]
    declared, summary = entry.get("declared"), entry.get("summary", {})
    if declared is None:
        lines.append(f"not declared: {summary.get('verdict', {}).get('target', 'the measuring run did not finish')}")
        return lines
    placement = declared["placement"]
    lines.append(f"placement (declared before the runs): {placement['ranks']} ({placement['moved']} experts moved; "
                 f"sum of the layers' busiest ranks {placement['default_objective']:.0f} -> "
                 f"{placement['objective']:.0f}, gap to the lower bound {placement['gap']:.1%}); "
                 f"cluster {declared['cluster']}")
    if "table" not in summary:
        lines.append("not summarised: the rounds did not finish")
        return lines
    lines += ["", "| variant | median s | min-max s | rounds (failed) | predicted s | error | predicted even s | "
                  "error even | losses |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, row in summary["table"].items():
        losses = ", ".join(f"{x:.6f}" for x in row["losses"] or [])
        lines.append(f"| {name} | {_s(row['median_s'])} | {_s(row['min_s'])}-{_s(row['max_s'])} | "
                     f"{row['rounds']} ({row['failed']}) | {_s(row['predicted_s'])} | "
                     f"{_s(row['model_error'], '{:+.1%}')} | {_s(row['predicted_even_s'])} | "
                     f"{_s(row['model_error_even'], '{:+.1%}')} | {losses} |")
    for label, key in (("before (default)", "load_before"), ("after (optimised)", "load_after"),
                       ("after migration", "load_migrated")):
        if key not in summary:  # results of a version without the variant
            continue
        table = summary.get(key)
        if table is None:
            lines.append(f"load per rank {label}: not measured")
            continue
        per_layer = ", ".join(f"layer {k} {v:.2f}" for k, v in table["max_over_mean"].items())
        lines.append(f"load per rank {label}: tokens {table['total']} (busiest {table['total_max_over_mean']:.2f}x "
                     f"the mean; {per_layer})")
    lines += _migration_lines(summary.get("migration"))
    v = summary["verdict"]
    met = {True: "MET", False: "NOT MET", None: "no target"}[v.get("met")]
    lines.append(f"verdict ({met}): {v.get('target')}; step cut {_s(v.get('step_cut'), '{:.1%}')}, "
                 f"speedup {_s(v.get('speedup'), '{:.3f}x')}, failed runs {v.get('failed_runs')}, losses' largest "
                 f"relative difference {_s(v.get('loss_max_rel_diff'), '{:.2g}')}")
    return lines


def _migration_lines(m: dict[str, Any] | None) -> list[str]:
    """piper-migrate's decisions after the warm-up: how many moved, what, and the move's time."""
    if m is None:
        return []
    lines = [f"migration after the warm-up: moved in {m['moved_after_warmup']} of {m['runs']} runs "
             f"(experts moved {m['experts_moved']}); the move (slowest rank) measured "
             f"{', '.join(f'{x:.3g}' for x in m['move_s'] if x is not None) or '-'} s against the model's "
             f"{', '.join(f'{x:.3g}' for x in m['predicted_move_s']) or '-'} s; later decisions moved "
             f"{m['later_moves']} times"]
    return lines + [f"  {line}" for line in m["lines"]]


def report(results: dict[str, Any]) -> str:
    """Markdown tables of every case (module docstring)."""
    head = (f"placement benchmark: {results['workload']} workload, router bias {results['router_bias']}, "
            f"{results['rounds']} rounds x {results['steps_timed']} timed steps; commit {results.get('commit')}")
    lines = [head]
    for entry in results["cases"]:
        lines += [""] + _case_report(entry)
    return "\n".join(lines)


_VERDICT = {True: "met", False: "**not met**", None: "no target"}
TABLES = ("verdict", "model", "repredicted", "model-summary")
"""The tables docs/placement-bench.md quotes (``--table``; docs/refresh.py keeps them current)."""


def verdict_table(results: dict[str, Any]) -> list[str]:
    """Per case: the measured busiest rank over the mean (summed over the MoE layers) with the default
    and the optimised placement (and after migration, where the run had the variant), each variant's
    median step, the judged cut and the verdict; the migrated variant's cut against Piper's default
    stands beside the judged one, not in it ("-": not run, or a results file from before it)."""
    lines = ["| case | busiest rank / mean, default -> optimised (-> migrated) (measured) | stock s | "
             "Piper default s | Piper optimised s | Piper migrated s | step cut (judged) | cut by migration | "
             "verdict |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for entry in results["cases"]:
        summary = entry.get("summary", {})
        if "table" not in summary:
            lines.append(f"| {entry['case']} | - | - | - | - | - | - | - | not measured |")
            continue
        table, v = summary["table"], summary["verdict"]
        keys = ("load_before", "load_after") + (("load_migrated",) if summary.get("load_migrated") else ())
        loads = " -> ".join(_s((summary.get(k) or {}).get("total_max_over_mean"), "{:.2f}") for k in keys)
        medians = [(table.get(name) or {}).get("median_s")
                   for name in ("stock", "piper-default", "piper-optimized", "piper-migrate")]
        default, migrated = medians[1], medians[3]
        cut = 1 - migrated / default if default and migrated else None
        lines.append(f"| {entry['case']} | {loads} | {' | '.join(_s(m) for m in medians)} | "
                     f"{_s(v.get('step_cut'), '{:.1%}')} | {_s(cut, '{:.1%}')} | {_VERDICT[v.get('met')]} |")
    return lines


def model_table(results: dict[str, Any]) -> list[str]:
    """Per case and variant: the measured median against the run's own (declared) prediction with the
    measured histogram and with even routing."""
    lines = ["| case | variant | measured s | predicted with the histogram | error | predicted with even routing | "
             "error |", "|---|---|---:|---:|---:|---:|---:|"]
    for entry in results["cases"]:
        for name, row in entry.get("summary", {}).get("table", {}).items():
            lines.append(f"| {entry['case']} | {name} | {_s(row['median_s'])} | {_s(row['predicted_s'])} | "
                         f"{_s(row['model_error'], '{:+.1%}')} | {_s(row['predicted_even_s'])} | "
                         f"{_s(row['model_error_even'], '{:+.1%}')} |")
    return lines


def model_summary(runs: list[tuple[str, dict[str, Any]]], *, mape_limit: float = 0.10, worst_limit: float = 0.25,
                  margin: float = 0.05) -> list[str]:
    """Over every case and variant of ``runs`` ((name, results)): the model's step MAPE and worst error
    with the measured histogram and with even routing, against issue 15's suite limits (MAPE and
    worst) and issue 17's "visibly worse" (even routing's MAPE above the histogram's by ``margin``)."""
    errors: dict[str, list[float]] = {"histogram": [], "even": []}
    missing = 0  # a variant with no successful run (or, for piper-migrate, no decision) has no error
    for _, results in runs:
        for entry in results["cases"]:
            for row in entry.get("summary", {}).get("table", {}).values():
                if row["model_error"] is None or row["model_error_even"] is None:
                    missing += 1
                    continue
                errors["histogram"].append(row["model_error"])
                errors["even"].append(row["model_error_even"])
    if not errors["histogram"]:
        return ["no measured case in " + ", ".join(name for name, _ in runs)]
    stat = {k: (sum(abs(e) for e in v) / len(v), max(v, key=abs)) for k, v in errors.items()}
    lines = ["| routing the model is given | predictions | step MAPE | worst step error |", "|---|---:|---:|---:|"]
    lines += [f"| {'the measured histogram' if k == 'histogram' else 'even'} | {len(errors[k])} | {m:.1%} | {w:+.1%} |"
              for k, (m, w) in stat.items()]
    (m, w), (m_even, _) = stat["histogram"], stat["even"]
    within = m <= mape_limit and abs(w) <= worst_limit
    worse = m_even >= m + margin
    lines += ["", f"Within the suite's limits (MAPE <= {mape_limit:.0%}, worst <= {worst_limit:.0%}): "
              f"{'yes' if within else 'no'}; even routing visibly worse (MAPE {margin:.0%} or more above): "
              f"{'yes' if worse else 'no'}; verdict: {'met' if within and worse and not missing else 'not met'}."]
    if missing:
        lines.append(f"{missing} variant(s) of a case had no measured step or no prediction: not in the figures, "
                     "and the verdict is not met.")
    return lines


def plot_loads(results: dict[str, Any], path: Path) -> Path | None:
    """Bar chart of each rank's load over the mean, default vs optimised placement (and the placement
    piper-migrate moved to, where it ran), one panel per case (None when no case measured both)."""
    cases = [e for e in results["cases"] if (e.get("summary") or {}).get("load_before")
             and e["summary"].get("load_after")]
    if not cases:
        return None
    from piper_core.plots import _figure

    fig = _figure(max(5.0, 4.0 * len(cases)), 3.4)
    axes = fig.subplots(1, len(cases), squeeze=False)[0]
    for ax, entry in zip(axes, cases):
        bars = [b for b in (("default", "load_before", "#e8743b"), ("optimised", "load_after", "#1f5fa8"),
                            ("migrated", "load_migrated", "#3a9a5b")) if entry["summary"].get(b[1])]
        width = 0.8 / len(bars)
        for offset, (label, key, colour) in enumerate(bars):
            total = entry["summary"][key]["total"]
            mean = sum(total) / len(total)
            xs = [r + (offset - (len(bars) - 1) / 2) * width for r in range(len(total))]
            ax.bar(xs, [t / mean for t in total], width=width, color=colour,
                   label=f"{label} (max {max(total) / mean:.2f}x)")
        ax.axhline(1.0, color="#a0a0a0", linewidth=0.8)
        ax.set_xticks(range(entry["world"]))
        ax.set_xlabel("expert-parallel rank")
        ax.set_ylabel("tokens / mean rank")
        ax.set_title(entry["case"])
        ax.legend(fontsize="small")
    bias = ", ".join(f"expert {e} {b:+g}" for e, b in results["router_bias"].items())
    fig.suptitle(f"tokens per expert-parallel rank, summed over MoE layers\n{results['workload']} workload, "
                 f"router logit bias: {bias}", fontsize="medium")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _case(name: str) -> Any:
    """The Case of a results entry's name (``local-4``, ``emu-2x2-1000mbit``)."""
    from piper_core.bench.placement import Case

    if name.startswith("local-"):
        return Case(nodes=1, ranks_per_node=int(name.split("-")[1]))
    nodes, ranks = name.split("-")[1].split("x")
    return Case(nodes=int(nodes), ranks_per_node=int(ranks), mbit=float(name.split("-")[2].removesuffix("mbit")))


def repredict(results: dict[str, Any], profiles: Path) -> list[str]:
    """Each case's variants predicted again by this version of the model, from what the run declared
    (the measured histogram, the plan, the placement) and the case's calibration profile in
    ``profiles`` (``<case>-fp32.yaml``), beside the declared predictions and the measured medians.
    The declared figures stay the run's verdict; these say how a later model would have priced it."""
    from piper_core.bench.placement import WORKLOADS, base_plan
    from piper_core.calibrate.profile import load_profile
    from piper_core.resource.predict import predict
    from piper_core.resource.routing import predict_routed
    from piper_core.specs.routing import Routing

    load = WORKLOADS[results["workload"]]
    lines = ["| case | variant | measured s | declared predicted s | error | re-predicted s | error | "
             "re-predicted even s | error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in results["cases"]:
        declared = entry.get("declared")
        if declared is None or "table" not in entry.get("summary", {}):
            continue
        cluster = load_profile(profiles / f"{entry['case']}-fp32.yaml")
        plan = base_plan(_case(entry["case"]), load)
        hist = declared["histogram"]
        routing = Routing(num_experts=hist["num_experts"], source=hist["source"],
                          layers=tuple((int(n), tuple(c)) for n, c in hist["layers"].items()))
        placed = {n: tuple(tuple(r) for r in declared["placement"]["ranks"]) for n, _ in routing.layers}
        default = predict_routed(load.model, cluster, plan, routing)  # stock runs the default placement too
        now = {"stock": default, "piper-default": default,
               "piper-optimized": predict_routed(load.model, cluster, plan, routing, placed)}
        migrated = _migrated_placements(entry)
        if migrated is not None:
            now["piper-migrate"] = predict_routed(load.model, cluster, plan, routing, migrated)
        even = predict(load.model, cluster, plan).time.step
        for name, row in entry["summary"]["table"].items():
            measured, then = row["median_s"], row["predicted_s"]
            again = now[name].prediction.time.step if name in now else None
            lines.append(f"| {entry['case']} | {name} | {_s(measured)} | {_s(then)} | {_err(then, measured)} | "
                         f"{_s(again)} | {_err(again, measured)} | {even:.3f} | {_err(even, measured)} |")
    return lines


def _err(predicted: float | None, measured: float | None) -> str:
    return "-" if predicted is None or not measured else f"{predicted / measured - 1:+.1%}"


def _migrated_placements(entry: dict[str, Any]) -> dict[int, tuple[tuple[int, ...], ...]] | None:
    """The placements piper-migrate's timed steps ran: its first successful run's last decision's
    (every run decides alike from the same routing), per MoE layer; None without such a run."""
    run = next((r for r in entry.get("runs", []) if r.get("variant") == "piper-migrate" and r.get("migrations")), None)
    if run is None:
        return None
    last = run["migrations"][-1]["placements"]
    return {int(n): tuple(tuple(r) for r in ranks) for n, ranks in last.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_core.bench.placement_report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+", help="a results file (several only with --table model-summary)")
    p.add_argument("--plot", type=Path, help="write the load plot here")
    p.add_argument("--repredict", type=Path, metavar="PROFILES",
                   help="also price every case again with this version of the model, from the run's declared "
                        "histogram and placement and the calibration profiles in PROFILES (<case>-fp32.yaml)")
    p.add_argument("--table", choices=TABLES,
                   help="print only this table, as docs/placement-bench.md quotes it (repredicted needs --repredict)")
    a = p.parse_args(argv)
    if a.table == "model-summary":
        print("\n".join(model_summary([(str(r), json.loads(r.read_text())) for r in a.results])))
        return 0
    if len(a.results) > 1:
        p.error("several results files go with --table model-summary only")
    results = json.loads(a.results[0].read_text())
    if a.table is not None:
        if a.table == "repredicted" and a.repredict is None:
            p.error("--table repredicted needs --repredict PROFILES (the profiles the run predicted from)")
        tables = {"verdict": lambda: verdict_table(results), "model": lambda: model_table(results),
                  "repredicted": lambda: repredict(results, a.repredict)}
        print("\n".join(tables[a.table]()))
        return 0
    print(report(results))
    if a.repredict is not None:
        print("\n".join(["", "re-predicted by this version of the model (declared: what the run's own version "
                          "predicted)", "", *repredict(results, a.repredict)]))
    if a.plot is not None:
        plot_loads(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
