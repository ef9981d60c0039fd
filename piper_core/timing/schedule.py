"""The 1F1B pipeline schedule, simulated pass by pass.

Megatron's non-interleaved schedule (``forward_backward_pipelining_without_interleaving``): each
stage runs its warm-up forwards, then alternates one forward and one backward, then drains its
backwards. :func:`simulate_1f1b` computes every pass's start and end from the dependencies alone,
which is exact for stages of different speeds, where the closed form
``(m - 1) max T + sum T`` (Narayanan et al.) over-counts the drain behind a slow middle stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from piper_core.timing.step import StageTime


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One forward or backward pass of one micro-batch on one pipeline stage (seconds)."""

    stage: int
    micro: int
    kind: Literal["F", "B"]
    start: float
    end: float


def one_f_one_b_order(stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order on ``stage``: ``stages - stage - 1`` warm-up forwards,
    then one forward and one backward in turn, then the remaining backwards
    (``forward_backward_pipelining_without_interleaving``)."""
    warmup = min(stages - stage - 1, microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(microbatches - warmup, microbatches)]


def simulate_1f1b(fwd: Sequence[float], bwd: Sequence[float], microbatches: int) -> list[list[Op]]:
    """Start and end of every pass, per stage, from dependencies alone: F of micro-batch i on stage
    p waits for F of i on p-1, B of i on p for B of i on p+1, and every pass for the previous pass
    of its own stage. Point-to-point sends are asynchronous and their time is inside the passes."""
    n = len(fwd)
    orders = [one_f_one_b_order(n, p, microbatches) for p in range(n)]
    done: dict[tuple[str, int, int], float] = {}
    ops: list[list[Op]] = [[] for _ in range(n)]
    free, nxt = [0.0] * n, [0] * n
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for p in range(n):
            while nxt[p] < len(orders[p]):
                kind, i = orders[p][nxt[p]]
                dep = (kind, i, p - 1) if kind == "F" else (kind, i, p + 1)
                ready = done.get(dep) if 0 <= dep[2] < n else 0.0
                if ready is None:
                    break
                start = max(free[p], ready)
                free[p] = done[(kind, i, p)] = start + (fwd[p] if kind == "F" else bwd[p])
                ops[p].append(Op(stage=p, micro=i, kind=kind, start=start, end=free[p]))
                nxt[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen for the order above
    return ops


def pass_parts(st: "StageTime") -> tuple[dict[str, float], dict[str, float]]:
    """Forward and backward pass of one micro-batch on one stage, split by kind (seconds).

    StageTime keeps per-micro-batch totals only: compute goes 1/3 forward, 2/3 backward (two
    GEMMs per forward GEMM; Narayanan et al., arXiv 2104.04473, Appendix), communication half and
    half (the backward sends the transposes of the forward's messages; p2p: activation forward,
    gradient backward).
    """
    other = st.comm + st.p2p
    fwd = {"compute F": st.compute / 3, "exposed all-to-all": st.a2a / 2, "other communication": other / 2}
    bwd = {"compute B": 2 * st.compute / 3, "exposed all-to-all": st.a2a / 2, "other communication": other / 2}
    return fwd, bwd


def makespan(ops: list[list[Op]]) -> float:
    return max(op.end for stage in ops for op in stage)


def closed_form(totals: Sequence[float], microbatches: int, vpp: int = 1) -> float:
    """``m max T + (sum T - max T) / vpp``: exact when the last stage is the slowest, an upper
    bound otherwise; with interleaving the fill/drain shrinks by ``vpp`` (Narayanan et al.)."""
    slow = max(totals)
    return microbatches * slow + (sum(totals) - slow) / vpp


def pipeline_time(stages: Sequence["StageTime"], microbatches: int, vpp: int = 1, *, exact: bool = True) -> float:
    """Seconds from the first forward to the last backward of one step.

    ``exact`` simulates 1F1B (vpp = 1); the interleaved schedule and the fast path of the search
    use :func:`closed_form`.
    """
    totals = [s.total for s in stages]
    if not exact or vpp > 1 or len(stages) == 1:
        return closed_form(totals, microbatches, vpp)
    parts = [pass_parts(s) for s in stages]
    ops = simulate_1f1b([sum(f.values()) for f, _ in parts], [sum(b.values()) for _, b in parts], microbatches)
    return makespan(ops)

