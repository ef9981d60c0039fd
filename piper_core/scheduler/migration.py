"""Incremental expert migration, the model's half (issue 17, deliverable 3): which experts move when
a placement changes, what a move costs, and whether it pays for itself.

* **What moves** (:func:`plan_migration`): per MoE layer, every logical expert whose physical slot
  changes. The target is first aligned to the current placement (:func:`align`): an expert that stays
  on its rank keeps its local slot, so only experts that change rank cross a link (the placement
  optimizer lists each rank's experts sorted, which would otherwise reorder slots for nothing).
* **Bytes per expert** (:func:`expert_state_bytes`): one expert's parameters
  (:func:`piper_core.resource.params.mlp_params` at the plan's etp) times the bytes per parameter of
  the memory model (:func:`piper_core.resource.memory._state_bytes`: weights, the DDP gradient buffer,
  Adam's m and v and the fp32 master weights where the plan keeps them). The whole state moves, with
  the distributed optimizer too: its pieces are first assembled over the expert data-parallel ranks
  (:func:`unshard_time`). The step's transient fp32 gradient copy is not state and does not move.
* **Time** (:func:`move_time`): alpha-beta per link level (as :mod:`piper_core.timing.comm`). The
  level between expert-parallel ranks ``a`` and ``b`` is the first whose domain holds both (their
  global ranks ``a*etp`` and ``b*etp`` in Megatron's expert order, :func:`piper_core.timing.topology.
  expert_groups`, taking the first expert-parallel group). Each rank sends one message to each peer
  it gives experts to and receives one from each it takes from; a rank's levels and its two directions
  run concurrently (bandwidth per direction), so a rank takes the largest, over its levels and
  directions, of ``messages x latency + bytes / rate``, with the level's bulk rate
  (:attr:`piper_core.specs.cluster.LinkLevel.bulk_rate_gb_per_s`: measured by ``piper calibrate``'s
  bulk two-way exchange where there is one, else the level's bandwidth), plus packing what it sends and unpacking
  what it receives (:func:`copy_time`); the move takes its slowest rank, per
  pipeline stage, and the slowest stage (stages and expert-data-parallel replicas move at once).
* **Candidates**: the optimizer's placement (built from scratch: it may move almost every expert) and
  :func:`swap_target` (swap descent from the current placement: only the swaps that lower the busiest
  rank); ``piper placement --current`` prices both and keeps the one with the larger net gain.
* **Decision** (:func:`decide`): migrate when the predicted step saving under the new placement,
  over the next ``horizon`` steps, exceeds the move's predicted time. :func:`choose` prices both
  candidates from a routing and the current placements and keeps the larger net gain: what ``piper
  placement --current`` prints and what Megatron-LM's ``--piper-migrate-every`` runs between iterations
  (:mod:`piper_megatron.live`).

Pure Python (no torch): the runtime half is :mod:`piper_megatron.migrate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from piper_core.errors import SpecError
from piper_core.resource.memory import _state_bytes
from piper_core.resource.params import ParamCount, mlp_params
from piper_core.resource.routing import Placement, check_placement
from piper_core.specs.cluster import ClusterSpec, LinkLevel
from piper_core.specs.compat import stage_layers
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.routing import Routing
from piper_core.timing.comm import US, ring
from piper_core.timing.topology import expert_groups


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    """Logical ``expert`` of MoE layer ``layer`` (Megatron's 1-based layer_number) goes from local slot
    ``src_local`` of expert-parallel rank ``src_rank`` to local slot ``dst_local`` of ``dst_rank``."""

    layer: int
    expert: int
    src_rank: int
    src_local: int
    dst_rank: int
    dst_local: int

    @property
    def crosses(self) -> bool:
        """Between two ranks (a link), not a copy inside one."""
        return self.src_rank != self.dst_rank


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrationPlan:
    """Every slot change from ``current`` to ``target`` (both layer -> placement, aligned)."""

    num_experts: int
    ep: int
    moves: tuple[Move, ...]
    target: tuple[tuple[int, Placement], ...]

    @property
    def crossing(self) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.crosses)

    def by_layer(self) -> dict[int, tuple[Move, ...]]:
        out: dict[int, list[Move]] = {}
        for m in self.moves:
            out.setdefault(m.layer, []).append(m)
        return {k: tuple(v) for k, v in sorted(out.items())}


def align(current: Placement, target: Placement) -> Placement:
    """``target``'s experts per rank, in local slots that keep every expert already on that rank in its
    current slot; the experts a rank takes in fill its freed slots in increasing id order."""
    out = []
    for here, wanted in zip(current, target, strict=True):
        keep = set(wanted) & set(here)
        incoming = iter(sorted(set(wanted) - keep))
        out.append(tuple(e if e in keep else next(incoming) for e in here))
    return tuple(out)


def plan_migration(current: dict[int, Placement], target: dict[int, Placement], *, num_experts: int,
                   ep: int, aligned: bool = True) -> MigrationPlan:
    """The moves that turn ``current`` into ``target`` (layer_number -> each rank's logical experts;
    a layer missing from either is Megatron's default). ``aligned``: first :func:`align` the target,
    so that experts staying on their rank do not change slot."""
    from piper_core.resource.routing import default_placement

    default = default_placement(num_experts, ep)
    moves: list[Move] = []
    final = []
    for layer in sorted(set(current) | set(target)):
        old = check_placement(current.get(layer, default), num_experts, ep, key=f"current.layers.{layer}")
        new = check_placement(target.get(layer, default), num_experts, ep, key=f"target.layers.{layer}")
        if aligned:
            new = align(old, new)
        final.append((layer, new))
        where = {e: (r, i) for r, experts in enumerate(old) for i, e in enumerate(experts)}
        for r, experts in enumerate(new):
            for i, e in enumerate(experts):
                src = where[e]
                if src != (r, i):
                    moves.append(Move(layer=layer, expert=e, src_rank=src[0], src_local=src[1], dst_rank=r,
                                      dst_local=i))
    moves.sort(key=lambda m: (m.layer, m.expert))
    return MigrationPlan(num_experts=num_experts, ep=ep, moves=tuple(moves), target=tuple(final))


def swap_target(routing: Routing, current: dict[int, Placement], ep: int) -> dict[int, Placement]:
    """Per MoE layer, the placement that swap descent (:func:`piper_core.scheduler.placement.improve`)
    reaches from ``current`` (Megatron's default where a layer is not given): only the swaps that
    lower the busiest rank, so few experts move -- against the optimizer's placement, built from
    scratch, which may move almost every expert for the same busiest rank."""
    from piper_core.resource.routing import default_placement
    from piper_core.scheduler.placement import improve

    default = default_placement(routing.num_experts, ep)
    return {n: improve(counts, current.get(n, default)) for n, counts in routing.layers}


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertBytes:
    """Bytes one expert-parallel rank sends to move one expert (memory model's rules)."""

    params: int       # parameters of one expert (at the plan's etp)
    weights: int
    gradients: int    # the DDP gradient buffer's view (main_grad)
    optimizer: int    # Adam m, v (+ fp32 master weights where kept): the whole state, dist_opt or not

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def expert_state_bytes(model: ModelSpec, plan: ParallelPlan) -> ExpertBytes:
    """One expert's moved bytes per rank (module docstring)."""
    if not model.is_moe:
        raise SpecError("model", model.name, "has no experts to migrate", "give a Mixture-of-Experts model")
    n = mlp_params(model, model.moe_ffn_hidden_size, plan.etp_size)
    # whole states move (with the distributed optimizer too: assembled first, see unshard_time)
    one = _state_bytes(ParamCount(expert=n), dataclasses.replace(plan, distributed_optimizer=False))
    if plan.optimizer_offload_fraction:
        raise SpecError("optimizer_offload_fraction", plan.optimizer_offload_fraction, "migration moves optimizer "
                        "state between GPUs; an offloaded share lives on the host", "price a plan without offload")
    return ExpertBytes(params=n, weights=one.weights, gradients=one.gradients, optimizer=one.optimizer)


def link_between(a: int, b: int, etp: int, cluster: ClusterSpec) -> LinkLevel:
    """The link level between expert-parallel ranks ``a`` and ``b`` (module docstring)."""
    for link in cluster.links:
        if link.domain_gpus is None or (a * etp) // link.domain_gpus == (b * etp) // link.domain_gpus:
            return link
    return cluster.links[-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class MoveCost:
    """The predicted time of a migration and what it moves."""

    seconds: float
    experts: int             # expert moves across ranks (all layers)
    bytes_per_expert: ExpertBytes
    busiest_rank_bytes: int  # the most one rank sends or receives
    levels: tuple[tuple[str, int], ...]  # bytes crossing each link level (all ranks, one replica)


def move_time(migration: MigrationPlan, model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> MoveCost:
    """Alpha-beta time of ``migration`` under ``plan`` on ``cluster`` (module docstring)."""
    per = expert_state_bytes(model, plan)
    stage_of = {i + 1: s for s, chunks in enumerate(stage_layers(model, plan)) for chunk in chunks for i in chunk}
    by_stage: dict[int, list[Move]] = {}
    for m in migration.crossing:
        by_stage.setdefault(stage_of.get(m.layer, 0), []).append(m)
    seconds, busiest = 0.0, 0
    level_bytes: dict[str, int] = {link.name: 0 for link in cluster.links}
    for stage, moves in by_stage.items():
        pairs: dict[tuple[int, int], int] = {}
        for m in moves:
            pairs[(m.src_rank, m.dst_rank)] = pairs.get((m.src_rank, m.dst_rank), 0) + per.total
        for (a, b), n in pairs.items():
            level_bytes[link_between(a, b, plan.etp_size, cluster).name] += n
        for r in range(migration.ep):
            t, io = _rank_time(r, pairs, plan.etp_size, cluster)
            held = sum(1 for m in migration.moves if m.src_rank == r and stage_of.get(m.layer, 0) == stage)
            t += unshard_time(held, per, plan, cluster)
            seconds, busiest = max(seconds, t), max(busiest, io)
    return MoveCost(seconds=seconds, experts=len(migration.crossing), bytes_per_expert=per,
                    busiest_rank_bytes=busiest, levels=tuple((k, v) for k, v in level_bytes.items() if v))


def _rank_time(rank: int, pairs: dict[tuple[int, int], int], etp: int, cluster: ClusterSpec) -> tuple[float, int]:
    """(seconds, the larger of its sent and received bytes) for one rank of the move."""
    per_level: dict[str, list[int]] = {}  # name -> [messages sent, bytes sent, messages received, bytes received]
    links = {link.name: link for link in cluster.links}
    for (a, b), n in pairs.items():
        if rank not in (a, b):
            continue
        row = per_level.setdefault(link_between(a, b, etp, cluster).name, [0, 0, 0, 0])
        i = 0 if rank == a else 2
        row[i] += 1
        row[i + 1] += n

    def direction(name: str, messages: int, nbytes: int) -> float:
        link = links[name]
        return messages * link.latency_us * US + nbytes / (link.bulk_rate_gb_per_s * 1e9)

    t = max((max(direction(name, ms, s), direction(name, mr, r)) for name, (ms, s, mr, r) in per_level.items()),
            default=0.0)
    io = max((max(s, r) for _, s, _, r in per_level.values()), default=0)
    moved = sum(s + r for _, s, _, r in per_level.values())
    return t + copy_time(moved, cluster), int(io)


def unshard_time(experts: int, per: ExpertBytes, plan: ParallelPlan, cluster: ClusterSpec) -> float:
    """With the distributed optimizer over ``edp > 1`` ranks, each rank first assembles the whole
    optimizer state of the ``experts`` it gives away (one all-reduce of that state over the expert
    data-parallel group: each rank holds a piece whose bounds depend on the expert's local slot,
    which a move changes), and writes its new piece back after the exchange (a local copy). 0 otherwise."""
    if not plan.distributed_optimizer or plan.edp == 1 or experts == 0:
        return 0.0
    return ring(expert_groups(plan)["edp"], experts * per.optimizer, cluster, passes=2)


def copy_time(nbytes: float, cluster: ClusterSpec) -> float:
    """Packing what a rank sends into one buffer and unpacking what it receives: one read and one write
    of each byte in device memory, before and after the exchange, at the accelerator's copy rate
    (:attr:`~piper_core.specs.cluster.AcceleratorSpec.copy_rate_gb_per_s`: the state moved is cold,
    unlike the activations :func:`piper_core.timing.comm.hierarchical_stages` regroups at HBM's rate)."""
    return 2 * nbytes / (cluster.accelerator.copy_rate_gb_per_s * 1e9)


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """Migrate iff ``gain_s`` (the step saving over ``horizon`` steps) exceeds ``cost.seconds``."""

    horizon: int
    step_before_s: float
    step_after_s: float
    cost: MoveCost

    @property
    def gain_s(self) -> float:
        return (self.step_before_s - self.step_after_s) * self.horizon

    @property
    def migrate(self) -> bool:
        return self.cost.experts > 0 and self.gain_s > self.cost.seconds

    @property
    def break_even_steps(self) -> float | None:
        """Steps after which the move has paid for itself (None: it never does)."""
        saving = self.step_before_s - self.step_after_s
        return self.cost.seconds / saving if saving > 0 else None

    def reason(self) -> str:
        if self.cost.experts == 0:
            return "nothing to move: the new placement puts every expert on the rank that holds it"
        be = self.break_even_steps
        if be is None:
            return (f"the new placement is not faster ({self.step_before_s:.4g} s -> {self.step_after_s:.4g} s per "
                    "step): keep the current one")
        verdict = "migrate" if self.migrate else "keep the current placement"
        cmp = ">" if self.migrate else "<="
        return (f"{verdict}: gain over {self.horizon} steps {self.gain_s:.4g} s {cmp} move {self.cost.seconds:.4g} s "
                f"(pays off after {be:.3g} steps)")


def check_horizon(horizon: int) -> int:
    """``horizon`` when it is a positive number of steps (SpecError otherwise)."""
    if type(horizon) is not int or horizon < 1:
        raise SpecError("--horizon", horizon, "must be a whole number of steps >= 1",
                        "give the steps the new placement will run before it is reconsidered, e.g. --horizon 100")
    return horizon


def decide(*, horizon: int, step_before_s: float, step_after_s: float, cost: MoveCost) -> Decision:
    """The rule (module docstring); ``horizon`` must be a positive number of steps."""
    check_horizon(horizon)
    return Decision(horizon=horizon, step_before_s=step_before_s, step_after_s=step_after_s, cost=cost)


def migration_json(migration: MigrationPlan, decision: Decision, *, candidate: str = "") -> dict:
    """The ``migration`` key of ``piper placement --current ... --json``."""
    c = decision.cost
    return {"candidate": candidate, "moves": [{"layer": m.layer, "expert": m.expert, "from": [m.src_rank, m.src_local],
                       "to": [m.dst_rank, m.dst_local]} for m in migration.crossing],
            "local_slot_changes": len(migration.moves) - len(migration.crossing),
            "bytes_per_expert": {"params": c.bytes_per_expert.params, "weights": c.bytes_per_expert.weights,
                                 "gradients": c.bytes_per_expert.gradients,
                                 "optimizer": c.bytes_per_expert.optimizer, "total": c.bytes_per_expert.total},
            "busiest_rank_bytes": c.busiest_rank_bytes, "level_bytes": dict(c.levels),
            "move_s": c.seconds, "horizon": decision.horizon, "step_before_s": decision.step_before_s,
            "step_after_s": decision.step_after_s, "gain_s": decision.gain_s,
            "break_even_steps": decision.break_even_steps, "migrate": decision.migrate, "reason": decision.reason(),
            "target": {"num_experts": migration.num_experts, "ep": migration.ep,
                       "layers": {str(k): [list(r) for r in v] for k, v in migration.target}}}


# ---- choosing a target (piper placement --current, --piper-migrate-every) ---------------------------

SWAPS, OPTIMIZER = "swaps", "optimizer"  # the candidates of :func:`choose`


@dataclass(frozen=True, kw_only=True, slots=True)
class Priced:
    """One candidate target: ``name`` (:data:`SWAPS` or :data:`OPTIMIZER`), its moves and the decision."""

    name: str
    migration: MigrationPlan
    decision: Decision

    @property
    def net_s(self) -> float:
        """The gain over the horizon net of the move."""
        return self.decision.gain_s - self.decision.cost.seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """Every candidate priced, and the one with the larger net gain (ties: swaps, fewer moves)."""

    candidates: tuple[Priced, ...]

    @property
    def chosen(self) -> Priced:
        return max(self.candidates, key=lambda c: (c.net_s, c.name == SWAPS))


def choose(model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan, routing: Routing,
           current: dict[int, Placement], *, horizon: int,
           optimized: dict[int, Placement] | None = None) -> Choice:
    """Price moving from ``current`` (layer_number -> placement; Megatron's default where a layer is not
    given) to :func:`swap_target` and to the placement optimizer's (``optimized``, else
    :func:`piper_core.scheduler.placement.optimize` of ``routing``), each step under ``routing``
    (:func:`piper_core.resource.routing.predict_routed`), each move by :func:`move_time`, each
    decision by :func:`decide` over ``horizon`` steps."""
    from piper_core.resource.routing import predict_routed
    from piper_core.scheduler.placement import optimize

    check_horizon(horizon)
    if optimized is None:
        optimized = {p.layer: p.placement for p in optimize(routing, plan.ep)}
    before = predict_routed(model, cluster, plan, routing, current).prediction.time.step
    out = []
    for name, target in ((SWAPS, swap_target(routing, current, plan.ep)), (OPTIMIZER, optimized)):
        migration = plan_migration(current, target, num_experts=model.num_experts, ep=plan.ep)
        after = predict_routed(model, cluster, plan, routing, dict(migration.target)).prediction.time.step
        cost = move_time(migration, model, plan, cluster)
        out.append(Priced(name=name, migration=migration,
                          decision=decide(horizon=horizon, step_before_s=before, step_after_s=after, cost=cost)))
    return Choice(candidates=tuple(out))


def layer_range(layers: list[int]) -> str:
    """``[3]`` -> ``3``; consecutive -> ``2-48``; else ``first,..,last``."""
    if len(layers) == 1:
        return str(layers[0])
    return f"{layers[0]}-{layers[-1]}" if layers[-1] - layers[0] == len(layers) - 1 else f"{layers[0]},..,{layers[-1]}"


def move_rows(migration: MigrationPlan, *, max_shown: int) -> list[tuple[list[int], str]]:
    """The experts that change rank, per layer (``expert 5 rank 0->1, ...``, or their number above
    ``max_shown``), consecutive layers with the same text merged: (layer numbers, text)."""
    rows: list[tuple[list[int], str]] = []
    for layer, moves in migration.by_layer().items():
        crossing = [m for m in moves if m.crosses]
        if not crossing:
            continue
        text = ", ".join(f"expert {m.expert} rank {m.src_rank}->{m.dst_rank}" for m in crossing) \
            if len(crossing) <= max_shown else f"{len(crossing)} experts change rank"
        if rows and rows[-1][1] == text:
            rows[-1][0].append(layer)
        else:
            rows.append(([layer], text))
    return rows
