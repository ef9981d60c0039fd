"""Piper's token dispatcher gives what Megatron-Core's alltoall dispatcher gives with expert tensor
parallelism (etp 2) and with shared experts, ``moe_shared_expert_overlap`` included.

Reference test on 4 gloo processes (tests/megatron/etp_ranks.py, one spawn for the file): a real
Megatron-Core ``MoELayer`` (``SequentialMLP`` experts, fp32, 8 experts, top-2, ep 2) built with
Megatron's ``MoEAlltoAllTokenDispatcher`` and again, with the same weights, with Piper's; one
forward and backward each on the same input. The output, the input gradient and every parameter
gradient (router, this rank's shard of each expert, shared expert) must agree to 1e-6, for attention
tp 1 and tp 2 (sequence parallel) with etp 2, dropless by the flat and hierarchical exchanges in 1
and 2 chunks, with token dropping and padding to capacity (factor 1.0), and with the shared expert
overlapped and not (also at etp 1). The overlapped shared expert's fc1 and fc2 must run while
Piper's dispatch and combine exchanges are in flight (unpipelined), and a tuned chunk count must be
decided alike on every rank of an expert-TP pair, whose ranks gather each chunk together.

The gloo stand-in for Megatron's uneven expert-TP all-gather/reduce-scatter (which only NCCL takes)
is :func:`tests.megatron.etp_ranks._gloo_uneven_collectives`; both dispatchers run through it.
"""

from __future__ import annotations

import pytest

from tests.megatron.etp_ranks import EP, LAYOUTS, TUNED, WORLD, etp_cases

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

TOL = 1e-6
CASES = etp_cases()
# forward of one unpipelined step: post tokens and probs, fc1, wait both; post the combine, fc2, wait
OVERLAPPED = ["post", "post", "fc1", "wait", "wait", "post", "fc2", "wait"]


@pytest.fixture(scope="module")
def etp_ranks():
    from tests.gloo import run_ranks
    from tests.megatron.etp_ranks import run_rank

    return run_ranks(WORLD, run_rank, timeout_s=300)


def _layout(results: dict, tp: int, etp: int) -> dict:
    return results["layouts"][f"tp{tp}-etp{etp}"]


def test_the_layouts_are_ep_by_etp(etp_ranks):
    """etp 2: EP groups (0, 2), (1, 3) and expert-TP pairs (0, 1), (2, 3): every expert-TP rank of an
    EP rank exchanges over its own EP group."""
    for rank, results in enumerate(etp_ranks):
        for tp, etp in LAYOUTS:
            groups = _layout(results, tp, etp)["groups"]
            if etp == 2:
                assert groups == {"ep": [rank % 2, rank % 2 + 2], "etp": [rank // 2 * 2, rank // 2 * 2 + 1]}
            else:
                assert groups == {"ep": [rank // EP * EP, rank // EP * EP + 1], "etp": [rank]}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_piper_dispatcher_matches_stock(etp_ranks, case):
    for rank, results in enumerate(etp_ranks):
        got = _layout(results, case.tp, case.etp)[case.id]
        assert got["dispatcher"] == "PiperTokenDispatcher", f"rank {rank}: the layer was built with {got['dispatcher']}"
        assert not got["missing_grads"], f"rank {rank}: parameters without gradient: {got['missing_grads']}"
        for what in ("output", "input_grad", "param_grads"):
            assert got[what] <= TOL, f"rank {rank}: {what} differs from Megatron's dispatcher by {got[what]:.3g}"
        assert got["expert_calls"] == case.chunks, f"rank {rank}: experts ran {got['expert_calls']} times"
        stages = 2 if case.algorithm == "hierarchical" else 1  # intra-node, then inter-node
        assert got["stages"] == [stages] * case.chunks, f"rank {rank}: dispatch stages {got['stages']}"


@pytest.mark.parametrize("case", [c for c in CASES if c.shared == "shared-overlap"],
                         ids=[c.id for c in CASES if c.shared == "shared-overlap"])
def test_overlapped_shared_expert_runs_beside_the_exchanges(etp_ranks, case):
    """Unpipelined: fc1 between posting and waiting the dispatch exchanges, fc2 between posting and
    waiting the combine. Pipelined: the chunks' exchanges are posted inside ``moe_alltoall``; the
    shared expert runs once, fc1 before and fc2 after (piper_megatron.dispatcher module doc)."""
    for rank, results in enumerate(etp_ranks):
        schedule = _layout(results, case.tp, case.etp)[case.id]["schedule"]
        if case.chunks == 1:
            assert schedule[:len(OVERLAPPED)] == OVERLAPPED, f"rank {rank}: {schedule}"
        else:
            assert schedule == ["fc1", "fc2"], f"rank {rank}: {schedule}"


def test_tuned_chunk_count_is_decided_alike_by_the_expert_tp_pair(etp_ranks):
    """``--piper-chunks tune`` at etp 2: the two EP groups time different exchanges, yet all four
    ranks must hold the same times (MAX over the tp x ep group) and choose the same count; the step
    after the choice equals stock."""
    tuned = [_layout(results, *TUNED)["tune"] for results in etp_ranks]
    assert all(t["chosen"] is not None for t in tuned)
    assert len({tuple(sorted(t["medians_s"].items())) for t in tuned}) == 1, [t["medians_s"] for t in tuned]
    assert len({t["chosen"] for t in tuned}) == 1
    for rank, got in enumerate(tuned):
        for what in ("output", "input_grad", "param_grads"):
            assert got[what] <= TOL, f"rank {rank}: {what} differs from Megatron's dispatcher by {got[what]:.3g}"


# ---- what --piper pins, now that the dispatcher runs etp > 1 and the shared-expert overlap --------

def _pins(argv: list[str]):
    from piper_megatron.args import parse_piper_options
    from piper_megatron.pins import pins_from

    return pins_from(argv, parse_piper_options(["--piper"]))


def test_pinned_etp_is_searched_as_etp_equal_to_tp():
    from piper_core.scheduler.space import SearchSpace
    from piper_megatron.pins import restrict

    space = SearchSpace(tp=(1, 2, 4), pp=(1,), ep=(1, 2, 4))
    assert restrict(space, _pins([])).etp_equals_tp == (False, True)  # the search tries etp 1 and etp = tp
    pinned = restrict(space, _pins(["--expert-tensor-parallel-size", "2", "--sequence-parallel"]))
    assert (pinned.tp, pinned.etp_equals_tp) == ((2,), (True,))
    assert restrict(space, _pins(["--expert-tensor-parallel-size", "1"])).etp_equals_tp == (False,)


def test_etp_the_search_cannot_set_is_refused():
    from piper_core.errors import SpecError

    with pytest.raises(SpecError, match=r"parallel size 1 or equal to --tensor-model-parallel-size \(4\)"):
        _pins(["--expert-tensor-parallel-size", "2", "--tensor-model-parallel-size", "4"])
    assert _pins(["--expert-tensor-parallel-size", "4", "--tensor-model-parallel-size", "4"]).values[
        "expert_tensor_parallel_size"] == 4


def test_shared_expert_overlap_is_pinned_not_refused():
    assert _pins(["--moe-shared-expert-overlap"]).values == {"moe_shared_expert_overlap": True}
