"""Micro-benchmarks, rank side: the target ``piper_core.calibrate.bench:run`` of
:func:`piper_core.emulate.run_local` / :func:`~piper_core.emulate.run_emulated`.

Every rank runs every benchmark at the same time (ranks share the host's cores, as they do in
training, so a profile for N ranks reflects N ranks sharing them). Each returns plain JSON:
per-rank medians (GEMMs, copies) or per-repetition times (collectives, so the launcher can take the
slowest rank of each repetition, then the median). Every collective runs on a group created with a
timeout and is waited on with that timeout: a missing peer raises
:class:`~piper_core.runtime.CollectiveError` naming the operation and the ranks, never a hang.

Settings (one JSON mapping, built by :mod:`piper_core.calibrate.steps`): ``shapes`` (GEMMs per
dtype), ``copy_mib``, ``sizes`` (bytes per rank), ``scope`` (all | intra | inter), ``budget_s``
(time per measured point), ``max_reps``, ``stop_s`` (a point slower than this ends the sweep),
``timeout_s`` (each collective's deadline), ``algorithm`` (all-to-all: flat | hierarchical),
``pool_mib`` (GEMMs: the operand pool each call takes its next pair from, :func:`operand_pool`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from piper_core.emulate.launch import RankInfo
from piper_core.runtime import Algorithm, NodeTopology, create_comm, exchange, flat_plan, plan_exchange
from piper_core.runtime import timeouts

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MIN_REPS = 3


def run(info: RankInfo, name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Run benchmark ``name`` on this rank with ``settings``; returns this rank's JSON result."""
    bench = {"gemm": gemm, "memory": memory, "alltoall": alltoall, "allreduce": allreduce,
             "allgather": allgather, "reducescatter": reducescatter, "p2p": p2p}.get(name)
    if bench is None:
        raise ValueError(f"unknown benchmark {name!r}")
    with torch.no_grad():
        out = bench(info, settings)
    return {"rank": info.rank, "torch": torch.__version__, "threads": torch.get_num_threads(), **out}


