"""Flat, hierarchical and aggregated all-to-alls equal ``all_to_all_single``, bit for bit, forward
and backward; a missing peer raises an error that names the exchange and the ranks.

Reference: ``torch.distributed.nn.functional.all_to_all_single`` (differentiable) on the default
group. Every world size (1, 2, 4, 8 gloo processes) runs in one spawn that loops over its
topologies (including one whose nodes hold interleaved ranks), the three algorithms and the count
cases listed in :func:`count_cases`; a case that differs is reported with its name.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import (
    Algorithm,
    CollectiveError,
    NodeTopology,
    all_to_all,
    all_to_all_flat,
    create_comm,
    layout_for,
    moe_alltoall,
    plan_dispatch,
    plan_exchange,
    start_exchange,
)
from piper_core.runtime.alltoall import counts_matrix
from tests.gloo import run_ranks

# (dtype, trailing shape) of the exchanged rows, rotated over the cases.
KINDS = ((torch.float32, (3,)), (torch.bfloat16, (2, 2)), (torch.float64, ()))


def topologies(world: int) -> list[NodeTopology]:
    """Node layouts to try: at 8 ranks 2 x 4 consecutive and 2 x 4 interleaved; below, every
    consecutive split (one node, one rank per node, two nodes)."""
    if world == 8:
        return [NodeTopology.uniform(world_size=8, ranks_per_node=4),
                NodeTopology(nodes=((0, 2, 4, 6), (1, 3, 5, 7)))]
    return [NodeTopology.uniform(world_size=world, ranks_per_node=q) for q in sorted({1, world, max(1, world // 2)})]


def count_cases(world: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Named ``[W, W]`` row-count matrices (``counts[s][d]`` rows from s to d)."""
    g = torch.Generator().manual_seed(seed)
    uneven = torch.randint(0, 6, (world, world), generator=g) * (torch.rand(world, world, generator=g) > 0.3)
    silent = uneven.clone()
    silent[world - 1] = 0
    starved = uneven.clone()
    starved[:, 0] = 0
    skew = torch.zeros(world, world, dtype=torch.long)
    skew[:, world - 1] = torch.randint(20, 40, (world,), generator=g)
    single = torch.zeros(world, world, dtype=torch.long)
    single[0, world - 1] = 1
    return [("random uneven with zeros", uneven.long()), (f"rank {world - 1} sends nothing", silent.long()),
            ("rank 0 receives nothing", starved.long()), (f"every row to rank {world - 1}", skew),
            ("one row in all", single), ("no rows at all", torch.zeros(world, world, dtype=torch.long))]


def _rows(rank: int, counts: torch.Tensor, kind: int, seed: int) -> torch.Tensor:
    dtype, shape = KINDS[kind % len(KINDS)]
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(int(counts[rank].sum()), *shape, generator=g).to(dtype).requires_grad_(True)


