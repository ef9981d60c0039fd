"""All-to-all exchanges with variable splits: flat, hierarchical and aggregated, sync and async.

Semantics are those of ``all_to_all_single`` on dim 0: this rank's input holds ``counts[me][d]``
rows for every member ``d`` (in ``d`` order); its output holds ``counts[s][me]`` rows from every
``s`` (in ``s`` order). Trailing dims and dtype are free. Every algorithm returns the same rows in
the same order (pure data movement, bit-identical); backward is the exchange with ``counts``
transposed (Megatron ``tensor_parallel.mappings._AllToAll`` swaps the splits the same way).

* :func:`plan_exchange` / :func:`flat_plan` -> :class:`ExchangePlan` (frozen; both directions).
* :func:`exchange` (autograd) and :func:`all_to_all` / :func:`all_to_all_flat` (conveniences).
* :func:`start_exchange` -> :class:`PendingExchange` (async, no autograd): ``advance()`` finishes
  the current stage and posts the next one, ``wait()`` finishes all and returns the output. The
  pipelined MoE layer (:mod:`piper_core.runtime.pipelined`) is built from these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import timeouts
from piper_core.runtime.groups import A2AComm
from piper_core.runtime.routes import Route, StagePlan, plan_route
from piper_core.runtime.topology import Algorithm


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangePlan:
    """This rank's part of one exchange, both directions; ``label`` names it in errors."""

    comm: A2AComm
    algorithm: Algorithm
    label: str
    forward: Route
    backward: Route
    device: torch.device

    def reversed(self, label: str) -> ExchangePlan:
        """The exchange that sends everything back (``counts`` transposed)."""
        return replace(self, label=label, forward=self.backward, backward=self.forward)


def counts_matrix(counts: Sequence[Sequence[int]] | torch.Tensor | np.ndarray, size: int) -> torch.Tensor:
    """``counts`` as an int64 ``[W, W]`` CPU tensor, checked (``counts[s][d]`` = rows s sends d)."""
    t = torch.as_tensor(counts).to("cpu")
    if t.shape != (size, size) or t.is_floating_point() or t.is_complex():
        raise SpecError("counts", tuple(t.shape), f"must be an integer [{size}, {size}] matrix "
                        "(counts[s][d] = rows member s sends member d)",
                        "all-gather every rank's input_splits (exchange_counts) and stack them")
    if bool((t < 0).any()):
        raise SpecError("counts", t.tolist(), "row counts must be >= 0", "fix the split sizes")
    return t.long()


def plan_exchange(counts: Sequence[Sequence[int]] | torch.Tensor | np.ndarray, *, comm: A2AComm, algorithm: Algorithm,
                  label: str = "all-to-all", device: torch.device | None = None) -> ExchangePlan:
    """Plan an exchange of ``counts[s][d]`` rows (the same matrix on every rank); index tensors go
    to ``device`` (where the data lives; default CPU). Pure computation, no communication."""
    c = counts_matrix(counts, comm.size).numpy()
    specs = comm.stages(algorithm)
    return ExchangePlan(comm=comm, algorithm=algorithm, label=f"{algorithm.value} {label}",
                        device=torch.device(device if device is not None else "cpu"),
                        forward=plan_route(specs, c, comm.me, device=device),
                        backward=plan_route(specs, np.ascontiguousarray(c.T), comm.me, device=device))


def flat_plan(input_splits: Sequence[int], output_splits: Sequence[int], *, comm: A2AComm,
              label: str = "all-to-all") -> ExchangePlan:
    """The flat exchange from this rank's splits alone (``all_to_all_single``'s arguments)."""
    for key, splits in (("input_splits", input_splits), ("output_splits", output_splits)):
        if len(splits) != comm.size or any(int(s) < 0 for s in splits):
            raise SpecError(key, tuple(splits), f"needs {comm.size} non-negative row counts, one per member",
                            "pass one count per rank of the group, in group-rank order")
    spec = comm.stages(Algorithm.FLAT)[0]
    members = tuple(range(comm.size))

    def route(ins: Sequence[int], outs: Sequence[int]) -> Route:
        stage = StagePlan(spec=spec, members=members, send_index=None, input_splits=tuple(map(int, ins)),
                          output_splits=tuple(map(int, outs)))
        return Route(stages=(stage,), final_index=None, rows_in=sum(stage.input_splits),
                     rows_out=sum(stage.output_splits))

    return ExchangePlan(comm=comm, algorithm=Algorithm.FLAT, label=f"flat {label}", device=torch.device("cpu"),
                        forward=route(input_splits, output_splits), backward=route(output_splits, input_splits))


