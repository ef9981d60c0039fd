"""Pictures of a plan for ``piper plan --plot DIR``: the pipeline timeline of one step, memory per
pipeline stage, and throughput against memory for every feasible plan (Pareto front).

matplotlib is imported only inside the drawing functions (planning never pays for it) and used
through ``matplotlib.figure.Figure`` with the Agg canvas, so no pyplot state or GUI backend is
touched. The 1F1B simulation lives in :mod:`piper_core.timing.schedule`. What is drawn (the
timeline's spans, memory per stage, the Pareto points) is computed here without matplotlib, so the
HTML report (:mod:`piper_core.report`) draws the same figures as inline SVG.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piper_core.errors import SpecError
from piper_core.export import plan_label
from piper_core.resource.memory import GIB, StageMemory
from piper_core.resource.predict import Prediction
from piper_core.scheduler.search import SearchResult
from piper_core.specs.compat import stage_layers
from piper_core.timing.schedule import Op, makespan, pass_parts, simulate_1f1b

MAX_DRAWN_MICROBATCHES = 16
MAX_SCATTER_POINTS = 20_000
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "buffers", "overhead")
COLOURS = {"compute F": "#7fb3e6", "compute B": "#1f5fa8", "exposed all-to-all": "#e8743b",
           "other communication": "#a0a0a0", "data-parallel sync": "#8e5bb5", "optimizer": "#4caf50",
           "weights": "#1f5fa8", "gradients": "#7fb3e6", "optimizer state": "#4caf50", "activations": "#e8743b",
           "buffers": "#f2c14e", "overhead": "#a0a0a0"}
TIMELINE_PARTS = ("compute F", "compute B", "exposed all-to-all", "other communication", "data-parallel sync",
                  "optimizer")


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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """One step as drawn: the 1F1B schedule of the first ``drawn`` micro-batches, then the tail
    (data-parallel sync, optimizer). Seconds since the step's start."""

    spans: tuple[dict[str, list[tuple[float, float]]], ...]  # per stage: part -> [(start, width)]
    passes: tuple[tuple[Op, ...], ...]  # per stage, for labels
    tail: dict[str, float]  # part -> seconds, after the pipeline
    end: float  # the drawn step, tail included
    microbatches: int
    drawn: int
    notes: tuple[str, ...]


def timeline(p: Prediction) -> Timeline:
    """The spans :func:`plot_timeline` and the HTML report (:mod:`piper_core.report`) draw, split
    by :data:`TIMELINE_PARTS` (passes from :func:`pass_parts`, placed by :func:`simulate_1f1b`)."""
    t, plan = p.time, p.plan
    m = plan.num_microbatches
    drawn = min(m, MAX_DRAWN_MICROBATCHES)
    parts = [pass_parts(st) for st in t.stages]
    ops = simulate_1f1b([sum(f.values()) for f, _ in parts], [sum(b.values()) for _, b in parts], drawn)
    left = makespan(ops)
    tail = {"data-parallel sync": t.data_parallel, "optimizer": t.optimizer}
    spans: list[dict[str, list[tuple[float, float]]]] = []
    for stage, stage_ops in enumerate(ops):
        by_part: dict[str, list[tuple[float, float]]] = {}  # one call per stage and colour when drawn
        for op in stage_ops:
            start = op.start
            for name, width in parts[stage][0 if op.kind == "F" else 1].items():
                by_part.setdefault(name, []).append((start, width))
                start += width
        start = left
        for name, width in tail.items():
            by_part[name] = [(start, width)]
            start += width
        spans.append(by_part)
    notes = [f"1F1B, {m} micro-batches" + (f"; first {drawn} drawn (schedule shortened)" if drawn < m else "")]
    if plan.virtual_stages > 1:
        notes.append(f"vpp={plan.vpp} drawn as the non-interleaved schedule (the model divides fill/drain by vpp)")
    return Timeline(spans=tuple(spans), passes=tuple(tuple(o) for o in ops), tail=tail, end=left + sum(tail.values()),
                    microbatches=m, drawn=drawn, notes=tuple(notes))


def stage_names(p: Prediction) -> list[str]:
    """``stage 0 (4 layers)``, ... for each pipeline stage."""
    layers = [sum(len(c) for c in rank) for rank in stage_layers(p.model, p.plan)]
    return [f"stage {s} ({n} layer{'s' * (n != 1)})" for s, n in enumerate(layers)]


