"""``piper plan ... --report FILE.html``: the plan search as one self-contained HTML page for a review.

The page holds what ``piper plan`` prints and writes, from the same objects: the ranked table (the
figures of ``--json``'s ``plans``, each cell's exact JSON value in ``data-value``), the best plan's
memory per pipeline stage and step timeline (the ``--plot`` figures, drawn as inline SVG by
:mod:`piper_core.svg` from :mod:`piper_core.plots`), the Pareto front of every feasible plan, the
rejections by reason, and the ``--export-megatron`` / ``--export-deepspeed`` files of the best plan.
Nothing is loaded from elsewhere (inline CSS, SVG and script); every text is escaped. A short inline
script fills in ``#summary`` from the ranked table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from piper_core import svg
from piper_core.export import plan_label
from piper_core.plots import (COLOURS, MEMORY_PARTS, TIMELINE_PARTS, memory_axis, pareto_front, pareto_points,
                              sample_points, stage_memory, stage_names, timeline)
from piper_core.resource.memory import GIB
from piper_core.resource.predict import Prediction, to_json
from piper_core.scheduler.search import SearchResult
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec

MAX_SVG_POINTS = 2_000  # feasible plans drawn in the Pareto chart (a seeded sample beyond)
BREAKDOWN_NAMES = {"compute": "compute", "exposed_a2a": "exposed all-to-all", "other_comm": "other communication",
                   "bubble": "pipeline bubble", "optimizer": "optimizer"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Exports:
    """The files ``--export-megatron`` and ``--export-deepspeed`` write for the search's best plan."""

    megatron: str
    deepspeed: str | None  # None: no feasible plan runs on DeepSpeed-MoE
    deepspeed_note: str = ""  # why none, or why the DeepSpeed plan is not the best plan


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """What one ``piper plan`` run found: its command line, the search, the top plans predicted in
    full (best first), and the lines ``piper plan`` prints under its table (``verdict``: the best
    plan, its bottleneck, why it won) or why nothing fits (``no_fit``)."""

    command: str
    model: ModelSpec
    cluster: ClusterSpec
    gpus: int
    gbs: int
    result: SearchResult
    best: Sequence[Prediction] = field(default_factory=tuple)
    verdict: Sequence[str] = ()
    exports: Exports | None = None
    no_fit: str = ""


# ---- the ranked table ----------------------------------------------------------------------------

Column = tuple[str, str, Callable[[Any], str]]  # (data-key, header, cell text from the JSON value)


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


RANKED: tuple[Column, ...] = (
    ("rank", "#", str), ("plan", "plan", str), ("tp", "tp", str), ("pp", "pp", str),
    ("vpp", "vpp", lambda v: "-" if v is None else str(v)), ("cp", "cp", str), ("dp", "dp", str), ("ep", "ep", str),
    ("etp", "etp", str), ("edp", "edp", str), ("micro_batch_size", "mbs", str),
    ("num_microbatches", "micro-batches", str), ("recompute", "recompute", str),
    ("distributed_optimizer", "dist. opt.", lambda v: "yes" if v else "no"), ("a2a", "all-to-all", str),
    ("a2a_chunks", "chunks", str), ("step_s", "step (s)", lambda v: f"{v:.3f}"), ("mfu", "MFU", _pct),
    ("tflops_per_gpu", "TFLOPS/GPU", lambda v: f"{v:.0f}"), ("tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"),
    ("peak_gib", "peak GiB/GPU", lambda v: f"{v:.2f}"), ("exposed_a2a_share", "exposed a2a", _pct),
    ("bubble_share", "bubble", _pct))
PLAN_KEYS = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp", "edp", "micro_batch_size", "num_microbatches", "recompute",
             "distributed_optimizer", "a2a", "a2a_chunks")


def ranked_values(rank: int, p: Prediction) -> dict[str, Any]:
    """One row of the ranked table: data-key -> the JSON value ``piper plan --json`` gives for it."""
    j = to_json(p)
    step, parts = j["time_s"]["step"], j["time_s"]["breakdown"]
    return {"rank": rank, "plan": plan_label(p.plan), **{k: j["plan"][k] for k in PLAN_KEYS}, "step_s": step,
            "mfu": j["mfu"], "tflops_per_gpu": j["tflops_per_gpu"], "tokens_per_s": j["tokens_per_s"],
            "peak_gib": j["memory_gib"]["peak"], "exposed_a2a_share": parts["exposed_a2a"] / step,
            "bubble_share": parts["bubble"] / step}


