"""Token dispatch and combine for expert parallelism: the frozen plan, and the unpipelined path.

Layout (Megatron-Core's ``MoEAlltoAllTokenDispatcher``): the ``E`` experts are spread over the
``W`` members of the group, ``E / W`` consecutive experts each (expert ``g`` on member
``g // (E / W)``, local index ``g % (E / W)``). A rank's tokens ``x`` are sorted by global expert,
i.e. by destination member, then local expert. ``counts[s][g]`` = tokens member ``s`` sends expert
``g``, the same ``[W, E]`` matrix on every rank (Megatron all-gathers it in ``preprocess``; here
:func:`exchange_counts`). On the expert side the tokens arrive by source member, then local expert;
experts see them grouped by local expert (Megatron's ``sort_chunks_by_idxs``).

Chunks: every (source, expert) run of ``n`` tokens is cut into ``chunks`` contiguous pieces,
piece ``k`` = tokens ``[n*k // chunks, n*(k+1) // chunks)``. Chunk ``k`` holds piece ``k`` of
every run, so each chunk is a smaller dispatch of the same shape, and its splits follow from the
per-expert counts alone. :func:`plan_dispatch` computes everything once per step into a frozen
:class:`DispatchMeta`; :func:`dispatch` returns the expert-side tokens, and :func:`combine` takes
the expert outputs and the same metadata back (nothing is kept on any object between the two).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import timeouts
from piper_core.runtime.alltoall import ExchangePlan, check_device, exchange, plan_exchange
from piper_core.runtime.autochunks import AutoChunks
from piper_core.runtime.groups import A2AComm
from piper_core.runtime.routes import reorder_rows
from piper_core.runtime.topology import Algorithm


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkPlan:
    """One chunk of a dispatch, for this rank.

    ``rows``: rows of ``x`` in the chunk, in send order (None: all of ``x`` as is, chunks == 1);
    ``dispatch``/``combine``: the two exchanges; ``to_experts``: received rows (source, local
    expert) -> grouped by local expert (None: already so), ``from_experts`` its inverse;
    ``tokens_per_expert``: rows per local expert in this chunk.
    """

    rows: torch.Tensor | None
    dispatch: ExchangePlan
    combine: ExchangePlan
    to_experts: torch.Tensor | None
    from_experts: torch.Tensor | None
    tokens_per_expert: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchMeta:
    """A step's dispatch plan for this rank (see module doc). ``rows_in``: tokens this rank sends
    (``x.shape[0]``); ``rows_out``: tokens its experts get; ``tokens_per_expert``: per local expert,
    all chunks; ``restore``: rows of the concatenated chunk outputs in ``x``'s order (None: as is);
    ``tuner``: the :class:`AutoChunks` that chose ``chunks`` and wants this layer timed (None: a fixed
    count, or the tuner has decided)."""

    algorithm: Algorithm
    chunks: int
    device: torch.device
    num_local_experts: int
    rows_in: int
    rows_out: int
    tokens_per_expert: tuple[int, ...]
    chunk: tuple[ChunkPlan, ...]
    restore: torch.Tensor | None
    tuner: AutoChunks | None = None


def exchange_counts(tokens_per_expert: Sequence[int] | torch.Tensor, *, comm: A2AComm) -> torch.Tensor:
    """All-gather every member's per-expert token counts: int64 ``[W, E]`` on the CPU.

    ``tokens_per_expert``: this rank's counts ``[E]`` (a tensor on the communication device for
    NCCL). One all-gather over ``comm.group``, with the runtime's timeout.
    """
    t = torch.as_tensor(tokens_per_expert).long().reshape(-1).contiguous()
    parts = [torch.empty_like(t) for _ in range(comm.size)]
    what = timeouts.OpName(op="exchange_counts (all-gather of tokens per expert)", stage="stage 1/1",
                           ranks=comm.layout.ranks, rank=comm.global_rank)
    work = timeouts.launch(what, lambda: dist.all_gather(parts, t, group=comm.group, async_op=True))
    timeouts.wait(work, what, comm.timeout if comm.host_timeout else None)
    return torch.stack(parts).cpu()


def plan_dispatch(counts: Sequence[Sequence[int]] | torch.Tensor, *, comm: A2AComm, algorithm: Algorithm,
                  chunks: int | AutoChunks = 1, device: torch.device | None = None) -> DispatchMeta:
    """Plan a dispatch of ``counts[s][g]`` tokens (``[W, E]``, identical on every rank) in
    ``chunks`` chunks by ``algorithm``; index tensors go to ``device``. No communication, except
    the one all-reduce with which an :class:`AutoChunks` passed as ``chunks`` makes its choice
    (at the same call on every rank; see :mod:`piper_core.runtime.autochunks`)."""
    c = _check_counts(counts, comm.size).numpy()
    tuner = None
    if isinstance(chunks, AutoChunks):
        if chunks.comm is not comm:
            raise SpecError("chunks.comm", "another A2AComm", "an AutoChunks decides over the group it plans for",
                            "build the AutoChunks with the comm passed to plan_dispatch")
        tuner = chunks
        chunks = tuner.next_chunks()
        tuner = tuner if tuner.tuning else None
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise SpecError("chunks", chunks, "must be an int >= 1 or an AutoChunks",
                        "use 1 for the unpipelined path, AutoChunks(comm) to choose by measurement")
    w, e = c.shape
    per = e // w
    me, plans = comm.me, []
    mine = c[:, me * per:(me + 1) * per]  # [W sources, local experts]
    order = np.arange(w * per).reshape(w, per).T.reshape(-1)  # (e, s) order of the (s, e) runs
    for k in range(chunks):
        part = (c * (k + 1)) // chunks - (c * k) // chunks  # [W, E] tokens in chunk k
        name = f"chunk {k + 1}/{chunks}"
        disp = plan_exchange(part.reshape(w, w, per).sum(-1), comm=comm, algorithm=algorithm,
                             label=f"dispatch {name}", device=device)
        got = part[:, me * per:(me + 1) * per]
        to_exp = reorder_rows(got.reshape(-1), order, device)
        plans.append(ChunkPlan(rows=_chunk_rows(c[me], k, chunks, device), dispatch=disp,
                               combine=disp.reversed(f"{algorithm.value} combine {name}"),
                               to_experts=to_exp, from_experts=_inverse(to_exp),
                               tokens_per_expert=tuple(got.sum(0).tolist())))
    return DispatchMeta(algorithm=algorithm, chunks=chunks, device=torch.device(device or "cpu"),
                        num_local_experts=per, rows_in=int(c[me].sum()),
                        rows_out=int(mine.sum()), tokens_per_expert=tuple(mine.sum(0).tolist()),
                        chunk=tuple(plans), restore=_restore(plans, device), tuner=tuner)


def _check_counts(counts: Sequence[Sequence[int]] | torch.Tensor, w: int) -> torch.Tensor:
    c = torch.as_tensor(counts).to("cpu")
    if c.dim() != 2 or c.shape[0] != w or c.is_floating_point() or c.shape[1] % w or c.shape[1] == 0:
        raise SpecError("counts", tuple(c.shape), f"must be an integer [{w}, E] matrix, E > 0 a multiple "
                        f"of the group size {w} (counts[s][g] = tokens member s sends expert g)",
                        f"pass exchange_counts(...)'s result; with {w} expert-parallel ranks the number "
                        f"of experts must be a multiple of {w}")
    if bool((c < 0).any()):
        raise SpecError("counts", c.tolist(), "token counts must be >= 0", "fix the router's counts")
    return c.long()


def _chunk_rows(mine: np.ndarray, k: int, chunks: int, device: torch.device | None) -> torch.Tensor | None:
    """Rows of ``x`` (runs of ``mine[g]`` tokens per expert) that chunk ``k`` takes, in order."""
    if chunks == 1:
        return None
    lo, hi = (mine * k) // chunks, (mine * (k + 1)) // chunks
    starts = np.cumsum(mine) - mine + lo
    lengths = hi - lo
    offsets = np.cumsum(lengths) - lengths
    rows = np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))
    return torch.from_numpy(rows.astype(np.int64)).to(device if device is not None else "cpu")


def _inverse(index: torch.Tensor | None) -> torch.Tensor | None:
    if index is None:
        return None
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), device=index.device)
    return inv


def _restore(plans: list[ChunkPlan], device: torch.device | None) -> torch.Tensor | None:
    if len(plans) == 1:
        return None
    taken = torch.cat([p.rows for p in plans if p.rows is not None])
    return _inverse(taken.to(device) if device is not None else taken)


def take(x: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` rows ``index`` (None index: ``x`` itself, made contiguous)."""
    if x is None:
        return None
    return x.contiguous() if index is None else x.index_select(0, index)


