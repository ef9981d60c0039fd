"""``released_groups`` destroys the process groups made inside it, so one process can build job
after job (the calibration probe trains 13) without gloo groups, and their threads, piling up."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from piper_core.runtime import NodeTopology, create_comm
from piper_core.runtime.groups import released_groups
from tests.gloo import run_ranks


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _jobs(rank: int, world: int) -> dict:
    from torch.distributed.distributed_c10d import _world

    topology = NodeTopology.uniform(world_size=world, ranks_per_node=1)
    with released_groups():  # the first job's groups start the threads gloo keeps for the process
        create_comm(topology)
    before_groups, before_threads = len(_world.pg_map), _threads()
    inside = []
    for _ in range(5):
        with released_groups():
            create_comm(topology)
            inside.append(len(_world.pg_map))
    x = torch.ones(1)
    dist.all_reduce(x)  # the default group survives
    return {"before": before_groups, "inside": inside, "after": len(_world.pg_map),
            "thread_growth": _threads() - before_threads, "sum": float(x)}


def test_groups_made_inside_are_destroyed_and_the_default_group_kept() -> None:
    for r in run_ranks(2, _jobs):
        assert r["inside"] == [r["before"] + 3] * 5, r  # the comm's copy, its node group, its local group
        assert r["after"] == r["before"], r
        assert r["thread_growth"] <= 2, r  # leaked, five comms would add 3 groups' threads each
        assert r["sum"] == 2.0
