"""Property-based tests (hypothesis) over topologies, split matrices and chunk counts.

1. Routing, in one process: every rank's stage plans (:func:`plan_route`) are simulated together
   (each stage delivers the blocks it says it sends), for any node layout (ranks shuffled over the
   nodes), any count matrix and every algorithm; the result must equal one ``all_to_all_single``
   bit for bit, and the aggregated algorithm must send at most one message per ordered node pair.
2. Chunking, in one process: :func:`plan_dispatch`'s chunks partition the tokens, keep each
   (source, expert) run in order, and group the expert side by local expert.
3. The real thing on 4 gloo processes (2 nodes x 2): random per-expert counts (zeros, skew, silent
   ranks), algorithm and chunk count -> ``moe_alltoall`` equals the reference MoE path. The processes
   are started once and serve every example (start-up dominates otherwise).
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piper_core.runtime import A2AComm, Algorithm, NodeTopology, create_comm, layout_for, moe_alltoall, plan_dispatch
from piper_core.runtime.routes import plan_route, stage_specs
from piper_core.runtime.topology import RankLayout
from tests.gloo import run_ranks
from tests.runtime.test_pipelined import LinearExperts, ScaleByProbs, _fwd_bwd, _inputs, _same, reference_moe

FAST = settings(max_examples=80, deadline=None, database=None)


@st.composite
def layouts(draw: st.DrawFn) -> RankLayout:
    nodes, per = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ranks = draw(st.permutations(range(nodes * per)))
    return layout_for(NodeTopology(nodes=tuple(tuple(ranks[i * per:(i + 1) * per]) for i in range(nodes))),
                      range(nodes * per))


@st.composite
def count_matrices(draw: st.DrawFn, rows: int, cols: int) -> torch.Tensor:
    """Counts with the shapes that break all-to-alls: zeros, a silent rank, a starved one, skew."""
    c = torch.tensor(draw(st.lists(st.lists(st.integers(0, 5), min_size=cols, max_size=cols),
                                   min_size=rows, max_size=rows)), dtype=torch.long)
    shape = draw(st.sampled_from(["as drawn", "silent", "starved", "skew"]))
    if shape == "silent":
        c[draw(st.integers(0, rows - 1))] = 0
    elif shape == "starved":
        c[:, draw(st.integers(0, cols - 1))] = 0
    elif shape == "skew":
        keep = draw(st.integers(0, cols - 1))
        c[:, [j for j in range(cols) if j != keep]] = 0
        c[:, keep] *= 7
    return c


def simulate(layout: RankLayout, algorithm: Algorithm, counts: torch.Tensor) -> tuple[list[torch.Tensor], list]:
    """Run every rank's route on random rows in one process; (outputs, routes)."""
    w = layout.size
    specs = stage_specs(layout, algorithm)
    routes = [plan_route(specs, counts.numpy(), me) for me in range(w)]
    bufs = [torch.randn(int(counts[me].sum()), 2) for me in range(w)]
    inputs = list(bufs)
    for k in range(len(specs)):
        sent = {}
        for me in range(w):
            stage = routes[me].stages[k]
            b = bufs[me] if stage.send_index is None else bufs[me][stage.send_index]
            sent[me] = dict(zip(stage.members, torch.split(b, list(stage.input_splits)), strict=True))
        bufs = []
        for me in range(w):
            stage = routes[me].stages[k]
            parts = [sent[p][me] for p in stage.members]
            assert [p.shape[0] for p in parts] == list(stage.output_splits)
            bufs.append(torch.cat(parts))
    outs = [b if r.final_index is None else b[r.final_index] for b, r in zip(bufs, routes, strict=True)]
    want = [torch.cat([inputs[s][int(counts[s, :d].sum()):int(counts[s, :d + 1].sum())] for s in range(w)])
            for d in range(w)]
    assert all(torch.equal(o, v) for o, v in zip(outs, want, strict=True))
    return outs, routes


@settings(max_examples=200, deadline=None, database=None)  # one process, a few ms per example
@given(data=st.data(), algorithm=st.sampled_from(list(Algorithm)))
def test_routes_deliver_what_all_to_all_single_delivers(data: st.DataObject, algorithm: Algorithm) -> None:
    layout = data.draw(layouts())
    counts = data.draw(count_matrices(layout.size, layout.size))
    _, routes = simulate(layout, algorithm, counts)
    simulate(layout, algorithm, counts.t().contiguous())  # the backward direction
    if algorithm is Algorithm.AGGREGATED:
        pairs = [(layout.node[me], layout.node[peer]) for me in range(layout.size)
                 for peer, n in zip(routes[me].stages[1].members, routes[me].stages[1].input_splits, strict=True)
                 if n and layout.node[peer] != layout.node[me]]
        assert len(pairs) == len(set(pairs))  # one message per ordered node pair


def _fake_comm(layout: RankLayout, me: int) -> A2AComm:
    """An A2AComm without process groups: planning is pure and never touches them."""
    return A2AComm(layout=layout, me=me, group=None, intra=None, inter=None, timeout=None, host_timeout=True,
                   specs=tuple((a, stage_specs(layout, a)) for a in Algorithm))


