"""Piper's token dispatcher gives what Megatron-Core's alltoall dispatcher gives.

Reference test, on 2 and 4 gloo processes (tests/megatron/piper_ranks.py, one spawn per world size):
a real Megatron-Core ``MoELayer`` (``SequentialMLP`` experts, fp32, 8 experts, hidden 16) is built
with Megatron's ``MoEAlltoAllTokenDispatcher`` and again, with the same weights, with
:class:`piper_megatron.dispatcher.PiperTokenDispatcher` installed the way ``--piper`` installs it
(the module-level name in ``moe_layer`` rebound before the layer is built). Both run one forward and
backward on the same input; the output, the input gradient and every parameter gradient (router
and experts) must agree to 1e-6, for ep 2 (2 and 4 processes) and ep 4, top-1 and top-2, dropless,
capacity factor 1.0 (token dropping) and capacity factor 1.0 with padding, every algorithm (flat,
hierarchical, aggregated; every expert-parallel group spans two "nodes"), and 1, 2 and 4 chunks; and,
on 4 processes, tp 2 with sequence parallelism and ep 2 (a smaller set); and with the experts' weight
gradients deferred (``--piper-defer-wgrad``: the expert linears' forward in torch operations, the
backward split) on a smaller set of every layout, to the same 1e-6.
The experts must run once per chunk (the pipelined path really is chunked) and the layer must hold
Piper's dispatcher. The traced case checks the ``--piper-trace`` records against the routing; the
hook case runs the path ``--piper`` takes at run time (``initialize_model_parallel`` hooked).
"""

from __future__ import annotations

import pytest

from piper_core.errors import SpecError
from tests.megatron.piper_ranks import dispatch_cases

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

TOL = 1e-6
CASES = [(world, case) for world in (2, 4) for case in dispatch_cases(world)]


@pytest.mark.parametrize(("world", "case"), CASES, ids=[f"w{w}-{c.id}" for w, c in CASES])
def test_piper_dispatcher_matches_stock(piper_ranks, world, case):
    for rank, results in enumerate(piper_ranks(world)):
        got = results["dispatcher"][case.id]
        assert got["dispatcher"] == "PiperTokenDispatcher", f"rank {rank}: the layer was built with {got['dispatcher']}"
        assert not got["missing_grads"], f"rank {rank}: parameters without gradient: {got['missing_grads']}"
        for what in ("output", "input_grad", "param_grads"):
            assert got[what] <= TOL, f"rank {rank}: {what} differs from Megatron's dispatcher by {got[what]:.3g}"
        assert got["expert_calls"] == case.chunks, f"rank {rank}: experts ran {got['expert_calls']} times"


@pytest.mark.parametrize("world", (2, 4))
def test_trace_records_each_forward(piper_ranks, world):
    for rank, results in enumerate(piper_ranks(world)):
        trace = results["trace"]
        records = trace["records"]
        assert [(r["rank"], r["layer"], r["call"]) for r in records] == [(rank, 1, 0), (rank, 1, 1)]
        for record, forward_s in zip(records, trace["forward_s"]):
            assert record["tokens_per_expert"] == trace["expected_tokens_per_expert"]
            assert record["first_expert"] == trace["first_expert"]
            assert (record["algorithm"], record["chunks"]) == ("flat", 2)
            assert record["tokens_received"] == sum(trace["expected_tokens_per_expert"])
            times = [record[f"{phase}_ms"] for phase in ("dispatch", "expert", "combine")]
            assert all(t > 0 for t in times), record
            assert sum(times) <= 1000 * forward_s, f"phases {times} ms exceed the forward ({1000 * forward_s:.2f} ms)"


@pytest.mark.parametrize("world", (2, 4))
def test_model_parallel_hook_installs_and_restores(piper_ranks, world):
    for rank, results in enumerate(piper_ranks(world)):
        # the request is hierarchical/2: the chunked exchanges run hierarchical, each rank its own node
        assert results["hook"] == {"dispatcher": "PiperTokenDispatcher", "algorithm": "hierarchical", "chunks": 2,
                                   "expert_calls": 2, "trace_lines": 1, "restored": True}, f"rank {rank}"


