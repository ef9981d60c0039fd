"""Which ranks share a node, stated explicitly (never read from the environment).

:class:`NodeTopology` is the physical fact (global ranks per node). :class:`RankLayout` is what the
all-to-all needs of it for one process group: each member's node and local index, with members
numbered by their rank in that group (sorted global ranks, as ``torch.distributed.new_group``
numbers them). Both are pure data; nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from piper_core.errors import SpecError, divisors


class Algorithm(enum.Enum):
    """How an all-to-all moves its blocks (see :mod:`piper_core.runtime.routes`).

    * ``FLAT``: one ``all_to_all_single`` over the whole group (the framework baseline).
    * ``HIERARCHICAL``: stage 1 inside the node regroups the data by the destination's local index,
      stage 2 exchanges among the ranks with the same local index across nodes (Tutel 2DH; the
      resource model's ``all_to_all_hierarchical``, piper_core/timing/comm.py).
    * ``AGGREGATED``: one message per ordered node pair (DeepEP/X-MoE style): stage 1 gathers a
      node's data for node ``b`` on its gateway rank (local index ``b % ranks_per_node``), stage 2
      sends it point-to-point to the gateway of node ``b`` (local index ``a % ranks_per_node``),
      stage 3 scatters it inside node ``b``.
    """

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"
    AGGREGATED = "aggregated"


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeTopology:
    """``nodes[i]`` = the global ranks that run on node ``i`` (any order, any rank numbering).

    Example: 2 nodes x 4 ranks, consecutive: ``NodeTopology.uniform(world_size=8, ranks_per_node=4)``
    = ``NodeTopology(nodes=((0, 1, 2, 3), (4, 5, 6, 7)))``.
    """

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        if not self.nodes:
            raise SpecError("nodes", self.nodes, "a topology needs at least one node",
                            "list the global ranks of every node, e.g. ((0, 1), (2, 3))")
        for i, node in enumerate(self.nodes):
            if not node:
                raise SpecError(f"nodes[{i}]", node, "a node must hold at least one rank",
                                "drop the empty node")
            for r in node:
                if not isinstance(r, int) or r < 0:
                    raise SpecError(f"nodes[{i}]", node, "ranks are non-negative ints",
                                    "use global ranks as torch.distributed numbers them")
                if r in seen:
                    raise SpecError(f"nodes[{i}]", node, f"rank {r} is listed on two nodes",
                                    "list every rank on exactly one node")
                seen.add(r)

    @classmethod
    def uniform(cls, *, world_size: int, ranks_per_node: int) -> NodeTopology:
        """Consecutive global ranks, ``ranks_per_node`` per node (the usual launcher layout)."""
        if world_size < 1 or ranks_per_node < 1 or world_size % ranks_per_node:
            raise SpecError("ranks_per_node", ranks_per_node,
                            f"must be >= 1 and divide world_size ({world_size})",
                            f"choose ranks_per_node in {divisors(max(world_size, 1))}")
        return cls(nodes=tuple(tuple(range(n, n + ranks_per_node))
                               for n in range(0, world_size, ranks_per_node)))

    def node_of(self, global_rank: int) -> int:
        """Index of the node that holds ``global_rank``."""
        for i, node in enumerate(self.nodes):
            if global_rank in node:
                return i
        raise SpecError("rank", global_rank, "is on no node of the topology",
                        "add it to NodeTopology.nodes")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankLayout:
    """One process group laid on the nodes; members are numbered 0..size-1 by group rank.

    ``node[m]`` and ``local[m]``: node (0..num_nodes-1, nodes ordered by their smallest member) and
    local index (0..per_node-1, by global rank inside the node) of member ``m``; ``ranks[m]`` its
    global rank. Every node holds the same number of members (the two-stage algorithms pair ranks
    with the same local index).
    """

    ranks: tuple[int, ...]
    node: tuple[int, ...]
    local: tuple[int, ...]
    num_nodes: int
    per_node: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def at(self, node: int, local: int) -> int:
        """The member on ``node`` with local index ``local``."""
        return self._grid()[node][local]

    def node_members(self, node: int) -> tuple[int, ...]:
        """Members on ``node``, by local index (= their rank order in the intra-node group)."""
        return self._grid()[node]

    def local_members(self, local: int) -> tuple[int, ...]:
        """Members with local index ``local``, by group rank (their order in the inter-node group)."""
        return tuple(m for m in range(self.size) if self.local[m] == local)

    def _grid(self) -> tuple[tuple[int, ...], ...]:
        grid = [[-1] * self.per_node for _ in range(self.num_nodes)]
        for m in range(self.size):
            grid[self.node[m]][self.local[m]] = m
        return tuple(tuple(row) for row in grid)


def layout_for(topology: NodeTopology, group_ranks: Sequence[int]) -> RankLayout:
    """The :class:`RankLayout` of the group with global ranks ``group_ranks`` on ``topology``."""
    ranks = tuple(sorted(group_ranks))
    if len(set(ranks)) != len(ranks) or not ranks:
        raise SpecError("group_ranks", tuple(group_ranks), "must be distinct and non-empty",
                        "pass each member's global rank once")
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(topology.node_of(r), []).append(r)
    sizes = {n: len(v) for n, v in by_node.items()}
    if len(set(sizes.values())) != 1:
        raise SpecError("group_ranks", ranks,
                        f"members per node differ ({sizes}, node index -> members); the two-stage "
                        "all-to-alls pair ranks with the same local index",
                        "give the group the same number of ranks on every node it touches")
    node_ids = sorted(by_node, key=lambda n: min(by_node[n]))
    node_of = {r: i for i, n in enumerate(node_ids) for r in by_node[n]}
    local_of = {r: j for n in node_ids for j, r in enumerate(sorted(by_node[n]))}
    return RankLayout(ranks=ranks, node=tuple(node_of[r] for r in ranks),
                      local=tuple(local_of[r] for r in ranks), num_nodes=len(node_ids),
                      per_node=len(ranks) // len(node_ids))
