"""Alpha-beta costs of the collectives, per link level.

A message over level ``l`` costs ``latency_us_l + bytes / bandwidth_l`` (Hockney's model).
Bandwidths are per GPU and direction; intra-node and inter-node traffic of one rank proceed at
the same time, so a flat all-to-all takes the slower of its levels. Rings (all-gather,
reduce-scatter, all-reduce) run at the pace of the slowest level they cross (NCCL ring/tree
bus-bandwidth model, ``(n-1)/n`` of the data per step).
"""

from __future__ import annotations

from piper_core.specs.cluster import ClusterSpec
from piper_core.timing.topology import Group, level_shares, slowest_link

US = 1e-6


def _level_time(peers: int, byte_count: float, latency_us: float, gb_per_s: float) -> float:
    return peers * latency_us * US + byte_count / (gb_per_s * 1e9)


def all_to_all_flat(group: Group, nbytes: float, cluster: ClusterSpec) -> float:
    """One rank sends ``nbytes`` spread evenly over the ``size`` ranks (its own share stays).

    Every peer gets one message (``peers x latency``) over the level that reaches it; levels run
    concurrently, the slowest sets the time.
    """
    if group.size == 1:
        return 0.0
    per_peer = nbytes / group.size
    return max(_level_time(s.peers, s.peers * per_peer, s.link.latency_us, s.link.bandwidth_gb_per_s)
               for s in level_shares(group, cluster))


def all_to_all_hierarchical(group: Group, nbytes: float, cluster: ClusterSpec) -> float:
    """Two stages (Tutel 2DH, DeepEP): an all-to-all inside the innermost domain that regroups the
    data by destination domain, then one among ranks with the same local index across domains.

    Stage 2 sends ``domains - 1`` aggregated messages instead of ``size - q`` small ones, which pays
    off when the per-message latency of the outer links dominates (many nodes, small messages).
    The local regrouping copy costs one pass over the data in HBM.
    """
    return sum(hierarchical_stages(group, nbytes, cluster))


def hierarchical_stages(group: Group, nbytes: float, cluster: ClusterSpec, *,
                        inter_share: float = 1.0) -> tuple[float, ...]:
    """(intra-node stage with the regrouping copy, inter-node stage) of :func:`all_to_all_hierarchical`;
    one stage (the flat exchange) when the group stays inside one domain. ``inter_share`` scales
    what crosses domains: below 1 when each token goes to a node once however many of its experts
    live there (DeepEP/HybridEP; :func:`piper_core.timing.routing.dedup_ratio`)."""
    shares = level_shares(group, cluster)
    if len(shares) < 2:
        return (all_to_all_flat(group, nbytes, cluster),)
    inner = shares[0].peers + 1
    stage1 = all_to_all_flat(Group(name=group.name + "-intra", size=inner, stride=group.stride), nbytes, cluster)
    outer = Group(name=group.name + "-inter", size=group.size // inner, stride=group.stride * inner)
    stage2 = all_to_all_flat(outer, nbytes * inter_share, cluster)
    acc = cluster.accelerator
    copy = 2 * nbytes / (acc.hbm_gb_per_s * 1e9 * acc.hbm_efficiency)
    return stage1 + copy, stage2


def ring(group: Group, nbytes: float, cluster: ClusterSpec, *, passes: int = 1) -> float:
    """All-gather or reduce-scatter of a ``nbytes`` buffer (the full, gathered size); an all-reduce
    is ``passes=2``."""
    link = slowest_link(group, cluster)
    if link is None:
        return 0.0
    steps = group.size - 1
    return passes * (steps * link.latency_us * US + steps / group.size * nbytes / (link.bandwidth_gb_per_s * 1e9))


def ring_parts(group: Group, nbytes: float, cluster: ClusterSpec) -> tuple[float, float]:
    """(latency, bandwidth) seconds of one :func:`ring` pass over ``nbytes``; (0, 0) inside one rank."""
    latency = ring(group, 0.0, cluster)
    return latency, ring(group, nbytes, cluster) - latency


def reduce_scatter(group: Group, nbytes: float, cluster: ClusterSpec) -> float:
    """Reduce-scatter of a ``nbytes`` buffer: a ring's latency, and ``cluster.reduce_scatter_factor``
    times the ring's bytes (1 for NCCL's ring; about 2 over gloo, which moves an all-reduce's)."""
    latency, bandwidth = ring_parts(group, nbytes, cluster)
    return latency + cluster.reduce_scatter_factor * bandwidth


def p2p(group: Group, nbytes: float, cluster: ClusterSpec) -> float:
    """Send ``nbytes`` to the next pipeline stage (over the level adjacent stages share)."""
    if group.size == 1:
        return 0.0
    neighbour = Group(name=group.name, size=2, stride=group.stride)
    link = slowest_link(neighbour, cluster)
    return link.latency_us * US + nbytes / (link.bandwidth_gb_per_s * 1e9)
