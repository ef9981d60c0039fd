"""Every collective of the runtime has a deadline, and a failure names the operation and the ranks.

Two mechanisms, both verified on gloo with torch 2.13 (tests/runtime/test_alltoall.py):

* the process groups are created with ``timeout`` (``dist.new_group(..., timeout=...)``): gloo
  aborts a send or receive that waits longer ("Timed out waiting ...ms for send operation"), NCCL's
  watchdog aborts the communicator;
* each wait is ``work.wait(timeout=...)`` (when ``host_timeout`` is set): the host stops waiting
  after ``timeout`` even if the backend would wait longer (gloo: "Operation timed out!").

Either error is re-raised as :class:`CollectiveError`, which says which exchange and stage failed,
on which group (global ranks), on which rank, and what usually causes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

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


class CollectiveError(RuntimeError):
    """A collective of the runtime failed or did not complete within its timeout."""

    def __init__(self, what: OpName, *, timeout: timedelta | None, cause: BaseException, posting: bool = False):
        self.what, self.timeout, self.cause = what, timeout, cause
        limit = f"within {timeout.total_seconds():g} s" if timeout is not None else "within the group's timeout"
        failed = "could not post it" if posting else f"did not complete it {limit}"
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(
            f"{what.op}, {what.stage}, on global ranks {list(what.ranks)}: rank {what.rank} {failed} "
            f"({type(cause).__name__}: {first}). A peer is missing: one of ranks "
            f"{[r for r in what.ranks if r != what.rank]} skipped this call, ran the exchanges in a "
            "different order (algorithm, chunks and counts must match on every rank), or died; fix "
            "that peer, or pass a larger timeout to create_comm if it is only slow.")


def launch(what: OpName, start: Callable[[], T]) -> T:
    """Run ``start`` (which posts a collective and returns its work handle), naming any failure."""
    try:
        return start()
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(what, timeout=None, cause=e, posting=True) from e


def wait(work: dist.Work, what: OpName, timeout: timedelta | None) -> None:
    """Wait for ``work``; at most ``timeout`` (None: rely on the process group's own timeout)."""
    try:
        done = work.wait() if timeout is None else work.wait(timeout=timeout)
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(what, timeout=timeout, cause=e) from e
    if done is False:
        raise CollectiveError(what, timeout=timeout, cause=TimeoutError("work.wait returned False"))
