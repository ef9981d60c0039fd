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
    AutoChunks,
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


def _round_trip(peer: int, me: int, out_bytes: int, back_bytes: int, reps: int) -> float:
    """Median seconds of rank 0 sending ``out_bytes`` to ``peer`` and getting ``back_bytes`` back
    (other ranks idle)."""
    out, back = torch.zeros(max(1, out_bytes // 4)), torch.zeros(max(1, back_bytes // 4))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        if me == 0:
            dist.send(out, peer)
            dist.recv(back, peer)
        elif me == peer:
            dist.recv(out, 0)
            dist.send(back, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ping_pong(peer: int, me: int, nbytes: int, reps: int) -> float:
    """Median seconds of rank 0 <-> ``peer`` round trips of ``nbytes`` each way."""
    return _round_trip(peer, me, nbytes, nbytes, reps)


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
        # least of three batch medians: one batch hit by a neighbour's burst of CPU use is ignored
        rtt = min(_ping_pong(peer, info.rank, 4, 11) for _ in range(3))
        out[f"{level}_latency_us"] = rtt / 2 * 1e6
        big = _send_time(peer, info.rank, big_bytes)
        out[f"{level}_gb_per_s"] = big_bytes / max(big - rtt / 2, 1e-9) / 1e9
        dist.barrier()
    return out


def _send_time(peer: int, me: int, nbytes: int) -> float:
    """``nbytes`` one way and a 4-byte acknowledgement back, median of three."""
    return _round_trip(peer, me, nbytes, 4, 3)


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


class _MoeLayer:
    """One rank's MoE-layer steps: ``tokens`` routed top-1, evenly, to ``world x experts_per_rank``
    experts (the same counts every step, so every variant moves the same bytes)."""

    def __init__(self, info: RankInfo, *, tokens: int, hidden: int, experts_per_rank: int):
        self.comm = _comm(info)
        w, e = info.world_size, info.world_size * experts_per_rank
        per = tokens // e
        self.counts = torch.full((w, e), per, dtype=torch.long)
        self.x = torch.randn(per * e, hidden, generator=torch.Generator().manual_seed(info.rank))
        self.grad = torch.randn(per * e, hidden, generator=torch.Generator().manual_seed(100 + info.rank))
        self.hidden, self.experts_per_rank = hidden, experts_per_rank
        self.received = per * experts_per_rank * w
        self.bytes_per_a2a = per * e * hidden * 4

    def flat(self, experts: Callable[..., torch.Tensor]) -> None:
        """The framework baseline: plan, ``dispatch`` -> experts -> ``combine``, backward."""
        x = self.x.detach().requires_grad_()
        meta = plan_dispatch(self.counts, comm=self.comm, algorithm=Algorithm.FLAT, chunks=1)
        y, _ = dispatch(x, meta)
        combine(experts(y, meta.tokens_per_expert, None), meta).backward(self.grad)

    def piped(self, experts: Callable[..., torch.Tensor], algorithm: str, chunks: int | AutoChunks) -> None:
        """Plan, ``moe_alltoall`` (pipelined when ``chunks`` > 1; chosen by measurement when it is an
        :class:`AutoChunks`), backward."""
        x = self.x.detach().requires_grad_()
        meta = plan_dispatch(self.counts, comm=self.comm, algorithm=Algorithm(algorithm), chunks=chunks)
        moe_alltoall(x, meta, experts).backward(self.grad)

    def compute(self, experts: Experts) -> None:
        """The experts alone, forward + backward, on the tokens a rank receives."""
        t = torch.randn(self.received, self.hidden).requires_grad_()
        split = tuple([self.received // self.experts_per_rank] * self.experts_per_rank)
        experts(t, split, None).backward(torch.ones(self.received, self.hidden))

    def experts(self, ffn: int) -> Experts:
        return Experts(local=self.experts_per_rank, hidden=self.hidden, ffn=ffn, seed=1)


def _width_for(layer: _MoeLayer, ratio: float, comm: Callable[[], object]) -> int:
    """FFN width whose experts' fwd+bwd takes ``1 / ratio`` of ``comm``'s time: from a 4096-wide
    probe, rescaled twice from measurements at the previous guess (GEMM speed is not linear in the
    width); each measurement times ``comm`` and the experts side by side, so that both see the
    same load on the (shared) machine. All ranks get the same times (slowest rank), hence the same
    width; rank 0's is broadcast all the same."""
    ffn = 4096
    for _ in range(3):
        ex = layer.experts(ffn)
        got = _side_by_side({"comm": comm, "c": lambda ex=ex: layer.compute(ex)}, 3)
        ffn = max(64, round(ffn * statistics.median(got["comm"]) / ratio / statistics.median(got["c"]) / 64) * 64)
    chosen = torch.tensor([ffn])
    dist.broadcast(chosen, 0)
    return int(chosen)


def moe_sweep(info: RankInfo, tokens: int, hidden: int, experts_per_rank: int, ratios: list[float],
              chunk_counts: list[int], algorithms: list[str], rounds: int,
              ffns: list[int] | None = None, auto_candidates: list[int] | None = None,
              auto_trials: int = 3) -> dict[str, object]:
    """MoE layer fwd+bwd: the flat unchunked path (the framework baseline) vs ``moe_alltoall`` with
    each of ``algorithms`` at each of ``chunk_counts``, and (``auto_candidates`` given) ``auto``:
    ``moe_alltoall`` with the flat algorithm and an :class:`AutoChunks` over those candidates, at
    each target communication/compute ratio.

    Communication (``comm <alg>``) is the unchunked layer with identity experts; the ratio is taken
    against ``comm flat``. Compute is the experts' forward + backward alone. The FFN width for a
    target ratio comes from :func:`_width_for`; the ratio actually obtained is measured in the same
    rounds as the comparison. ``ffns`` (optional) fixes the widths instead (``ratios`` ignored).
    Planning (``plan_dispatch``) is inside every timed step, as it is per step in training. Per
    case: every variant runs once (warm-up), then ``auto`` tunes (``len(auto_candidates) x
    auto_trials`` steps, not timed here; its choice and its own measurements are recorded), then
    the timed side-by-side rounds, ``auto`` among them with its choice fixed.
    """
    layer = _MoeLayer(info, tokens=tokens, hidden=hidden, experts_per_rank=experts_per_rank)
    comm_variants: dict[str, Callable[[], object]] = {"comm flat": lambda: layer.flat(_identity)}
    for alg in algorithms:
        if alg != "flat":
            comm_variants[f"comm {alg}"] = lambda alg=alg: layer.piped(_identity, alg, 1)
    _side_by_side(comm_variants, 1)  # connections up, first-call costs paid
    cases = []
    for target in (ffns or ratios):
        ffn = int(target) if ffns else _width_for(layer, target, comm_variants["comm flat"])
        ex = layer.experts(ffn)

        def step(fn: Callable[[], None], ex: Experts = ex) -> Callable[[], None]:
            return lambda: (ex.zero_grad(), fn())

        variants = {**comm_variants, "compute": step(lambda: layer.compute(ex)),
                    "flat": step(lambda: layer.flat(ex))}
        for alg in algorithms:
            for c in chunk_counts:
                variants[f"{alg} x{c}"] = step(lambda alg=alg, c=c: layer.piped(ex, alg, c))
        case: dict[str, object] = {"target_ratio": None if ffns else target, "ffn": ffn}
        if auto_candidates:
            auto = AutoChunks(layer.comm, candidates=tuple(auto_candidates), trials=auto_trials)
            for fn in variants.values():  # warm-up, so that tuning does not see first-call costs
                fn()
            tune_start = time.perf_counter()
            while auto.tuning:
                dist.barrier()
                step(lambda: layer.piped(ex, "flat", auto))()
            case["auto"] = {"chosen": auto.chosen, "tuning_s": time.perf_counter() - tune_start,
                            "medians_ms": {str(c): t * 1e3 for c, t in (auto.medians_s or {}).items()}}
            variants["auto"] = step(lambda: layer.piped(ex, "flat", auto))
        case["times"] = _side_by_side(variants, rounds, warmup=0 if auto_candidates else 1)
        cases.append(case)
    return {"cases": cases, "tokens": tokens, "hidden": hidden, "experts_per_rank": experts_per_rank,
            "received_tokens": layer.received, "bytes_per_a2a": layer.bytes_per_a2a}


def interference(info: RankInfo, nbytes: int, gemm: list[int], iters: int, reps: int) -> dict[str, object]:
    """How much an exchange in flight slows a rank's compute: a fixed GEMM loop (``iters`` x
    ``[m, k] @ [k, n]``, ``gemm = [m, k, n]``) alone, an ``nbytes`` point-to-point exchange each way
    alone (receive posted first), and the GEMM loop started right after posting that exchange.
    Interleaved, ``reps`` times; per rank: medians (ms) of the wall time and of the main thread's
    CPU time and run-queue wait (``/proc/self/task/<tid>/schedstat``: network softirqs that
    interrupt the thread are charged to its CPU time on kernels without IRQ time accounting).
    Also torch's intra-op and inter-op thread counts."""
    import os
    import threading

    tid = threading.get_native_id()

    def sched() -> tuple[float, float]:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            run, wait, _ = (int(v) for v in f.read().split())
        return run / 1e6, wait / 1e6

    peer = (info.rank + info.ranks_per_node) % info.world_size
    m, k, n = gemm
    a, w = torch.randn(m, k), torch.randn(k, n)
    send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

    def post() -> list[dist.Work]:
        return dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, peer), dist.P2POp(dist.isend, send, peer)])

    def loop() -> None:
        for _ in range(iters):
            torch.mm(a, w)

    def measure(fn: Callable[[], object]) -> dict[str, float]:
        dist.barrier()
        r0, w0 = sched()
        t0 = time.perf_counter()
        fn()
        wall = (time.perf_counter() - t0) * 1e3
        r1, w1 = sched()
        return {"wall": wall, "cpu": r1 - r0, "wait": w1 - w0}

    for _ in range(2):
        loop()
        for work in post():
            work.wait()
    samples: dict[str, list[dict[str, float]]] = {"gemm alone": [], "exchange alone": [], "gemm during exchange": []}
    for _ in range(reps):
        samples["gemm alone"].append(measure(loop))
        samples["exchange alone"].append(measure(lambda: [wk.wait() for wk in post()]))
        # the GEMM's own time, from right after posting (the exchange may outlast it)
        dist.barrier()
        r0, w0 = sched()
        works = post()
        t0 = time.perf_counter()
        loop()
        wall = (time.perf_counter() - t0) * 1e3
        r1, w1 = sched()
        for work in works:
            work.wait()
        samples["gemm during exchange"].append({"wall": wall, "cpu": r1 - r0, "wait": w1 - w0})
    out: dict[str, object] = {k: {q: statistics.median(s[q] for s in v) for q in ("wall", "cpu", "wait")}
                              for k, v in samples.items()}
    out.update(threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
               loadavg=os.getloadavg())
    return out
