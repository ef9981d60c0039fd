"""Pipelined dispatch -> experts -> combine: chunk ``k + 1``'s all-to-all runs while chunk ``k``'s
experts compute, in forward and in backward.

Forward schedule (every rank runs the same one, so collectives are posted in the same order on every
group; chunk ``k``: ``D_k`` dispatch, ``E_k`` experts, ``C_k`` combine)::

    post D_0
    for k: post D_{k+1}; wait D_k; advance in-flight; E_k; post C_k
    wait C_0 .. C_{n-1}; put rows back in x's order

Backward mirrors it: post the gradient of ``C_0`` (and ``C_{k+1}`` before waiting ``C_k``), run
``E_k``'s backward while the next one is in flight, post the gradient of ``D_k`` right after, wait
them all at the end. "advance in-flight" moves every multi-stage exchange in flight to its next
stage (e.g. the inter-node stage of a hierarchical exchange) so that it, too, overlaps the experts.

Why one autograd Function with an explicit backward schedule rather than start/wait nodes left to
the autograd engine: the engine orders nodes by their creation sequence and readiness, which depends
on the expert function's graph; a rank whose graph differs (say, an expert skipped for having no
tokens) could post its collectives in another order and, on gloo, exchange the wrong data silently.
Here the order is fixed by this code. The expert graph of each chunk is built in forward on detached
inputs and run backward chunk by chunk (as reentrant activation checkpointing does); the expert
function may depend only on its arguments and on leaf tensors (its parameters).
``chunks == 1`` runs exactly the unpipelined path.

Parameter gradients, and why ``params`` matters: a parameter used by ``C`` chunks would receive
``C`` separate accumulations if each chunk's graph were run backward into ``.grad``, and every
per-parameter gradient hook would fire ``C`` times. Frameworks count those hooks: Megatron-Core's
DDP with ``overlap_grad_reduce`` records in its first step how often each parameter's hook fires
(``_ParamAndGradBuffer`` bucket groups, ``golden_per_param_grad_ready_counts``) and launches a
bucket's reduction when the counts match again, so a chunk count that changes between steps
(``AutoChunks``) launches the reduction after the first chunk's gradient (wrong gradients, silently)
or never (an assertion in ``finish_grad_sync``); DeepSpeed's ZeRO-2 allows one reduce per parameter.
Pass the experts' parameters as ``params``: each chunk's backward then computes their gradients with
``torch.autograd.grad`` (no accumulation, no hook), the call sums them over the chunks and hands the
sum to autograd as the gradient of its own inputs, so each parameter gets exactly one accumulation
per backward, as with an unchunked layer, whatever the chunk count. Every parameter the experts use
must be in ``params`` (a leaf left out would get no gradient at all); parameters that received no
gradient in any chunk get zeros, so their hooks fire as well. Without ``params`` the chunks
accumulate into ``.grad`` directly (hooks fire once per chunk).

When ``meta`` was planned with an :class:`~piper_core.runtime.autochunks.AutoChunks` that is still
measuring (``meta.tuner``), the call times its forward and its backward (each from entry to return,
experts included) and reports the sum to the tuner.

``defer_wgrad`` (needs ``params``): each chunk's expert backward computes the input gradients
first, posts the gradient of its dispatch, and only then the experts' weight gradients
(:func:`~piper_core.runtime.wgrad.split_backward`), so the weight GEMMs run while that exchange is in
flight; unpipelined (``chunks == 1``) too, where it is the only overlap in backward. Every gradient
is bit-identical to the undeferred backward (the same autograd nodes on the same tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import torch

from piper_core.errors import SpecError
from piper_core.runtime.alltoall import ExchangePlan, PendingExchange, check_device, start_exchange
from piper_core.runtime.dispatch import DispatchMeta, take
from piper_core.runtime.wgrad import WeightPass, split_backward


class ExpertFn(Protocol):
    """Runs the local experts: ``tokens`` ``[T, ...]`` grouped by local expert,
    ``tokens_per_expert[e]`` rows each (sum = T), ``probs`` ``[T, ...]`` or None -> ``[T, ...]``
    (Megatron's ``SequentialMLP.forward(hidden, tokens_per_expert, probs)`` has this shape)."""

    def __call__(self, tokens: torch.Tensor, tokens_per_expert: tuple[int, ...],
                 probs: torch.Tensor | None) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleEvent:
    """One step of the schedule, reported to ``on_event`` (tests check the overlap with these;
    benchmarks may time-stamp them)."""

    direction: Literal["forward", "backward"]
    action: Literal["post", "wait", "experts", "wgrad"]
    exchange: Literal["dispatch", "combine", "none"]
    chunk: int


EventFn = Callable[[ScheduleEvent], None]
_T = TypeVar("_T")


def moe_alltoall(x: torch.Tensor, meta: DispatchMeta, experts: ExpertFn, *, probs: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] = (), on_event: EventFn | None = None,
                 defer_wgrad: bool = False) -> torch.Tensor:
    """Dispatch ``x`` ``[rows_in, ...]`` (and ``probs`` ``[rows_in, ...]``, moved alongside) to the
    experts, run ``experts`` per chunk, combine: -> ``[rows_in, ...]`` in ``x``'s order.
    Differentiable in ``x``, ``probs`` and the experts' parameters; ``meta`` from ``plan_dispatch``.
    ``params``: every parameter the experts use; each then gets one gradient accumulation per
    backward whatever the chunk count (see the module doc; the adapters always pass them).
    ``defer_wgrad``: compute their gradients after posting each chunk's dispatch gradient (module doc)."""
    for key, t in (("x", x), ("probs", probs)):
        if t is not None and t.shape[0] != meta.rows_in:
            raise SpecError(f"{key}.shape[0]", t.shape[0], f"must equal the tokens this rank sends "
                            f"({meta.rows_in}, the sum of its row of counts)",
                            "plan_dispatch with this step's counts; sort tokens by expert")
    check_device(x, meta.device, "plan_dispatch")
    trained = tuple(p for p in params if p.requires_grad)
    if defer_wgrad and not trained:
        raise SpecError("defer_wgrad", True, "needs the experts' trained parameters in params (the gradients it "
                        "defers)", "pass params=<the experts' parameters>, or defer_wgrad=False")
    run = _Run(meta=meta, experts=experts, on_event=on_event, x=x, probs=probs, params=trained, defer=defer_wgrad)
    if not torch.is_grad_enabled():
        return run.timed(run.forward, x, probs, build_graph=False)
    anchor = torch.empty(0, requires_grad=True)  # the output needs a graph even if only parameters do
    return _Pipelined.apply(run, x, probs, anchor, *trained)


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Run, x: torch.Tensor, probs: torch.Tensor | None,  # type: ignore[override]
                anchor: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        return run.timed(run.forward, x, probs, build_graph=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.run is None:
            raise RuntimeError("moe_alltoall: backward ran twice through one call; the experts' graphs are "
                               "freed after the first (retain_graph is not supported); run the layer again")
        run, ctx.run = ctx.run, None
        gx, gp = run.timed(run.backward, grad)
        return None, gx, gp, None, *run.param_grads()


class _Run:
    """The state of one call (what forward keeps for backward); never outlives it."""

    def __init__(self, *, meta: DispatchMeta, experts: ExpertFn, on_event: EventFn | None,
                 x: torch.Tensor, probs: torch.Tensor | None, params: tuple[torch.Tensor, ...] = (),
                 defer: bool = False):
        self.meta, self.experts, self.on_event, self.params, self.defer = meta, experts, on_event, params, defer
        self.grads: list[torch.Tensor | None] = [None] * len(params)  # summed over the chunks' backward
        self.kinds = [(t.dtype, tuple(t.shape[1:])) for t in (x, probs) if t is not None]
        self.saved: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None] = []
        self.inflight: list[PendingExchange] = []
        self.timer = None if meta.tuner is None else meta.tuner.start(meta.chunks, x.device)

    def timed(self, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """``fn(*args, **kwargs)``, its duration added to the tuner's timer (if any)."""
        if self.timer is None:
            return fn(*args, **kwargs)
        self.timer.begin()
        try:
            return fn(*args, **kwargs)
        finally:
            self.timer.end()

    def _event(self, direction: str, action: str, exchange: str, k: int) -> None:
        if self.on_event is not None:
            self.on_event(ScheduleEvent(direction=direction, action=action, exchange=exchange, chunk=k))

    def _post(self, x: torch.Tensor, plan: ExchangePlan, backward: bool, direction: str, name: str,
              k: int) -> PendingExchange:
        self._event(direction, "post", name, k)
        pending = start_exchange(x, plan, backward=backward)
        self.inflight.append(pending)
        return pending

    def _wait(self, pending: PendingExchange, direction: str, name: str, k: int) -> torch.Tensor:
        self._event(direction, "wait", name, k)
        out = pending.wait()
        self.inflight.remove(pending)
        return out

    def _advance(self) -> None:
        for pending in self.inflight:  # launch order: the same on every rank
            pending.advance()

    def forward(self, x: torch.Tensor, probs: torch.Tensor | None, *, build_graph: bool) -> torch.Tensor:
        chunks = self.meta.chunk

        def post_dispatch(k: int) -> PendingExchange:
            sent = pack([take(x, chunks[k].rows), take(probs, chunks[k].rows)])
            return self._post(sent, chunks[k].dispatch, False, "forward", "dispatch", k)

        disp, comb = {0: post_dispatch(0)}, []
        for k, ch in enumerate(chunks):
            if k + 1 < len(chunks):
                disp[k + 1] = post_dispatch(k + 1)
            y = self._wait(disp.pop(k), "forward", "dispatch", k)
            self._advance()
            out = self._experts(k, take(y, ch.to_experts), build_graph)
            comb.append(self._post(take(out, ch.from_experts), ch.combine, False, "forward", "combine", k))
        z = [self._wait(p, "forward", "combine", k) for k, p in enumerate(comb)]
        return take(torch.cat(z) if len(z) > 1 else z[0], self.meta.restore)

    def _experts(self, k: int, y: torch.Tensor, build_graph: bool) -> torch.Tensor:
        tokens, probs = unpack(y, self.kinds)
        counts = self.meta.chunk[k].tokens_per_expert
        self._event("forward", "experts", "none", k)
        if build_graph:
            with torch.enable_grad():
                tokens = tokens.detach().requires_grad_(True)
                probs = None if probs is None else probs.detach().requires_grad_(True)
                out = self.experts(tokens, counts, probs)
            self.saved.append((tokens, probs, out))
            out = out.detach()
        else:
            out = self.experts(tokens, counts, probs)
        if out.shape[0] != tokens.shape[0]:
            raise SpecError("experts(...).shape[0]", out.shape[0], f"must equal its input's rows ({tokens.shape[0]})",
                            "return one output row per token, in the order given")
        return out

    def backward(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        chunks, grad = self.meta.chunk, grad.contiguous()
        back = {0: self._post(take(grad, chunks[0].rows), chunks[0].combine, True, "backward", "combine", 0)}
        disp = []
        for k, ch in enumerate(chunks):
            if k + 1 < len(chunks):
                back[k + 1] = self._post(take(grad, chunks[k + 1].rows), chunks[k + 1].combine, True,
                                         "backward", "combine", k + 1)
            g_out = self._wait(back.pop(k), "backward", "combine", k)
            self._advance()
            g_in, weight_pass = self._experts_backward(k, take(g_out, ch.to_experts))
            disp.append(self._post(take(g_in, ch.from_experts), ch.dispatch, True, "backward", "dispatch", k))
            if weight_pass is not None:  # defer_wgrad: the weight GEMMs while that gradient is in flight
                self._event("backward", "wgrad", "none", k)
                self._add_param_grads(weight_pass())
        g = [self._wait(p, "backward", "dispatch", k) for k, p in enumerate(disp)]
        gx, gp = unpack(take(torch.cat(g) if len(g) > 1 else g[0], self.meta.restore), self.kinds)
        return gx, gp

    def _experts_backward(self, k: int, grad_out: torch.Tensor) -> tuple[torch.Tensor, WeightPass | None]:
        """Backward of chunk ``k``'s experts: packed gradients of their inputs (tokens, probs), and
        with ``defer`` the pass that computes the parameters' (else they are already summed)."""
        tokens, probs, out = self.saved[k]  # type: ignore[misc]
        self.saved[k] = None
        self._event("backward", "experts", "none", k)
        inputs = [t for t in (tokens, probs) if t is not None]
        weight_pass = None
        if not out.requires_grad:
            got: list[torch.Tensor | None] = [None] * (len(inputs) + len(self.params))
        elif self.defer:
            got, weight_pass = split_backward(out, grad_out, inputs, self.params)
        elif self.params:  # gradients returned, not accumulated: one accumulation per parameter in backward()
            got = list(torch.autograd.grad(out, [*inputs, *self.params], grad_out, allow_unused=True))
        else:
            torch.autograd.backward(out, grad_out)
            got = [t.grad for t in inputs]
        self._add_param_grads(got[len(inputs):])
        return pack([g if g is not None else torch.zeros_like(t) for t, g in zip(inputs, got)]), weight_pass

    def _add_param_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.grads[i] = g if self.grads[i] is None else self.grads[i] + g

    def param_grads(self) -> list[torch.Tensor]:
        """Each of ``params``' gradient summed over the chunks (zeros where no chunk gave one)."""
        return [g if g is not None else torch.zeros_like(p) for p, g in zip(self.params, self.grads)]


def pack(parts: list[torch.Tensor | None]) -> torch.Tensor:
    """Rows of several tensors side by side as bytes ``[T, bytes]`` (one message instead of several;
    a lone tensor passes through unchanged). ``None`` parts are skipped."""
    real = [p for p in parts if p is not None]
    if len(real) == 1:
        return real[0]
    return torch.cat([p.contiguous().reshape(p.shape[0], math.prod(p.shape[1:])).view(torch.uint8)
                      for p in real], dim=1)


def unpack(buf: torch.Tensor, kinds: list[tuple[torch.dtype, tuple[int, ...]]]
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`pack` for (tokens, probs) of the given (dtype, trailing shape)."""
    if len(kinds) == 1:
        return buf, None
    out, col = [], 0
    for dtype, shape in kinds:
        width = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        part = buf[:, col:col + width].contiguous().view(dtype).reshape(buf.shape[0], *shape)
        out.append(part)
        col += width
    return out[0], out[1]
