"""Pictures of a plan for ``piper plan --plot DIR``: the pipeline timeline of one step, memory per
pipeline stage, and throughput against memory for every feasible plan (Pareto front).

matplotlib is imported only inside the drawing functions (planning never pays for it) and used
through ``matplotlib.figure.Figure`` with the Agg canvas, so no pyplot state or GUI backend is
touched. The 1F1B simulation lives in :mod:`piper_core.timing.schedule`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piper_core.errors import SpecError
from piper_core.export import plan_label
from piper_core.resource.memory import GIB
from piper_core.resource.predict import Prediction
from piper_core.scheduler.search import SearchResult
from piper_core.specs.compat import stage_layers
from piper_core.timing.schedule import makespan, pass_parts, simulate_1f1b

MAX_DRAWN_MICROBATCHES = 16
MAX_SCATTER_POINTS = 20_000
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "buffers", "overhead")
COLOURS = {"compute F": "#7fb3e6", "compute B": "#1f5fa8", "exposed all-to-all": "#e8743b",
           "other communication": "#a0a0a0", "data-parallel sync": "#8e5bb5", "optimizer": "#4caf50",
           "weights": "#1f5fa8", "gradients": "#7fb3e6", "optimizer state": "#4caf50", "activations": "#e8743b",
           "buffers": "#f2c14e", "overhead": "#a0a0a0"}


# ---- drawing ----------------------------------------------------------------------------------

def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise SpecError("--plot", "matplotlib", "needs matplotlib, which is not installed",
                        "pip install matplotlib") from exc
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _subtitle(p: Prediction) -> str:
    return f"{p.model.name} on {p.plan.gpus} x {p.cluster.accelerator.name} ({p.cluster.name})\n{plan_label(p.plan, gbs=True)}"


def plot_timeline(path: Path, p: Prediction) -> Path:
    """Gantt chart of one step: a row per pipeline stage, passes split by kind, then the tail."""
    t, plan = p.time, p.plan
    m = plan.num_microbatches
    drawn = min(m, MAX_DRAWN_MICROBATCHES)
    parts = [pass_parts(st) for st in t.stages]
    ops = simulate_1f1b([sum(f.values()) for f, _ in parts], [sum(b.values()) for _, b in parts], drawn)
    end = makespan(ops)
    tail = {"data-parallel sync": t.data_parallel, "optimizer": t.optimizer}
    min_label = 0.018 * (end + sum(tail.values()))  # narrower passes go unlabelled
    fig = _figure(12, 3.2 + 0.42 * plan.pp)
    ax = fig.subplots()
    for stage, stage_ops in enumerate(ops):
        spans: dict[str, list[tuple[float, float]]] = {}  # colour -> (left, width): one call per stage and colour
        for op in stage_ops:
            left = op.start
            for name, width in parts[stage][0 if op.kind == "F" else 1].items():
                spans.setdefault(name, []).append((left, width))
                left += width
            if op.end - op.start >= min_label:
                ax.text((op.start + op.end) / 2, stage, f"{op.kind}{op.micro}", ha="center", va="center", fontsize=6,
                        color="white" if op.kind == "B" else "black", clip_on=True)
        left = end
        for name, width in tail.items():
            spans[name] = [(left, width)]
            left += width
        for name, xranges in spans.items():
            ax.broken_barh(xranges, (stage - 0.4, 0.8), facecolors=COLOURS[name], edgecolor="white", linewidth=0.3)
    notes = [f"1F1B, {m} micro-batches" + (f"; first {drawn} drawn (schedule shortened)" if drawn < m else "")]
    if plan.virtual_stages > 1:
        notes.append(f"vpp={plan.vpp} drawn as the non-interleaved schedule (the model divides fill/drain by vpp)")
    fig.suptitle(f"One training step: {_subtitle(p)}\n" + "; ".join(notes) +
                 f"\npredicted step {t.step:.4g} s (pipeline {t.pipeline:.4g} s, "
                 f"DP sync {tail['data-parallel sync']:.3g} s, optimizer {t.optimizer:.3g} s)", fontsize=9)
    layers = [sum(len(c) for c in rank) for rank in stage_layers(p.model, plan)]
    ax.set_yticks(range(plan.pp), [f"stage {s} ({n} layer{'s' * (n != 1)})" for s, n in enumerate(layers)],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time since step start (s)")
    ax.set_ylabel("pipeline stage")
    ax.set_xlim(0, end + sum(tail.values()))
    _legend(fig, ("compute F", "compute B", "exposed all-to-all", "other communication", "data-parallel sync",
                  "optimizer"))
    fig.savefig(path)
    return path


def _legend(fig: Any, names: Sequence[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COLOURS[n], label=n) for n in names]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(names), fontsize=8, frameon=False)


def plot_memory(path: Path, p: Prediction) -> Path:
    """Stacked memory per pipeline stage (GiB) against the usable capacity."""
    fig = _figure(max(8.0, 0.35 * len(p.stages) + 4), 5.5)
    ax = fig.subplots()
    x = [s.stage for s in p.stages]
    bottom, handles = [0.0] * len(x), []
    for part in MEMORY_PARTS:
        values = [getattr(s, part) / GIB for s in p.stages]
        name = "optimizer state" if part == "optimizer" else part
        handles.append(ax.bar(x, values, bottom=bottom, color=COLOURS[name], label=name, width=0.75))
        bottom = [b + v for b, v in zip(bottom, values)]
    cap = p.capacity_bytes / GIB
    line = ax.axhline(cap, color="#c62828", linestyle="--", linewidth=1.2, label=f"usable capacity ({cap:.1f} GiB)")
    fig.suptitle(f"Memory per GPU by pipeline stage: {_subtitle(p)}\npeak {p.peak_stage.total / GIB:.2f} GiB "
                 f"on stage {p.peak_stage.stage}", fontsize=9)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_xticks(x if len(x) <= 32 else x[:: -(-len(x) // 32)])
    ax.set_ylim(0, max(cap, max(bottom)) * 1.15)
    ax.legend(handles=[line, *reversed(handles)], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)  # top-down as the stack reads
    fig.savefig(path)
    return path


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (memory, throughput) that no other point beats on both: the highest throughput for at
    most that memory, sorted by memory."""
    front: list[tuple[float, float]] = []
    for mem, rate in sorted(points, key=lambda q: (q[0], -q[1])):
        if not front or rate > front[-1][1]:
            front.append((mem, rate))
    return front


