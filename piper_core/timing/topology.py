"""Where a process group lands on the cluster, from Megatron's rank order.

Megatron's default order is ``tp-cp-ep-dp-pp`` (``RankGenerator``, parallel_state.py): the dense
side lays ranks out tp fastest, then cp, dp, pp; the expert side (MoE parallel folding) etp
fastest, then ep, edp, pp. A group of ``size`` ranks spaced ``stride`` apart therefore has
``per_domain`` members inside each domain of a link level, and talks over every level up to the
first one whose domain holds it whole.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from piper_core.specs.cluster import ClusterSpec, LinkLevel
from piper_core.specs.parallel import ParallelPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """A process group's shape: ``size`` ranks, ``stride`` apart in the global rank order."""

    name: str
    size: int
    stride: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LevelShare:
    """For one link level: how many peers of a rank are reached over it (not over a faster one)."""

    link: LinkLevel
    peers: int


def members_per_domain(group: Group, domain_gpus: int | None) -> int:
    """How many members of ``group`` share one domain of ``domain_gpus`` GPUs (None: all)."""
    if domain_gpus is None:
        return group.size
    if group.stride >= domain_gpus:
        return 1
    return min(group.size, max(1, domain_gpus // group.stride))


@functools.lru_cache(maxsize=8192)
def level_shares(group: Group, cluster: ClusterSpec) -> tuple[LevelShare, ...]:
    """Peers per link level for one rank of ``group`` (levels with no peers are left out)."""
    out, inside = [], 1
    for link in cluster.links:
        here = members_per_domain(group, link.domain_gpus)
        if here > inside:
            out.append(LevelShare(link=link, peers=here - inside))
        inside = max(inside, here)
    return tuple(out)


def slowest_link(group: Group, cluster: ClusterSpec) -> LinkLevel | None:
    """The outermost level the group crosses (None for a group of one)."""
    shares = level_shares(group, cluster)
    return shares[-1].link if shares else None


def dense_groups(plan: ParallelPlan) -> dict[str, Group]:
    tp, cp, dp = plan.tp, plan.cp, plan.dp
    return {
        "tp": Group(name="tp", size=tp, stride=1),
        "cp": Group(name="cp", size=cp, stride=tp),
        "dp": Group(name="dp", size=dp * cp, stride=tp),  # gradients reduce over dp x cp
        "pp": Group(name="pp", size=plan.pp, stride=tp * cp * dp),
    }


def expert_groups(plan: ParallelPlan) -> dict[str, Group]:
    etp, ep = plan.etp_size, plan.ep
    return {
        "etp": Group(name="etp", size=etp, stride=1),
        "ep": Group(name="ep", size=ep, stride=etp),
        "edp": Group(name="edp", size=plan.edp, stride=etp * ep),
    }


def nodes_spanned(group: Group, cluster: ClusterSpec) -> int:
    """Nodes that hold members of ``group``."""
    return math.ceil(group.size / members_per_domain(group, cluster.gpus_per_node))
