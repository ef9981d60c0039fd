"""Markdown tables of :mod:`piper_core.bench.e2e` results (``results.json``): one table per case,
every variant with its median step, spread, speedup over stock and the model's predicted step, then
the pipelining gain and the verdict against the declared judged variant.

Run: ``python -m piper_core.bench.e2e_report FILE...`` (several files: one headline table of every
case first, then each file's tables; ``--headline``: the headline table alone). ``--profiles DIR``
adds the model's step predicted again from ``DIR/<cluster>.yaml`` beside the declared one (e.g. the
profiles fitted again by ``piper calibrate --refit`` after a fit changed); the judged variant stays
the one declared before the runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any


def _s(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def repredict(declared: dict[str, Any], profiles: Path) -> dict[str, Any]:
    """The declaration of ``declared``'s case made again from ``profiles/<cluster>.yaml`` (its
    predictions; the judged variant and chunk count of the original stand)."""
    from piper_core.bench.e2e import Case, declare
    from piper_core.presets import load_cluster

    workload = declared["workload"]
    name = declared["case"] if workload == "small" else declared["case"].removesuffix(f"-{workload}")
    match = re.fullmatch(r"(\w+)-(\d+)x(\d+)-([\d.]+)mbit", name)
    if match is None:
        raise ValueError(f"case {declared['case']!r}: not FRAMEWORK-NODESxRANKS-RATEmbit[-WORKLOAD]")
    path = profiles / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"--profiles {profiles}: no profile {path.name} for case {declared['case']} "
                                f"(write it with `piper calibrate --refit` or `piper calibrate --emulate`)")
    case = Case(framework=match[1], nodes=int(match[2]), ranks_per_node=int(match[3]), mbit=float(match[4]),
                workload=workload)
    return declare(case, load_cluster(str(path))) | {"profile": str(path)}


def case_table(entry: dict[str, Any], profiles: Path | None = None) -> str:
    """The table of one case (its ``summary`` made from its runs so far if absent); with
    ``profiles``, the step predicted again from them beside the declared prediction."""
    from piper_core.bench.e2e import model_error, predicted_step, summarize

    declared = entry["declared"]
    summary = entry.get("summary") or summarize(declared, entry["runs"], diagnostic="variants" in entry)
    again = repredict(declared, profiles) if profiles is not None else None
    extra = " re-predicted s | error |" if again else ""
    lines = [f"**{declared['case']}** (plan ep {declared['plan']['ep']}, mbs {declared['plan']['mbs']}, "
             f"gbs {declared['plan']['gbs']}; predicted from `{declared['cluster']}`): declared before the runs: "
             f"judged `{declared['judged']}`, pipelined variants in {declared['chunks']} chunks; the model puts "
             f"the exchange at {declared['exchange_share_of_stock']:.0%} of the stock step."
             + (f" Re-predicted from `{again['profile']}`." if again else ""), "",
             "| variant | rounds | median step s | spread (min-max) s | vs stock | predicted s | model error |" + extra,
             "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if again else "")]
    for name, row in summary["table"].items():
        judged = " (judged)" if name == declared["judged"] else ""
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        p = predicted_step(again, declared["chunks"], name) if again else None
        more = f" {_s(p)} | {_s(model_error(p, row['median_s']), '{:+.0%}')} |" if again else ""
        lines.append(f"| `{name}`{judged} | {row['rounds']}{failed} | {_s(row['median_s'])} | "
                     f"{_s(row['min_s'])}-{_s(row['max_s'])} | {_s(row['speedup_vs_stock'], '{:.2f}x')} | "
                     f"{_s(row['predicted_s'])} | {_s(row['model_error'], '{:+.0%}')} |" + more)
    gains = ", ".join(f"{a}/{declared['chunks']} over {a}/1: {g:.2f}x" for a, g in summary["pipelining_gain"].items())
    v = summary["verdict"]
    met = {True: "met", False: "NOT met", None: "-"}[v["met"]]
    lines += ["", f"Pipelining alone (same exchange): {gains or '-'}. Target: {v['target']}: **{met}** "
                  f"(judged `{v['judged']}` {_s(v['speedup_vs_stock'], '{:.2f}x')} stock; failed runs "
                  f"{v['failed_runs']})."]
    return "\n".join(lines + phases_table(entry["runs"]))


def phases_table(runs: list[dict[str, Any]]) -> list[str]:
    """Where Piper's MoE layers spent each step's forward (the trainer's tracer, rank 0; Megatron runs
    only): per variant the median over rounds of the dispatch, expert and combine milliseconds per
    step. In a pipelined exchange ``dispatch + combine`` is the exchange time the experts did not hide
    (piper_megatron/trace.py). Empty when no run recorded phases."""
    from statistics import median

    by: dict[str, list[dict[str, float]]] = {}
    for r in runs:
        if r.get("moe_phases_ms_per_step"):
            by.setdefault(r["variant"], []).append(r["moe_phases_ms_per_step"])
    if not by:
        return []
    lines = ["", "Forward of the MoE layers per step (rank 0, Piper's tracer; median over rounds):", "",
             "| variant | dispatch ms | expert ms | combine ms | exchange not hidden ms |", "|---|---:|---:|---:|---:|"]
    for name, rows in by.items():
        d, e, c = (median(r.get(k, 0.0) for r in rows) for k in ("dispatch", "expert", "combine"))
        exposed = median(r.get("dispatch", 0.0) + r.get("combine", 0.0) for r in rows)
        lines.append(f"| `{name}` | {d:.0f} | {e:.0f} | {c:.0f} | {exposed:.0f} |")
    return lines


def report(results: dict[str, Any], profiles: Path | None = None) -> str:
    """Every case's table, with the command and commit that produced them."""
    m = results["machine"]
    bf16 = {True: ", bf16 instructions", False: ", no bf16 instructions", None: ""}[m.get("bf16_instructions")]
    head = [f"Command: `{results['command']}` at commit `{results['commit']}` on {m['cpu']}{bf16}; "
            f"{results['rounds']} rounds interleaved, {results['steps_timed']} timed steps per run."]
    return "\n\n".join(head + [case_table(e, profiles) for e in results["cases"] if e["runs"]])


