"""Rank-side halves of the all-to-all benchmarks (run inside the emulated cluster's ranks).

Each function is a launch target ``fn(info, *args)`` (see :mod:`piper_core.emulate`) and returns
JSON. Times are wall seconds of one operation as the slowest rank saw it: every iteration starts
after a barrier, each rank times itself, and one all-reduce (MAX) at the end takes the slowest rank
per iteration. Variants run side by side: every round runs each variant once, in an order rotated
from round to round, so drift on the machine hits all of them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from piper_core.emulate import RankInfo
from piper_core.runtime import (
    A2AComm,
    Algorithm,
    NodeTopology,
    combine,
    create_comm,
    dispatch,
    moe_alltoall,
    plan_dispatch,
    plan_exchange,
    start_exchange,
)

ROW_FLOATS = 64
"""Exchanged rows are ``[ROW_FLOATS]`` fp32 (256 bytes) in the all-to-all sweep."""


def _comm(info: RankInfo) -> A2AComm:
    topo = NodeTopology.uniform(world_size=info.world_size, ranks_per_node=info.ranks_per_node)
    return create_comm(topo, timeout=timedelta(seconds=info.collective_timeout_s))


def _slowest(times: list[float]) -> list[float]:
    """Per-iteration maximum over the ranks (one all-reduce)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _side_by_side(variants: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
                  ) -> dict[str, list[float]]:
    """``rounds`` timed runs of every variant, interleaved with rotation; slowest rank per run."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    order, times = [], []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            variants[name]()
            times.append(time.perf_counter() - start)
            order.append(name)
    slow = _slowest(times)
    out: dict[str, list[float]] = {n: [] for n in names}
    for name, t in zip(order, slow):
        out[name].append(t)
    return out


def _ping_pong(peer: int, me: int, nbytes: int, reps: int) -> float:
    """Median seconds of rank 0 <-> ``peer`` round trips of ``nbytes`` (other ranks idle)."""
    buf = torch.zeros(max(1, nbytes // 4))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        if me == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        elif me == peer:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def links(info: RankInfo, big_bytes: int) -> dict[str, float]:
    """Link parameters for the resource model: one-way latency (half a 4-byte round trip) and
    bandwidth (``big_bytes`` one way, 4 bytes back) from rank 0 to a rank on its node and to one
    on the next node. Meaningful on rank 0."""
    out: dict[str, float] = {}
    peers = {"intra": 1 if info.ranks_per_node > 1 else None, "inter": info.ranks_per_node if info.nodes > 1 else None}
    for level, peer in peers.items():
        if peer is None:
            continue
        for _ in range(2):  # warm the connection (TCP slow start, lazy gloo pairs)
            _ping_pong(peer, info.rank, 4, 3)
            _ping_pong(peer, info.rank, big_bytes, 1)
        dist.barrier()
        rtt = _ping_pong(peer, info.rank, 4, 21)
        out[f"{level}_latency_us"] = rtt / 2 * 1e6
        big = _send_time(peer, info.rank, big_bytes)
        out[f"{level}_gb_per_s"] = big_bytes / max(big - rtt / 2, 1e-9) / 1e9
        dist.barrier()
    return out


def _send_time(peer: int, me: int, nbytes: int) -> float:
    payload, ack = torch.zeros(nbytes // 4), torch.zeros(1)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        if me == 0:
            dist.send(payload, peer)
            dist.recv(ack, peer)
        elif me == peer:
            dist.recv(payload, 0)
            dist.send(ack, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def a2a_sweep(info: RankInfo, sizes: list[int], algorithms: list[str], rounds: int) -> dict[str, object]:
    """Time each algorithm's all-to-all at each per-rank send size (bytes, spread evenly over all
    ranks, own share included), side by side per size. Returns ``{size: {algorithm: [s, ...]}}``."""
    comm = _comm(info)
    w = info.world_size
    out: dict[str, object] = {}
    for size in sizes:
        rows = max(1, size // (ROW_FLOATS * 4) // w)
        counts = torch.full((w, w), rows, dtype=torch.long)
        x = torch.randn(rows * w, ROW_FLOATS)
        plans = {a: plan_exchange(counts, comm=comm, algorithm=Algorithm(a)) for a in algorithms}
        variants = {a: (lambda p=p: start_exchange(x, p).wait()) for a, p in plans.items()}
        out[str(rows * w * ROW_FLOATS * 4)] = _side_by_side(variants, rounds)
    return {"sweep": out, "links": links(info, 4 << 20)}


class Experts:
    """``local`` two-layer ReLU FFNs ``hidden -> ffn -> hidden`` (fp32), the expert compute."""

    def __init__(self, *, local: int, hidden: int, ffn: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.w1 = [(torch.randn(hidden, ffn, generator=g) / hidden ** 0.5).requires_grad_() for _ in range(local)]
        self.w2 = [(torch.randn(ffn, hidden, generator=g) / ffn ** 0.5).requires_grad_() for _ in range(local)]

    def __call__(self, tokens: torch.Tensor, tokens_per_expert: tuple[int, ...],
                 probs: torch.Tensor | None) -> torch.Tensor:
        parts = torch.split(tokens, list(tokens_per_expert))
        return torch.cat([torch.relu(p @ w1) @ w2 for p, w1, w2 in zip(parts, self.w1, self.w2)])

    def zero_grad(self) -> None:
        for w in (*self.w1, *self.w2):
            w.grad = None


def _identity(tokens: torch.Tensor, tokens_per_expert: tuple[int, ...], probs: torch.Tensor | None) -> torch.Tensor:
    return tokens * 1.0


def moe_sweep(info: RankInfo, tokens: int, hidden: int, experts_per_rank: int, ratios: list[float],
              chunk_counts: list[int], algorithm: str, rounds: int) -> dict[str, object]:
    """MoE layer fwd+bwd, flat unchunked vs pipelined at ``chunk_counts``, at each target
    communication/compute ratio. ``tokens`` per rank are routed top-1 evenly over all experts.

    Communication ``c`` is the flat dispatch + combine, forward and backward, with identity experts;
    compute is the experts' forward + backward alone on the tokens a rank receives. The FFN width
    for a target ratio ``r`` is set from a probe so that compute ~= ``c / r`` (rank 0 decides, all
    follow); the ratio actually obtained is measured in the same run as the comparison.
    """
    comm = _comm(info)
    w, e = info.world_size, info.world_size * experts_per_rank
    per = tokens // e
    counts = torch.full((w, e), per, dtype=torch.long)
    x = torch.randn(per * e, hidden, generator=torch.Generator().manual_seed(info.rank))
    grad = torch.randn(per * e, hidden, generator=torch.Generator().manual_seed(100 + info.rank))
    alg = Algorithm(algorithm)
    received = per * experts_per_rank * w

    def flat_step(experts: Callable[..., torch.Tensor], zero: Callable[[], None]) -> None:
        zero()
        xi = x.detach().requires_grad_()
        meta = plan_dispatch(counts, comm=comm, algorithm=Algorithm.FLAT, chunks=1)
        y, _ = dispatch(xi, meta)
        combine(experts(y, meta.tokens_per_expert, None), meta).backward(grad)

    def piped_step(experts: Callable[..., torch.Tensor], zero: Callable[[], None], chunks: int) -> None:
        zero()
        xi = x.detach().requires_grad_()
        meta = plan_dispatch(counts, comm=comm, algorithm=alg, chunks=chunks)
        moe_alltoall(xi, meta, experts).backward(grad)

    def compute_only(ex: Experts) -> None:
        ex.zero_grad()
        t = torch.randn(received, hidden).requires_grad_()
        ex(t, tuple([received // experts_per_rank] * experts_per_rank), None).backward(torch.ones(received, hidden))

    comm_s = statistics.median(_side_by_side({"comm": lambda: flat_step(_identity, lambda: None)}, 5)["comm"])
    probe_ffn = 1024
    probe = Experts(local=experts_per_rank, hidden=hidden, ffn=probe_ffn, seed=0)
    probe_s = statistics.median(_side_by_side({"c": lambda: compute_only(probe)}, 3)["c"])
    cases = []
    for ratio in ratios:
        ffn = torch.tensor([max(64, round(probe_ffn * comm_s / ratio / probe_s / 64) * 64)])
        dist.broadcast(ffn, 0)
        ex = Experts(local=experts_per_rank, hidden=hidden, ffn=int(ffn), seed=1)
        variants: dict[str, Callable[[], object]] = {
            "comm": lambda: flat_step(_identity, lambda: None),
            "compute": lambda ex=ex: compute_only(ex),
            "flat": lambda ex=ex: flat_step(ex, ex.zero_grad)}
        for c in chunk_counts:
            variants[f"chunks={c}"] = lambda ex=ex, c=c: piped_step(ex, ex.zero_grad, c)
        cases.append({"target_ratio": ratio, "ffn": int(ffn), "times": _side_by_side(variants, rounds)})
    return {"cases": cases, "tokens": tokens, "hidden": hidden, "experts_per_rank": experts_per_rank,
            "received_tokens": received, "bytes_per_a2a": per * e * hidden * 4}
