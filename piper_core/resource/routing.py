"""Pricing a routing distribution under a placement of experts on expert-parallel ranks (issue 17).

A **placement** puts each MoE layer's ``E`` logical experts on the ``ep`` ranks of an
expert-parallel group, ``E / ep`` on each (Megatron's equal slots); the default is Megatron's:
rank ``r`` holds experts ``r E/ep .. (r+1) E/ep - 1`` (``MoELayer.__init__``,
``local_expert_indices``).

Assumption: every source rank routes with the layer's distribution (the histogram, summed over
ranks, is each rank's shape), so rank ``s`` sends ``T k p_d`` token copies to rank ``d``, where
``T`` are the tokens a rank routes (``s b / cp``, over tp with SP), ``k`` the top-k and ``p_d`` the
share of the layer's tokens that ``d``'s experts take. Then, per MoE layer and micro-batch:

* **busiest rank**: ``d* = argmax p_d``; its experts get ``ep p_d* x T k`` token copies, ``f = ep
  p_d*`` times the mean rank's (``f = 1`` for even routing on the default placement). ``f`` is
  what the time and memory models take (``step_time(..., loads=...)``, :mod:`piper_core.timing.step`): it sets the expert
  GEMMs, the permutation and the dropless receive buffer of the busiest rank.
* **busiest exchange per link level**: ``d*`` receives ``T k p_d*`` from each of its ``peers_l``
  peers behind level ``l`` (:func:`piper_core.timing.topology.level_shares`). No rank sends more
  over a level than ``d*`` receives over it: a rank sends ``T k`` times the share of the ranks
  behind that level, at most ``peers_l p_d*`` (receive dominates at every level), so the busiest
  exchange of every level is ``d*``'s receive, ``f`` times the even one. Across nodes, the total
  bytes are ``T k (ep - q)`` per layer (``q`` ranks of the group per node) whatever the placement;
  only the busiest rank's share moves them.
* **dropped tokens** under a capacity factor ``cf`` (Megatron's ``get_capacity``:
  ``ceil(T k / E x cf)`` per expert and source rank, moe_utils.py): expert ``e`` of each source
  gets ``T k p_e`` copies and keeps ``cap``; the dropped fraction is
  ``sum_e max(0, T k p_e - cap) / (T k)`` (expected counts; no drop when ``cap >= T``, as
  ``apply_token_drop``). With padding to capacity (the convention priced), the busiest rank's
  buffers do not depend on the routing.

Per-stage memory prices every MoE layer of a stage at the stage's largest ``f`` (an upper bound,
exact where a stage's MoE layers share one distribution); the receive buffer, of which one layer's
is live at a time, is exact.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from piper_core.errors import SpecError
from piper_core.resource.memory import StageMemory, stage_memory
from piper_core.resource.predict import Prediction, predict, to_json
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import check_plan, stage_layers
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.routing import Counts, Routing, moe_layer_numbers
from piper_core.timing.compute import element_bytes
from piper_core.timing.step import step_time, with_load
from piper_core.timing.step import throughput
from piper_core.timing.topology import expert_groups, level_shares

Placement = tuple[tuple[int, ...], ...]
"""Per expert-parallel rank, the logical experts it holds (each rank ``E / ep`` of them)."""


def default_placement(num_experts: int, ep: int) -> Placement:
    """Megatron's placement: rank ``r`` holds experts ``r E/ep .. (r+1) E/ep - 1`` (MoELayer.__init__)."""
    if ep < 1 or num_experts % ep:
        raise SpecError("ep", ep, f"must divide num_experts ({num_experts})", "choose a divisor of num_experts")
    per = num_experts // ep
    return tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ep))


