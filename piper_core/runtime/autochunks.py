"""Choose ``moe_alltoall``'s chunk count by measuring it (Tutel's adaptive pipelining degree).

Whether cutting the tokens into chunks pays depends on the ratio of communication to expert compute,
which depends on the model, the cluster and the batch: where communication is small, every extra
chunk only adds messages and smaller GEMMs; where it is about as long as the compute, 2-8 chunks hide
much of it. :class:`AutoChunks` finds out at run time. Pass it as ``chunks`` to ``plan_dispatch``::

    auto = AutoChunks(comm, candidates=(1, 2, 4), trials=3)      # one per MoE layer, kept across steps
    for step in ...:
        meta = plan_dispatch(counts, comm=comm, algorithm=alg, chunks=auto)
        y = moe_alltoall(x, meta, experts)                        # times itself, reports to ``auto``
        ...backward...

Schedule: the first ``len(candidates) x trials`` calls of ``plan_dispatch`` use each candidate in
turn (``trials`` steps each, in the order given); ``moe_alltoall`` times each of those layers
(forward + backward, or forward alone under ``no_grad``). The next call decides: one all-reduce
(MAX over the group, with the runtime's timeout) of every candidate's median time, so every rank
sees the slowest rank's times and picks the same count, then the fewest chunks whose time is within
``margin`` of the fastest (noise alone never buys a pipelined setting). From then on that count is
used, with no further measurement or communication, until :meth:`reset`.

Rules: every rank of the group must plan its layers in the same order (as it must anyway, for the
exchanges); the decision happens at the same call on every rank because it is counted in calls, not
in samples. Times are wall clock on the host: on a CUDA device ``moe_alltoall`` records CUDA events
instead and they are read (synchronizing) only when the decision is made.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import timeouts
from piper_core.runtime.groups import A2AComm


#: What the adapters measure when asked to tune the chunk count at run time (``--piper-chunks tune``,
#: ``"chunks": "tune"``): these counts, this many steps each, one :class:`AutoChunks` per MoE layer.
ADAPTER_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8)
ADAPTER_TRIALS = 3
#: How the adapters' reports name that schedule ("1/2/4/8 chunks, 3 steps each").
ADAPTER_TUNING = f"{'/'.join(map(str, ADAPTER_CANDIDATES))} chunks, {ADAPTER_TRIALS} steps each"


class AutoChunks:
    """Measures each of ``candidates`` for ``trials`` steps, then keeps the fastest (see module doc).

    ``margin``: a larger chunk count must be at least this fraction faster than a smaller one to be
    chosen (default 5 %). ``device``: where the decision's all-reduce tensor lives (the
    communication device; CPU for gloo)."""

    def __init__(self, comm: A2AComm, *, candidates: Sequence[int] = (1, 2, 4), trials: int = 3,
                 margin: float = 0.05, device: torch.device | str | None = None):
        cands = tuple(candidates)
        if not cands or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in cands) \
                or len(set(cands)) != len(cands):
            raise SpecError("candidates", cands, "must be distinct ints >= 1", "e.g. (1, 2, 4)")
        if not isinstance(trials, int) or trials < 1:
            raise SpecError("trials", trials, "must be an int >= 1", "3 steps per candidate is usually enough")
        if not 0.0 <= margin < 1.0:
            raise SpecError("margin", margin, "must be in [0, 1)", "0.05: more chunks must win by 5 %")
        self.comm, self.candidates, self.trials, self.margin = comm, cands, trials, margin
        self.device = torch.device(device if device is not None else "cpu")
        self.reset()

    def reset(self) -> None:
        """Forget every measurement and the choice; the next calls measure again (on every rank)."""
        self._calls = 0
        self._samples: dict[int, list[_Timer]] = {c: [] for c in self.candidates}
        self.chosen: int | None = None
        self.medians_s: dict[int, float] | None = None

    @property
    def tuning(self) -> bool:
        """True while the counts handed out are being measured."""
        return self.chosen is None

    def next_chunks(self) -> int:
        """The chunk count for this call (``plan_dispatch`` calls it once per planned layer)."""
        if self.chosen is not None:
            return self.chosen
        step = self._calls
        self._calls += 1
        if step < len(self.candidates) * self.trials:
            return self.candidates[step // self.trials]
        self._decide()
        assert self.chosen is not None
        return self.chosen

    def start(self, chunks: int, device: torch.device) -> _Timer | None:
        """A timer for one layer run with ``chunks`` (None once decided: nothing is measured)."""
        if self.chosen is not None or chunks not in self._samples:
            return None
        timer = _Timer(device)
        self._samples[chunks].append(timer)
        return timer

    def _decide(self) -> None:
        inf = float("inf")
        mine = [statistics.median(t.seconds() for t in self._samples[c]) if self._samples[c] else inf
                for c in self.candidates]
        t = torch.tensor(mine, dtype=torch.float64, device=self.device)
        if self.comm.size > 1:
            what = timeouts.OpName(op="AutoChunks decision (all-reduce of measured layer times)", stage="stage 1/1",
                                   ranks=self.comm.layout.ranks, rank=self.comm.global_rank)
            work = timeouts.launch(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.comm.group,
                                                                 async_op=True))
            timeouts.wait(work, what, self.comm.timeout if self.comm.host_timeout else None)
        slowest = dict(zip(self.candidates, t.cpu().tolist()))
        self.medians_s = slowest
        self.chosen = choose(slowest, self.margin)
        self._samples = {c: [] for c in self.candidates}


def choose(times_s: dict[int, float], margin: float) -> int:
    """The fewest chunks whose time is within ``margin`` of the fastest candidate's."""
    best = min(times_s.values())
    return min(c for c, t in times_s.items() if t <= best * (1.0 + margin))


class _Timer:
    """Accumulates the time of one layer's forward and backward (host clock, or CUDA events)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._host = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._open: float | torch.cuda.Event | None = None

    def begin(self) -> None:
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open = ev
        else:
            self._open = time.perf_counter()

    def end(self) -> None:
        if self._open is None:
            return
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((self._open, ev))  # type: ignore[arg-type]
        else:
            self._host += time.perf_counter() - self._open  # type: ignore[operator]
        self._open = None

    def seconds(self) -> float:
        total = self._host
        for start, stop in self._events:
            stop.synchronize()
            total += start.elapsed_time(stop) / 1e3
        return total
