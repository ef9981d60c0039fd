"""Moving experts between expert-parallel ranks between two steps: the part every framework shares
(issue 17, deliverable 3). :mod:`piper_megatron.migrate` and :mod:`piper_deepspeed.migrate` say what
moves with an expert (weights, gradients, the optimizer's state) and switch their dispatchers; this
module plans the move and carries the bytes.

Every rank calls, between the same two steps:

1. :func:`plan_moves` -- the same plan on every rank, from the placements in force and the target
   (:func:`piper_core.scheduler.migration.plan_migration`: experts staying on a rank keep their slot);
2. :func:`barrier` (``"before"``), then :func:`exchange`: each rank packs, for every expert it gives a
   peer, the tensors ``tensors_of(layer, local slot)`` names, in that order, into one byte buffer per
   peer (typed copies), posts one ``irecv`` per peer it takes from and one ``isend`` per peer it gives
   to over the expert-parallel group, waits for each within ``timeout`` (a
   :class:`~piper_core.runtime.timeouts.CollectiveError` naming the operation and both ranks, never a
   hang), and copies what it received into place (``copy_``: the tensors stay the same objects, so
   gradient buckets and optimizer references stay valid); moves inside a rank go through a packed
   copy too, so a rank whose slots trade experts reads every source before it writes;
3. :func:`barrier` (``"after"``).

Buffers: :class:`MoveBuffers` keeps the send and receive buffers between migrations, one per peer and
direction, grown to the largest move so far. torch's CPU allocator gives blocks this large back to the
operating system when they are freed, so fresh ones page-fault as they are written, which made a move
of 32 MiB per rank take about twice as long (docs/migration.md, "Measured cost of a move"); CUDA's
caching allocator keeps freed blocks in the same way. The adapter owns the instance (nothing here is
module state).

Checkpoints hold physical slots under the framework's own expert names: :func:`write_placements`
keeps the placement of every MoE layer beside them (``piper_placement.json``, the format of ``piper
placement --out``), :func:`read_placements` reads it back for the adapter to route by before loading.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import timeouts
from piper_core.runtime.placement import ExpertPlacement, LayerPlacements
from piper_core.runtime.placement import read_placements as read_any_placements
from piper_core.scheduler.migration import MigrationPlan, plan_migration

PLACEMENT_NAME = "piper_placement.json"
TensorsOf = Callable[[int, int], list[torch.Tensor]]
"""(layer, local slot) -> the tensors that move with the expert in that slot, in a fixed order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrationReport:
    """What one rank did: the plan, the bytes it sent and received, and the exchange's seconds
    (packing, the point-to-point exchange and unpacking, between two barriers of the EP group)."""

    plan: MigrationPlan
    sent_bytes: int
    received_bytes: int
    seconds: float
    placements: dict[int, ExpertPlacement]
    phases: dict[str, float]  # this rank's seconds packing, exchanging (posting to the last wait), unpacking


def plan_moves(current: Mapping[int, ExpertPlacement],
               target: ExpertPlacement | Mapping[int, ExpertPlacement]) -> tuple[MigrationPlan, dict[int, ExpertPlacement]]:
    """The plan from ``current`` (layer -> placement in force, every MoE layer of this rank) to
    ``target`` (one placement for every layer, or layer -> placement; layers not given keep theirs),
    and the placements after it. SpecError for a layer this rank does not hold, a model without MoE
    layers, and a placement for another expert count or ep."""
    wanted = {n: target for n in current} if isinstance(target, ExpertPlacement) else dict(target)
    first = next(iter(current.values()), None)
    if first is None:
        raise SpecError("model", "no MoE layers", "has no experts to migrate", "migrate a Mixture-of-Experts model")
    unknown = sorted(set(wanted) - set(current))
    if unknown:
        raise SpecError("placement layers", unknown, f"are not MoE layers of this rank (it holds {sorted(current)})",
                        "give placements for this rank's (pipeline stage's) MoE layers")
    for n, p in wanted.items():
        p.check(num_experts=first.num_experts, ep=first.ep, key=f"placement of layer {n}")
    plan = plan_migration({n: p.ranks for n, p in current.items()},
                          {n: wanted.get(n, current[n]).ranks for n in current},
                          num_experts=first.num_experts, ep=first.ep)
    target_ranks = dict(plan.target)
    after = {n: ExpertPlacement(num_experts=first.num_experts, ep=first.ep, ranks=target_ranks[n]) for n in current}
    return plan, after


class MoveBuffers:
    """The exchange's byte buffers, kept between migrations: (direction, peer's global rank) -> buffer
    (module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, direction: str, peer: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the buffer kept for ``direction`` ("send", "receive") with global rank
        ``peer``, grown (reallocated) when a move needs more."""
        kept = self._kept.get((direction, peer))
        if kept is None or kept.numel() < nbytes:
            kept = self._kept[(direction, peer)] = torch.empty(nbytes, dtype=torch.uint8)
        return kept[:nbytes]

    def release(self) -> int:
        """Free the buffers; the bytes they held."""
        held = sum(b.numel() for b in self._kept.values())
        self._kept.clear()
        return held


ALIGN = 8
"""Each tensor starts at a multiple of this many bytes in a packed buffer (the widest element, int64 or
fp64), so that a bf16 tensor of odd length before an fp32 one leaves the next view aligned."""


