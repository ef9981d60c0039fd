"""Published, measured MoE training results on GPUs, each predicted by Piper from its presets.

    python -m piper_core.validate.published           # the Markdown table and its MAPE
    python -m piper_core.validate.published --json    # the same as one JSON object, nothing else

The rows live in ``published.yaml`` beside this module (its header gives the format and the mapping
rules every row follows). A row names a model preset (with the ModelSpec fields its workload sets
differently, e.g. a proxy's layer count), a cluster preset, the GPU count, the published parallel
plan (ParallelPlan field names) and the measured number exactly as the source prints it, with a
verbatim excerpt holding it. Each predicted row runs :func:`piper_core.resource.predict.predict`,
what ``piper predict`` runs; nothing is fitted to a row.

The prediction becomes the published metric so (``T`` the predicted step time, FLOPs Megatron's
model FLOPs, :class:`piper_core.timing.step.Throughput`):

* ``tokens_per_s``: global batch x sequence / ``T``, over all GPUs;
* ``tokens_per_s_per_gpu``: the same divided by the GPUs;
* ``tflops_per_gpu``: model FLOPs per step / ``T`` / GPUs, what Megatron-LM logs as TFLOP/s/GPU
  (``num_floating_point_operations``, megatron/training/training.py);
* ``mfu``: that over the dense peak of the precision, in percent as sources print it.

Error = predicted / measured - 1; MAPE = the mean absolute error over every predicted row. A row
whose predicted peak memory exceeds the usable HBM is still timed and counted (the step model does
not depend on the memory verdict); the table marks it and gives the MAPE of the rows that fit too.
Rows the model cannot price (fp8, a layout ParallelPlan cannot express) are listed, not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import yaml

from piper_core.errors import SpecError, nearest
from piper_core.export import plan_label
from piper_core.presets import load_cluster, load_model
from piper_core.resource.memory import GIB
from piper_core.resource.predict import Prediction, predict
from piper_core.specs._check import literals
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import check_plan
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.yamlio import from_dict, to_dict

DEFAULT_FILE = Path(__file__).with_name("published.yaml")
Metric = Literal["mfu", "tflops_per_gpu", "tokens_per_s_per_gpu", "tokens_per_s"]
UNITS = {"mfu": "% MFU", "tflops_per_gpu": "TFLOPS/GPU", "tokens_per_s_per_gpu": "tokens/s/GPU",
         "tokens_per_s": "tokens/s"}
PRECISIONS = ("bf16", "fp16", "fp8")
ROW_KEYS = ("id", "source", "model", "model_overrides", "cluster", "gpus", "precision", "plan", "measured",
            "assumptions", "notes", "unsure", "not_predicted")
REQUIRED = ("id", "source", "model", "cluster", "gpus", "precision", "measured")


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """Where the number was published; ``excerpt`` (and ``plan_excerpt``) are verbatim text of it."""

    url: str
    title: str
    excerpt: str
    repo: str | None = None
    path: str | None = None
    commit: str | None = None
    plan_excerpt: str | None = None

    @property
    def origin(self) -> str:
        """The repository, or the host of a page: what counts as one source."""
        return self.repo or urlparse(self.url).netloc


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """The published number: ``as_written`` exactly as the source prints it (commas, a % sign)."""

    metric: Metric
    as_written: str

    def __post_init__(self) -> None:
        literals(self)
        try:
            float(self.as_written.replace(",", "").strip().rstrip("%"))
        except ValueError:
            raise SpecError("as_written", self.as_written, "is not a number", "copy the number as printed, "
                            "e.g. '12,040' or '45.4%'") from None

    @property
    def value(self) -> float:
        return float(self.as_written.replace(",", "").strip().rstrip("%"))


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedRow:
    id: str
    source: Source
    model_name: str
    model: ModelSpec
    overrides: tuple[tuple[str, Any], ...]
    cluster: ClusterSpec
    gpus: int
    precision: str
    plan: ParallelPlan | None  # None: not predicted
    measured: Measured
    assumptions: tuple[str, ...] = ()
    notes: str | None = None
    unsure: str | None = None
    not_predicted: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    row: PublishedRow
    prediction: Prediction | None

    @property
    def predicted(self) -> float | None:
        return None if self.prediction is None else metric_value(self.prediction, self.row.measured.metric)

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.row.measured.value - 1


def metric_value(p: Prediction, metric: str) -> float:
    """The prediction in the published metric (see the module docstring)."""
    r = p.rate
    return {"mfu": 100 * r.mfu, "tflops_per_gpu": r.tflops_per_gpu, "tokens_per_s": r.tokens_per_s,
            "tokens_per_s_per_gpu": r.tokens_per_s / p.plan.gpus}[metric]


# ---- loading ------------------------------------------------------------------------------------

def _mapping(raw: Any, key: str, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise SpecError(key, raw, "must be a mapping", f"write {key} as a YAML mapping", where=where)
    return raw


def _keys(raw: dict[str, Any], where: str) -> None:
    for key in raw:
        if key not in ROW_KEYS:
            guess = nearest(str(key), ROW_KEYS)
            raise SpecError(str(key), raw[key], "is not a key of a published row",
                            f"did you mean '{guess}'?" if guess else f"use one of {list(ROW_KEYS)}", where=where)
    for key in REQUIRED:
        if key not in raw:
            raise SpecError(key, None, "is required in every published row", f"add '{key}: ...'", where=where)
    if ("plan" in raw) == ("not_predicted" in raw):
        raise SpecError("plan", raw.get("plan"), "a row has a plan or a not_predicted reason, exactly one",
                        "give the published plan, or not_predicted: '<why>' instead", where=where)


def _source(raw: dict[str, Any], measured: Measured, where: str) -> Source:
    source = from_dict(Source, _mapping(raw["source"], "source", where), where=where, prefix="source.")
    if not source.excerpt.strip():
        raise SpecError("source.excerpt", source.excerpt, "must quote the source", "paste the text that holds "
                        "the measured number", where=where)
    if measured.as_written not in source.excerpt:
        raise SpecError("measured.as_written", measured.as_written, "does not appear in source.excerpt",
                        "copy the number exactly as the source prints it, in an excerpt that holds it", where=where)
    return source


def _presets(raw: dict[str, Any], where: str) -> tuple[ModelSpec, ClusterSpec, tuple[tuple[str, Any], ...]]:
    try:
        model, cluster = load_model(str(raw["model"])), load_cluster(str(raw["cluster"]))
    except SpecError as exc:
        raise SpecError(exc.key, exc.value, exc.rule, exc.fix, where=where) from None
    overrides = _mapping(raw.get("model_overrides", {}), "model_overrides", where)
    if overrides:
        model = from_dict(ModelSpec, {**to_dict(model), **overrides}, where=where, prefix="model_overrides.")
    return model, cluster, tuple(overrides.items())


def _plan(raw: dict[str, Any], model: ModelSpec, where: str) -> ParallelPlan | None:
    if raw["precision"] not in PRECISIONS:
        raise SpecError("precision", raw["precision"], f"must be one of {list(PRECISIONS)}",
                        f"use one of {list(PRECISIONS)}", where=where)
    if "plan" not in raw:
        return None
    fields = _mapping(raw["plan"], "plan", where)
    precision = raw["precision"]
    if precision == "fp8":  # a bf16 plan whose linears run FP8 GEMMs (ParallelPlan.fp8), as Megatron runs FP8
        if fields.get("fp8") is None:
            raise SpecError("plan.fp8", fields.get("fp8"), "an fp8 row's plan names the FP8 format it ran (and "
                            "fp8_recipe, default delayed)", "add fp8: hybrid (or e4m3) to the plan, saying in "
                            "assumptions where it comes from", where=where)
        precision = "bf16"
    elif fields.get("fp8") is not None:
        raise SpecError("plan.fp8", fields["fp8"], f"is set on a {precision} row", "set the row's precision to "
                        "fp8, or drop plan.fp8", where=where)
    for key in ("gpus", "precision"):
        if key in fields:
            raise SpecError(f"plan.{key}", fields[key], "is a row key, not a plan key", f"set {key} on the row",
                            where=where)
    plan = from_dict(ParallelPlan, {**fields, "gpus": raw["gpus"], "precision": precision},
                     where=where, prefix="plan.")
    try:
        check_plan(model, plan)
    except SpecError as exc:
        raise SpecError(f"plan.{exc.key}", exc.value, exc.rule, exc.fix, where=where) from None
    return plan


def _row(raw: Any, where: str) -> PublishedRow:
    raw = _mapping(raw, "row", where)
    rid = raw.get("id")
    if not isinstance(rid, str) or not rid.strip():
        raise SpecError("id", rid, "must be a non-empty string", "add 'id: <source>-<model>-<gpus>'", where=where)
    where = f"{where} '{rid}'"
    _keys(raw, where)
    if isinstance(raw["gpus"], bool) or not isinstance(raw["gpus"], int) or raw["gpus"] <= 0:
        raise SpecError("gpus", raw["gpus"], "must be a positive integer", "write the GPU count", where=where)
    measured = from_dict(Measured, _mapping(raw["measured"], "measured", where), where=where, prefix="measured.")
    source = _source(raw, measured, where)
    model, cluster, overrides = _presets(raw, where)
    plan = _plan(raw, model, where)
    assumptions = raw.get("assumptions", [])
    if not isinstance(assumptions, list) or not all(isinstance(a, str) for a in assumptions):
        raise SpecError("assumptions", assumptions, "must be a list of sentences", "write one '- ...' per "
                        "assumption", where=where)
    return PublishedRow(id=rid, source=source, model_name=str(raw["model"]), model=model, overrides=overrides,
                        cluster=cluster, gpus=raw["gpus"], precision=raw["precision"], plan=plan,
                        measured=measured, assumptions=tuple(assumptions), notes=raw.get("notes"),
                        unsure=raw.get("unsure"), not_predicted=raw.get("not_predicted"))


def load_rows(path: str | Path = DEFAULT_FILE) -> tuple[PublishedRow, ...]:
    """The rows of ``path``; a bad row raises :class:`SpecError` naming the row, key, value, rule and fix."""
    path = Path(path)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, list):
        raise SpecError("document", type(data).__name__, "must be a list of rows", "write '- id: ...' items",
                        where=str(path))
    rows: list[PublishedRow] = []
    for i, raw in enumerate(data):
        row = _row(raw, f"{path.name} row {i + 1}")
        if any(r.id == row.id for r in rows):
            raise SpecError("id", row.id, "is used by an earlier row", "give each row its own id",
                            where=f"{path.name} row {i + 1}")
        rows.append(row)
    return tuple(rows)


# ---- predicting and reporting -------------------------------------------------------------------

def evaluate(rows: Sequence[PublishedRow]) -> tuple[Result, ...]:
    return tuple(Result(row=r, prediction=None if r.plan is None else predict(r.model, r.cluster, r.plan))
                 for r in rows)


def _mape(results: Sequence[Result]) -> float | None:
    return statistics.fmean(abs(r.error) for r in results) if results else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def summary(results: Sequence[Result]) -> dict[str, Any]:
    """MAPE over every predicted row (over-memory rows included), over the rows that fit, per source."""
    timed = [r for r in results if r.prediction is not None]
    fitting = [r for r in timed if r.prediction.feasible]
    origins = sorted({r.row.source.origin for r in timed})
    by_source = {}
    for origin in origins:
        rows = [r for r in timed if r.row.source.origin == origin]
        by_source[origin] = {"rows": len(rows), "mape": _mape(rows)}
    return {"predicted_rows": len(timed), "mape": _mape(timed), "fitting_rows": len(fitting),
            "mape_fitting": _mape(fitting), "over_memory": [r.row.id for r in timed if not r.prediction.feasible],
            "not_predicted": [r.row.id for r in results if r.prediction is None], "sources": origins,
            "by_source": by_source}


def _number(value: float, metric: str) -> str:
    return f"{value:.1f}" if metric in ("mfu", "tflops_per_gpu") else f"{value:,.0f}"


def _model_cell(row: PublishedRow) -> str:
    over = ", ".join(f"{k}={v}" for k, v in row.overrides)
    return f"{row.model_name}{f' ({over})' if over else ''}, {row.gpus} x {row.cluster.accelerator.name}"


def _line(r: Result) -> str:
    row, s = r.row, r.row.source
    name = row.id + (" ?" if row.unsure else "")
    src = f"[{s.origin}@{s.commit[:7]}]({s.url})" if s.commit else f"[{s.origin}]({s.url})"
    measured = f"{row.measured.as_written} {UNITS[row.measured.metric]}"
    if r.prediction is None:
        reason = row.not_predicted.split(":")[0]
        return (f"| {name} | {src} | {_model_cell(row)} | ({row.precision}) | {measured} | "
                f"not predicted ({reason}) | | |")
    p = r.prediction
    mem = f"{p.peak_stage.total / GIB:.1f} / {p.capacity_bytes / GIB:.1f}" + ("" if p.feasible else " †")
    return (f"| {name} | {src} | {_model_cell(row)} | {plan_label(row.plan, gbs=True)} | {measured} | "
            f"{_number(r.predicted, row.measured.metric)} | {100 * r.error:+.1f}% | {mem} |")


def markdown(results: Sequence[Result]) -> str:
    s = summary(results)
    lines = ["| row | source | model, GPUs | plan | measured | predicted | error | peak / usable GiB |",
             "|---|---|---|---|---:|---:|---:|---:|"] + [_line(r) for r in results]
    lines += ["", f"**MAPE {_pct(s['mape'])}** over the {s['predicted_rows']} predicted rows from "
              f"{len(s['sources'])} sources. Rows marked † exceed the usable HBM under Piper's memory model "
              f"({len(s['over_memory'])} rows); they are still timed and counted in that MAPE. Over the "
              f"{s['fitting_rows']} rows that fit: MAPE {_pct(s['mape_fitting'])}. Rows marked ? are uncertain "
              "(see `unsure` in published.yaml). Error = predicted / measured - 1.", "",
              "MAPE by source: " + "; ".join(f"{o} {_pct(v['mape'])} ({v['rows']} row{'s' * (v['rows'] != 1)})"
                                             for o, v in s["by_source"].items())
              + ".", "", f"Not predicted, not counted ({len(s['not_predicted'])} rows):"]
    lines += [f"- {r.row.id}: {r.row.not_predicted}" for r in results if r.prediction is None]
    return "\n".join(lines)


def to_json(results: Sequence[Result]) -> dict[str, Any]:
    rows = []
    for r in results:
        row, p, s = r.row, r.prediction, r.row.source
        rows.append({
            "id": row.id, "source": {"url": s.url, "title": s.title, "repo": s.repo, "path": s.path,
                                     "commit": s.commit, "origin": s.origin},
            "model": row.model_name, "model_overrides": dict(row.overrides), "cluster": row.cluster.name,
            "gpus": row.gpus, "precision": row.precision, "plan": None if row.plan is None else to_dict(row.plan),
            "metric": row.measured.metric, "measured": row.measured.value,
            "measured_as_written": row.measured.as_written,
            "predicted": r.predicted, "error": r.error, "fits": None if p is None else p.feasible,
            "peak_gib": None if p is None else p.peak_stage.total / GIB,
            "usable_gib": None if p is None else p.capacity_bytes / GIB,
            "step_s": None if p is None else p.time.step, "assumptions": list(row.assumptions),
            "unsure": row.unsure, "not_predicted": row.not_predicted})
    return {"rows": rows, "summary": summary(results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m piper_core.validate.published", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the Markdown table")
    parser.add_argument("--file", type=Path, default=DEFAULT_FILE, help="rows to predict (default: published.yaml)")
    args = parser.parse_args(argv)
    try:
        results = evaluate(load_rows(args.file))
    except SpecError as exc:
        print(f"published: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(results), indent=2) if args.json else markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
