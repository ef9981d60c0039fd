"""The validation table, its JSON, and the predicted-vs-measured scatter plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piper_core.export import plan_label
from piper_core.validate.compare import Row


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def table(rows: Sequence[Row], verdict: dict[str, Any]) -> str:
    head = (f"{'case':<20} {'profile':<16} {'plan':<42} {'measured s':>10} {'predicted s':>11} {'error':>7} "
            f"{'mem MiB meas/pred':>18} {'mem err':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = f"{max(r.measured_memory) / 2**20:.1f}/{max(r.predicted_memory) / 2**20:.1f}"
        name = r.case.name + ("*" if r.case.excluded else "")
        lines.append(f"{name:<20} {r.case.topology:<16} {plan_label(r.case.plan, gbs=True):<42} "
                     f"{r.measured_step_s:>10.4f} {r.predicted_step_s:>11.4f} {_pct(r.step_error):>7} "
                     f"{mem:>18} {_pct(r.memory_error):>7}")
    v, lim = verdict, verdict["limits"]
    ok = {True: "ok", False: "FAIL"}
    lines += ["",
              f"step time MAPE {100 * v['step_mape']:.1f}% (limit {100 * lim['step_mape']:.0f}%): {ok[v['step_mape_ok']]}",
              f"worst step error {_pct(v['worst_step_error'])} on {v['worst_step_case']} "
              f"(limit {100 * lim['worst_step']:.0f}%): {ok[v['worst_step_ok']]}",
              f"worst parameter+activation memory error {_pct(v['worst_memory_error'])} on {v['worst_memory_case']} "
              f"(limit {100 * lim['memory']:.0f}%): {ok[v['memory_ok']]}"]
    reasons: dict[str, list[str]] = {}
    for name, why in v["excluded"].items():
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        lines.append(f"* {', '.join(names)}: measured, not in the figures above: {why}")
    for g, p in v["picks"].items():
        lines.append(f"scheduler's pick in {g}: {p['pick']} (measured fastest {p['measured_fastest']}; pick slower by "
                     f"{100 * p['pick_slower_by']:.1f}%, limit {100 * lim['pick']:.0f}%): {ok[p['ok']]}")
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
        if r.case.excluded:  # measured and shown, not in the figures
            ax.scatter(r.measured_step_s, r.predicted_step_s, marker="x", color="grey", s=42, zorder=3)
        else:
            marker = "s" if r.case.nodes > 1 else ("^" if r.case.plan.gpus == 4 else "o")
            ax.scatter(r.measured_step_s, r.predicted_step_s, marker=marker, s=42, zorder=3)
        ax.annotate(r.case.name + ("*" if r.case.excluded else ""), (r.measured_step_s, r.predicted_step_s),
                    fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"piper validate: {len(rows)} plans, step-time MAPE {100 * verdict['step_mape']:.1f}%\n"
                 "o 2 local ranks, ^ 4 local ranks, s emulated 2 nodes, x excluded (*)", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