def check_placement(placement: Placement, num_experts: int, ep: int, *, key: str = "placement",
                    where: str | None = None) -> Placement:
    """``placement`` as tuples, if it holds every expert once and ``E / ep`` on each of ``ep`` ranks."""
    if len(placement) != ep:
        raise SpecError(key, f"{len(placement)} ranks", f"must list the experts of each of the ep={ep} ranks",
                        f"give {ep} lists", where=where)
    per = num_experts // ep
    seen: set[int] = set()
    for r, experts in enumerate(placement):
        if len(experts) != per:
            raise SpecError(f"{key}[{r}]", list(experts), f"must hold exactly num_experts/ep = {per} experts "
                            "(Megatron's equal slots)", f"give rank {r} {per} experts", where=where)
        for e in experts:
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < num_experts or e in seen:
                raise SpecError(f"{key}[{r}]", e, f"experts must be distinct ids in 0..{num_experts - 1}",
                                "list every expert exactly once", where=where)
            seen.add(e)
    return tuple(tuple(experts) for experts in placement)


def rank_loads(counts: Counts, placement: Placement) -> tuple[float, ...]:
    """Tokens each rank's experts receive (in the histogram's units)."""
    return tuple(sum(counts[e] for e in experts) for experts in placement)


def load_factor(counts: Counts, placement: Placement) -> float:
    """Busiest rank's tokens over the mean rank's, ``ep p_d*`` (exactly 1.0 for an even split)."""
    loads = [sum((Fraction(counts[e]) for e in experts), Fraction(0)) for experts in placement]
    return float(len(placement) * max(loads) / sum(loads))


def capacity(model: ModelSpec, assigned: float, local: int) -> int:
    """Megatron's per-expert capacity on one source rank (``get_capacity``), at most its tokens
    (as ``busiest_rows`` in resource/activations.py)."""
    return min(math.ceil(assigned / model.num_experts * model.moe_capacity_factor), local)


def dropped_fraction(counts: Counts, assigned: float, local_tokens: int, capacity_factor: float | None) -> float:
    """Share of the ``assigned`` token copies (``T k``) dropped at ``cf`` (0 dropless; module docstring)."""
    if capacity_factor is None:
        return 0.0
    experts = len(counts)
    cap = math.ceil(assigned / experts * capacity_factor)
    if cap >= local_tokens:
        return 0.0
    total = sum(counts)
    return sum(max(0.0, assigned * c / total - cap) for c in counts) / assigned


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerLoad:
    """One MoE layer under a placement, per micro-batch on the busiest rank."""

    layer: int                      # Megatron's 1-based layer_number
    expert_max_over_mean: float     # busiest expert / mean expert
    rank_max_over_mean: float       # f: busiest rank / mean rank (the load the memory model takes)
    busiest_rank: int
    busiest_rank_tokens: float      # token copies its experts receive (before the etp all-gather; padded to
                                    # capacity under a capacity factor)
    exchange_bytes: tuple[tuple[str, float], ...]  # (link level, bytes the busiest rank receives over it)
    dropped_fraction: float         # of the token copies, under the capacity factor (0 dropless)
    time_factor: float = 0.0        # under core sharing, the load the time model takes instead of f
                                    # (:func:`shared_load`); 0 with a core per rank

    @property
    def priced_load(self) -> float:
        return self.time_factor or self.rank_max_over_mean


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutedPrediction:
    """A :class:`Prediction` under a routing distribution and a placement, with each layer's load."""

    prediction: Prediction
    routing: Routing
    placements: tuple[tuple[int, Placement], ...]  # (layer_number, placement), every MoE layer
    loads: tuple[LayerLoad, ...]

    @property
    def max_load(self) -> LayerLoad:
        return max(self.loads, key=lambda x: x.rank_max_over_mean)


def shared_makespan(work: tuple[float, ...], cores: float) -> float:
    """Time for ranks with ``work`` (core-seconds each) to finish on ``cores`` cores shared fairly
    (processor sharing: each running rank gets ``min(1, cores / running)`` of a core; a rank that
    is done, waiting in the exchange, gives its core away)."""
    t, done = 0.0, 0.0
    ordered = sorted(work)
    for i, w in enumerate(ordered):
        t += (w - done) / min(1.0, cores / (len(ordered) - i))
        done = w
    return t


