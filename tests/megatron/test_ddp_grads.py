"""Piper's pipelined dispatcher gives Megatron-Core's DDP the gradients of the stock dispatcher, with
overlapped gradient reduction and with the distributed optimizer's reduce-scatter, whether its chunk
count is fixed or changes between steps (``--piper-chunks tune``); see tests/megatron/ddp_ranks.py.

2 gloo ranks (ep 2, expert data parallel 1) and 4 (ep 2, expert data parallel 2, so expert
gradients are really reduced). The same run with the old per-chunk accumulation injected must come
out wrong, or this test could not tell the fix from its absence.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

# relative to the largest gradient. Dispatch order alone differs by ~1e-7 in fp32 on the first step;
# the difference compounds through the optimizer's steps, and the kernels' summation order depends on
# the CPU: on an Intel Xeon copy of the machine (2026-12-07) rank 2 of chunks2 under overlap-distopt
# reached 1.47e-5 by the 8th step (1.3e-8 on the first), at this commit and at the last one that
# passed 1e-5 on an AMD EPYC copy. 1e-4 keeps a factor 10 below what the injected fault must show.
TOL = 1e-4
WRONG = 1e-3  # what the injected accounting must at least produce (or an error)


@functools.cache
def _ranks(world: int) -> list[dict]:
    from tests.gloo import run_ranks
    from tests.megatron.ddp_ranks import run_rank

    return run_ranks(world, run_rank, timeout_s=400)


@pytest.mark.parametrize("ddp", ("overlap", "overlap-distopt"))
@pytest.mark.parametrize("variant", ("tune", "chunks2"))
@pytest.mark.parametrize("world", (2, 4))
def test_reduced_gradients_equal_stock_every_step(world, variant, ddp):
    from tests.megatron.ddp_ranks import STEPS

    for rank, result in enumerate(_ranks(world)):
        run = result[ddp][variant]
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        assert run["steps"] == STEPS
        worst = max(run["relative_diff"])
        assert worst <= TOL, f"rank {rank} {variant} under DDP {ddp}: gradients off by {run['relative_diff']}"
        for step, (want, got) in enumerate(zip(result[ddp]["stock_losses"], run["losses"])):
            assert got == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}: {variant} {got} vs stock {want}"


@pytest.mark.parametrize("ddp", ("overlap", "overlap-distopt"))
@pytest.mark.parametrize("world", (2, 4))
def test_per_chunk_accumulation_is_caught(world, ddp):
    """The accounting before the fix (a gradient accumulation per chunk) fails here: Megatron's DDP
    raises, or the reduced gradients differ from stock once the chunk count changes."""
    outcomes = []
    for result in _ranks(world):
        run = result[ddp]["legacy-tune"]
        outcomes.append(run["error"] or max(run["relative_diff"]))
    assert any(isinstance(o, str) or o > WRONG for o in outcomes), outcomes