@pytest.mark.parametrize("world", (2, 4))
def test_hierarchical_in_chunks_trains_like_stock(piper_ranks, world):
    """``--piper-a2a hierarchical --piper-chunks 2`` (tests/megatron/piper_ranks.py ``_settings``):
    tiny-moe trains 7 steps with losses equal to Megatron's dispatcher, and each of the two chunks
    ran a two-stage (intra-node, then inter-node) exchange: every expert-parallel group spans two
    "nodes" (``TOPOLOGY``). Flat in 2 chunks runs one stage per chunk."""
    for rank, results in enumerate(piper_ranks(world)):
        run = results["training"]
        assert run["exchange"]["hierarchical-chunks2"] == {"algorithm": "hierarchical", "chunks": 2,
                                                           "stages": [2, 2]}, f"rank {rank}"
        assert run["exchange"]["flat-chunks2"] == {"algorithm": "flat", "chunks": 2, "stages": [1, 1]}, f"rank {rank}"
        assert run["exchange"]["dwg"] == run["exchange"]["hierarchical-chunks2"], f"rank {rank}"
        if run["last_stage"]:
            # dwg: the same exchange with the experts' weight gradients deferred (--piper-defer-wgrad), through
            # Megatron's DDP and optimizer: Adam steps on those gradients keep the losses on stock's
            for variant in ("hierarchical-chunks2", "dwg"):
                stock, piper = run["losses"]["stock"], run["losses"][variant]
                assert len(piper) == len(stock) == 7
                for step, (want, got) in enumerate(zip(stock, piper)):
                    assert got == pytest.approx(want, abs=1e-5, rel=0), \
                        f"rank {rank} {variant} step {step}: {got} vs stock {want}"


def test_settings_follow_the_plan_names():
    from piper_core.runtime import Algorithm
    from piper_megatron.dispatcher import DispatchSettings

    hierarchical = DispatchSettings.from_plan("hierarchical", 4)  # pipelined hierarchical exchanges, not flat ones
    assert hierarchical == DispatchSettings(algorithm=Algorithm.HIERARCHICAL, chunks=4) and hierarchical.pipelined
    assert hierarchical.describe() == ("Piper pipelined all-to-all: 4 chunks of hierarchical exchanges, chunk k+1's "
                                       "exchange overlapping chunk k's experts")
    assert DispatchSettings.from_plan("flat", 2) == DispatchSettings(algorithm=Algorithm.FLAT, chunks=2)
    assert DispatchSettings.from_plan("hierarchical", 1) == DispatchSettings(algorithm=Algorithm.HIERARCHICAL)
    assert not DispatchSettings.from_plan("flat", 1).pipelined
    with pytest.raises(SpecError, match="chunks=0: must be an int >= 1"):
        DispatchSettings(chunks=0)
    for a2a in ("flat", "hierarchical"):  # tuning measures the chunk count of either algorithm
        tuned = DispatchSettings.from_plan(a2a, 1, tune=True)
        assert (tuned.algorithm.value, tuned.tune, tuned.pipelined) == (a2a, True, True)
        assert f"chunks of {a2a} exchanges" in tuned.describe() and "measured per MoE layer at run time" in \
            tuned.describe()
    with pytest.raises(SpecError, match="a2a='aggregated': a plan's exchange algorithm is one of flat, hierarchical"):
        DispatchSettings.from_plan("aggregated", 1)


def test_legacy_pipelined_reads_as_flat_chunks_with_a_note():
    from piper_core.runtime import Algorithm
    from piper_megatron.dispatcher import DispatchSettings

    with pytest.warns(FutureWarning, match="DispatchSettings.from_plan: a2a 'pipelined' is read as a2a 'flat' "
                                           "with 4 chunks; the exchange algorithm"):
        legacy = DispatchSettings.from_plan("pipelined", 4, tune=True)
    assert legacy == DispatchSettings(algorithm=Algorithm.FLAT, chunks=4, tune=True)
