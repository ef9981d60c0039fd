"""``AutoChunks``: the chunk count chosen at run time by measurement.

* :func:`choose` takes the fewest chunks within ``margin`` of the fastest;
* on 2 gloo processes, ``plan_dispatch(chunks=auto)`` hands out each candidate ``trials`` times,
  ``moe_alltoall`` times those layers, and the next call decides on the slowest rank's times, the
  same on every rank; experts whose sleep depends on the chunk size make the answer known in
  advance (2 chunks fastest on both ranks; 1 chunk once rank 1 is slow at 2 chunks; gaps of >= 0.1 s, so load cannot reorder them);
* the decision's all-reduce has a timeout: a rank that skips it gets an error naming it;
* the layer's outputs and gradients are those of the fixed chunk count it ran with.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from piper_core.errors import SpecError
from piper_core.runtime import AutoChunks, CollectiveError, NodeTopology, create_comm, moe_alltoall, plan_dispatch
from piper_core.runtime.autochunks import choose
from piper_core.runtime.topology import Algorithm
from tests.gloo import run_ranks

TOKENS_PER_EXPERT = 8  # per source rank; 2 ranks x 2 experts -> 16 tokens per local expert per layer


def test_choose_prefers_fewer_chunks_within_margin() -> None:
    assert choose({1: 1.00, 2: 0.80, 4: 0.70}, 0.05) == 4
    assert choose({1: 1.00, 2: 0.80, 4: 0.78}, 0.05) == 2  # 4 chunks win by 2.5 %: not enough
    assert choose({1: 1.00, 2: 1.02, 4: 1.30}, 0.05) == 1
    assert choose({1: 1.04, 2: 1.00}, 0.05) == 1
    assert choose({1: 1.06, 2: 1.00}, 0.05) == 2
    assert choose({4: 0.5, 2: 0.5}, 0.0) == 2


def test_bad_arguments_name_the_rule() -> None:
    class _Comm:
        size, me = 2, 0
    for kwargs, rule in (({"candidates": ()}, "must be distinct ints >= 1"),
                         ({"candidates": (1, 0)}, "must be distinct ints >= 1"),
                         ({"candidates": (2, 2)}, "must be distinct ints >= 1"),
                         ({"trials": 0}, "must be an int >= 1"), ({"margin": 1.0}, r"must be in \[0, 1\)")):
        with pytest.raises(SpecError, match=rule):
            AutoChunks(_Comm(), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"chunks=2.0: must be an int >= 1 or an AutoChunks"):
        plan_dispatch([[1, 1], [1, 1]], comm=_Comm(), algorithm=Algorithm.FLAT, chunks=2.0)  # type: ignore[arg-type]


class SleepyExperts:
    """Identity experts that sleep ``delay[tokens in the call]`` seconds (per call), so a layer
    with ``c`` chunks sleeps ``c x delay[16 x 2 / c]``: the ranking of chunk counts is known."""

    def __init__(self, delay: dict[int, float]):
        self.delay = delay

    def __call__(self, tokens: torch.Tensor, tokens_per_expert: tuple[int, ...], probs: torch.Tensor | None):
        time.sleep(self.delay[tokens.shape[0]])
        return tokens * 1.0


def _tune(rank: int, world: int, slow_rank1_at_2: bool) -> dict[str, object]:
    comm = create_comm(NodeTopology.uniform(world_size=world, ranks_per_node=1))
    counts = torch.full((world, 2 * world), TOKENS_PER_EXPERT)
    rows = int(counts[rank].sum())
    received = TOKENS_PER_EXPERT * world * 2
    # 1 chunk: 0.15 s; 2 chunks: 2 x 0.01 s; 4 chunks: 4 x 0.1 s. The gaps (>= 0.13 s a layer) are
    # far above what a loaded machine adds to a layer (up to 0.05 s seen in CI with gaps of 0.02 s)
    delay = {received: 0.15, received // 2: 0.01, received // 4: 0.1}
    if slow_rank1_at_2 and rank == 1:
        delay[received // 2] = 0.15  # 2 chunks: 0.30 s on rank 1, slower than 1 chunk
    auto = AutoChunks(comm, candidates=(1, 2, 4), trials=3)  # the median of 3 ignores a first, slow step
    experts = SleepyExperts(delay)
    handed, tuned, outputs_ok = [], [], True
    for step in range(11):
        meta = plan_dispatch(counts, comm=comm, algorithm=Algorithm.FLAT, chunks=auto)
        handed.append(meta.chunks)
        tuned.append(meta.tuner is not None)
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(step * 10 + rank)).requires_grad_(True)
        y = moe_alltoall(x, meta, experts)
        y.backward(torch.ones_like(y))
        outputs_ok &= torch.equal(y, x.detach()) and torch.equal(x.grad, torch.ones_like(x))
    return {"handed": handed, "tuned": tuned, "chosen": auto.chosen, "medians": auto.medians_s, "ok": outputs_ok}


def _all_cases(rank: int, world: int) -> dict[str, object]:
    """Everything that needs processes, in one spawn (a spawn costs seconds)."""
    return {"fast at 2": _tune(rank, world, False), "rank 1 slow at 2": _tune(rank, world, True),
            "decision skipped": _skip_decision(rank, world)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, object]]:
    return run_ranks(2, _all_cases, timeout_s=120)


@pytest.mark.parametrize("slow_rank1_at_2", [False, True])
def test_auto_chunks_measures_each_candidate_then_agrees_on_the_fastest(two_ranks, slow_rank1_at_2: bool) -> None:
    results = [r["rank 1 slow at 2" if slow_rank1_at_2 else "fast at 2"] for r in two_ranks]
    want = 1 if slow_rank1_at_2 else 2
    for rank, r in enumerate(results):
        assert r["handed"] == [1, 1, 1, 2, 2, 2, 4, 4, 4, want, want], (rank, r["medians"])
        assert r["tuned"] == [True] * 9 + [False] * 2, rank
        assert r["chosen"] == want and r["ok"], rank
    assert results[0]["medians"] == results[1]["medians"]  # the slowest rank's times, on both
    med = results[0]["medians"]
    assert 0.145 < med[1] < med[4] and 0.39 < med[4]  # sleeps are lower bounds; the order is by design
    assert (0.29 < med[2] and med[1] < med[2]) if slow_rank1_at_2 else (0.018 < med[2] < 0.6 * med[1])


def _skip_decision(rank: int, world: int) -> str:
    """Rank 1 never joins the decision's all-reduce; rank 0 reports its error."""
    comm = create_comm(NodeTopology.uniform(world_size=world, ranks_per_node=1), timeout=timedelta(seconds=1))
    auto = AutoChunks(comm, candidates=(1,), trials=1)
    counts = torch.full((world, world), 2)
    auto.next_chunks()  # the one measured call (nothing timed: the median is inf, fine)
    if rank == 1:
        time.sleep(4.0)  # alive, but never joins the decision (well past rank 0's 1 s deadline, even under load)
        return "skipped"
    try:
        plan_dispatch(counts, comm=comm, algorithm=Algorithm.FLAT, chunks=auto)
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_decision_has_a_timeout_naming_it(two_ranks) -> None:
    results = [r["decision skipped"] for r in two_ranks]
    assert results[1] == "skipped"
    assert "AutoChunks decision (all-reduce of measured layer times)" in results[0]
    assert "rank 0 did not complete it within 1 s" in results[0]