def plot_pareto(path: Path, p: Prediction, result: SearchResult) -> Path:
    """Every feasible plan as (peak memory, tokens/s); the Pareto front and the chosen plan marked."""
    tokens = p.model.seq_length * p.plan.global_batch_size
    points = [(s.peak_bytes / GIB, tokens / s.step_s) for s in result.scored]
    front = pareto_front(points)
    shown = points if len(points) <= MAX_SCATTER_POINTS else random.Random(0).sample(points, MAX_SCATTER_POINTS)
    fig = _figure(9, 5.5)
    ax = fig.subplots()
    ax.scatter([q[0] for q in shown], [q[1] for q in shown], s=6, color="#9e9e9e", alpha=0.5, linewidths=0,
               label=f"feasible plans ({len(shown):,}" + (f" of {len(points):,} sampled)" if len(shown) < len(points)
                                                         else ")"))
    ax.step([q[0] for q in front], [q[1] for q in front], where="post", color="#1f5fa8", linewidth=1.2)
    ax.scatter([q[0] for q in front], [q[1] for q in front], s=18, color="#1f5fa8", zorder=3,
               label=f"Pareto front ({len(front)} plans)")
    ax.scatter([p.peak_stage.total / GIB], [p.rate.tokens_per_s], s=160, marker="*", color="#f2b01e",
               edgecolors="black", linewidths=0.6, zorder=4, label=f"chosen plan ({p.rate.tokens_per_s:,.0f} tokens/s)")
    cap, widest = p.capacity_bytes / GIB, max(q[0] for q in points)
    off = cap > 2 * widest  # keep small models legible: the capacity line then lies off the right edge
    ax.axvline(cap, color="#c62828", linestyle="--", linewidth=1.2,
               label=f"usable capacity ({cap:.1f} GiB{', off scale' if off else ''})")
    fig.suptitle(f"Throughput against memory of every feasible plan: {_subtitle(p)}", fontsize=9)
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("predicted throughput (tokens/s)")
    ax.set_xlim(0, max(widest * 1.1 if off else cap * 1.05, p.peak_stage.total / GIB * 1.05))
    ax.yaxis.set_major_formatter(_thousands())
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return path


def _thousands() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: f"{v:,.0f}")


def write_plots(out_dir: Path, best: Prediction, result: SearchResult) -> list[Path]:
    """Write ``timeline.png``, ``memory.png`` and ``pareto.png`` for ``best`` into ``out_dir``."""
    _figure(1, 1)  # fail before creating the folder when matplotlib is missing
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_timeline(out_dir / "timeline.png", best), plot_memory(out_dir / "memory.png", best),
            plot_pareto(out_dir / "pareto.png", best, result)]