def shared_load(loads: tuple[float, ...], share: float) -> float:
    """The load factor a layer's expert work takes on a host whose ranks share its cores (each gets
    ``share`` of a core while all run; the calibrated rates are those): the processor-sharing
    makespan of the ranks' ``loads`` over that of the mean load on every rank. With a core per rank
    (``share`` 1) it is the busiest rank over the mean, ``f``; shared, the busiest rank's excess runs
    on the cores the others give away once their experts are done. The benchmark of 2026-12-07
    (docs/placement-bench.md): 4 ranks on 2 cores at f = 2.56 measured 5 % off the step where f
    priced 86 % too slow; this factor is 1.51 there."""
    n = len(loads)
    mean = sum(loads) / n
    if mean == 0 or share >= 1.0:
        return max(loads) / mean if mean else 1.0
    cores = n * share
    return shared_makespan(tuple(loads), cores) / shared_makespan((mean,) * n, cores)


def local_tokens(model: ModelSpec, plan: ParallelPlan) -> int:
    """Tokens one rank routes per micro-batch: ``s b / cp`` (over tp with SP), as the activation model's ``T_l``."""
    tokens = math.ceil(model.seq_length / plan.cp) * plan.micro_batch_size
    return math.ceil(tokens / plan.tp) if plan.sequence_parallel else tokens


def layer_loads(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, routing: Routing,
                placements: dict[int, Placement]) -> tuple[LayerLoad, ...]:
    """:class:`LayerLoad` of every MoE layer (``placements``: layer_number -> placement)."""
    t_l = local_tokens(model, plan)
    assigned = t_l * model.moe_router_topk
    shares = level_shares(expert_groups(plan)["ep"], cluster) if plan.ep > 1 else ()
    width = model.hidden_size * element_bytes(plan.precision)
    share = cluster.accelerator.core_share
    out = []
    for number, counts in routing.layers:
        placement = placements[number]
        loads = rank_loads(counts, placement)
        busiest = max(range(len(loads)), key=loads.__getitem__)
        f = load_factor(counts, placement)
        per_source = assigned * f / plan.ep  # T k p_d*
        if model.moe_capacity_factor is not None:  # padded to capacity: (E / ep) cap from each source
            per_source = model.num_experts // plan.ep * capacity(model, assigned, t_l)
        out.append(LayerLoad(
            layer=number, expert_max_over_mean=routing.max_over_mean(number), rank_max_over_mean=f,
            busiest_rank=busiest, busiest_rank_tokens=per_source * plan.ep,
            exchange_bytes=tuple((s.link.name, s.peers * per_source * width) for s in shares),
            dropped_fraction=dropped_fraction(counts, assigned, t_l, model.moe_capacity_factor),
            time_factor=shared_load(loads, share) if share < 1.0 else 0.0))
    return tuple(out)


def full_placements(model: ModelSpec, routing: Routing, ep: int,
                    given: dict[int, Placement] | None = None) -> dict[int, Placement]:
    """A placement for every MoE layer: ``given``'s, else Megatron's default."""
    given = given or {}
    default = default_placement(model.num_experts, ep)
    return {n: check_placement(given[n], model.num_experts, ep, key=f"placement.layers.{n}") if n in given
            else default for n, _ in routing.layers}


def _stage_memory(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec,
                  loads: dict[int, float]) -> tuple[StageMemory, ...]:
    """Per stage, memory with its MoE layers at the stage's largest load (module docstring)."""
    pattern = model.moe_layer_pattern
    out = []
    by_load: dict[float, tuple[StageMemory, ...]] = {}
    for rank, chunks in enumerate(stage_layers(model, plan)):
        stage = [loads[i + 1] for chunk in chunks for i in chunk if pattern[i]]
        load = max(stage, default=model.moe_expert_load_skew)
        if load not in by_load:
            by_load[load] = stage_memory(with_load(model, load), plan, cluster)
        out.append(by_load[load][rank])
    return tuple(out)