def table(table_id: str, columns: Sequence[Column], rows: Sequence[dict[str, Any]], *, caption: str,
          attrs: str = "", row_class: Callable[[dict[str, Any]], str] = lambda _row: "") -> str:
    """A ``<table>`` with a ``<th>`` per column and a ``<tr>`` per row; each ``<td>`` carries its
    column's key (``data-key``) and the exact value as JSON (``data-value``)."""
    head = "".join(f'<th scope="col" data-key="{escape(k)}">{escape(h)}</th>' for k, h, _ in columns)
    body = []
    for row in rows:
        cells = "".join(f'<td data-key="{escape(k)}" data-value="{escape(json.dumps(row[k]))}">{escape(fmt(row[k]))}'
                        "</td>" for k, _, fmt in columns)
        cls = row_class(row)
        body.append((f'<tr class="{escape(cls)}">' if cls else "<tr>") + f"{cells}</tr>")
    return (f'<div class="wide"><table id="{escape(table_id)}"{attrs}><caption>{escape(caption)}</caption><thead>'
            f"<tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>")


# ---- sections ------------------------------------------------------------------------------------

def _header(r: PlanReport) -> str:
    res, acc = r.result, r.cluster.accelerator
    facts = [("model", r.model.name), ("cluster", f"{r.cluster.name} ({acc.name}, {r.cluster.gpus_per_node} per node)"),
             ("GPUs", f"{r.gpus:,}"), ("global batch size", f"{r.gbs:,} sequences of {r.model.seq_length:,} tokens"),
             ("search", f"{res.candidates:,} plans in {res.elapsed_s:.2f} s: {res.feasible:,} feasible, "
                        f"{sum(res.rejected.values()):,} rejected")]
    items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in facts)
    return (f"<header><h1>Piper plan: {escape(r.model.name)} on {r.gpus:,} GPUs of {escape(r.cluster.name)}</h1>"
            f'<dl>{items}<dt>command</dt><dd><code id="command">{escape(r.command)}</code></dd></dl>'
            '<p id="summary">(the page\'s script writes a summary of the ranked table here)</p></header>')


def _ranked(r: PlanReport) -> str:
    rows = [ranked_values(i, p) for i, p in enumerate(r.best, 1)]
    top = r.best[0]
    verdict = "".join(f"<p>{escape(line.strip())}</p>" for line in r.verdict)
    return ("<section><h2>Ranked plans</h2>" +
            table("ranked", RANKED, rows, caption=f"the {len(rows)} fastest of {r.result.feasible:,} feasible plans, "
                  f"of {top.capacity_bytes / GIB:.1f} GiB usable per GPU",
                  attrs=f' data-feasible="{r.result.feasible:,}"') +
            f'<div id="verdict">{verdict}</div></section>')


def _legend(names: Sequence[str]) -> str:
    return '<p class="legend">' + "".join(f'<span><i style="background:{COLOURS[n]}"></i>{escape(n)}</span>'
                                          for n in names) + "</p>"


def _gib(v: float) -> str:
    return f"{v:.2f}"


MEMORY: tuple[Column, ...] = (("stage", "stage", str), ("layers", "layers", str),
                              ("params", "parameters", lambda v: f"{v:,}"),
                              *((k, k, _gib) for k in (*MEMORY_PARTS, "total")))


def _memory(p: Prediction) -> str:
    stages = to_json(p)["memory_gib"]["stages"]
    rows = [{**{k: s[k] for k in ("stage", "layers", *MEMORY_PARTS, "total")}, "params": s["params"]["total"]}
            for s in stages]
    peak, cap = p.peak_stage, p.capacity_bytes / GIB
    chart = svg.stacked_bars([stage_memory(s) for s in p.stages], [f"stage {s.stage}" for s in p.stages], COLOURS,
                             limit=cap, limit_label=f"usable capacity {cap:.1f} GiB", unit="GiB",
                             label="memory per GPU by pipeline stage")
    return ("<section><h2>Memory per GPU by pipeline stage (best plan)</h2>" +
            table("memory", MEMORY, rows, caption=f"GiB per GPU; peak {peak.total / GIB:.2f} GiB on stage {peak.stage} "
                  f"of {cap:.2f} GiB usable", row_class=lambda row: "peak" if row["stage"] == peak.stage else "") +
            chart + _legend([*stage_memory(p.stages[0])]) + "</section>")


SHARE: tuple[Column, ...] = (("part", "part", str), ("seconds", "seconds", lambda v: f"{v:.4g}"),
                             ("share", "share of the step", _pct))
STAGE_TIMES: tuple[Column, ...] = (("stage", "stage", str), *((k, f"{k.replace('_', ' ')} (s)", lambda v: f"{v:.4g}")
                                                               for k in ("compute", "exposed_a2a", "other_comm", "p2p",
                                                                         "total")))


def _timeline(p: Prediction) -> str:
    t, tl = to_json(p)["time_s"], timeline(p)
    parts = [{"part": BREAKDOWN_NAMES[k], "seconds": v, "share": v / t["step"]} for k, v in t["breakdown"].items()]
    parts.append({"part": "step", "seconds": t["step"], "share": 1.0})
    chart = svg.gantt(tl.spans, tl.passes, tl.end, stage_names(p), COLOURS, label="one training step by stage")
    return ("<section><h2>Step timeline (best plan)</h2>" +
            table("timeline", SHARE, parts, caption=f"one step of {p.plan.num_microbatches} micro-batches, by what the "
                  "time is spent on") +
            table("stage-times", STAGE_TIMES, t["stages"], caption="one micro-batch, forward and backward, per "
                  f"pipeline stage (slowest: stage {t['slowest_stage']})") +
            chart + _legend(TIMELINE_PARTS) + f"<p>{escape('; '.join(tl.notes))}</p></section>")