def plot_timeline(path: Path, p: Prediction) -> Path:
    """Gantt chart of one step: a row per pipeline stage, passes split by kind, then the tail."""
    t, plan, tl = p.time, p.plan, timeline(p)
    min_label = 0.018 * tl.end  # narrower passes go unlabelled
    fig = _figure(12, 3.2 + 0.42 * plan.pp)
    ax = fig.subplots()
    for stage, by_part in enumerate(tl.spans):
        for op in tl.passes[stage]:
            if op.end - op.start >= min_label:
                ax.text((op.start + op.end) / 2, stage, f"{op.kind}{op.micro}", ha="center", va="center", fontsize=6,
                        color="white" if op.kind == "B" else "black", clip_on=True)
        for name, xranges in by_part.items():
            ax.broken_barh(xranges, (stage - 0.4, 0.8), facecolors=COLOURS[name], edgecolor="white", linewidth=0.3)
    fig.suptitle(f"One training step: {_subtitle(p)}\n" + "; ".join(tl.notes) +
                 f"\npredicted step {t.step:.4g} s (pipeline {t.pipeline:.4g} s, "
                 f"DP sync {tl.tail['data-parallel sync']:.3g} s, optimizer {t.optimizer:.3g} s)", fontsize=9)
    ax.set_yticks(range(plan.pp), stage_names(p), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time since step start (s)")
    ax.set_ylabel("pipeline stage")
    ax.set_xlim(0, tl.end)
    _legend(fig, TIMELINE_PARTS)
    fig.savefig(path)
    return path


def _legend(fig: Any, names: Sequence[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COLOURS[n], label=n) for n in names]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(names), fontsize=8, frameon=False)


def stage_memory(stage: StageMemory) -> dict[str, float]:
    """GiB of one stage's memory per part of :data:`MEMORY_PARTS`,
    bottom of the stack first, named as the legends name them."""
    return {("optimizer state" if part == "optimizer" else part): getattr(stage, part) / GIB for part in MEMORY_PARTS}


def plot_memory(path: Path, p: Prediction) -> Path:
    """Stacked memory per pipeline stage (GiB) against the usable capacity."""
    fig = _figure(max(8.0, 0.35 * len(p.stages) + 4), 5.5)
    ax = fig.subplots()
    x = [s.stage for s in p.stages]
    stacks = [stage_memory(s) for s in p.stages]
    bottom, handles = [0.0] * len(x), []
    for name in stacks[0]:
        values = [stack[name] for stack in stacks]
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


def pareto_points(p: Prediction, result: SearchResult) -> list[tuple[float, float]]:
    """Every feasible plan of ``result`` as (peak memory per GPU in GiB, tokens/s) at ``p``'s batch."""
    tokens = p.model.seq_length * p.plan.global_batch_size
    return [(s.peak_bytes / GIB, tokens / s.step_s) for s in result.scored]


def sample_points(points: list[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    """At most ``most`` of ``points``, the same seeded sample every time."""
    return points if len(points) <= most else random.Random(0).sample(points, most)


def memory_axis(p: Prediction, points: Sequence[tuple[float, float]]) -> tuple[float, bool]:
    """(right end of the memory axis in GiB, whether the usable capacity lies off it): small models
    stay legible when the capacity is more than twice the widest plan."""
    cap, widest = p.capacity_bytes / GIB, max(q[0] for q in points)
    off = cap > 2 * widest
    return max(widest * 1.1 if off else cap * 1.05, p.peak_stage.total / GIB * 1.05), off


def plot_pareto(path: Path, p: Prediction, result: SearchResult) -> Path:
    """Every feasible plan as (peak memory, tokens/s); the Pareto front and the chosen plan marked."""
    points = pareto_points(p, result)
    front = pareto_front(points)
    shown = sample_points(points, MAX_SCATTER_POINTS)
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
    cap, (right, off) = p.capacity_bytes / GIB, memory_axis(p, points)
    ax.axvline(cap, color="#c62828", linestyle="--", linewidth=1.2,
               label=f"usable capacity ({cap:.1f} GiB{', off scale' if off else ''})")
    fig.suptitle(f"Throughput against memory of every feasible plan: {_subtitle(p)}", fontsize=9)
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("predicted throughput (tokens/s)")
    ax.set_xlim(0, right)
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
