"""Expert placement optimizer (issue 17, deliverable 2, the model's half): put each MoE layer's
experts on the expert-parallel ranks so that the busiest rank gets as few tokens as possible.

The problem, per layer: split ``E`` experts with token counts ``c_e`` over ``m = ep`` ranks, each
rank exactly ``E / m`` experts (Megatron's equal slots), minimising the largest rank sum. That is
the *k-partitioning* problem (multiprocessor scheduling with a cardinality constraint; NP-hard).
Why this objective: under the priced model (:mod:`piper_core.resource.routing`) the busiest rank's
tokens set the MoE layer's expert GEMMs, its receive buffer, and the busiest exchange of every link
level (the cross-node exchange included: it is the busiest rank's receive, and the total
cross-node bytes do not depend on the placement), so minimising it minimises all of them.

Algorithm:

1. **Greedy LPT with slots** (Kellerer & Woeginger's "modified LPT"): experts in decreasing count,
   each to the least-loaded rank that still has a free slot.
2. **Swap descent**: while some swap of an expert of the busiest rank with a lighter expert of
   another rank lowers the busiest rank and leaves the other below the old maximum, make the best
   one (each swap lowers the sum of squared loads, so it stops).
3. Keep the better of that and Megatron's default placement: **never worse than the default**.

Bounds. Steps 2 and 3 never raise the busiest rank, so what holds for step 1 holds for the result:
with one expert per rank every placement is optimal; with two, the greedy pairs the ``i``-th
largest with the ``i``-th smallest, which is optimal; with three, modified LPT is within
``4/3 - 1/(3m)`` of the optimum (Kellerer & Woeginger, "A tight bound for 3-partitioning",
Discrete Applied Mathematics 45, 1993). For more experts per rank no a-priori ratio is claimed
(plain LPT's ``4/3 - 1/(3m)``, Graham 1969, does not carry over as is). So each result states its
distance from optimal, instance by instance: the optimum is at least

``LB = max(total / m, c_max + (sum of the E/m - 1 smallest other counts))``

(the mean rank; and the rank that holds the largest expert holds E/m - 1 others, at least the
smallest ones), so the placement's busiest rank is within ``gap = busiest / LB - 1`` of the
optimum.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from piper_core.errors import SpecError
from piper_core.resource.routing import Placement, default_placement, load_factor, placement_file, rank_loads
from piper_core.specs.routing import Counts, Routing


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerPlacement:
    """One layer's optimised placement and how it compares (loads in the histogram's units)."""

    layer: int
    placement: Placement
    busiest: float           # busiest rank's tokens under ``placement``
    default_busiest: float   # ... under Megatron's default placement
    lower_bound: float       # no placement has a busiest rank below this (LB above)
    rank_max_over_mean: float
    default_rank_max_over_mean: float

    @property
    def gap(self) -> float:
        """How far above the optimum it can be: busiest / LB - 1 (0: optimal)."""
        return self.busiest / self.lower_bound - 1 if self.lower_bound > 0 else 0.0


def lower_bound(counts: Counts, ranks: int) -> float:
    """A lower bound on the busiest rank of any equal-slot placement (module docstring)."""
    slots = len(counts) // ranks
    ordered = sorted(counts)
    largest = ordered[-1]
    return max(sum(counts) / ranks, largest + sum(ordered[:slots - 1]))


def greedy(counts: Counts, ranks: int) -> Placement:
    """Decreasing counts, each to the least-loaded rank with a free slot (ties: the lower rank, then
    the lower expert id, so the result is deterministic)."""
    slots = len(counts) // ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0.0] * ranks
    for e in sorted(range(len(counts)), key=lambda e: (-counts[e], e)):
        r = min((r for r in range(ranks) if len(held[r]) < slots), key=lambda r: (loads[r], r))
        held[r].append(e)
        loads[r] += counts[e]
    return tuple(tuple(sorted(h)) for h in held)


def improve(counts: Counts, placement: Placement, *, max_swaps: int = 10_000) -> Placement:
    """Swap descent on the busiest rank (module docstring, step 2)."""
    held = [list(h) for h in placement]
    loads = [sum(counts[e] for e in h) for h in held]
    for _ in range(max_swaps):
        b = max(range(len(loads)), key=lambda r: (loads[r], -r))
        top, best = loads[b], None
        for r in range(len(held)):
            if r == b:
                continue
            for i, x in enumerate(held[b]):
                for j, y in enumerate(held[r]):
                    d = counts[x] - counts[y]
                    if d <= 0 or loads[r] + d >= top:
                        continue
                    pair = max(top - d, loads[r] + d)
                    if best is None or pair < best[0]:
                        best = (pair, r, i, j, d)
        if best is None:
            break
        _, r, i, j, d = best
        held[b][i], held[r][j] = held[r][j], held[b][i]
        loads[b] -= d
        loads[r] += d
    return tuple(tuple(sorted(h)) for h in held)


def optimize_layer(layer: int, counts: Counts, ranks: int) -> LayerPlacement:
    """The best of greedy + swap descent and Megatron's default placement for one layer."""
    default = default_placement(len(counts), ranks)
    found = improve(counts, greedy(counts, ranks))
    busiest, default_busiest = max(rank_loads(counts, found)), max(rank_loads(counts, default))
    if default_busiest <= busiest:
        found, busiest = default, default_busiest
    return LayerPlacement(layer=layer, placement=found, busiest=busiest, default_busiest=default_busiest,
                          lower_bound=lower_bound(counts, ranks), rank_max_over_mean=load_factor(counts, found),
                          default_rank_max_over_mean=load_factor(counts, default))


