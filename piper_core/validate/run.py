"""Run the validation cases and compare each with the prediction of its topology's profile.

``profiles`` maps a case's :attr:`Case.topology` (``local-2``, ``local-4``, ``emu-2x1-200mbit``) to
the calibrated :class:`ClusterSpec` that predicts it. Training runs through the case framework's
registered trainer (:mod:`piper_core.trainers`: Megatron-Core with Piper's dispatcher, or DeepSpeed-MoE
with Piper's MoE layer; local or emulated ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from piper_core.resource.predict import predict
from piper_core.specs.cluster import ClusterSpec
from piper_core.validate.cases import Case
from piper_core.validate.compare import Row, compare

STEPS, WARMUP = 12, 3


def run_case(case: Case, cluster: ClusterSpec, *, steps: int = STEPS, warmup: int = WARMUP,
             timeout_s: float = 600.0, realtime: bool = False, peak: bool = True) -> Row:
    """The timed job of ``case``, then (``peak``) its memory job (:mod:`.peak`), both against the
    prediction from ``cluster``."""
    return _row(case, cluster, [_timed(case, steps, warmup, timeout_s, realtime)], warmup, timeout_s, peak)


def _timed(case: Case, steps: int, warmup: int, timeout_s: float, realtime: bool) -> dict[str, Any]:
    """One run of ``case``'s timed job: its :func:`~piper_core.validate.instrument.summary`."""
    from piper_core import trainers
    from piper_core.validate.instrument import TrainJob, summary

    job = TrainJob(model=case.model, plan=case.plan, steps=steps, warmup=warmup, stock=case.stock)
    return summary(trainers.get(case.framework).run(job, nodes=case.nodes, inter_node_mbit=case.inter_node_mbit,
                                                    timeout_s=timeout_s, realtime=realtime))


def _row(case: Case, cluster: ClusterSpec, summaries: list[dict[str, Any]], warmup: int, timeout_s: float,
         peak: bool) -> Row:
    import dataclasses

    from piper_core.validate.peak import measure_peak

    pred = predict(case.model, cluster, case.plan)
    row = compare(case, pred, summaries, warmup=warmup)
    return dataclasses.replace(row, peak=measure_peak(case, pred, timeout_s=timeout_s)) if peak else row


def run_cases(cases: Sequence[Case], profiles: Mapping[str, ClusterSpec] | Callable[[], Mapping[str, ClusterSpec]], *,
              steps: int = STEPS, warmup: int = WARMUP, rounds: int = 1,
              progress: Callable[[int, int], None] | None = None, realtime: bool = False, peak: bool = True,
              timeout_s: float = 600.0, before_round: Callable[[int], None] | None = None) -> list[Row]:
    """Every case's row. With ``rounds`` > 1 each round runs every case's timed job once, in order, and a
    case's measured step is the median over rounds (:func:`~piper_core.validate.compare.compare`);
    its memory job runs once, after the last round. ``before_round(r)`` runs before round ``r``
    (0-based; the interleaved probe); ``profiles`` may be a function, called after the last round
    (the profiles that probe refitted)."""
    from piper_core.validate.rounds import in_rounds

    total = rounds * len(cases) + (len(cases) if peak else 0)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    summaries, _ = in_rounds(len(cases), rounds, lambda i: _timed(cases[i], steps, warmup, timeout_s, realtime),
                             before_round=before_round, tick=tick)
    clusters = profiles() if callable(profiles) else profiles
    rows = []
    for case, runs in zip(cases, summaries):
        if progress:
            progress(done, total)
        rows.append(_row(case, clusters[case.topology], runs, warmup, timeout_s, peak))
        done += 1 if peak else 0
    if progress:
        progress(total, total)
    return rows
