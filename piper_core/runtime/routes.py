"""Pure routing of an all-to-all's blocks through stages (no ``torch.distributed`` here).

An all-to-all moves ``counts[s][d]`` rows from member ``s`` to member ``d`` (a *block*, keyed
``s * W + d``). An algorithm is a sequence of stages; stage ``k`` moves every block from its holder
``hop[k-1][s, d]`` to ``hop[k][s, d]`` (``hop[-1] = s``, the last hop ``= d``), either with one
``all_to_all_single`` among the members of a sub-group (intra-node, inter-node, or all) or with
point-to-point messages. Every rank knows ``counts`` in full, so it can work out, without asking
anyone, which blocks it holds before and after each stage and in which order:

* a sender orders what it sends by destination (group rank), then by block key;
* a receiver therefore gets, from each peer in group-rank order, that peer's blocks for it, sorted
  by key; after the last stage the blocks are put in source order, which makes the output equal,
  row for row, to one ``all_to_all_single`` (output ordered by source rank).

Rows inside a block keep their order, so every algorithm is pure data movement: bit-identical to the
flat exchange. The backward of an exchange is the same algorithm on ``counts`` transposed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from piper_core.runtime.topology import Algorithm, RankLayout


class Scope(enum.Enum):
    """Which process group a stage runs on."""

    ALL = "all"      # the whole group (flat stage, or point-to-point)
    INTRA = "intra"  # the ranks on this rank's node
    INTER = "inter"  # the ranks with this rank's local index, one per node


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """One stage of an algorithm on one group layout (numpy, computed once per comm).

    ``hop_WW[s, d]``: member holding block (s, d) after the stage; ``members[m]``: member ``m``'s
    stage group (member numbers, by group rank); ``pos_WW[m, j]``: rank of member ``j`` in that
    group, -1 if ``j`` is not in it.
    """

    name: str
    scope: Scope
    p2p: bool
    hop_WW: np.ndarray
    members: tuple[tuple[int, ...], ...]
    pos_WW: np.ndarray


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """What one rank does in one stage of one exchange.

    ``send_index``: rows of the current buffer in send order (None: already in order);
    ``input_splits``/``output_splits``: rows to / from each member of the stage group, by group rank;
    ``members``: those members (member numbers of the whole group, by group rank).
    """

    spec: StageSpec
    members: tuple[int, ...]
    send_index: torch.Tensor | None
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Route:
    """One rank's whole exchange: stages, then ``final_index`` (rows in source order; None: as is)."""

    stages: tuple[StagePlan, ...]
    final_index: torch.Tensor | None
    rows_in: int
    rows_out: int


def stage_specs(layout: RankLayout, algorithm: Algorithm) -> tuple[StageSpec, ...]:
    """The stages of ``algorithm`` on ``layout``."""
    w = layout.size
    node, local = np.array(layout.node), np.array(layout.local)
    grid = np.array([layout.node_members(n) for n in range(layout.num_nodes)], dtype=np.int64)
    src, dst = np.indices((w, w))

    def spec(name: str, scope: Scope, hop: np.ndarray, p2p: bool = False) -> StageSpec:
        members = tuple(scope_members(layout, scope, m) for m in range(w))
        pos = np.full((w, w), -1, dtype=np.int64)
        for m, group in enumerate(members):
            pos[m, list(group)] = np.arange(len(group))
        return StageSpec(name=name, scope=scope, p2p=p2p, hop_WW=hop, members=members, pos_WW=pos)

    if algorithm is Algorithm.FLAT:
        return (spec("flat", Scope.ALL, dst),)
    if algorithm is Algorithm.HIERARCHICAL:
        regroup = grid[node[src], local[dst]]  # the source's node, the destination's local index
        return (spec("intra-node regroup", Scope.INTRA, regroup),
                spec("inter-node (same local index)", Scope.INTER, dst))
    if algorithm is Algorithm.AGGREGATED:
        a, b, q = node[src], node[dst], layout.per_node
        gather = np.where(a == b, dst, grid[a, b % q])  # sending gateway of node pair (a, b)
        cross = np.where(a == b, dst, grid[b, a % q])   # receiving gateway, on node b
        return (spec("intra-node gather", Scope.INTRA, gather), spec("node-pair send", Scope.ALL, cross, True),
                spec("intra-node scatter", Scope.INTRA, dst))
    raise ValueError(f"unknown algorithm {algorithm!r}; use one of {[a.value for a in Algorithm]}")


def scope_members(layout: RankLayout, scope: Scope, me: int) -> tuple[int, ...]:
    """Members of ``me``'s group for ``scope``, by group rank."""
    if scope is Scope.ALL:
        return tuple(range(layout.size))
    if scope is Scope.INTRA:
        return layout.node_members(layout.node[me])
    return layout.local_members(layout.local[me])


def plan_route(specs: tuple[StageSpec, ...], counts_WW: np.ndarray, me: int, *,
               device: torch.device | None = None) -> Route:
    """Rank ``me``'s plan for moving ``counts_WW[s, d]`` rows from every ``s`` to every ``d``.

    Input rows are in destination order (as ``all_to_all_single`` takes them); output rows come out
    in source order. ``counts_WW``: int64 ``[W, W]``; index tensors land on ``device`` (default CPU).
    """
    w = counts_WW.shape[0]
    flat = counts_WW.reshape(-1)
    keys = me * w + np.arange(w)                # blocks held now, in buffer order
    holder = np.repeat(np.arange(w), w)         # holder of every block before the stage: its source
    plans = []
    for spec in specs:
        pos, hop, n = spec.pos_WW[me], spec.hop_WW.reshape(-1), len(spec.members[me])
        to = pos[hop[keys]]
        if (to < 0).any():
            raise RuntimeError(f"stage {spec.name!r}: a block leaves rank {me}'s group (routing bug)")
        order = np.argsort(to * (w * w) + keys)
        arrive = np.flatnonzero((hop == me) & (pos[holder] >= 0))
        arrive = arrive[np.argsort(pos[holder[arrive]] * (w * w) + arrive)]
        plans.append(StagePlan(spec=spec, members=spec.members[me],
                               send_index=reorder_rows(flat[keys], order, device),
                               input_splits=_sum_by(to, flat[keys], n),
                               output_splits=_sum_by(pos[holder[arrive]], flat[arrive], n)))
        keys, holder = arrive, hop
    return Route(stages=tuple(plans), final_index=reorder_rows(flat[keys], np.argsort(keys), device),
                 rows_in=int(counts_WW[me].sum()), rows_out=int(counts_WW[:, me].sum()))


def _sum_by(bucket: np.ndarray, rows: np.ndarray, n: int) -> tuple[int, ...]:
    """Rows per bucket ``0..n-1`` (exact int64 sums)."""
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, bucket, rows)
    return tuple(out.tolist())


def reorder_rows(lengths: np.ndarray, order: np.ndarray, device: torch.device | None = None
                 ) -> torch.Tensor | None:
    """Row indices (int64 tensor on ``device``) that reorder a buffer of blocks (``lengths`` rows
    each, in buffer order) into block ``order``; None when that is the identity (empty blocks may
    move freely)."""
    moved = order[lengths[order] > 0]
    if moved.size < 2 or bool((moved[1:] > moved[:-1]).all()):
        return None
    starts = np.cumsum(lengths) - lengths
    sel_len, sel_start = lengths[order], starts[order]
    offsets = np.cumsum(sel_len) - sel_len
    index = np.repeat(sel_start - offsets, sel_len) + np.arange(int(sel_len.sum()))
    return torch.from_numpy(index.astype(np.int64)).to(device if device is not None else "cpu")
