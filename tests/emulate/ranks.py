"""Rank-side functions for the emulated-cluster tests (run in the ranks' processes, no pytest)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from piper_core.emulate import RankInfo


def all_to_all(info: RankInfo, splits: list[list[int]]) -> dict[str, object]:
    """``all_to_all_single`` with uneven ``splits[src][dst]`` rows; each row is tagged by source rank
    and destination so the parent can check every element arrived where it belongs."""
    me, world = info.rank, info.world_size
    send = torch.cat([torch.full((splits[me][dst],), float(1000 * me + dst)) for dst in range(world)])
    recv_counts = [splits[src][me] for src in range(world)]
    recv = torch.empty(sum(recv_counts))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=splits[me])
    return {"address": info.address, "node": info.node, "local_rank": info.local_rank, "recv": recv.tolist()}


def send_times(info: RankInfo, nbytes: int, peers: list[int]) -> dict[str, float]:
    """Rank 0 sends ``nbytes`` to each of ``peers`` in turn (the peer acknowledges with one float);
    returns seconds per peer. Other ranks only take part in their own transfer."""
    payload = torch.zeros(nbytes // 4)
    ack = torch.zeros(1)
    out: dict[str, float] = {}
    for peer in peers:
        dist.barrier()
        if info.rank == 0:
            start = time.perf_counter()
            dist.send(payload, peer)
            dist.recv(ack, peer)
            out[str(peer)] = time.perf_counter() - start
        elif info.rank == peer:
            dist.recv(payload, 0)
            dist.send(ack, 0)
    return out


def fail_on(info: RankInfo, bad_rank: int) -> int:
    """Rank ``bad_rank`` raises before the collective the others wait in."""
    if info.rank == bad_rank:
        raise ValueError(f"rank {bad_rank} fails on purpose")
    dist.barrier()
    return info.rank


def hang_on(info: RankInfo, stuck_rank: int) -> int:
    """Rank ``stuck_rank`` never joins the collective (a missing peer)."""
    if info.rank == stuck_rank:
        time.sleep(3600)
    dist.barrier()
    return info.rank


def sleep(info: RankInfo, seconds: float) -> int:
    time.sleep(seconds)
    return info.rank