def dispatch(x: torch.Tensor, meta: DispatchMeta, *, probs: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unpipelined dispatch (``meta.chunks`` must be 1), differentiable: ``x`` ``[rows_in, ...]``
    -> expert-side tokens ``[rows_out, ...]`` grouped by local expert (``meta.tokens_per_expert``),
    and ``probs`` ``[rows_in, ...]`` moved alongside (None if not given)."""
    ch = _single(meta, "dispatch")
    check_device(x, meta.device, "plan_dispatch")
    y = take(exchange(take(x, None), ch.dispatch), ch.to_experts)
    p = None if probs is None else take(exchange(take(probs, None), ch.dispatch), ch.to_experts)
    return y, p


def combine(y: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
    """Unpipelined combine, differentiable: expert outputs ``[rows_out, ...]`` grouped by local
    expert -> ``[rows_in, ...]`` in the order of the ``x`` given to :func:`dispatch`."""
    ch = _single(meta, "combine")
    return exchange(take(y, ch.from_experts), ch.combine)


def _single(meta: DispatchMeta, what: str) -> ChunkPlan:
    if meta.chunks != 1:
        raise SpecError("meta.chunks", meta.chunks, f"unpipelined {what} moves all tokens at once",
                        "plan with chunks=1, or use moe_alltoall for the pipelined path")
    return meta.chunk[0]
