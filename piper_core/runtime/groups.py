"""Process groups of the runtime all-to-all, created once, explicitly and collectively.

:func:`create_comm` is a collective over the *whole job*: ``torch.distributed.new_group`` must be
entered by every process of the default group, for every sub-group, in the same order. So every
rank calls ``create_comm`` with identical arguments (the same topology and the same list of parent
groups), at the same point of its program, after ``init_process_group``. It creates, per parent
group, a copy of the group (flat stages and point-to-point messages, with the runtime's timeout), one
group per node (intra-node stages) and one group per local index (inter-node stages), runs one
barrier on the calling rank's parent copy, and returns the :class:`A2AComm` of that parent. Nothing is read from the
environment; nothing is cached in module state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import timeouts
from piper_core.runtime.routes import Scope, StageSpec, stage_specs
from piper_core.runtime.topology import Algorithm, NodeTopology, RankLayout, layout_for


@dataclass(frozen=True, kw_only=True, slots=True)
class A2AComm:
    """Everything an exchange needs to know about its group (immutable; share it freely).

    ``layout``: the members on the nodes; ``me``: this rank's member number (= its rank in
    ``group``); ``group``/``intra``/``inter``: process groups for the flat and point-to-point stages,
    this rank's node, and this rank's local index; ``timeout``: deadline of each wait (and of the
    groups); ``host_timeout``: False leaves the deadline to the process group alone (NCCL's
    non-blocking ``wait`` semantics, at the cost of errors that do not name the exchange).
    """

    layout: RankLayout
    me: int
    group: dist.ProcessGroup
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    timeout: timedelta
    host_timeout: bool
    specs: tuple[tuple[Algorithm, tuple[StageSpec, ...]], ...]

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def global_rank(self) -> int:
        return self.layout.ranks[self.me]

    def stages(self, algorithm: Algorithm) -> tuple[StageSpec, ...]:
        """The stage specs of ``algorithm`` on this group (precomputed by :func:`create_comm`)."""
        for alg, specs in self.specs:
            if alg is algorithm:
                return specs
        raise SpecError("algorithm", algorithm, "is not an Algorithm",
                        f"use one of {[a.value for a in Algorithm]}")

    def group_for(self, scope: Scope) -> dist.ProcessGroup:
        return {Scope.ALL: self.group, Scope.INTRA: self.intra, Scope.INTER: self.inter}[scope]


def create_comm(topology: NodeTopology, *, parents: Sequence[Sequence[int]] | None = None,
                timeout: timedelta = timedelta(seconds=60), host_timeout: bool = True) -> A2AComm:
    """Create the groups for every parent group (global ranks; default: one, the whole job) and
    return this rank's :class:`A2AComm`. Collective: every rank calls it with identical arguments.

    ``timeout`` is every group's timeout and, with ``host_timeout``, the host's limit on each wait;
    pass the job's process-group timeout (piper_megatron passes Megatron's
    ``--distributed-timeout-minutes``). ``host_timeout=False`` (NCCL) leaves the deadline to the
    groups' timeout alone."""
    if not dist.is_initialized():
        raise SpecError("torch.distributed", "not initialized", "create_comm creates process groups",
                        "call torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [tuple(p) for p in parents] if parents is not None else [tuple(range(world))]
    _check_parents(groups, world, rank)
    if timeout.total_seconds() <= 0:
        raise SpecError("timeout", timeout, "must be positive", "pass e.g. timedelta(seconds=60)")
    mine: A2AComm | None = None
    for parent in groups:
        layout = layout_for(topology, parent)
        whole = _new_group("PIPER_A2A", list(layout.ranks), timeout)
        nodes = [_new_group("PIPER_A2A_INTRA_NODE", [layout.ranks[m] for m in layout.node_members(n)], timeout)
                 for n in range(layout.num_nodes)]
        locals_ = [_new_group("PIPER_A2A_INTER_NODE", [layout.ranks[m] for m in layout.local_members(j)], timeout)
                   for j in range(layout.per_node)]
        if rank in layout.ranks:
            me = layout.ranks.index(rank)
            specs = tuple((alg, stage_specs(layout, alg)) for alg in Algorithm)
            mine = A2AComm(layout=layout, me=me, group=whole, intra=nodes[layout.node[me]],
                           inter=locals_[layout.local[me]], timeout=timeout, host_timeout=host_timeout,
                           specs=specs)
    if mine is None:  # unreachable: _check_parents put this rank in one parent
        raise RuntimeError(f"rank {rank} found in no parent group {groups}")
    _warm_up(mine.group, mine.layout.ranks, timeout)
    return mine


def _new_group(kind: str, ranks: list[int], timeout: timedelta) -> dist.ProcessGroup:
    """``dist.new_group`` with the runtime's timeout, which is the backend's own deadline for every
    collective on the group (gloo's send/receive timeout; NCCL's watchdog, the only deadline there
    with ``host_timeout=False``), and a description (``group_desc``), which NCCL's watchdog and
    flight recorder print with a timed-out collective (e.g. "PIPER_A2A[0,1]"): the one hint on
    NCCL that the collective was Piper's."""
    return dist.new_group(ranks, timeout=timeout, group_desc=f"{kind}[{','.join(map(str, ranks))}]")


def _warm_up(group: dist.ProcessGroup, ranks: tuple[int, ...], timeout: timedelta) -> None:
    """One barrier on the new group: connections are made now rather than inside the first timed
    exchange, and NCCL's communicator exists before the first point-to-point batch (which
    ``batch_isend_irecv`` requires when it is a group's first operation)."""
    what = timeouts.OpName(op="create_comm (barrier on the new group)", stage="stage 1/1", ranks=ranks,
                           rank=dist.get_rank())
    work = timeouts.launch(what, lambda: dist.barrier(group=group, async_op=True))
    timeouts.wait(work, what, timeout)


def _check_parents(groups: list[tuple[int, ...]], world: int, rank: int) -> None:
    seen: set[int] = set()
    for i, g in enumerate(groups):
        bad = [r for r in g if not isinstance(r, int) or not 0 <= r < world]
        if bad or not g:
            raise SpecError(f"parents[{i}]", g, f"global ranks must be ints in [0, {world})",
                            "list the global ranks of each parent group")
        if seen & set(g):
            raise SpecError(f"parents[{i}]", g, f"ranks {sorted(seen & set(g))} are in two parent groups",
                            "parent groups must be disjoint (e.g. the expert-parallel groups)")
        seen |= set(g)
    if rank not in seen:
        raise SpecError("parents", groups, f"rank {rank} is in no parent group",
                        "every calling rank must belong to one parent group")


@contextmanager
def released_groups(destroy: Callable[[dist.ProcessGroup], object] | None = None) -> Iterator[None]:
    """Destroy, on leaving, every process group created inside (the default group is kept).
    ``destroy``: how to destroy one group (default ``torch.distributed.destroy_process_group``); pass
    a framework's own (``deepspeed.comm.destroy_process_group``) so that the framework also forgets
    the groups it cached during the job, and builds fresh ones for the next job instead of reusing
    destroyed ones.

    For one process that builds several jobs in turn (``piper calibrate``'s host-overhead probe
    trains 13 models in one process): ``parallel_state.destroy_model_parallel`` forgets Megatron's
    groups but does not destroy them, and each live gloo group keeps its threads and sockets. Measured
    on a 2-core machine (2026-12-04), 17-20 leaked groups per run slowed the same run by 20-35 % by the
    probe's end, which inflated the fitted host overheads and made every validation plan predicted too
    slow; with the groups destroyed, the same run at the probe's start and end agrees within 5 %."""
    from torch.distributed.distributed_c10d import _world

    before = set(_world.pg_map)
    try:
        yield
    finally:
        for group in [g for g in list(_world.pg_map) if g not in before]:
            (destroy or dist.destroy_process_group)(group)