@FAST
@given(data=st.data(), chunks=st.integers(1, 6), per=st.integers(1, 3))
def test_chunks_partition_tokens_and_group_by_expert(data: st.DataObject, chunks: int, per: int) -> None:
    layout = data.draw(layouts())
    w = layout.size
    counts = data.draw(count_matrices(w, w * per))
    me = data.draw(st.integers(0, w - 1))
    meta = plan_dispatch(counts, comm=_fake_comm(layout, me), algorithm=Algorithm.HIERARCHICAL, chunks=chunks)
    expert_of_row = torch.arange(w * per).repeat_interleave(counts[me])  # x is sorted by global expert
    taken = [torch.arange(meta.rows_in) if c.rows is None else c.rows for c in meta.chunk]
    assert torch.equal(torch.sort(torch.cat(taken)).values, torch.arange(meta.rows_in))
    for rows in taken:  # runs stay in order, chunk rows stay sorted by expert
        assert torch.equal(rows, torch.sort(rows).values)
    sizes = torch.stack([torch.bincount(expert_of_row[r], minlength=w * per) for r in taken])
    assert int((sizes.max(0).values - sizes.min(0).values).max()) <= 1  # even pieces
    per_expert = torch.tensor([c.tokens_per_expert for c in meta.chunk]).sum(0)
    assert tuple(per_expert.tolist()) == meta.tokens_per_expert
    assert meta.tokens_per_expert == tuple(counts[:, me * per:(me + 1) * per].sum(0).tolist())
    for k, c in enumerate(meta.chunk):  # the expert side: (source, expert) runs -> by expert, then source
        runs = _chunk_part(counts, chunks, k)[:, me * per:(me + 1) * per].reshape(-1)
        key = (torch.arange(per).repeat(w) * w + torch.arange(w).repeat_interleave(per)).repeat_interleave(runs)
        arrived = key if c.to_experts is None else key[c.to_experts]
        assert torch.equal(arrived, torch.sort(key).values)
        assert tuple(torch.bincount(key // w, minlength=per).tolist()) == c.tokens_per_expert


def _chunk_part(counts: torch.Tensor, chunks: int, k: int) -> torch.Tensor:
    return (counts * (k + 1)) // chunks - (counts * k) // chunks


# --- on 4 gloo processes, started once ---------------------------------------------------------

WORLD = 4


def _serve(rank: int, world: int, inboxes: list[Any], outbox: Any) -> int:
    """Run cases from this rank's inbox until None; report (rank, failure or None) per case."""
    comm = create_comm(NodeTopology.uniform(world_size=world, ranks_per_node=2))
    served = 0
    while (case := inboxes[rank].get()) is not None:
        try:
            outbox.put((rank, _moe_case(rank, comm, *case)))
        except Exception:  # noqa: BLE001 -- the parent reports it with the example
            outbox.put((rank, traceback.format_exc()))
        served += 1
    return served


def _moe_case(rank: int, comm: A2AComm, counts: torch.Tensor, algorithm: Algorithm, chunks: int,
              linear: bool) -> str | None:
    x, probs = _inputs(rank, counts, chunks)
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(chunks))
    experts = LinearExperts(counts.shape[1] // WORLD, rank) if linear else ScaleByProbs()
    want = _fwd_bwd(lambda a, p: reference_moe(a, p, counts, experts, rank), x, probs, experts, up)
    meta = plan_dispatch(counts, comm=comm, algorithm=algorithm, chunks=chunks)
    got = _fwd_bwd(lambda a, p: moe_alltoall(a, meta, experts, probs=p), x, probs, experts, up)
    return None if _same(got, want, exact=chunks == 1 or not linear) else "differs from the reference"


@pytest.fixture(scope="module")
def pool() -> Iterator[Callable[..., list[Any]]]:
    ctx = mp.get_context("spawn")
    inboxes, outbox = [ctx.Queue() for _ in range(WORLD)], ctx.Queue()
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(_run_pool(inboxes, outbox)), daemon=True)
    thread.start()

    def call(*case: Any) -> list[Any]:
        for box in inboxes:
            box.put(case)
        got = {}
        while len(got) < WORLD:
            try:
                rank, result = outbox.get(timeout=60)
            except queue.Empty:
                raise AssertionError(f"the rank pool stopped answering: {done}") from None
            got[rank] = result
        return [got[r] for r in range(WORLD)]

    yield call
    for box in inboxes:
        box.put(None)
    thread.join(60)


def _run_pool(inboxes: list[Any], outbox: Any) -> Any:
    try:
        return run_ranks(WORLD, _serve, inboxes, outbox, timeout_s=600)
    except Exception as e:  # noqa: BLE001 -- surfaced by the caller's timeout message
        return e


@settings(max_examples=20, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), algorithm=st.sampled_from(list(Algorithm)), chunks=st.integers(1, 5),
       per=st.integers(1, 2), linear=st.booleans())
def test_moe_alltoall_matches_reference_on_gloo(pool, data: st.DataObject, algorithm: Algorithm, chunks: int,
                                                per: int, linear: bool) -> None:
    counts = data.draw(count_matrices(WORLD, WORLD * per))
    results = pool(counts, algorithm, chunks, linear)
    assert results == [None] * WORLD, results
