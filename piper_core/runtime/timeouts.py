"""Every collective of the runtime has a deadline, and a failure names the operation and the ranks.

Two mechanisms, both verified on gloo with torch 2.13 (tests/runtime/test_alltoall.py):

* the process groups are created with ``timeout`` (``dist.new_group(..., timeout=...)``): gloo
  aborts a send or receive that waits longer ("Timed out waiting ...ms for send operation"), NCCL's
  watchdog aborts the communicator;
* each wait is ``work.wait(timeout=...)`` (when ``host_timeout`` is set): the host stops waiting
  after ``timeout`` even if the backend would wait longer (gloo: "Operation timed out!").

A peer that dies (killed, crashed, its node rebooted with the sockets reset) needs neither: gloo
fails every wait on a connection to it at once ("Connection closed by peer [addr]:port", seen
within ~0.1 s on loopback, tests/megatron/test_faults.py). NCCL rarely sees a dead peer; there the
group's timeout, enforced by its watchdog, is the deadline (docs/megatron.md, "Faults and deadlines").

Every error is re-raised as :class:`CollectiveError` (the backend's error kept as ``__cause__``),
which says which exchange and stage failed, on which group (global ranks), on which rank, whether
it timed out or lost a peer, and what usually causes it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, TypeVar

import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class OpName:
    """What a collective is, for error messages: ``op`` (the exchange, e.g. "hierarchical all-to-all
    'dispatch chunk 2/4' (forward)"), ``stage`` (e.g. "stage 2/2 inter-node (same local index)"),
    ``ranks`` (global ranks of the group it runs on) and ``rank`` (this process's global rank)."""

    op: str
    stage: str
    ranks: tuple[int, ...]
    rank: int


Kind = Literal["timeout", "peer gone", "failed"]
# how backends word a connection to a dead peer (gloo: "Connection closed by peer", "Connection reset
# by peer"; a send into a closed socket: "Broken pipe")
_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused")
# gloo's "[.../pair.cc:553] " prefix and its advice after the error ("This is typically caused by a remote
# worker crashing. ... GLHF!"): left out of the message, kept in the cause
_NOISE = re.compile(r"^\[[^\]]+:\d+\]\s*|\s*This is typically caused by .*$")


def kind_of(cause: BaseException) -> Kind:
    """What a backend error means for the exchange: it ran out of time, a peer's connection is
    gone (the peer died), or something else failed."""
    text = str(cause).lower()
    if isinstance(cause, TimeoutError) or "timed out" in text or "timeout" in text:
        return "timeout"
    return "peer gone" if any(s in text for s in _GONE) else "failed"


def first_line(cause: BaseException) -> str:
    """The backend's error in one line, without gloo's source-location prefix and generic advice."""
    text = str(cause).strip()
    return _NOISE.sub("", text.splitlines()[0]).rstrip(".") if text else type(cause).__name__


class CollectiveError(RuntimeError):
    """A collective of the runtime failed or did not complete within its timeout; ``kind`` says
    which (:func:`kind_of`), ``cause`` is the backend's error (also ``__cause__``)."""

    def __init__(self, what: OpName, *, timeout: timedelta | None, cause: BaseException, posting: bool = False):
        self.what, self.timeout, self.cause, self.kind = what, timeout, cause, kind_of(cause)
        others = [r for r in what.ranks if r != what.rank]
        limit = f"within {timeout.total_seconds():g} s" if timeout is not None else "within the group's timeout"
        first = first_line(cause)
        if posting:
            failed = "could not post it"
        elif self.kind == "peer gone":
            failed = "lost a peer in it"
        else:
            failed = f"did not complete it {limit}" if self.kind == "timeout" else "saw it fail"
        if self.kind == "peer gone":
            hint = (f"A peer is gone: one of ranks {others} exited, crashed or was killed (its own log says why; "
                    "the errors of the other ranks follow from it).")
        else:
            hint = (f"A peer is missing: one of ranks {others} skipped this call, ran the exchanges in a different "
                    "order (algorithm, chunks and counts must match on every rank), or died; fix that peer, or pass "
                    "a larger timeout to create_comm if it is only slow.")
        super().__init__(f"{what.op}, {what.stage}, on global ranks {list(what.ranks)}: rank {what.rank} {failed} "
                         f"({type(cause).__name__}: {first}). {hint}")


Named = OpName | Callable[[], OpName]
"""A collective's name, or a function that makes it: the runtime's exchanges pass the function, so the
name (strings and tuples, built for every stage of every exchange) is made only when a message needs it."""


def _name(what: Named) -> OpName:
    return what if isinstance(what, OpName) else what()


def launch(what: Named, start: Callable[[], T]) -> T:
    """Run ``start`` (which posts a collective and returns its work handle), naming any failure."""
    try:
        return start()
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(_name(what), timeout=None, cause=e, posting=True) from e


def wait(work: dist.Work, what: Named, timeout: timedelta | None) -> None:
    """Wait for ``work``; at most ``timeout`` (None: rely on the process group's own timeout)."""
    try:
        done = work.wait() if timeout is None else work.wait(timeout=timeout)
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(_name(what), timeout=timeout, cause=e) from e
    if done is False:
        raise CollectiveError(_name(what), timeout=timeout, cause=TimeoutError("work.wait returned False"))