class PendingExchange:
    """One exchange in flight (lives for one call; not autograd-aware).

    Stage ``k`` is posted asynchronously; :meth:`advance` waits for it and posts stage ``k + 1``
    (so a multi-stage exchange can progress between two pieces of compute); :meth:`wait` runs the
    remaining stages and returns the output ``[rows_out, ...]``.

    Stages that are a group of one on *every* member (e.g. the intra-node stages with one rank per
    node) move no data: they are run locally (their reordering only) as soon as they are reached, so
    the first real communication is posted when the exchange starts, and :meth:`advance` does not
    block on a stage that is followed only by such stages. They are skipped on every rank alike, so
    the order of collectives on each group stays the same on every rank.
    """

    def __init__(self, x: torch.Tensor, route: Route, comm: A2AComm, op: str):
        if x.shape[0] != route.rows_in:
            raise SpecError("x.shape[0]", x.shape[0], f"must equal the rows this rank sends in {op} "
                            f"({route.rows_in})", "sort x by destination; counts[me] must sum to its rows")
        self._route, self._comm, self._op = route, comm, op
        self._stage = 0
        self._buf: torch.Tensor | None = None
        self._works: list[dist.Work] = []
        self._keep: tuple[torch.Tensor, ...] = ()
        self._waited = False
        self._post(x)

    @property
    def done(self) -> bool:
        return self._stage >= len(self._route.stages)

    def advance(self) -> None:
        """If a stage is in flight and a stage that communicates follows it, finish it and post the next."""
        stages = self._route.stages
        if self._stage < len(stages) and any(not _trivial(s) for s in stages[self._stage + 1:]):
            self._finish()
            self._post(self._buf)

    def wait(self) -> torch.Tensor:
        """Finish every stage; the output, rows in source order."""
        if self._waited:
            raise RuntimeError(f"{self._op}: wait() was already called on this exchange")
        self._waited = True
        while not self.done:
            self._finish()
            if not self.done:
                self._post(self._buf)
        out = self._buf
        self._buf = None
        idx = self._route.final_index
        return out if idx is None else out.index_select(0, idx)

    def _what(self, stage: StagePlan) -> Callable[[], timeouts.OpName]:
        """The current stage's name for errors, made only when one is raised (:data:`timeouts.Named`)."""
        ranks, number = self._comm.layout.ranks, self._stage + 1
        return lambda: timeouts.OpName(op=self._op, stage=f"stage {number}/{len(self._route.stages)} "
                                       f"({stage.spec.name})", ranks=tuple(ranks[m] for m in stage.members),
                                       rank=self._comm.global_rank)

    def _post(self, buf: torch.Tensor) -> None:
        """Post the current stage; first run locally every stage that is trivial on every member
        (possibly all the remaining ones, leaving the output in ``_buf`` and nothing in flight)."""
        stages = self._route.stages
        while self._stage < len(stages) and _trivial(stages[self._stage]):
            index = stages[self._stage].send_index
            buf = buf if index is None else buf.index_select(0, index)
            self._stage += 1
        if self._stage >= len(stages):
            self._buf, self._works, self._keep = buf.contiguous(), [], ()
            return
        stage = stages[self._stage]
        if stage.send_index is not None:
            buf = buf.index_select(0, stage.send_index)
        buf = buf.contiguous()
        if len(stage.members) == 1:  # a group of one here (not on every member): the data stays
            self._buf, self._works, self._keep = buf, [], ()
            return
        out = buf.new_empty((sum(stage.output_splits), *buf.shape[1:]))
        what = self._what(stage)
        if stage.spec.p2p or _is_gloo(self._comm.group):
            # gloo's all_to_all_single often runs a link one direction at a time, on every stage of a
            # hierarchical exchange as on a flat one; point-to-point messages with every receive
            # posted first use both directions (same rows, same order)
            works = timeouts.launch(what, lambda: _post_p2p(out, buf, stage, self._comm))
        else:
            group = self._comm.group_for(stage.spec.scope)
            works = [timeouts.launch(what, lambda: dist.all_to_all_single(
                out, buf, list(stage.output_splits), list(stage.input_splits), group=group, async_op=True))]
        self._buf, self._works, self._keep = out, works, (buf,)

    def _finish(self) -> None:
        stage = self._route.stages[self._stage]
        timeout, what = self._comm.timeout if self._comm.host_timeout else None, self._what(stage)
        for work in self._works:
            timeouts.wait(work, what, timeout)
        self._works, self._keep = [], ()
        self._stage += 1