def headline(results: list[dict[str, Any]], profiles: Path | None = None) -> str:
    """One row per case of every results file: the model's exchange share, the judged variant, its
    speedup over stock, the pipelining gain of its algorithm, its model error (and, with
    ``profiles``, its error re-predicted from them) and the verdict."""
    from piper_core.bench.e2e import model_error, predicted_step, summarize

    extra = (" model error (judged, re-predicted) |", "---:|") if profiles is not None else ("", "")
    lines = ["| case | timed steps | exchange share (model) | judged | judged vs stock | pipelining (judged's "
             "algorithm) | model error (judged) |" + extra[0] + " target | verdict |",
             "|---|---:|---:|---|---:|---:|---:|" + extra[1] + "---|---|"]
    for res in results:
        for entry in res["cases"]:
            if not entry["runs"]:
                continue
            d = entry["declared"]
            s = entry.get("summary") or summarize(d, entry["runs"], diagnostic="variants" in entry)
            v, judged = s["verdict"], s["table"].get(d["judged"], {})
            algorithm = d["judged"].split("/")[0]
            gain = s["pipelining_gain"].get(algorithm)
            gain_text = (f"{gain:.2f}x ({algorithm}/{d['chunks']} over {algorithm}/1)" if gain else "-")
            target = v["target"].split(": ", 1)[-1]
            met = {True: "met", False: "**NOT met**", None: "no target"}[v["met"]]
            lines.append(f"| {d['case']} | {res.get('steps_timed', '-')} | {d['exchange_share_of_stock']:.0%} | `{d['judged']}` | "
                         f"{_s(v['speedup_vs_stock'], '{:.2f}x')} | {gain_text} | "
                         f"{_s(judged.get('model_error'), '{:+.0%}')} |" + (
                             f" {_s(model_error(predicted_step(repredict(d, profiles), d['chunks'], d['judged']), judged.get('median_s')), '{:+.0%}')} |"
                             if profiles is not None else "") + f" {target} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_core.bench.e2e_report",
                                description="Markdown tables of bench-e2e results files.")
    p.add_argument("results", nargs="*", type=Path, default=[Path("docs/e2e/results.json")])
    p.add_argument("--headline", action="store_true", help="print only the one-row-per-case table")
    p.add_argument("--profiles", type=Path, metavar="DIR",
                   help="also predict each case again from DIR/<cluster>.yaml (e.g. profiles refitted with "
                        "`piper calibrate --refit`); the declared judged variant stays")
    a = p.parse_args(argv)
    for path in a.results:
        if not path.exists():
            p.error(f"results file {str(path)!r} does not exist: run `make bench-e2e` first or name the file")
    if a.profiles is not None and not a.profiles.is_dir():
        p.error(f"--profiles {str(a.profiles)!r} is not a directory: give the folder holding <cluster>.yaml profiles")
    results = [json.loads(path.read_text()) for path in a.results]
    try:
        parts = [headline(results, a.profiles)] if a.headline or len(results) > 1 else []
        if not a.headline:
            parts += [report(r, a.profiles) for r in results]
    except (FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    print("\n\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
