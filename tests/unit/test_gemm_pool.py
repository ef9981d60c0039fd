"""The GEMM sweep's operand pool (piper_core.calibrate.bench.operand_pool): each timed call reads the
next pair of disjoint operands, so a call finds its operands out of cache as a training step does."""

from __future__ import annotations

import pytest
import torch

from piper_core.calibrate.assemble import reduce_outcomes
from piper_core.calibrate.bench import operand_pool
from piper_core.calibrate.steps import GEMM_POOL_MIB, Topology, plan_steps


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    return t.storage_offset(), t.storage_offset() + t.numel()


@pytest.mark.parametrize("batch", [1, 4])
def test_pairs_are_disjoint_views_that_fill_the_pool(batch):
    pool = torch.randn(10_000)
    m, n, k = 8, 16, 12
    pairs = operand_pool(pool, m, n, k, torch.float32, batch)
    per_pair = batch * (m * k + k * n)
    assert len(pairs) == 10_000 // per_pair
    spans = []
    for a, b in pairs:
        assert a.shape == ((batch, m, k) if batch > 1 else (m, k))
        assert b.shape == ((batch, k, n) if batch > 1 else (k, n))
        assert a.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
        spans += [_storage_span(a), _storage_span(b)]
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no two operands overlap
    assert spans[-1][1] <= pool.numel()
    torch.mm(*pairs[-1]) if batch == 1 else torch.bmm(*pairs[-1])  # usable as GEMM operands


def test_no_pool_gives_one_pair_and_a_pool_too_small_gives_one_fresh_pair():
    (a, b), = operand_pool(None, 4, 5, 6, torch.bfloat16)
    assert a.shape == (4, 6) and b.shape == (6, 5) and a.dtype == torch.bfloat16
    small = torch.randn(10)
    (a, b), = operand_pool(small, 4, 5, 6, torch.float32)
    assert a.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()


def test_the_calibration_sweeps_through_the_pool_and_records_how():
    (gemm,) = [s for s in plan_steps(Topology(nodes=1, ranks_per_node=2), quick=True, timeout_s=60, overhead_probe=False)
               if s.name == "gemm"]
    assert gemm.args[1]["pool_mib"] == GEMM_POOL_MIB > 50  # larger than an H100's L2


def test_the_profile_says_whether_its_gemms_were_timed_in_or_out_of_cache():
    class Outcome:
        name, status = "gemm", "ok"

        def __init__(self, pool_mib):
            row = {"gemm": {"fp32": [[8, 8, 8, 1e-6]]}}
            self.results = [row | ({"gemm_pool_mib": pool_mib} if pool_mib is not None else {})]

    assert reduce_outcomes([Outcome(256)])["gemm_operands"]["pool_mib"] == 256
    assert "256 MiB pool" in reduce_outcomes([Outcome(256)])["gemm_operands"]["timed"]
    # a profile measured before the pool existed says its GEMMs were timed in cache
    assert "in cache" in reduce_outcomes([Outcome(None)])["gemm_operands"]["timed"]