def _median_time(fn: Callable[[], object], budget_s: float, max_reps: int) -> float:
    """Median seconds of ``fn`` over as many calls as fit ``budget_s`` (MIN_REPS..max_reps), after warm-up.
    A call that alone outlasts the budget (a bf16 GEMM on a CPU without bf16 instructions takes
    seconds) is timed twice: its own length dwarfs the timer's noise, and MIN_REPS of them would make
    one point cost many budgets."""
    fn()
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first >= budget_s:
        start = time.perf_counter()
        fn()
        return (first + time.perf_counter() - start) / 2
    reps = max(MIN_REPS, min(max_reps, int(budget_s / max(first, 1e-9))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _barrier(group: dist.ProcessGroup | None, what: str, ranks: tuple[int, ...], timeout_s: float) -> None:
    name = timeouts.OpName(op=f"calibrate barrier ({what})", stage="stage 1/1", ranks=ranks, rank=dist.get_rank())
    work = timeouts.launch(name, lambda: dist.barrier(group=group, async_op=True))
    timeouts.wait(work, name, timedelta(seconds=timeout_s))


def gemm(info: RankInfo, s: dict[str, Any]) -> dict[str, Any]:
    """``{dtype: [[m, n, k, median seconds], ...]}``: one ``[m, k] x [k, n]`` matmul per call, each
    call on the next operand pair of :func:`operand_pool` (``s["pool_mib"]``; absent or 0: the same
    pair every call, operands in cache, as profiles before 2026-12-08 were measured)."""
    ranks = tuple(range(info.world_size))
    mib = s.get("pool_mib", 0)
    out: dict[str, list[list[float]]] = {}
    for dtype, shapes in s["shapes"].items():
        rows = []
        pool = make_pool(mib, DTYPES[dtype]) if mib else None
        cursor = 0  # elements of the pool read so far: a shape starts where the last one stopped
        for m, n, k in shapes:
            pairs = operand_pool(pool, m, n, k, DTYPES[dtype])
            pair_size = m * k + k * n
            turn = itertools.count(cursor // pair_size)
            _barrier(None, f"before GEMM {dtype} {m}x{n}x{k}", ranks, s["timeout_s"])
            rows.append([m, n, k, _median_time(lambda: torch.mm(*pairs[next(turn) % len(pairs)]),
                                               s["budget_s"], s["max_reps"])])
            cursor = next(turn) * pair_size
        out[dtype] = rows
    return {"gemm": out, "gemm_pool_mib": mib}


def make_pool(mib: int, dtype: torch.dtype) -> torch.Tensor:
    """``mib`` MiB of random ``dtype`` values for :func:`operand_pool` to carve operands from."""
    return torch.randn(mib * 2**20 // dtype.itemsize).to(dtype)


def operand_pool(pool: torch.Tensor | None, m: int, n: int, k: int, dtype: torch.dtype,
                 batch: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Operand pairs (``[batch,] m x k`` and ``k x n``) to rotate through, one per call.

    ``pool`` None: one fresh pair, so every call finds its operands in cache. Else as many disjoint
    pairs as fit in ``pool`` (views of it; one fresh pair where even one does not fit: operands that
    large are out of cache anyway), so a call reads operands that the calls before it have pushed
    out of the cache, as a training step's GEMMs do: between two uses of a weight or an activation
    a step touches many MiB. Timing one GEMM repeated on the same tensors prices the step's GEMMs
    too fast -- on this host 21.3 against 42.4 ms per step, and this pool (256 MiB) times the same
    products at 30.2 ms (docs/validation.md, "Diagnosis"); on a GPU the same holds for its L2
    (50 MiB on an H100), which is why GEMM benchmarks there flush it between calls."""
    shape_a, shape_b = ((batch, m, k), (batch, k, n)) if batch > 1 else ((m, k), (k, n))
    size_a, size_b = batch * m * k, batch * k * n
    count = 0 if pool is None else pool.numel() // (size_a + size_b)
    if count == 0:
        return [(torch.randn(shape_a).to(dtype), torch.randn(shape_b).to(dtype))]
    pool = pool.to(dtype)
    pairs = []
    for i in range(count):
        start = i * (size_a + size_b)
        pairs.append((pool[start:start + size_a].view(shape_a), pool[start + size_a:start + size_a + size_b].view(shape_b)))
    return pairs


def memory(info: RankInfo, s: dict[str, Any]) -> dict[str, Any]:
    """Copy bandwidth: ``bytes`` read + written per copy of a ``copy_mib`` MiB fp32 tensor, median seconds."""
    src = torch.randn(s["copy_mib"] * 2**20 // 4)
    dst = torch.empty_like(src)
    _barrier(None, "before the copy", tuple(range(info.world_size)), s["timeout_s"])
    seconds = _median_time(lambda: dst.copy_(src), s["budget_s"], s["max_reps"])
    return {"bytes": 2 * src.numel() * 4, "seconds": seconds, "elementwise": elementwise(s)}


def elementwise(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Element-wise kernels a transformer layer runs (add, multiply, GeLU, softmax, LayerNorm) in the
    training dtype (``s["dtype"]``, default bf16) on an activation-sized [4096, 256] tensor: bytes
    read + written and median seconds each."""
    dtype = DTYPES[s.get("dtype", "bf16")]
    x, y = torch.randn(4096, 256, dtype=dtype), torch.randn(4096, 256, dtype=dtype)
    n = x.numel() * x.element_size()
    ops = {"add": (lambda: x + y, 3 * n), "mul": (lambda: x * y, 3 * n),
           "gelu": (lambda: torch.nn.functional.gelu(x), 2 * n), "softmax": (lambda: torch.softmax(x, -1), 2 * n),
           "layernorm": (lambda: torch.nn.functional.layer_norm(x, (256,)), 2 * n)}
    budget = s["budget_s"] / len(ops)
    return [{"op": name, "bytes": moved, "seconds": _median_time(fn, budget, s["max_reps"])}
            for name, (fn, moved) in ops.items()]


def _agree_reps(first: float, group: dist.ProcessGroup | None, what: timeouts.OpName,
                s: dict[str, Any]) -> tuple[int, float]:
    """(repetitions, slowest first time): every rank must make the same choice, so decide on the max."""
    t = torch.tensor([first], dtype=torch.float64)
    work = timeouts.launch(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True))
    timeouts.wait(work, what, timedelta(seconds=s["timeout_s"]))
    slowest = float(t.item())
    return max(MIN_REPS, min(s["max_reps"], int(s["budget_s"] / max(slowest, 1e-9)))), slowest


def _sweep(run_once: Callable[[int], Callable[[], None]], group: dist.ProcessGroup, ranks: tuple[int, ...],
           label: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    """Time every size of ``s["sizes"]``. First, per size: warm up, time once, agree on the
    repetitions (sizes after the first one slower than ``stop_s`` are dropped: larger ones would
    only be slower); then the repetitions run in rounds over all sizes, each after a barrier, so a
    burst of load from elsewhere on a shared machine hits every size alike rather than one."""
    # agreed over the whole job (not ``group``): concurrent sub-groups then measure the same sizes,
    # the same number of times, and the launcher can line their repetitions up
    what = timeouts.OpName(op=f"calibrate {label} (agreeing on repetitions)", stage="stage 1/1",
                           ranks=tuple(range(dist.get_world_size())), rank=dist.get_rank())
    plan: list[tuple[int, Callable[[], None], int]] = []
    for nbytes in s["sizes"]:
        once = run_once(nbytes)
        once()
        _barrier(group, f"{label} {nbytes} B", ranks, s["timeout_s"])
        start = time.perf_counter()
        once()
        reps, slowest = _agree_reps(time.perf_counter() - start, None, what, s)
        plan.append((nbytes, once, reps))
        if slowest > s["stop_s"]:
            break
    times: list[list[float]] = [[] for _ in plan]
    for round_ in range(max(reps for _, _, reps in plan)):
        for i, (nbytes, once, reps) in enumerate(plan):
            if round_ >= reps:
                continue
            _barrier(group, f"{label} {nbytes} B", ranks, s["timeout_s"])
            start = time.perf_counter()
            once()
            times[i].append(time.perf_counter() - start)
    return [{"bytes": nbytes, "times": t} for (nbytes, _, _), t in zip(plan, times)]


def _topology(info: RankInfo) -> NodeTopology:
    return NodeTopology.uniform(world_size=info.world_size, ranks_per_node=info.ranks_per_node)


def alltoall(info: RankInfo, s: dict[str, Any]) -> dict[str, Any]:
    """All-to-all (Piper's runtime, the path the dispatcher takes) of ``bytes`` per rank, spread
    evenly over the group (own share included): over the whole job, inside each node, or among the
    ranks with the same local index (every such group at once). ``algorithm``: flat (default) or
    hierarchical (whole job only)."""
    topo, rpn, nodes = _topology(info), info.ranks_per_node, info.nodes
    parents = {"all": [list(range(info.world_size))],
               "intra": [[n * rpn + j for j in range(rpn)] for n in range(nodes)],
               "inter": [[n * rpn + j for n in range(nodes)] for j in range(rpn)]}[s["scope"]]
    comm = create_comm(topo, parents=parents, timeout=timedelta(seconds=s["timeout_s"]))
    size, algorithm = comm.size, Algorithm(s.get("algorithm", "flat"))

    def once_for(nbytes: int) -> Callable[[], None]:
        per_peer = nbytes // size
        x = torch.zeros(per_peer * size, dtype=torch.uint8)
        label = f"calibrate {s['scope']} {nbytes} B"
        if algorithm is Algorithm.FLAT:
            plan = flat_plan([per_peer] * size, [per_peer] * size, comm=comm, label=label)
        else:
            plan = plan_exchange([[per_peer] * size] * size, comm=comm, algorithm=algorithm, label=label)
        return lambda: exchange(x, plan)

    points = _sweep(once_for, comm.group, comm.layout.ranks, f"{algorithm.value} all-to-all ({s['scope']})", s)
    return {"group_size": size, "stride": 1 if s["scope"] != "inter" else rpn, "points": points}


Post = Callable[[torch.Tensor, dist.ProcessGroup], dist.Work]


def _collective(info: RankInfo, s: dict[str, Any], label: str, post: Post,
                elements: Callable[[int], int]) -> dict[str, Any]:
    ranks = tuple(range(info.world_size))
    group = dist.new_group(list(ranks), timeout=timedelta(seconds=s["timeout_s"]))

    def once_for(nbytes: int) -> Callable[[], None]:
        x = torch.zeros(elements(nbytes), dtype=torch.float32)
        what = timeouts.OpName(op=f"calibrate {label} {nbytes} B", stage="stage 1/1", ranks=ranks, rank=info.rank)

        def once() -> None:
            timeouts.wait(timeouts.launch(what, lambda: post(x, group)), what, timedelta(seconds=s["timeout_s"]))
        return once

    return {"group_size": info.world_size, "stride": 1, "points": _sweep(once_for, group, ranks, label, s)}


def allreduce(info: RankInfo, s: dict[str, Any]) -> dict[str, Any]:
    """Sum all-reduce of a ``bytes`` fp32 buffer over the whole job."""
    return _collective(info, s, "all-reduce", lambda x, g: dist.all_reduce(x, group=g, async_op=True),
                       lambda nbytes: max(1, nbytes // 4))


def allgather(info: RankInfo, s: dict[str, Any]) -> dict[str, Any]:
    """All-gather to a ``bytes`` fp32 buffer (the full, gathered size; each rank gives 1/world of it)."""
    world = info.world_size
    outs: dict[int, torch.Tensor] = {}

    def post(x: torch.Tensor, g: dist.ProcessGroup) -> dist.Work:
        out = outs.setdefault(x.numel(), torch.empty(x.numel() * world))
        return dist.all_gather_into_tensor(out, x, group=g, async_op=True)

    return _collective(info, s, "all-gather", post, lambda nbytes: max(1, nbytes // 4 // world))


def reducescatter(info: RankInfo, s: dict[str, Any]) -> dict[str, Any]:
    """Sum reduce-scatter of a ``bytes`` fp32 buffer (the full size; each rank keeps 1/world of it)."""
    world = info.world_size
    outs: dict[int, torch.Tensor] = {}

    def post(x: torch.Tensor, g: dist.ProcessGroup) -> dist.Work:
        out = outs.setdefault(x.numel(), torch.empty(x.numel() // world))
        return dist.reduce_scatter_tensor(out, x, group=g, async_op=True)

    return _collective(info, s, "reduce-scatter", post, lambda nbytes: world * max(1, nbytes // 4 // world))


def p2p(info: RankInfo, s: dict[str, Any]) -> dict[str, Any]:
    """Ping-pong of ``bytes`` between pairs of ranks (all pairs at once); a repetition is one round
    trip, so a message takes half of it. ``scope`` intra pairs local ranks (2i, 2i+1) of each node,
    inter pairs the same local rank of nodes (2j, 2j+1). ``mode`` "exchange": both ranks of a pair
    send ``bytes`` to each other at once instead (one receive and one send posted together, into
    buffers reused across repetitions), the shape of a move of experts; a repetition is one exchange."""
    rpn, rank = info.ranks_per_node, info.rank
    if s["scope"] == "intra":
        peer = rank + 1 if info.local_rank % 2 == 0 else rank - 1
        peer = peer if peer // rpn == rank // rpn and info.local_rank ^ 1 < rpn else None
        stride = 1
    else:
        peer = rank + rpn if info.node % 2 == 0 else rank - rpn
        peer = peer if 0 <= peer < info.world_size else None
        stride = rpn
    ranks = tuple(range(info.world_size))
    group = dist.new_group(list(ranks), timeout=timedelta(seconds=s["timeout_s"]))
    pair = tuple(sorted((rank, peer))) if peer is not None else (rank,)
    first = peer is not None and rank < peer

    def once_for(nbytes: int) -> Callable[[], None]:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        what = timeouts.OpName(op=f"calibrate point-to-point {nbytes} B", stage=s.get("mode", "ping-pong"),
                               ranks=pair, rank=rank)
        limit = timedelta(seconds=s["timeout_s"])

        def send() -> None:
            timeouts.wait(timeouts.launch(what, lambda: dist.isend(buf, peer, group=group)), what, limit)

        def recv() -> None:
            timeouts.wait(timeouts.launch(what, lambda: dist.irecv(buf, peer, group=group)), what, limit)

        if peer is None:
            return lambda: None
        if s.get("mode") == "exchange":
            inbox = torch.zeros(nbytes, dtype=torch.uint8)

            def both() -> None:
                works = [timeouts.launch(what, lambda: dist.irecv(inbox, peer, group=group)),
                         timeouts.launch(what, lambda: dist.isend(buf, peer, group=group))]
                for work in works:
                    timeouts.wait(work, what, limit)
            return both
        return (lambda: (send(), recv())) if first else (lambda: (recv(), send()))

    kind = "exchange" if s.get("mode") == "exchange" else "point-to-point"
    points = _sweep(once_for, group, ranks, f"{kind} ({s['scope']})", s)
    return {"group_size": 2, "stride": stride, "paired": peer is not None, "points": points}