def _pareto(p: Prediction, result: SearchResult) -> str:
    points = pareto_points(p, result)
    front, shown = pareto_front(points), sample_points(points, MAX_SVG_POINTS)
    right, off = memory_axis(p, points)
    cap = p.capacity_bytes / GIB
    chart = svg.pareto(shown, front, (p.peak_stage.total / GIB, p.rate.tokens_per_s), x_max=right,
                       capacity=None if off else cap, label="throughput against peak memory of every feasible plan")
    drawn = f"{len(shown):,} of {len(points):,} drawn, a seeded sample" if len(shown) < len(points) else \
        f"all {len(points):,} drawn"
    text = (f"Every feasible plan as (peak memory per GPU, predicted tokens/s) in grey ({drawn}); the Pareto front "
            f"({len(front)} plans: no other plan is both faster and lighter) in blue; the best plan as the star; "
            f"the usable capacity ({cap:.1f} GiB) dashed" + (", off the right edge" if off else "") + ".")
    return f'<section><h2>Pareto front</h2><p id="pareto-note">{escape(text)}</p>{chart}</section>'


REJECTED: tuple[Column, ...] = (("reason", "reason", str), ("plans", "plans", lambda v: f"{v:,}"))


def _rejected(result: SearchResult) -> str:
    rows = [{"reason": reason, "plans": n} for reason, n in result.rejected.most_common()]
    return ("<section><h2>Rejected plans</h2>" +
            table("rejected", REJECTED, rows, caption=f"{sum(result.rejected.values()):,} of {result.candidates:,} "
                  "candidates rejected, by reason") + "</section>")


def _exports(e: Exports) -> str:
    ds = (f'<pre id="export-deepspeed">{escape(e.deepspeed)}</pre>' if e.deepspeed is not None else "")
    note = f'<p id="deepspeed-note">{escape(e.deepspeed_note)}</p>' if e.deepspeed_note else ""
    return ("<section><h2>Exports</h2><h3>Megatron-LM arguments (<code>--export-megatron</code>)</h3>"
            f'<pre id="export-megatron">{escape(e.megatron)}</pre>'
            f"<h3>DeepSpeed config (<code>--export-deepspeed</code>)</h3>{note}{ds}</section>")


# ---- the page ------------------------------------------------------------------------------------

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;color:#222;margin:1.5em auto;max-width:1400px;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ccc}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.2em 1em}dt{font-weight:600}dd{margin:0}
table{border-collapse:collapse;margin:.8em 0;font-variant-numeric:tabular-nums}
caption{text-align:left;color:#555;padding:.3em 0;white-space:nowrap}
th,td{border:1px solid #ddd;padding:.15em .4em;text-align:right;white-space:nowrap}
th{background:#f3f3f3}[data-key=plan],[data-key=part],[data-key=reason]{text-align:left}
#ranked{font-size:13px}
tr.peak,#ranked tbody tr:first-child{background:#fff6d8}
.wide{overflow-x:auto}svg{max-width:900px;width:100%;height:auto;display:block}
pre{background:#f6f8fa;border:1px solid #ddd;padding:.8em;overflow:auto;max-height:32em}
.legend span{margin-right:1em;white-space:nowrap}.legend i{display:inline-block;width:.9em;height:.9em;
margin-right:.3em;vertical-align:-.1em}
#summary{font-weight:600}
"""

# Fills #summary from the ranked table: the page was rendered and its script ran (the browser test
# reads it back).
SCRIPT = """
(function () {
  var summary = document.getElementById("summary"), ranked = document.getElementById("ranked"),
      noFit = document.getElementById("no-fit");
  if (noFit) summary.textContent = noFit.textContent;
  if (!ranked) return;
  var rows = ranked.tBodies[0].rows, cell = function (key) {
    return rows[0].querySelector('td[data-key="' + key + '"]').textContent; };
  summary.textContent = rows.length + " of " + ranked.dataset.feasible + " feasible plans shown; best: " +
    cell("plan") + ", step " + cell("step_s") + " s, MFU " + cell("mfu");
})();
"""


def render_html(r: PlanReport) -> str:
    """The whole page: header, then the sections of the best plan, or why nothing fits."""
    if r.best:
        top = r.best[0]
        sections = [_ranked(r), _memory(top), _timeline(top), _pareto(top, r.result), _rejected(r.result)]
        if r.exports is not None:
            sections.append(_exports(r.exports))
    else:
        sections = [f'<section><h2>No plan fits</h2><p id="no-fit">{escape(r.no_fit)}</p></section>',
                    _rejected(r.result)]
    title = f"piper plan: {r.model.name} on {r.gpus:,} GPUs of {r.cluster.name}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            f"{_header(r)}<main>{''.join(sections)}</main><script>{SCRIPT}</script></body></html>\n")
