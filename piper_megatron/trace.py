"""``--piper-trace FILE``: per MoE layer and rank, the forward dispatch, expert and combine times
and the tokens per local expert, as JSON lines.

One line per forward call of a MoE layer (micro-batches and recomputed forwards each get one)::

    {"rank": 0, "layer": 3, "call": 0, "dispatch_ms": 0.41, "expert_ms": 2.9, "combine_ms": 0.37,
     "algorithm": "flat", "chunks": 4, "tokens_sent": 512, "tokens_received": 498,
     "first_expert": 8, "tokens_per_expert": [130, 121, 126, 121]}

``layer`` is Megatron's 1-based ``layer_number``; ``call`` counts that layer's forwards on this
rank; ``tokens_per_expert`` are the tokens the local experts ``first_expert, first_expert + 1, ...``
received. Under an expert placement (``--piper-placement``) those are physical slots, and the
record adds ``logical_experts``: the logical expert each local slot holds, so that a histogram read
from the trace (``piper --routing``) counts logical experts whatever the placement.
Phases: ``dispatch`` from the start of ``token_dispatch``, ``expert`` from
``routed_experts_compute`` (Megatron's sort by local expert, the experts and the unsort),
``combine`` from ``token_combine`` to its end. In the pipelined all-to-all the phases interleave:
each schedule event (post or wait of a chunk's exchange, a chunk's experts) that changes the phase
starts an interval charged to the new phase, so the three add up to the layer's time and
``dispatch_ms + combine_ms`` is the all-to-all time the experts did not hide.

Cheap enough to leave on (tests/megatron/bench_trace.py): per layer a few clock stamps and one
dict, about 15 us of host time, written in batches. On CUDA the stamps are ``torch.cuda.Event`` s,
read when a batch is written and only once complete (no synchronisation; :meth:`Tracer.close`
waits for the rest); on the host ``time.perf_counter_ns``. Each rank writes its own file: ``FILE``
in a one-process job, else ``FILE`` with ``.rank<R>`` before the suffix.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

PHASES = ("dispatch", "expert", "combine")


class HostClock:
    """Wall-clock stamps on the host (nanoseconds)."""

    def stamp(self) -> int:
        return time.perf_counter_ns()

    def elapsed_ms(self, start: int, end: int) -> float:
        return (end - start) / 1e6

    def ready(self, stamp: Any) -> bool:
        return True

    def settle(self, stamp: Any) -> None:
        return None


class CudaClock:
    """Stamps on the current CUDA stream; read only when a batch of records is written."""

    def stamp(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def ready(self, stamp: Any) -> bool:
        return bool(stamp.query())

    def settle(self, stamp: Any) -> None:
        stamp.synchronize()


class LayerRecord:
    """One forward of one MoE layer on this rank, being timed."""

    __slots__ = ("tracer", "fields", "layer", "marks")

    def __init__(self, tracer: Tracer, fields: dict[str, Any]):
        self.tracer, self.fields, self.layer = tracer, fields, None
        self.marks: list[tuple[str, Any]] = []

    def mark(self, phase: str) -> None:
        """From now on the time goes to ``phase`` (one of :data:`PHASES`); a mark of the phase
        already running costs nothing (its interval simply goes on)."""
        if not self.marks or self.marks[-1][0] != phase:
            self.marks.append((phase, self.tracer.clock.stamp()))

    def finish(self) -> None:
        self.marks.append(("end", self.tracer.clock.stamp()))
        self.tracer.done(self)


class Tracer:
    """Collects :class:`LayerRecord` s of one rank and writes them to ``path`` as JSON lines."""

    def __init__(self, path: Path, *, rank: int, clock: HostClock | CudaClock | None = None, batch: int = 256):
        self.path, self.rank, self.batch = Path(path), rank, batch
        self.clock = clock if clock is not None else (CudaClock() if torch.cuda.is_available() else HostClock())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self._pending: list[LayerRecord] = []
        self._since_flush = 0
        self._calls: dict[int | None, int] = {}

    @classmethod
    def for_rank(cls, path: Path, *, rank: int, world_size: int) -> Tracer:
        """The tracer of ``rank``, writing ``path`` (one process) or ``<stem>.rank<R><suffix>``."""
        path = Path(path)
        if world_size > 1:
            path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
        return cls(path, rank=rank)

    def begin(self, *, algorithm: str, chunks: int, meta: Any, first_expert: int,
              logical_experts: Sequence[int] | None = None) -> LayerRecord:
        """A record for one layer forward; ``meta`` is the step's ``DispatchMeta``; ``logical_experts``
        the logical expert of each local slot under a placement (None: slot = logical expert)."""
        fields = {"algorithm": algorithm, "chunks": chunks, "tokens_sent": meta.rows_in,
                  "tokens_received": meta.rows_out, "first_expert": first_expert,
                  "tokens_per_expert": list(meta.tokens_per_expert)}
        if logical_experts is not None:
            fields["logical_experts"] = [int(e) for e in logical_experts]
        return LayerRecord(self, fields)

    def done(self, record: LayerRecord) -> None:
        self._pending.append(record)
        self._since_flush += 1
        if self._since_flush >= self.batch:
            self.flush(wait=False)

    def flush(self, *, wait: bool = True) -> None:
        """Write the pending records whose clocks can be read: all of them with ``wait`` (on CUDA:
        after synchronising with the last event), else those already complete, in order, without
        stalling the device queue."""
        self._since_flush = 0
        if wait and self._pending:
            self.clock.settle(self._pending[-1].marks[-1][1])
        ready = 0
        while ready < len(self._pending) and (wait or self.clock.ready(self._pending[ready].marks[-1][1])):
            ready += 1
        if not ready:
            return
        lines = [json.dumps(self._line(r)) for r in self._pending[:ready]]
        del self._pending[:ready]
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")

    def _line(self, record: LayerRecord) -> dict[str, Any]:
        times = dict.fromkeys(PHASES, 0.0)
        for (phase, start), (_, end) in zip(record.marks, record.marks[1:]):
            times[phase] += self.clock.elapsed_ms(start, end)
        call = self._calls.get(record.layer, 0)
        self._calls[record.layer] = call + 1
        head = {"rank": self.rank, "layer": record.layer, "call": call}
        return head | {f"{p}_ms": round(times[p], 4) for p in PHASES} | record.fields

    def close(self) -> None:
        self.flush()


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The records of one trace file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