def _is_gloo(group: dist.ProcessGroup) -> bool:
    return str(dist.get_backend(group)) == "gloo"


def _trivial(stage: StagePlan) -> bool:
    """A stage whose groups all have one member: no rank sends anything in it."""
    return all(len(group) == 1 for group in stage.spec.members)


def _post_p2p(out: torch.Tensor, buf: torch.Tensor, stage: StagePlan, comm: A2AComm) -> list[dist.Work]:
    """Point-to-point stage: one message per peer with rows (empty ones are not sent: both sides
    know the counts); the rows that stay are copied locally. ``batch_isend_irecv`` groups the
    messages, which NCCL needs when two ranks send to each other. Every receive is posted before
    any send (gloo runs the ops in list order): a link then carries both directions at once."""
    ranks, recv_ops, send_ops = comm.layout.ranks, [], []
    sends = torch.split(buf, list(stage.input_splits))  # by group rank, as members
    recvs = torch.split(out, list(stage.output_splits))
    for i, peer in enumerate(stage.members):
        if peer == comm.me:
            recvs[i].copy_(sends[i])
            continue
        if recvs[i].shape[0]:
            recv_ops.append(dist.P2POp(dist.irecv, recvs[i], ranks[peer], group=comm.group))
        if sends[i].shape[0]:
            send_ops.append(dist.P2POp(dist.isend, sends[i].contiguous(), ranks[peer], group=comm.group))
    ops = recv_ops + send_ops
    return dist.batch_isend_irecv(ops) if ops else []


def start_exchange(x: torch.Tensor, plan: ExchangePlan, *, backward: bool = False) -> PendingExchange:
    """Post ``plan`` (its backward direction if ``backward``) on ``x``; no autograd."""
    route = plan.backward if backward else plan.forward
    if any(i is not None for i in _indices(route)):
        check_device(x, plan.device, "plan_exchange")
    return PendingExchange(x, route, plan.comm, f"{plan.label} ({'backward' if backward else 'forward'})")


def _indices(route: Route) -> list[torch.Tensor | None]:
    return [stage.send_index for stage in route.stages] + [route.final_index]


def check_device(x: torch.Tensor, device: torch.device, planner: str) -> None:
    """Index tensors of a plan live on ``device``; ``x`` must be there too."""
    same = x.device.type == device.type and (x.device.index is None or device.index is None
                                              or x.device.index == device.index)
    if not same:
        raise SpecError("x.device", str(x.device), f"must be where {planner} put its index tensors ({device})",
                        f"pass device=x.device to {planner}")


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        return start_exchange(x, plan).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return start_exchange(grad.contiguous(), ctx.plan, backward=True).wait(), None


def exchange(x: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    """Run ``plan`` on ``x`` ``[rows_in, ...]`` -> ``[rows_out, ...]``, differentiable."""
    return _Exchange.apply(x, plan)


def all_to_all(x: torch.Tensor, counts: Sequence[Sequence[int]] | torch.Tensor, *, comm: A2AComm,
               algorithm: Algorithm, label: str = "all-to-all") -> torch.Tensor:
    """``all_to_all_single`` by ``algorithm``, differentiable; ``counts[s][d]`` as in :func:`plan_exchange`."""
    return exchange(x, plan_exchange(counts, comm=comm, algorithm=algorithm, label=label, device=x.device))


def all_to_all_flat(x: torch.Tensor, *, input_splits: Sequence[int], output_splits: Sequence[int],
                    comm: A2AComm, label: str = "all-to-all") -> torch.Tensor:
    """Exactly ``all_to_all_single(out, x, output_splits, input_splits)``, differentiable."""
    return exchange(x, flat_plan(input_splits, output_splits, comm=comm, label=label))
