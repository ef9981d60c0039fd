"""Pipelined dispatch -> experts -> combine equals the unpipelined MoE all-to-all path.

Reference (written here, independently of the runtime): ``all_to_all_single`` of the tokens and
probs with the splits Megatron's dispatcher derives from per-expert counts, a Python-loop sort of
the received (source, local expert) runs into local-expert order, the experts on all tokens at
once, the inverse sort, and the return ``all_to_all_single``. Compared with
:func:`piper_core.runtime.moe_alltoall` for every algorithm and several chunk counts, on 1, 2, 4 and
8 gloo processes (one spawn each):

* ``ScaleByProbs`` experts (element-wise, so pure data movement plus a per-row scale): outputs and
  gradients bit-identical at every chunk count > 1;
* ``LinearExperts`` (a GEMM per expert): bit-identical at ``chunks=1`` (the unpipelined path);
  within fp32 tolerance otherwise (GEMMs over chunks, weight gradients summed chunk by chunk);
* the unfused :func:`dispatch` / :func:`combine` equal ``moe_alltoall(chunks=1)`` bit for bit, and
  the no-grad (inference) path equals the autograd one;
* the schedule overlaps: chunk ``k + 1``'s exchange is posted before chunk ``k``'s experts run and
  waited after, in forward and in backward (from the ``on_event`` trace).
"""

from __future__ import annotations

import pytest
import torch

from piper_core.errors import SpecError
from piper_core.runtime import (
    Algorithm,
    NodeTopology,
    ScheduleEvent,
    combine,
    create_comm,
    dispatch,
    exchange_counts,
    moe_alltoall,
    plan_dispatch,
)
from tests.gloo import run_ranks
from tests.runtime.test_alltoall import reference as a2a_reference

HIDDEN = 4


class ScaleByProbs:
    """Experts that only scale each token by its prob: no reduction whose order chunking changes."""

    def __call__(self, tokens: torch.Tensor, tokens_per_expert: tuple[int, ...], probs: torch.Tensor | None):
        assert sum(tokens_per_expert) == tokens.shape[0]
        return tokens * probs.unsqueeze(-1)


class LinearExperts:
    """``(t @ w[e] + b[e]) * p`` per local expert ``e`` (SequentialMLP's shape of computation)."""

    def __init__(self, num_local: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(num_local, HIDDEN, HIDDEN, generator=g).requires_grad_(True)
        self.b = torch.randn(num_local, HIDDEN, generator=g).requires_grad_(True)

    def __call__(self, tokens: torch.Tensor, tokens_per_expert: tuple[int, ...], probs: torch.Tensor | None):
        split = list(tokens_per_expert)
        pairs = zip(torch.split(tokens, split), torch.split(probs, split), strict=True)
        return torch.cat([(t @ self.w[e] + self.b[e]) * p.unsqueeze(-1) for e, (t, p) in enumerate(pairs)])

    def grads(self) -> list[torch.Tensor]:
        out = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in (self.w, self.b)]
        self.w.grad = self.b.grad = None
        return out


def reference_moe(x: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, experts, rank: int) -> torch.Tensor:
    """The unpipelined MoE all-to-all path, from ``all_to_all_single`` and Python loops."""
    w, e = counts.shape
    per = e // w
    mat = counts.reshape(w, w, per).sum(-1)  # [src, dst] tokens
    y, p = a2a_reference(x, mat, rank), a2a_reference(probs, mat, rank)
    got = counts[:, rank * per:(rank + 1) * per].tolist()  # [src][local expert]
    start, order = {}, []
    pos = 0
    for s in range(w):
        for j in range(per):
            start[s, j] = pos
            pos += got[s][j]
    for j in range(per):
        for s in range(w):
            order += range(start[s, j], start[s, j] + got[s][j])
    idx = torch.tensor(order, dtype=torch.long)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel())
    tokens_per_expert = tuple(sum(got[s][j] for s in range(w)) for j in range(per))
    out = experts(y[idx], tokens_per_expert, p[idx])
    return a2a_reference(out[inv].contiguous(), mat.t().contiguous(), rank)