def optimize(routing: Routing, ep: int) -> tuple[LayerPlacement, ...]:
    """An optimised placement for every MoE layer of ``routing`` on ``ep`` ranks."""
    if ep < 1 or routing.num_experts % ep:
        raise SpecError("ep", ep, f"must divide num_experts ({routing.num_experts}): Megatron gives every rank "
                        "the same number of experts", "choose a divisor of num_experts")
    return tuple(optimize_layer(n, counts, ep) for n, counts in routing.layers)


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedPlacement:
    """One placement for every MoE layer (what a runtime that places experts once per model runs,
    e.g. Piper's dispatcher with ``--piper-placement``) and how it compares. The objective is the
    sum over layers of each layer's busiest rank (tokens, the histogram's units): every layer waits
    for its own busiest rank, so that sum is what the step's expert GEMMs and exchanges follow."""

    placement: Placement
    objective: float          # sum over layers of the busiest rank's tokens under ``placement``
    default_objective: float  # ... under Megatron's default placement
    lower_bound: float        # sum over layers of lower_bound(counts): no placement, shared or not, does better
    start: str                # the candidate the descent started from (default, summed, or layer N)

    @property
    def gap(self) -> float:
        """How far above the optimum it can be: objective / lower bound - 1."""
        return self.objective / self.lower_bound - 1 if self.lower_bound > 0 else 0.0


def _objective(layers: tuple[Counts, ...], placement: Placement) -> float:
    return sum(max(rank_loads(counts, placement)) for counts in layers)


def optimize_shared(routing: Routing, ep: int, *, max_swaps: int = 10_000) -> SharedPlacement:
    """The placement of one expert layout for every MoE layer minimising the sum of the layers'
    busiest ranks: the best of Megatron's default, the optimiser's placement of the histogram summed
    over the layers and each layer's own optimised placement, then the best improving swap of two
    experts on different ranks while one exists (the objective falls with every swap, so it stops).
    Never worse than the default (it is a candidate and swaps only improve). Each descent round
    tries every pair of experts on different ranks: meant for the tens of experts of a benchmark."""
    layers = tuple(counts for _, counts in optimize_input(routing, ep))
    summed = tuple(sum(c[e] for c in layers) for e in range(routing.num_experts))
    default = default_placement(routing.num_experts, ep)
    candidates = {"default": default, "summed": optimize_layer(0, summed, ep).placement}
    for number, counts in routing.layers:
        candidates[f"layer {number}"] = optimize_layer(number, counts, ep).placement
    start = min(candidates, key=lambda k: (_objective(layers, candidates[k]), k != "default"))
    held = [list(r) for r in candidates[start]]
    best = _objective(layers, candidates[start])
    for _ in range(max_swaps):
        move = None
        for a, b in itertools.combinations(range(ep), 2):
            for i, j in itertools.product(range(len(held[a])), range(len(held[b]))):
                held[a][i], held[b][j] = held[b][j], held[a][i]
                value = _objective(layers, tuple(tuple(r) for r in held))
                held[a][i], held[b][j] = held[b][j], held[a][i]
                if value < best - 1e-9 and (move is None or value < move[0]):
                    move = (value, a, i, b, j)
        if move is None:
            break
        best, a, i, b, j = move
        held[a][i], held[b][j] = held[b][j], held[a][i]
    found = tuple(tuple(sorted(r)) for r in held)
    return SharedPlacement(placement=found, objective=best, default_objective=_objective(layers, default),
                           lower_bound=sum(lower_bound(c, ep) for c in layers), start=start)


def optimize_input(routing: Routing, ep: int) -> tuple[tuple[int, Counts], ...]:
    """``routing``'s layers, after the check :func:`optimize` makes (``ep`` divides the experts)."""
    if ep < 1 or routing.num_experts % ep:
        raise SpecError("ep", ep, f"must divide num_experts ({routing.num_experts}): Megatron gives every rank "
                        "the same number of experts", "choose a divisor of num_experts")
    return routing.layers


def placement_json(placements: tuple[LayerPlacement, ...], *, num_experts: int, ep: int) -> dict:
    """The placement file (:func:`load_placement` reads it back): per layer, each rank's experts."""
    return placement_file(num_experts, ep, {p.layer: p.placement for p in placements})


def summary_json(placements: tuple[LayerPlacement, ...]) -> list[dict]:
    return [{"layer": p.layer, "rank_max_over_mean": p.rank_max_over_mean,
             "default_rank_max_over_mean": p.default_rank_max_over_mean, "busiest": p.busiest,
             "default_busiest": p.default_busiest, "lower_bound": p.lower_bound, "gap": p.gap}
            for p in placements]