def predict_routed(model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan, routing: Routing,
                   placements: dict[int, Placement] | None = None) -> RoutedPrediction:
    """:func:`piper_core.resource.predict.predict` with each MoE layer at its load under ``placements``
    (layer_number -> placement; Megatron's default for the layers not given)."""
    check_plan(model, plan)
    if routing.num_experts != model.num_experts:
        raise SpecError("num_experts", routing.num_experts, f"must equal the model's ({model.num_experts})",
                        "give the routing of this model", where=routing.source or None)
    full = full_placements(model, routing, plan.ep, placements)
    loads = layer_loads(model, plan, cluster, routing, full)
    factors = {x.layer: x.priced_load for x in loads}  # time: under core sharing, the shared load
    held = {x.layer: x.rank_max_over_mean for x in loads}  # memory: the busiest rank's rows, whatever the cores
    base = predict(model, cluster, plan)
    t = step_time(model, plan, cluster, loads=factors)
    stages = _stage_memory(model, plan, cluster, held)
    prediction = dataclasses.replace(base, time=t, stages=stages, rate=throughput(model, plan, cluster, t))
    return RoutedPrediction(prediction=prediction, routing=routing, placements=tuple(sorted(full.items())),
                            loads=loads)


def routing_json(r: RoutedPrediction) -> dict[str, Any]:
    """The ``routing`` key of ``--json``: the input, and per MoE layer its load under the placement."""
    default = default_placement(r.routing.num_experts, r.prediction.plan.ep)
    return {"source": r.routing.source, "num_experts": r.routing.num_experts,
            "placement": "default" if all(p == default for _, p in r.placements) else "custom",
            "max_rank_over_mean": r.max_load.rank_max_over_mean,
            "layers": [{"layer": x.layer, "expert_max_over_mean": x.expert_max_over_mean,
                        "rank_max_over_mean": x.rank_max_over_mean, "busiest_rank": x.busiest_rank,
                        "busiest_rank_tokens": x.busiest_rank_tokens,
                        "exchange_bytes": {name: b for name, b in x.exchange_bytes},
                        "dropped_fraction": x.dropped_fraction} for x in r.loads]}


def routed_to_json(r: RoutedPrediction) -> dict[str, Any]:
    """``piper predict --json`` with a ``routing`` key."""
    return to_json(r.prediction) | {"routing": routing_json(r)}


def placement_file(num_experts: int, ep: int, layers: dict[int, Placement]) -> dict[str, Any]:
    """The placement file :func:`load_placement` reads: per MoE layer (``layer_number``), each rank's
    logical experts (what ``piper placement --out`` and a migrated checkpoint write; the format is
    :class:`piper_core.runtime.placement.LayerPlacements`'s)."""
    from piper_core.runtime.placement import ExpertPlacement, LayerPlacements

    return LayerPlacements(num_experts=num_experts, ep=ep, layers={
        n: ExpertPlacement(num_experts=num_experts, ep=ep, ranks=p) for n, p in layers.items()}).to_json()


def load_placement(path: str, model: ModelSpec, ep: int) -> dict[int, Placement]:
    """Read a placement file, either form (:func:`piper_core.runtime.placement.read_placements`; JSON,
    or YAML by its suffix)::

        {"num_experts": 8, "ep": 2, "layers": {"1": [[0, 5, 6, 7], [1, 2, 3, 4]], ...}}
        {"num_experts": 8, "ep": 2, "ranks": [[0, 5, 6, 7], [1, 2, 3, 4]]}      (every MoE layer)

    ``layers`` maps Megatron's 1-based layer_number to each rank's logical experts; MoE layers not
    listed keep Megatron's default placement. ``num_experts`` and ``ep`` must match the model and plan.
    """
    from piper_core.runtime.placement import ExpertPlacement, read_placements

    where = str(path)
    placements = read_placements(path, key="--placement")
    if placements.num_experts != model.num_experts:
        raise SpecError("num_experts", placements.num_experts, f"must equal the model's ({model.num_experts})",
                        "give a placement of this model's experts", where=where)
    if placements.ep != ep:
        raise SpecError("ep", placements.ep, f"must equal the plan's expert parallelism ({ep})",
                        f"make the placement for ep={ep} (piper placement ... --ep {ep})", where=where)
    moe = moe_layer_numbers(model)
    if isinstance(placements, ExpertPlacement):
        return {n: placements.ranks for n in moe}
    for n in placements.layers:
        if n not in moe:
            raise SpecError(f"layers.{n}", n, f"is not a MoE layer of {model.name}",
                            f"use MoE layer numbers {moe[0]}..{moe[-1]}", where=where)
    return {n: p.ranks for n, p in placements.layers.items()}