def _padded(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    return -(-n // ALIGN) * ALIGN


def nbytes(tensors: list[torch.Tensor]) -> int:
    """The packed size of ``tensors``: each one's bytes, padded to :data:`ALIGN`."""
    return sum(_padded(t) for t in tensors)


@torch.no_grad()
def pack(tensors: list[torch.Tensor], buffer: torch.Tensor | None = None) -> torch.Tensor:
    """One byte buffer holding ``tensors`` back to back, each at an :data:`ALIGN`-byte offset (typed
    copies: a uint8 ``cat`` runs byte-wise), in ``buffer`` (its first bytes) when given, else in a new one."""
    buffer = torch.empty(nbytes(tensors), dtype=torch.uint8) if buffer is None else buffer[:nbytes(tensors)]
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        buffer[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += _padded(t)
    return buffer


@torch.no_grad()
def unpack(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> int:
    """Copy ``buffer``'s bytes (:func:`pack`'s layout) into ``tensors`` in order; the bytes read."""
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        t.copy_(buffer[offset:offset + n].view(t.dtype).view(t.shape))
        offset += _padded(t)
    return offset


def exchange(plan: MigrationPlan, tensors_of: TensorsOf, group: Any, ranks: tuple[int, ...], me: int,
             timeout: timedelta, buffers: MoveBuffers) -> tuple[int, int, dict[str, float]]:
    """Pack, exchange point-to-point, unpack (module docstring, step 2): (bytes sent, bytes received,
    the seconds of each phase). ``ranks``: the expert-parallel group's global ranks; ``me``: this
    rank's index in it."""
    t0 = time.perf_counter()
    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[list[torch.Tensor]]] = {}
    local: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for m in plan.moves:  # sorted by (layer, expert): the same order on both ends of a pair
        if m.src_rank == me and m.dst_rank == me:
            local.append((pack(tensors_of(m.layer, m.src_local)), tensors_of(m.layer, m.dst_local)))
        elif m.src_rank == me:
            outgoing.setdefault(m.dst_rank, []).extend(tensors_of(m.layer, m.src_local))
        elif m.dst_rank == me:
            incoming.setdefault(m.src_rank, []).append(tensors_of(m.layer, m.dst_local))
    sends = {peer: pack(parts, buffers.get("send", ranks[peer], nbytes(parts))) for peer, parts in outgoing.items()}
    inbox = {peer: buffers.get("receive", ranks[peer], sum(nbytes(ts) for ts in parts))
             for peer, parts in incoming.items()}
    t1 = time.perf_counter()
    works = []
    for peer, buf in inbox.items():
        what = _op("receive", ranks, me, peer, buf.numel())
        works.append((timeouts.launch(what, lambda b=buf, p=peer: dist.irecv(b, src=ranks[p], group=group)), what))
    for peer, buf in sends.items():
        what = _op("send", ranks, me, peer, buf.numel())
        works.append((timeouts.launch(what, lambda b=buf, p=peer: dist.isend(b, dst=ranks[p], group=group)), what))
    for work, what in works:
        timeouts.wait(work, what, timeout)
    t2 = time.perf_counter()
    for packed, dst in local:
        unpack(packed, dst)
    for peer, parts in incoming.items():
        offset = 0
        for ts in parts:
            offset += unpack(inbox[peer][offset:], ts)
    phases = {"pack": t1 - t0, "exchange": t2 - t1, "unpack": time.perf_counter() - t2}
    return sum(b.numel() for b in sends.values()), sum(b.numel() for b in inbox.values()), phases


def barrier(group: Any, ranks: tuple[int, ...], me: int, timeout: timedelta, when: str) -> None:
    """A barrier of the expert-parallel group, bounded by ``timeout`` (every rank must migrate)."""
    what = timeouts.OpName(op=f"expert migration barrier ({when} the exchange; every rank of the expert-parallel "
                           "group must call migrate)", stage="barrier", ranks=ranks, rank=ranks[me])
    timeouts.wait(timeouts.launch(what, lambda: dist.barrier(group=group, async_op=True)), what, timeout)


def _op(direction: str, ranks: tuple[int, ...], me: int, peer: int, size: int) -> timeouts.OpName:
    other = "to" if direction == "send" else "from"
    return timeouts.OpName(op=f"expert migration {direction} ({size:,} bytes {other} expert-parallel rank {peer}, "
                           f"global rank {ranks[peer]})", stage="point-to-point", ranks=(ranks[me], ranks[peer]),
                           rank=ranks[me])


# ---- checkpoints ---------------------------------------------------------------------------------

def placements_json(placements: Mapping[int, ExpertPlacement]) -> dict[str, Any]:
    """``piper placement --out``'s format: num_experts, ep, layers {layer: each rank's experts}."""
    first = next(iter(placements.values()))
    return LayerPlacements(num_experts=first.num_experts, ep=first.ep, layers=dict(placements)).to_json()


def write_placements(directory: Path | str, placements: Mapping[int, ExpertPlacement]) -> Path:
    """Write ``directory/piper_placement.json`` (the placement the checkpoint's slots hold)."""
    path = Path(directory) / PLACEMENT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(placements_json(placements)) + "\n")
    return path


def read_placements(path: Path | str) -> dict[int, ExpertPlacement]:
    """The placements :func:`write_placements` (or ``piper placement --out``) wrote, by layer
    (a directory: its piper_placement.json; SpecError naming the file otherwise)."""
    path = Path(path)
    if path.is_dir():
        path = path / PLACEMENT_NAME
    placements = read_any_placements(path)
    if not isinstance(placements, LayerPlacements):
        raise SpecError("placement", str(path), "holds one placement for every layer (ranks); a checkpoint's "
                        "placement file lists each MoE layer (layers)", "pass the piper_placement.json saved with "
                        "the checkpoint")
    return dict(placements.layers)
