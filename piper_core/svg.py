"""Inline SVG charts for the HTML plan report (:mod:`piper_core.report`): stacked bars (memory per
stage), a Gantt chart (one step's timeline) and a scatter with a step line (the Pareto front).

Plain strings, no drawing library: the report stays one self-contained file and needs nothing
beyond the standard library. What is drawn comes from :mod:`piper_core.plots`, which draws the same
figures as PNGs with matplotlib. Every text is escaped; every shape carries a ``<title>`` (the
browser's tooltip) with its value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from piper_core.timing.schedule import Op

WIDTH = 760  # viewBox units; the page scales the chart to its column
LABEL_FRACTION = 0.025  # passes narrower than this share of the axis go unlabelled


@dataclass(frozen=True, kw_only=True, slots=True)
class Frame:
    """A plot area inside a ``WIDTH`` x ``height`` viewBox, axes from 0 to ``x_max`` / ``y_max``."""

    height: int
    x_max: float
    y_max: float
    left: int = 72
    right: int = 16
    top: int = 12
    bottom: int = 44

    def x(self, v: float) -> float:
        return self.left + v / self.x_max * (WIDTH - self.left - self.right)

    def y(self, v: float) -> float:
        return self.top + (1 - v / self.y_max) * (self.height - self.top - self.bottom)


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """0 and multiples of a 1-2-5 step up to ``top`` (about ``count`` of them)."""
    if top <= 0:
        return [0.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(top / step + 1e-9) + 1)]


def _n(v: float) -> str:
    return f"{v:.1f}"


def _rect(x: float, y: float, w: float, h: float, colour: str, title: str) -> str:
    return (f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(max(w, 0.0))}" height="{_n(max(h, 0.0))}" fill="{colour}">'
            f"<title>{escape(title)}</title></rect>")


def _svg(height: int, label: str, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" role="img" '
            f'aria-label="{escape(label)}" font-family="sans-serif" font-size="11">' + "".join(body) + "</svg>")


def _x_axis(f: Frame, ticks: Sequence[float], fmt: Callable[[float], str], label: str) -> list[str]:
    base = f.height - f.bottom
    out = [f'<line x1="{f.left}" y1="{base}" x2="{WIDTH - f.right}" y2="{base}" stroke="#333"/>']
    for t in ticks:
        out.append(f'<text x="{_n(f.x(t))}" y="{base + 14}" text-anchor="middle">{escape(fmt(t))}</text>')
    return out + [f'<text x="{_n((f.left + WIDTH - f.right) / 2)}" y="{f.height - 6}" '
                  f'text-anchor="middle">{escape(label)}</text>']


def _y_axis(f: Frame, ticks: Sequence[float], fmt: Callable[[float], str], label: str) -> list[str]:
    out = [f'<line x1="{f.left}" y1="{f.top}" x2="{f.left}" y2="{f.height - f.bottom}" stroke="#333"/>']
    for t in ticks:
        y = _n(f.y(t))
        out += [f'<line x1="{f.left}" y1="{y}" x2="{WIDTH - f.right}" y2="{y}" stroke="#ddd"/>',
                f'<text x="{f.left - 4}" y="{y}" text-anchor="end" dominant-baseline="middle">{escape(fmt(t))}</text>']
    middle = _n((f.top + f.height - f.bottom) / 2)
    return out + [f'<text transform="translate(12 {middle}) rotate(-90)" text-anchor="middle">{escape(label)}</text>']


def stacked_bars(stacks: Sequence[dict[str, float]], names: Sequence[str], colours: dict[str, str], *,
                 limit: float, limit_label: str, unit: str, label: str) -> str:
    """A bar per entry of ``stacks`` (part -> value, bottom first) named by ``names``, and a dashed
    line at ``limit`` (e.g. the usable memory)."""
    tallest = max([sum(s.values()) for s in stacks] + [limit])
    f = Frame(height=300, x_max=len(stacks), y_max=tallest * 1.1)
    body = [*_y_axis(f, nice_ticks(f.y_max), lambda v: f"{v:g}", unit)]
    slot = f.x(1) - f.x(0)
    bar = min(0.7 * slot, 48.0)
    for i, (stack, name) in enumerate(zip(stacks, names)):
        bottom = 0.0
        for part, value in stack.items():
            body.append(_rect(f.x(i) + (slot - bar) / 2, f.y(bottom + value), bar, f.y(bottom) - f.y(bottom + value),
                              colours[part], f"{name}: {part} {value:.3g} {unit}"))
            bottom += value
    every = max(1, -(-len(stacks) // 24))  # at most 24 labels under the bars
    body += [f'<text x="{_n(f.x(i + 0.5))}" y="{f.height - f.bottom + 14}" text-anchor="middle">{i}</text>'
             for i in range(0, len(stacks), every)]
    body.append(f'<text x="{_n((f.left + WIDTH - f.right) / 2)}" y="{f.height - 6}" text-anchor="middle">'
                "pipeline stage</text>")
    y = _n(f.y(limit))
    body += [f'<line x1="{f.left}" y1="{y}" x2="{WIDTH - f.right}" y2="{y}" stroke="#c62828" stroke-dasharray="6 4">'
             f"<title>{escape(limit_label)}</title></line>",
             f'<text x="{WIDTH - f.right}" y="{_n(f.y(limit) - 4)}" text-anchor="end" fill="#c62828">'
             f"{escape(limit_label)}</text>"]
    return _svg(f.height, label, body)


def gantt(spans: Sequence[dict[str, list[tuple[float, float]]]], passes: Sequence[Sequence[Op]], end: float,
          rows: Sequence[str], colours: dict[str, str], *, label: str) -> str:
    """A row per pipeline stage (``rows`` names them): each part's (start, width) spans in seconds,
    the passes wide enough labelled ``F3`` / ``B3``."""
    f = Frame(height=44 + 56 + 26 * len(rows), x_max=end, y_max=len(rows), left=130)
    body = [*_x_axis(f, nice_ticks(end, 6), lambda v: f"{v:.3g}", "time since step start (s)")]
    band = f.y(0) - f.y(1)
    for row, by_part in enumerate(spans):
        top = f.y(len(rows) - row) + 0.1 * band
        body.append(f'<text x="{f.left - 4}" y="{_n(top + 0.4 * band)}" text-anchor="end" '
                    f'dominant-baseline="middle">{escape(rows[row])}</text>')
        for part, ranges in by_part.items():
            body += [_rect(f.x(s), top, f.x(s + w) - f.x(s), 0.8 * band, colours[part], f"{part}: {w:.4g} s")
                     for s, w in ranges]
        for op in passes[row]:
            if op.end - op.start >= LABEL_FRACTION * end:
                body.append(f'<text x="{_n(f.x((op.start + op.end) / 2))}" y="{_n(top + 0.4 * band)}" '
                            f'text-anchor="middle" dominant-baseline="middle" font-size="9" '
                            f'fill="{"white" if op.kind == "B" else "black"}">{op.kind}{op.micro}</text>')
    return _svg(f.height, label, body)


def pareto(points: Sequence[tuple[float, float]], front: Sequence[tuple[float, float]], chosen: tuple[float, float],
           *, x_max: float, capacity: float | None, label: str) -> str:
    """Every plan as a grey dot (memory GiB, tokens/s), the front as a blue step line with dots, the
    chosen plan as a gold star; ``capacity`` a dashed line (None: off the axis)."""
    f = Frame(height=360, x_max=x_max, y_max=max(q[1] for q in [*points, chosen]) * 1.08, left=84)
    body = [*_y_axis(f, nice_ticks(f.y_max), lambda v: f"{v:,.0f}", "predicted throughput (tokens/s)"),
            *_x_axis(f, nice_ticks(x_max, 6), lambda v: f"{v:g}", "peak memory per GPU (GiB)")]
    body += [f'<circle cx="{_n(f.x(m))}" cy="{_n(f.y(r))}" r="1.6" fill="#9e9e9e" fill-opacity="0.6"/>'
             for m, r in points]
    path = [(f.x(front[0][0]), f.y(front[0][1]))]
    for (_, r0), (m1, r1) in zip(front, front[1:]):  # step "post": along at the last rate, then up
        path += [(f.x(m1), f.y(r0)), (f.x(m1), f.y(r1))]
    body.append('<polyline fill="none" stroke="#1f5fa8" stroke-width="1.4" points="' +
                " ".join(f"{_n(x)},{_n(y)}" for x, y in path) + '"/>')
    body += [f'<circle cx="{_n(f.x(m))}" cy="{_n(f.y(r))}" r="3" fill="#1f5fa8"><title>'
             f"{m:.3g} GiB, {r:,.0f} tokens/s</title></circle>" for m, r in front]
    if capacity is not None:
        x = _n(f.x(capacity))
        body.append(f'<line x1="{x}" y1="{f.top}" x2="{x}" y2="{f.height - f.bottom}" stroke="#c62828" '
                    f'stroke-dasharray="6 4"><title>usable capacity {capacity:.1f} GiB</title></line>')
    cx, cy = f.x(chosen[0]), f.y(chosen[1])
    star = " ".join(f"{_n(cx + r * math.sin(k * math.pi / 5))},{_n(cy - r * math.cos(k * math.pi / 5))}"
                    for k, r in zip(range(10), [9, 4] * 5))
    body.append(f'<polygon points="{star}" fill="#f2b01e" stroke="black" stroke-width="0.6"><title>chosen plan: '
                f"{chosen[0]:.3g} GiB, {chosen[1]:,.0f} tokens/s</title></polygon>")
    return _svg(f.height, label, body)