def moe_cases(world: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Named ``[W, E]`` tokens-per-expert matrices (E = 2W: two local experts; one case E = W)."""
    g = torch.Generator().manual_seed(seed)
    e = 2 * world
    uneven = (torch.randint(0, 7, (world, e), generator=g) * (torch.rand(world, e, generator=g) > 0.3)).long()
    silent = uneven.clone()
    silent[world - 1] = 0
    starved = uneven.clone()
    starved[:, :2] = 0
    skew = torch.zeros(world, e, dtype=torch.long)
    skew[:, e - 1] = torch.randint(5, 12, (world,), generator=g)
    one_expert = torch.randint(0, 9, (world, world), generator=g)
    return [("random uneven with zeros", uneven), (f"rank {world - 1} sends nothing", silent),
            ("rank 0 receives nothing", starved), ("every token to the last expert", skew),
            ("one local expert", one_expert), ("no tokens at all", torch.zeros(world, e, dtype=torch.long))]


def _inputs(rank: int, counts: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    rows = int(counts[rank].sum())
    return (torch.randn(rows, HIDDEN, generator=g).requires_grad_(True),
            torch.rand(rows, generator=g).requires_grad_(True))


def _fwd_bwd(fn, x: torch.Tensor, probs: torch.Tensor, experts, up: torch.Tensor) -> list[torch.Tensor]:
    """Output and gradients (x, probs, expert parameters) of ``fn(x, probs)`` for upstream ``up``."""
    out = fn(x, probs)
    out.backward(up)
    grads = [x.grad.clone(), probs.grad.clone()]
    x.grad = probs.grad = None
    return [out.detach(), *grads, *(experts.grads() if isinstance(experts, LinearExperts) else [])]


def _same(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool) -> bool:
    if exact:
        return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    return all(torch.allclose(u, v, rtol=1e-5, atol=1e-5) for u, v in zip(a, b, strict=True))


def _pipelined_cases(rank: int, world: int, seed: int, chunk_counts: tuple[int, ...]) -> tuple[int, list[str]]:
    """Every count case x experts x algorithm x chunks against the reference; (checks, failures)."""
    comm = create_comm(NodeTopology.uniform(world_size=world, ranks_per_node=max(1, world // 2)))
    checks, failures = 0, []
    for i, (name, counts) in enumerate(moe_cases(world, seed)):
        gathered = exchange_counts(counts[rank], comm=comm)
        if not torch.equal(gathered, counts):
            failures.append(f"{name}: exchange_counts differs")
        x, probs = _inputs(rank, counts, seed + i)
        up = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + i))
        for experts in (ScaleByProbs(), LinearExperts(counts.shape[1] // world, seed + rank)):
            want = _fwd_bwd(lambda a, p: reference_moe(a, p, counts, experts, rank), x, probs, experts, up)
            for alg in Algorithm:
                for chunks in _chunks_for(experts, chunk_counts):
                    meta = plan_dispatch(counts, comm=comm, algorithm=alg, chunks=chunks)
                    got = _fwd_bwd(lambda a, p: moe_alltoall(a, meta, experts, probs=p), x, probs, experts, up)
                    exact = chunks == 1 or isinstance(experts, ScaleByProbs)
                    checks += 1
                    if not _same(got, want, exact):
                        failures.append(f"{name} {type(experts).__name__} {alg.value} chunks={chunks}")
        failures += _unfused_and_inference(rank, comm, counts, x, probs, up, name)
        checks += 1
    return checks, failures


def _chunks_for(experts, chunk_counts: tuple[int, ...]) -> tuple[int, ...]:
    """Element-wise experts at chunks=1 would repeat what the linear ones check exactly there."""
    return chunk_counts if isinstance(experts, LinearExperts) else tuple(c for c in chunk_counts if c > 1)


def _unfused_and_inference(rank, comm, counts, x, probs, up, name) -> list[str]:
    """dispatch/combine == moe_alltoall(chunks=1), and the no-grad path == the autograd path."""
    experts = LinearExperts(counts.shape[1] // comm.size, 5)
    meta = plan_dispatch(counts, comm=comm, algorithm=Algorithm.HIERARCHICAL)

    def unfused(a, p):
        tokens, moved = dispatch(a, meta, probs=p)
        return combine(experts(tokens, meta.tokens_per_expert, moved), meta)

    a = _fwd_bwd(unfused, x, probs, experts, up)
    b = _fwd_bwd(lambda u, p: moe_alltoall(u, meta, experts, probs=p), x, probs, experts, up)
    chunked = plan_dispatch(counts, comm=comm, algorithm=Algorithm.AGGREGATED, chunks=3)
    with torch.no_grad():
        c = moe_alltoall(x, chunked, experts, probs=probs)
    d = moe_alltoall(x, chunked, experts, probs=probs).detach()
    out = [] if _same(a, b, exact=True) else [f"{name}: unfused dispatch/combine != moe_alltoall(chunks=1)"]
    return out + ([] if torch.equal(c, d) else [f"{name}: no-grad path != autograd path"])


# Chunk counts per world size (test_properties.py draws 1..5 at 4 ranks): 1 is the unpipelined path,
# 3 does not divide most runs (uneven pieces), 5 exceeds some runs (empty pieces).
CHUNKS = {1: (1, 3), 2: (1, 2, 5), 4: (1, 3, 5), 8: (1, 3)}


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_pipelined_equals_unpipelined_reference(world: int) -> None:
    results = run_ranks(world, _pipelined_cases, 11, CHUNKS[world], timeout_s=240)
    for rank, (checks, failures) in enumerate(results):
        runs = len(Algorithm) * (2 * len(CHUNKS[world]) - 1)  # linear: every chunk count; scale: > 1
        assert checks == len(moe_cases(world, 11)) * (runs + 1), rank
        assert not failures, f"rank {rank}: {failures}"


# --- the schedule overlaps communication with the experts ----------------------------------------

def _trace(rank: int, world: int, chunks: int) -> list[ScheduleEvent]:
    comm = create_comm(NodeTopology.uniform(world_size=world, ranks_per_node=1))
    counts = torch.full((world, 2 * world), 6)
    x, probs = _inputs(rank, counts, 3)
    events: list[ScheduleEvent] = []
    meta = plan_dispatch(counts, comm=comm, algorithm=Algorithm.HIERARCHICAL, chunks=chunks)
    moe_alltoall(x, meta, LinearExperts(2, 0), probs=probs, on_event=events.append).sum().backward()
    return events


def _at(events: list[ScheduleEvent], direction: str, action: str, exchange: str, chunk: int) -> int:
    return events.index(ScheduleEvent(direction=direction, action=action, exchange=exchange, chunk=chunk))


def test_schedule_overlaps_exchanges_with_experts_forward_and_backward() -> None:
    chunks = 4
    events = run_ranks(2, _trace, chunks, timeout_s=120)
    assert events[0] == events[1]  # both ranks run the same schedule
    ev = events[0]
    assert len(ev) == 2 * 5 * chunks  # per direction and chunk: 2 posts, 2 waits, 1 experts
    for k in range(1, chunks):
        # forward: dispatch k in flight while experts k-1 run
        assert _at(ev, "forward", "post", "dispatch", k) < _at(ev, "forward", "experts", "none", k - 1) \
            < _at(ev, "forward", "wait", "dispatch", k)
        # forward: combine k-1 in flight while experts k run
        assert _at(ev, "forward", "post", "combine", k - 1) < _at(ev, "forward", "experts", "none", k) \
            < _at(ev, "forward", "wait", "combine", k - 1)
        # backward: the gradient of combine k arrives while experts k-1 run backward ...
        assert _at(ev, "backward", "post", "combine", k) < _at(ev, "backward", "experts", "none", k - 1) \
            < _at(ev, "backward", "wait", "combine", k)
        # ... and the gradient of dispatch k-1 leaves while experts k run backward
        assert _at(ev, "backward", "post", "dispatch", k - 1) < _at(ev, "backward", "experts", "none", k) \
            < _at(ev, "backward", "wait", "dispatch", k - 1)
    assert all(e.direction == "forward" for e in ev[:5 * chunks])


def test_chunks_and_counts_errors_name_the_rule() -> None:
    class _Comm:  # plan_dispatch validates before it touches the comm's groups
        size, me = 2, 0
    with pytest.raises(SpecError, match=r"chunks=0: must be an int >= 1"):
        plan_dispatch([[1, 1], [1, 1]], comm=_Comm(), algorithm=Algorithm.FLAT, chunks=0)
    with pytest.raises(SpecError, match=r"counts=\(2, 3\): must be an integer \[2, E\] matrix, E > 0 a multiple "
                                        r"of the group size 2"):
        plan_dispatch([[1, 1, 1], [1, 1, 1]], comm=_Comm(), algorithm=Algorithm.FLAT)


# --- one gradient accumulation per parameter, whatever the chunk count ------------------------------

def _counted_setup(rank: int, world: int):
    """A comm, counts, inputs, an upstream gradient, and linear experts whose parameters count their
    gradient accumulations in ``fired``."""
    comm = create_comm(NodeTopology.uniform(world_size=world, ranks_per_node=1))
    counts = moe_cases(world, 5)[0][1]
    x, probs = _inputs(rank, counts, 5)
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    experts = LinearExperts(counts.shape[1] // world, 7 + rank)
    fired = {"w": 0, "b": 0}
    experts.w.register_post_accumulate_grad_hook(lambda p: fired.__setitem__("w", fired["w"] + 1))
    experts.b.register_post_accumulate_grad_hook(lambda p: fired.__setitem__("b", fired["b"] + 1))
    return comm, counts, x, probs, up, experts, fired


def _accumulations(rank: int, world: int) -> dict[str, object]:
    """Per chunk count: how often each expert parameter's post-accumulate hook fired in one backward,
    with and without ``params``, and whether the gradients equal the reference's."""
    comm, counts, x, probs, up, experts, fired = _counted_setup(rank, world)
    want = _fwd_bwd(lambda a, p: reference_moe(a, p, counts, experts, rank), x, probs, experts, up)
    out: dict[str, object] = {}
    for chunks in (1, 3, 2, 5):  # a count that changes between calls, as AutoChunks hands them out
        meta = plan_dispatch(counts, comm=comm, algorithm=Algorithm.HIERARCHICAL, chunks=chunks)
        for params in ((experts.w, experts.b), ()):
            fired.update(w=0, b=0)
            got = _fwd_bwd(lambda a, p: moe_alltoall(a, meta, experts, probs=p, params=params), x, probs, experts, up)
            out[f"chunks={chunks} params={bool(params)}"] = (dict(fired), _same(got, want, exact=False))
    return out


def test_params_get_one_accumulation_per_backward_at_any_chunk_count() -> None:
    """With ``params`` each expert parameter's gradient is accumulated once per backward (so hooks
    that count accumulations, like Megatron DDP's grad-ready counting, see the same count at every
    chunk count); without, once per chunk. Both give the reference's gradients."""
    for rank, result in enumerate(run_ranks(2, _accumulations, timeout_s=120)):
        for chunks in (1, 3, 2, 5):
            fired, same = result[f"chunks={chunks} params=True"]
            assert fired == {"w": 1, "b": 1} and same, (rank, chunks, fired, same)
            fired, same = result[f"chunks={chunks} params=False"]
            assert fired == {"w": chunks, "b": chunks} and same, (rank, chunks, fired, same)


# --- deferred weight gradients (defer_wgrad) ----------------------------------------------------------

def _deferred(rank: int, world: int) -> dict[str, object]:
    """Per algorithm and chunk count: whether ``defer_wgrad`` gives gradients bit-identical to the
    undeferred backward, how often each parameter's accumulation hook fired, and the backward events."""
    comm, counts, x, probs, up, experts, fired = _counted_setup(rank, world)
    params = (experts.w, experts.b)
    out: dict[str, object] = {}
    for alg in Algorithm:
        for chunks in (1, 3):
            meta = plan_dispatch(counts, comm=comm, algorithm=alg, chunks=chunks)
            want = _fwd_bwd(lambda a, p: moe_alltoall(a, meta, experts, probs=p, params=params), x, probs, experts, up)
            events: list[ScheduleEvent] = []
            fired.update(w=0, b=0)
            got = _fwd_bwd(lambda a, p: moe_alltoall(a, meta, experts, probs=p, params=params, on_event=events.append,
                                                     defer_wgrad=True), x, probs, experts, up)
            out[f"{alg.value}/{chunks}"] = (_same(got, want, exact=True), dict(fired),
                                           [e for e in events if e.direction == "backward"])
    try:
        moe_alltoall(x, plan_dispatch(counts, comm=comm, algorithm=Algorithm.FLAT), experts, probs=probs,
                     defer_wgrad=True)
    except SpecError as exc:
        out["no params"] = str(exc)
    return out


def test_deferred_weight_gradients_are_bit_identical_and_computed_while_the_dispatch_gradient_flies() -> None:
    for rank, result in enumerate(run_ranks(2, _deferred, timeout_s=120)):
        assert "defer_wgrad=True: needs the experts' trained parameters in params" in result.pop("no params")
        for case, (same, fired, ev) in result.items():
            assert same, (rank, case)  # outputs, input and parameter gradients: torch.equal
            assert fired == {"w": 1, "b": 1}, (rank, case, fired)  # still one accumulation per parameter
            chunks = int(case.split("/")[1])
            assert [e.chunk for e in ev if e.action == "wgrad"] == list(range(chunks)), (rank, case)
            for k in range(chunks):
                # chunk k's weight GEMMs run after its dispatch gradient is posted and before it is waited
                assert _at(ev, "backward", "post", "dispatch", k) < _at(ev, "backward", "wgrad", "none", k) \
                    < _at(ev, "backward", "wait", "dispatch", k), (rank, case)
                if k + 1 < chunks:  # ... and before the next chunk's experts
                    assert _at(ev, "backward", "wgrad", "none", k) < _at(ev, "backward", "experts", "none", k + 1)
