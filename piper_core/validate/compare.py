"""Measured vs predicted for one validation case, and the whole table's verdict (pure; no torch).

Per case: the step time (median of the timed steps of the slowest rank) against ``predict``'s step;
per pipeline stage, parameter bytes plus the peak of activation storages held for backward against
the model's weights plus activations of that stage; the forward dispatch / expert / combine times of
the MoE layers (rank 0, per step) against the model's exposed all-to-all and expert compute, for
reading only (the acceptance is on the step and on memory). Across cases: MAPE, the worst case, and
per group whether the plan with the least predicted step is the measured fastest or within 5 % of it;
over every case (the headline, which decides pass or fail), and again over each subset the suite
registered (shown beside it, never instead).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from piper_core.resource.predict import Prediction
from piper_core.timing.layer import layer_cost, shape_of
from piper_core.validate.peak import PeakRow, peak_figures, peak_json, worst_relative_error
from piper_core.validate.suite import Case, Subset, by_subset

STEP_MAPE_LIMIT, STEP_WORST_LIMIT, MEMORY_LIMIT, PICK_LIMIT = 0.10, 0.20, 0.05, 0.05


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    case: Case
    measured_step_s: float
    predicted_step_s: float
    measured_memory: tuple[int, ...]  # per stage: param bytes + activation peak
    predicted_memory: tuple[int, ...]
    phases: dict[str, float]  # measured/predicted ms per step, rank 0
    losses: tuple[float, ...]
    peak: PeakRow | None = None  # peak tensor bytes per stage (piper_core.validate.peak), when measured
    round_steps_s: tuple[float, ...] = ()  # each round's step median, in round order (measured_step_s: their median)

    @property
    def round_spread(self) -> float | None:
        """The slowest round's step over the fastest's, minus 1 (None with fewer than 2 rounds)."""
        if len(self.round_steps_s) < 2:
            return None
        return max(self.round_steps_s) / min(self.round_steps_s) - 1

    @property
    def step_error(self) -> float:
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    @property
    def memory_error(self) -> float:
        """The largest relative error over the pipeline stages."""
        return worst_relative_error(self.measured_memory, self.predicted_memory)


def _phases(case: Case, pred: Prediction, measured: dict[str, float]) -> dict[str, float]:
    model, plan = case.model, case.plan
    out = {f"measured_{k}_ms": round(v, 3) for k, v in measured.items() if k != "calls"}
    if not model.is_moe or not measured:  # DeepSpeed cases record no phases
        return out
    cost = layer_cost(model, shape_of(plan), pred.cluster, True)
    calls = measured.get("calls", 0.0)  # MoE layer forwards per step on rank 0
    out["predicted_a2a_fwd_ms"] = round(1e3 * calls * cost.a2a_fwd, 3)
    out["measured_a2a_fwd_ms"] = round(measured.get("dispatch", 0.0) + measured.get("combine", 0.0), 3)
    return out


def compare(case: Case, pred: Prediction, summaries: list[dict[str, Any]], *, warmup: int) -> Row:
    """``case`` measured in ``summaries`` (one per round, :func:`~piper_core.validate.instrument.summary`)
    against ``pred``. The step: the median over rounds of each round's median timed step; memory,
    phases and losses: from the first round (the same seeded job each round)."""
    rounds = tuple(statistics.median(s["step_s"][warmup:]) for s in summaries)
    summary = summaries[0]
    stages = summary["stages"]
    measured_mem = tuple(s["param_bytes"] + s["activation_peak_bytes"] for s in stages)
    # what saved-tensor hooks measure: parameters and autograd's saved activations
    predicted_mem = tuple(s.weights + s.activations - s.unsaved for s in pred.stages)
    return Row(case=case, measured_step_s=statistics.median(rounds), predicted_step_s=pred.time.step,
               measured_memory=measured_mem, predicted_memory=predicted_mem,
               phases=_phases(case, pred, summary["moe_phases_ms_per_step"]), losses=tuple(summary["losses"]),
               round_steps_s=rounds if len(rounds) > 1 else ())


def figures(rows: list[Row]) -> dict[str, Any]:
    """MAPE, worst step error, worst memory error and the scheduler's pick per group of ``rows``,
    each with its pass/fail against the limits."""
    errors = [abs(r.step_error) for r in rows]
    mape = sum(errors) / len(errors)
    worst = max(rows, key=lambda r: abs(r.step_error))
    mem_worst = max(rows, key=lambda r: abs(r.memory_error))
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.case.group, []).append(r)
    picks = {}
    for g, members in groups.items():
        if len(members) < 2:
            continue
        pick = min(members, key=lambda r: r.predicted_step_s)
        fastest = min(members, key=lambda r: r.measured_step_s)
        slower = pick.measured_step_s / fastest.measured_step_s - 1
        picks[g] = {"pick": pick.case.name, "measured_fastest": fastest.case.name, "pick_slower_by": round(slower, 4),
                    "ok": slower <= PICK_LIMIT}
    return {
        "cases": len(rows),
        "step_mape": round(mape, 4), "step_mape_ok": mape <= STEP_MAPE_LIMIT,
        "worst_step_case": worst.case.name, "worst_step_error": round(worst.step_error, 4),
        "worst_step_ok": abs(worst.step_error) <= STEP_WORST_LIMIT,
        "worst_memory_case": mem_worst.case.name, "worst_memory_error": round(mem_worst.memory_error, 4),
        "memory_ok": abs(mem_worst.memory_error) <= MEMORY_LIMIT,
        "picks": picks, "picks_ok": all(p["ok"] for p in picks.values()),
        **_peaks(rows),
    }


def _peaks(rows: list[Row]) -> dict[str, Any]:
    """The peak-memory figures over the rows whose peak was measured (a run without its peak is
    named, so a partial figure is never read as a whole one)."""
    measured = [r.peak for r in rows if r.peak is not None]
    if not measured:
        return {}
    return peak_figures(measured, MEMORY_LIMIT) | {"peak_not_measured": [r.case.name for r in rows if r.peak is None]}


def verdict(rows: list[Row], subsets: tuple[Subset, ...] = ()) -> dict[str, Any]:
    """The headline :func:`figures` over every row (pass or fail), and each registered subset's
    figures beside it (``subsets``: name -> why, its cases and its figures; none decides the verdict)."""
    return figures(rows) | {"subsets": by_subset(rows, subsets, figures), "limits": {"step_mape": STEP_MAPE_LIMIT, "worst_step": STEP_WORST_LIMIT,
                                                           "memory": MEMORY_LIMIT, "pick": PICK_LIMIT}}


def passed(v: dict[str, Any]) -> bool:
    """Whether the headline meets every limit (the peak's too, where it was measured)."""
    return v["step_mape_ok"] and v["worst_step_ok"] and v["memory_ok"] and v["picks_ok"] and v.get("peak_ok", True)


def row_json(r: Row) -> dict[str, Any]:
    from piper_core.export import plan_label

    return {"case": r.case.name, "group": r.case.group, "framework": r.case.framework, "stock": r.case.stock,
            "topology": r.case.topology,
            "model": r.case.model.name,
            "plan": plan_label(r.case.plan),
            "step_s": {"measured": round(r.measured_step_s, 5), "predicted": round(r.predicted_step_s, 5),
                       "error": round(r.step_error, 4)}
            | ({"rounds": [round(t, 5) for t in r.round_steps_s], "round_spread": round(r.round_spread, 4)}
               if r.round_steps_s else {}),
            "memory_bytes": {"measured": list(r.measured_memory), "predicted": list(r.predicted_memory),
                             "error": round(r.memory_error, 4)},
            "phases_ms_per_step": r.phases, "losses": list(r.losses),
            "peak_tensor_bytes": None if r.peak is None else peak_json(r.peak)}
