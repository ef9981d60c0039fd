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

import torch

from piper_core.runtime.topology import Algorithm, RankLayout


class Scope(enum.Enum):
    """Which process group a stage runs on."""

    ALL = "all"      # the whole group (flat stage, or point-to-point)
    INTRA = "intra"  # the ranks on this rank's node
    INTER = "inter"  # the ranks with this rank's local index, one per node


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """One stage of an algorithm: ``hop_WW[s, d]`` = member holding block (s, d) after it."""

    name: str
    scope: Scope
    p2p: bool
    hop_WW: torch.Tensor


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
    """The stages of ``algorithm`` on ``layout`` (hop tables are ``[W, W]`` int64, CPU)."""
    w = layout.size
    node = torch.tensor(layout.node, dtype=torch.long)
    local = torch.tensor(layout.local, dtype=torch.long)
    grid = torch.tensor([list(row) for row in (layout.node_members(n) for n in range(layout.num_nodes))],
                        dtype=torch.long)
    src = torch.arange(w).unsqueeze(1).expand(w, w)
    dst = torch.arange(w).unsqueeze(0).expand(w, w)
    if algorithm is Algorithm.FLAT:
        return (StageSpec(name="flat", scope=Scope.ALL, p2p=False, hop_WW=dst.clone()),)
    if algorithm is Algorithm.HIERARCHICAL:
        regroup = grid[node[src], local[dst]]  # same node as the source, local index of the destination
        return (StageSpec(name="intra-node regroup", scope=Scope.INTRA, p2p=False, hop_WW=regroup),
                StageSpec(name="inter-node (same local index)", scope=Scope.INTER, p2p=False,
                          hop_WW=dst.clone()))
    if algorithm is Algorithm.AGGREGATED:
        a, b, q = node[src], node[dst], layout.per_node
        same = a == b
        gather = torch.where(same, dst, grid[a, b % q])  # sending gateway of node pair (a, b)
        cross = torch.where(same, dst, grid[b, a % q])   # receiving gateway on node b
        return (StageSpec(name="intra-node gather", scope=Scope.INTRA, p2p=False, hop_WW=gather),
                StageSpec(name="node-pair send", scope=Scope.ALL, p2p=True, hop_WW=cross),
                StageSpec(name="intra-node scatter", scope=Scope.INTRA, p2p=False, hop_WW=dst.clone()))
    raise ValueError(f"unknown algorithm {algorithm!r}; use one of {[a.value for a in Algorithm]}")


def scope_members(layout: RankLayout, scope: Scope, me: int) -> tuple[int, ...]:
    """Members of ``me``'s group for ``scope``, by group rank."""
    if scope is Scope.ALL:
        return tuple(range(layout.size))
    if scope is Scope.INTRA:
        return layout.node_members(layout.node[me])
    return layout.local_members(layout.local[me])


def plan_route(specs: tuple[StageSpec, ...], layout: RankLayout, counts_WW: torch.Tensor, me: int,
               *, device: torch.device | None = None) -> Route:
    """Rank ``me``'s plan for moving ``counts_WW[s, d]`` rows from every ``s`` to every ``d``.

    Input rows are in destination order (as ``all_to_all_single`` takes them); output rows come out
    in source order. ``counts_WW``: int64 ``[W, W]``; index tensors land on ``device`` (default CPU).
    """
    w = layout.size
    flat = counts_WW.reshape(-1)
    keys = me * w + torch.arange(w)           # blocks held now, in buffer order
    holder = torch.arange(w).repeat_interleave(w)  # holder of every block before the stage: its source
    plans = []
    for spec in specs:
        members = scope_members(layout, spec.scope, me)
        pos = torch.full((w,), -1, dtype=torch.long)
        pos[torch.tensor(members, dtype=torch.long)] = torch.arange(len(members))
        hop = spec.hop_WW.reshape(-1)
        to = pos[hop[keys]]
        if bool((to < 0).any()):
            raise RuntimeError(f"stage {spec.name!r}: a block leaves rank {me}'s group (routing bug)")
        order = torch.argsort(to * (w * w) + keys)
        send_index = reorder_rows(flat[keys], order, device)
        input_splits = _sum_by(to, flat[keys], len(members))
        arrive = torch.nonzero((hop == me) & (pos[holder] >= 0)).reshape(-1)
        frm = pos[holder[arrive]]
        arrive = arrive[torch.argsort(frm * (w * w) + arrive)]
        output_splits = _sum_by(pos[holder[arrive]], flat[arrive], len(members))
        plans.append(StagePlan(spec=spec, members=members, send_index=send_index,
                               input_splits=input_splits, output_splits=output_splits))
        keys, holder = arrive, hop
    final_index = reorder_rows(flat[keys], torch.argsort(keys), device)
    return Route(stages=tuple(plans), final_index=final_index, rows_in=int(flat[me * w:(me + 1) * w].sum()),
                 rows_out=int(counts_WW[:, me].sum()))


def _sum_by(bucket: torch.Tensor, rows: torch.Tensor, n: int) -> tuple[int, ...]:
    """Rows per bucket (exact int64 sums)."""
    return tuple(torch.zeros(n, dtype=torch.long).scatter_add_(0, bucket, rows).tolist())


def reorder_rows(lengths: torch.Tensor, order: torch.Tensor, device: torch.device | None) -> torch.Tensor | None:
    """Row indices that reorder a buffer of blocks (``lengths`` rows each, in buffer order) into
    ``order``; None when that is the identity (empty blocks may move freely)."""
    moved = order[lengths[order] > 0]
    if moved.numel() < 2 or bool((moved[1:] > moved[:-1]).all()):
        return None
    starts = torch.cumsum(lengths, 0) - lengths
    sel_len, sel_start = lengths[order], starts[order]
    offsets = torch.cumsum(sel_len, 0) - sel_len
    total = int(sel_len.sum())
    index = torch.repeat_interleave(sel_start - offsets, sel_len) + torch.arange(total)
    return index.to(device) if device is not None else index
