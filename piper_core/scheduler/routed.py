"""The search under a measured routing distribution (issue 17), for ``piper plan --routing`` and the
adapters (Megatron's ``--piper-routing``, the DeepSpeed block's ``"routing"``).

Two passes:

1. one search per expert-parallel size ``ep`` of the space, each with every MoE layer at the
   largest load any layer has on ``ep`` ranks under the placement (Megatron's contiguous one, or the
   optimizer's for that ep, :mod:`piper_core.scheduler.placement`): an upper bound on each layer's
   cost and memory, so no plan that fits is lost;
2. the leading plans re-priced exactly, each MoE layer at its own load
   (:func:`piper_core.resource.routing.predict_routed`), and ranked again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from piper_core.resource.routing import RoutedPrediction, default_placement, predict_routed, rank_loads, shared_load
from piper_core.scheduler.search import Scored, SearchResult, _rank_key, search
from piper_core.scheduler.space import SearchSpace
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.routing import Routing
from piper_core.timing.step import with_load

REPRICED = 20

Placements = dict  # layer_number -> placement (a tuple of each rank's experts)


def placements_for(routing: Routing, ep: int, optimized: bool) -> Placements:
    """layer_number -> placement on ``ep`` ranks: the optimizer's, or Megatron's default."""
    if optimized:
        from piper_core.scheduler.placement import optimize
        return {p.layer: p.placement for p in optimize(routing, ep)}
    default = default_placement(routing.num_experts, ep)
    return {n: default for n, _ in routing.layers}


def search_by_ep(model: ModelSpec, cluster: ClusterSpec, gpus: int, gbs: int, routing: Routing, *, space: SearchSpace,
                 optimize_placement: bool = False, progress: Callable[[int], Callable | None] | None = None,
                 **search_kwargs) -> tuple[dict[int, Placements], SearchResult]:
    """Pass 1: (placements per ep, the merged result of one search per ep at its busiest layer's load).
    ``progress(ep)`` gives each search its progress callback; ``search_kwargs`` go to :func:`search`."""
    placed = {ep: placements_for(routing, ep, optimize_placement) for ep in space.ep
              if model.num_experts % ep == 0}
    result = SearchResult()
    for ep in space.ep:
        share = cluster.accelerator.core_share
        load = max((shared_load(rank_loads(c, placed[ep][n]), share) for n, c in routing.layers), default=1.0) \
            if ep in placed else model.moe_expert_load_skew
        part = search(with_load(model, load), cluster, gpus, gbs, space=dataclasses.replace(space, ep=(ep,)),
                      progress=progress(ep) if progress else None, **search_kwargs)
        result.candidates += part.candidates
        result.rejected.update(part.rejected)
        result.scored += part.scored
        result.elapsed_s += part.elapsed_s
    return placed, result


def reprice(model: ModelSpec, cluster: ClusterSpec, routing: Routing, placed: dict[int, Placements],
            result: SearchResult, count: int = REPRICED, keep: Callable[[Scored], bool] | None = None
            ) -> list[RoutedPrediction]:
    """Pass 2: the ``count`` leading plans of ``result`` (those ``keep`` admits), each MoE layer at its
    own load, fastest first."""
    leading = [s for s in sorted(result.scored, key=_rank_key) if keep is None or keep(s)][:count]
    routed = [predict_routed(model, cluster, s.plan, routing, placed[s.plan.ep]) for s in leading]
    return sorted(routed, key=lambda r: _rank_key(scored(r)))


def scored(r: RoutedPrediction) -> Scored:
    p = r.prediction
    return Scored(plan=p.plan, step_s=p.time.step, peak_bytes=p.peak_stage.total)
