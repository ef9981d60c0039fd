"""Run the validation cases and compare each with the prediction of its topology's profile.

``profiles`` maps a case's :attr:`Case.topology` (``local-2``, ``local-4``, ``emu-2x1-200mbit``) to
the calibrated :class:`ClusterSpec` that predicts it. Training runs through the case framework's
registered trainer (:mod:`piper_core.trainers`: Megatron-Core with Piper's dispatcher, or DeepSpeed-MoE
with Piper's MoE layer; local or emulated ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from piper_core.resource.predict import predict
from piper_core.specs.cluster import ClusterSpec
from piper_core.validate.cases import Case
from piper_core.validate.compare import Row, compare

STEPS, WARMUP = 12, 3


def run_case(case: Case, cluster: ClusterSpec, *, steps: int = STEPS, warmup: int = WARMUP,
             timeout_s: float = 600.0, realtime: bool = False, peak: bool = True) -> Row:
    """The timed job of ``case``, then (``peak``) its memory job (:mod:`.peak`), both against the
    prediction from ``cluster``."""
    import dataclasses

    from piper_core import trainers
    from piper_core.validate.instrument import TrainJob, summary
    from piper_core.validate.peak import measure_peak

    job = TrainJob(model=case.model, plan=case.plan, steps=steps, warmup=warmup, stock=case.stock)
    reports = trainers.get(case.framework).run(job, nodes=case.nodes, inter_node_mbit=case.inter_node_mbit,
                                               timeout_s=timeout_s, realtime=realtime)
    pred = predict(case.model, cluster, case.plan)
    row = compare(case, pred, summary(reports), warmup=warmup)
    return dataclasses.replace(row, peak=measure_peak(case, pred, timeout_s=timeout_s)) if peak else row


def run_cases(cases: Sequence[Case], profiles: Mapping[str, ClusterSpec], *, steps: int = STEPS,
              warmup: int = WARMUP, progress: Callable[[int, int], None] | None = None,
              realtime: bool = False, peak: bool = True) -> list[Row]:
    rows = []
    for i, case in enumerate(cases):
        if progress:
            progress(i, len(cases))
        rows.append(run_case(case, profiles[case.topology], steps=steps, warmup=warmup, realtime=realtime, peak=peak))
    if progress:
        progress(len(cases), len(cases))
    return rows