class _Reference(torch.autograd.Function):
    """``all_to_all_single`` on the default group; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: torch.Tensor, rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.counts, ctx.rank = counts, rank
        return _a2a(x, counts, rank)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _a2a(grad.contiguous(), ctx.counts.t(), ctx.rank), None, None


def _a2a(x: torch.Tensor, counts: torch.Tensor, rank: int) -> torch.Tensor:
    out = x.new_empty((int(counts[:, rank].sum()), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), counts[:, rank].tolist(), counts[rank].tolist())
    return out


def reference(x: torch.Tensor, counts: torch.Tensor, rank: int) -> torch.Tensor:
    """Plain ``all_to_all_single`` (``counts[s][d]`` rows from s to d), differentiable."""
    return _Reference.apply(x, counts, rank)


def _exchange_cases(rank: int, world: int, seed: int) -> tuple[int, list[str]]:
    """Every topology x algorithm x count case on this world; (checks run, failures)."""
    checks, failures = 0, []
    for topo in topologies(world):
        comm = create_comm(topo)
        for i, (name, counts) in enumerate(count_cases(world, seed)):
            x = _rows(rank, counts, i, seed + i)
            ref = reference(x, counts, rank)
            up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + i)).to(ref.dtype)
            (g_ref,) = torch.autograd.grad(ref, x, up)
            runs = {f"{alg.value}": all_to_all(x, counts, comm=comm, algorithm=alg, label=name) for alg in Algorithm}
            runs["flat by splits"] = all_to_all_flat(x, input_splits=counts[rank].tolist(),
                                                     output_splits=counts[:, rank].tolist(), comm=comm)
            for label, mine in runs.items():
                checks += 1
                (g_mine,) = torch.autograd.grad(mine, x, up)
                if not torch.equal(mine, ref):
                    failures.append(f"{topo.nodes} {name} {label}: forward differs")
                elif not torch.equal(g_mine, g_ref):
                    failures.append(f"{topo.nodes} {name} {label}: backward differs")
            failures += _check_async(rank, comm, x.detach(), counts, ref.detach(), f"{topo.nodes} {name}")
            checks += 1
    if world == 4:
        checks, failures = checks + 1, failures + _check_parents(rank)
    if world == 2:
        checks, failures = checks + 1, failures + _check_posted_at_start(rank)
    return checks, failures


def _check_parents(rank: int) -> list[str]:
    """Two parent groups at once (strided, like expert-parallel groups inside a 2 x 2 job): each
    member gets, from every member ``s`` of its own group, the rows ``s`` labelled for it."""
    comm = create_comm(NodeTopology.uniform(world_size=4, ranks_per_node=2), parents=((0, 2), (1, 3)))
    peers = comm.layout.ranks
    x = torch.tensor([[10.0 * rank + d] for d in peers for _ in range(d + 1)])  # d + 1 rows for d
    counts = [[d + 1 for d in peers] for _ in peers]
    out = all_to_all(x, counts, comm=comm, algorithm=Algorithm.AGGREGATED)
    want = torch.tensor([[10.0 * s + rank] for s in peers for _ in range(rank + 1)])
    ok = comm.layout.num_nodes == 2 and comm.layout.per_node == 1 and torch.equal(out, want)
    return [] if ok else [f"parents ((0, 2), (1, 3)): rank {rank} got {out.flatten().tolist()}"]


def _check_async(rank: int, comm, x: torch.Tensor, counts: torch.Tensor, want: torch.Tensor,
                 where: str) -> list[str]:
    """Two hierarchical exchanges in flight at once, advanced stage by stage, then waited."""
    plan = plan_exchange(counts, comm=comm, algorithm=Algorithm.HIERARCHICAL, label="async")
    first = start_exchange(x, plan)
    second = start_exchange(x * 2, plan)
    first.advance()
    second.advance()
    ok = torch.equal(first.wait(), want) and torch.equal(second.wait(), want * 2)
    return [] if ok else [f"{where} async hierarchical: differs"]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_exchanges_equal_all_to_all_single(world: int) -> None:
    results = run_ranks(world, _exchange_cases, 7, timeout_s=180)
    for rank, (checks, failures) in enumerate(results):
        assert checks >= len(topologies(world)) * len(count_cases(world, 7)) * 5, f"rank {rank} ran {checks} checks"
        assert not failures, f"rank {rank}: {failures}"


# --- an exchange moves data as soon as it starts (checked in the world-2 spawn above) ---------

def _check_posted_at_start(rank: int) -> list[str]:
    """Two nodes of one rank. Rank 0 starts each exchange and then does nothing with it until rank 1
    has received everything (rank 1 waits first, then tells rank 0 by a message on the default
    group): that can only finish if ``start_exchange`` itself posted the exchange's first stage that
    communicates (for hierarchical and aggregated, after their group-of-one stages). Otherwise rank
    1's wait runs into the comm's 5 s timeout and the test fails with a CollectiveError."""
    comm = create_comm(NodeTopology.uniform(world_size=2, ranks_per_node=1), timeout=timedelta(seconds=5))
    counts = torch.tensor([[3, 5], [4, 2]])
    x = torch.tensor([[100.0 * rank + d] for d in range(2) for _ in range(int(counts[rank, d]))])
    want = torch.tensor([[100.0 * s + rank] for s in range(2) for _ in range(int(counts[s, rank]))])
    out = []
    for alg in Algorithm:
        pending = start_exchange(x, plan_exchange(counts, comm=comm, algorithm=alg))
        flag = torch.zeros(1)
        if rank == 1:
            got = pending.wait()
            dist.send(flag + 1, 0)
        else:
            dist.recv(flag, 1)
            got = pending.wait()
        if not torch.equal(got, want):
            out.append(f"posted at start, {alg.value}: rank {rank} got {got.flatten().tolist()}")
    return out


# --- a missing peer -----------------------------------------------------------------------------

TIMEOUT_S = 1.0
SKIPPER = 3


def _missing_peer(rank: int, world: int) -> list[tuple[str, float, str]]:
    """Rank SKIPPER skips each call; the others report (what they ran, seconds, error message).

    One comm per call: a timed-out group is broken for good (gloo has lost track of its tags).
    "flat, group timeout" leaves the deadline to gloo's process-group timeout alone
    (``host_timeout=False``); the others also bound each ``work.wait`` (both work on gloo)."""
    topo = NodeTopology.uniform(world_size=world, ranks_per_node=2)
    counts = torch.full((world, world), 2)  # 2 rows per pair: both chunks of the pipelined run carry rows
    x = torch.ones(2 * world, 2)
    runs = {
        "flat": lambda comm: all_to_all(x, counts, comm=comm, algorithm=Algorithm.FLAT, label="probe"),
        "flat, group timeout": lambda comm: all_to_all(x, counts, comm=comm, algorithm=Algorithm.FLAT,
                                                       label="probe"),
        "hierarchical": lambda comm: all_to_all(x, counts, comm=comm, algorithm=Algorithm.HIERARCHICAL,
                                                label="probe"),
        "pipelined": lambda comm: moe_alltoall(
            x, plan_dispatch(counts, comm=comm, algorithm=Algorithm.AGGREGATED, chunks=2), lambda t, n, p: t),
    }
    comms = {name: create_comm(topo, timeout=timedelta(seconds=TIMEOUT_S), host_timeout="group" not in name)
             for name in runs}
    out = []
    for name, run in runs.items():
        if rank == SKIPPER:
            break  # skips every call; stays alive in the barrier below until the others are done
        start = time.monotonic()
        try:
            run(comms[name])
            out.append((name, time.monotonic() - start, "no error"))
        except CollectiveError as e:
            out.append((name, time.monotonic() - start, str(e)))
    dist.barrier()  # on the default group, which the runtime's failed groups do not touch
    return out


def test_missing_peer_raises_error_naming_op_and_ranks() -> None:
    results = run_ranks(4, _missing_peer, timeout_s=120)
    stages = {"flat": 1, "flat, group timeout": 1, "hierarchical": 2, "pipelined": 3}
    expect = {"flat": "flat probe (forward), stage 1/1", "flat, group timeout": "flat probe (forward), stage 1/1",
              "hierarchical": "hierarchical probe (forward)", "pipelined": "aggregated dispatch chunk 1/2 (forward)"}
    for rank, runs in enumerate(results):
        if rank == SKIPPER:
            assert runs == []
            continue
        assert [r[0] for r in runs] == list(stages)
        for name, seconds, message in runs:
            assert expect[name] in message, (rank, message)
            limit = "within the group's timeout (RuntimeError: " if "group" in name else "within 1 s"
            failed = [f"rank {rank} did not complete it {limit}"]
            if stages[name] > 1:  # a peer that timed out in an earlier stage (waiting for SKIPPER) gives up on
                failed.append(f"rank {rank} lost a peer in it")  # the group: its sockets close, seen at once
            assert "on global ranks [" in message and any(f in message for f in failed), (rank, name, message)
            if name.startswith("flat"):  # multi-stage exchanges may time out on a peer that waits for SKIPPER
                assert f"global ranks {list(range(4))}" in message
                assert str(SKIPPER) in message.split("A peer is missing")[1]
            assert seconds < stages[name] * TIMEOUT_S + 1.5, (rank, name, seconds)


# --- input errors (no processes) ---------------------------------------------------------------

def test_topology_errors_name_the_rule() -> None:
    with pytest.raises(SpecError, match=r"rank 1 is listed on two nodes"):
        NodeTopology(nodes=((0, 1), (1, 2)))
    with pytest.raises(SpecError, match=r"ranks_per_node=3: must be >= 1 and divide world_size \(8\); "
                                        r"choose ranks_per_node in \[1, 2, 4, 8\]"):
        NodeTopology.uniform(world_size=8, ranks_per_node=3)
    with pytest.raises(SpecError, match=r"members per node differ"):
        layout_for(NodeTopology(nodes=((0, 1, 2), (3,))), range(4))
    layout = layout_for(NodeTopology(nodes=((5, 1), (0, 7))), [0, 1, 5, 7])
    assert layout.ranks == (0, 1, 5, 7) and layout.node == (0, 1, 1, 0) and layout.local == (0, 0, 1, 1)


def test_counts_errors_name_the_rule() -> None:
    with pytest.raises(SpecError, match=r"counts=\(2, 3\): must be an integer \[2, 2\] matrix"):
        counts_matrix([[1, 2, 3], [4, 5, 6]], 2)
    with pytest.raises(SpecError, match=r"row counts must be >= 0"):
        counts_matrix([[1, -2], [0, 0]], 2)


