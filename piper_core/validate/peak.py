"""Peak memory per pipeline stage, measured against the model's predicted peak.

Measured: one short job of the case (2 steps: the optimizer's state exists from the first, the
second is a steady step) run whole under :class:`~piper_core.validate.instrument.TensorLedger`, which
counts every tensor storage from its creation until it is freed: parameters, gradients and their
buffers, optimizer state, activations, communication buffers and temporaries -- what a device
allocator's high-water mark counts for tensors (it cannot see scratch space freed inside one
kernel). The largest rank of each stage. Also the live bytes after the last step (no activations
left: the model state).

Predicted: the stage's peak (:attr:`~piper_core.resource.memory.StageMemory.total`) less the fixed
overhead (a device's CUDA context, NCCL and allocator reserve: not tensors), and the model state
(weights, gradients, optimizer state, and the fp32 gradient copy of the step where there is one: it
lives from the step to the next zero_grad; the gradients only where the trainer keeps them past the
step, :attr:`~piper_core.trainers.Trainer.gradients_after_step`) with the framework's persistent workspace
(:func:`~piper_core.resource.activations.workspace_bytes`), live after the step as the state is.

The ledger slows the job several-fold: its step times are not timings, and timed runs never use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from piper_core.resource.predict import Prediction
from piper_core.validate.suite import Case, Subset, by_subset

MIB = 2**20
PEAK_STEPS = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakRow:
    """Per pipeline stage: measured and predicted peak tensor bytes, and the model state."""

    case: Case
    measured: tuple[int, ...]
    predicted: tuple[int, ...]
    measured_state: tuple[int, ...]
    predicted_state: tuple[int, ...]

    @property
    def error(self) -> float:
        """The largest relative error of the peak over the stages."""
        return worst_relative_error(self.measured, self.predicted)

    @property
    def state_error(self) -> float:
        return worst_relative_error(self.measured_state, self.predicted_state)


def worst_relative_error(measured: tuple[int, ...], predicted: tuple[int, ...]) -> float:
    """(predicted - measured) / measured of the stage where it is largest in size."""
    return max(((p - m) / m for m, p in zip(measured, predicted)), key=abs)


def peak_row(case: Case, pred: Prediction, summary: dict[str, Any], *, gradients_after_step: bool = True) -> PeakRow:
    """``gradients_after_step``: the trainer keeps the gradients past the step (Megatron's DDP buffer,
    zeroed at the next step; DeepSpeed's engine frees them), so they are part of the measured state."""
    stages = summary["stages"]
    missing = [i for i, s in enumerate(stages) if "peak_tensor_bytes" not in s]
    if missing:
        raise ValueError(f"{case.name}: stages {missing} report no peak_tensor_bytes: the job did not run with memory=True")
    return PeakRow(case=case, measured=tuple(s["peak_tensor_bytes"] for s in stages),
                   predicted=tuple(s.total - s.overhead for s in pred.stages),
                   measured_state=tuple(s["state_tensor_bytes"] for s in stages),
                   predicted_state=tuple(s.weights + s.gradients * gradients_after_step + s.optimizer
                                         + s.step_gradients + s.workspace for s in pred.stages))


def measure_peak(case: Case, pred: Prediction, *, timeout_s: float = 600.0) -> PeakRow:
    """Run ``case``'s memory job through its framework's trainer and compare with ``pred``."""
    from piper_core import trainers
    from piper_core.validate.instrument import TrainJob, summary

    job = TrainJob(model=case.model, plan=case.plan, steps=PEAK_STEPS, warmup=1, memory=True, stock=case.stock)
    trainer = trainers.get(case.framework)
    reports = trainer.run(job, nodes=case.nodes, inter_node_mbit=case.inter_node_mbit, timeout_s=timeout_s)
    return peak_row(case, pred, summary(reports), gradients_after_step=trainer.gradients_after_step)


def peak_figures(rows: list[PeakRow], limit: float) -> dict[str, Any]:
    """Mean and worst relative error of the peak over ``rows``, against ``limit``."""
    worst = max(rows, key=lambda r: abs(r.error))
    state = max(rows, key=lambda r: abs(r.state_error))
    mean = sum(abs(r.error) for r in rows) / len(rows)
    return {"peak_cases": len(rows), "peak_mean_abs_error": round(mean, 4), "worst_peak_case": worst.case.name,
            "worst_peak_error": round(worst.error, 4), "peak_ok": abs(worst.error) <= limit,
            "worst_state_case": state.case.name, "worst_state_error": round(state.state_error, 4)}


def peak_json(r: PeakRow) -> dict[str, Any]:
    return {"measured": list(r.measured), "predicted": list(r.predicted), "error": round(r.error, 4),
            "state_measured": list(r.measured_state), "state_predicted": list(r.predicted_state),
            "state_error": round(r.state_error, 4)}


def peak_from_json(case: Case, d: dict[str, Any]) -> PeakRow:
    return PeakRow(case=case, measured=tuple(d["measured"]), predicted=tuple(d["predicted"]),
                   measured_state=tuple(d["state_measured"]), predicted_state=tuple(d["state_predicted"]))


def peak_lines(rows: list[PeakRow], figures: dict[str, Any], limit: float) -> list[str]:
    """The peak table: per case the largest stage's measured / predicted MiB and the worst error."""
    w = max([20, *(len(r.case.name) for r in rows)])
    head = f"{'case':<{w}} {'peak MiB meas/pred':>19} {'peak err':>8} {'state MiB meas/pred':>20} {'state err':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.case.name:<{w}} {f'{max(r.measured) / MIB:.1f}/{max(r.predicted) / MIB:.1f}':>19} "
                     f"{100 * r.error:>+7.1f}% {f'{max(r.measured_state) / MIB:.1f}/{max(r.predicted_state) / MIB:.1f}':>20} "
                     f"{100 * r.state_error:>+8.1f}%")
    ok = "ok" if figures["peak_ok"] else "FAIL"
    lines.append(f"peak tensor memory: mean |error| {100 * figures['peak_mean_abs_error']:.1f}%, worst "
                 f"{100 * figures['worst_peak_error']:+.1f}% on {figures['worst_peak_case']} (limit "
                 f"{100 * limit:.0f}%): {ok}")
    return lines


def peak_subsets(rows: list[PeakRow], subsets: tuple[Subset, ...], limit: float) -> dict[str, Any]:
    """Each registered subset's peak figures (beside the headline over every row, never instead)."""
    return by_subset(rows, subsets, lambda members: peak_figures(members, limit))


def subset_lines(subsets: dict[str, Any]) -> list[str]:
    lines = ["beside it (never instead), the subsets the suite registered:"] if subsets else []
    for name, f in subsets.items():
        lines.append(f"  {name} ({f['peak_cases']} runs): mean |error| {100 * f['peak_mean_abs_error']:.1f}%, worst "
                     f"{100 * f['worst_peak_error']:+.1f}% on {f['worst_peak_case']}")
    return lines
