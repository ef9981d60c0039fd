"""``piper plan``'s engine: enumerate the space, reject with a counted reason, score the rest.

Each raw combination is first checked with cheap structural rules (Megatron's divisibility
rules, in the order below, the first failure being the reason); survivors become a
``ParallelPlan``, their memory is predicted once, and the all-to-all variants share it and are
timed separately (re-pricing only their MoE layers, :class:`ExchangeVariants`). A candidate the resource model finds infeasible (``Infeasible``: a rule of the
host framework the structural checks do not cover) is rejected with its reason like any other; it
never ends the search. Plans are ranked by predicted tokens/s (equivalently MFU) and, at equal speed,
by lower peak memory.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import math
import operator
import time
from collections import Counter
from dataclasses import dataclass, field

from piper_core.errors import Infeasible, SpecError
from piper_core.resource import activations
from piper_core.resource.flops import layer_flops_per_token, logit_flops_per_token, mtp_flops_per_token
from piper_core.resource.memory import GIB, _state_bytes, fp8_weights, peak_bytes, stage_memory
from piper_core.resource.params import stage_params
from piper_core.specs.layout import balanced_layout, parse_layout
from piper_core.resource.predict import Prediction, predict
from piper_core.scheduler.space import UNPIPELINED, A2AVariant, SearchSpace, default_space, pipeline_split
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import check_plan
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs._check import freeze_hash
from piper_core.timing.step import ExchangeVariants, step_time
from piper_core.timing.topology import Group, members_per_domain

RETIME = 16
_PLAN_FIELDS = tuple(f for f in dataclasses.fields(ParallelPlan) if f.init)
MEMORY = "exceeds memory"
HOST_MEMORY = "offloaded optimizer exceeds host memory"


@dataclass(frozen=True, kw_only=True, slots=True)
class Scored:
    """A feasible plan with its predicted step time and peak memory (bytes)."""

    plan: ParallelPlan
    step_s: float
    peak_bytes: int


@dataclass(kw_only=True)
class SearchResult:
    candidates: int = 0
    rejected: Counter = field(default_factory=Counter)
    scored: list[Scored] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def feasible(self) -> int:
        return len(self.scored)

    @property
    def plans_per_s(self) -> float:
        return self.candidates / self.elapsed_s if self.elapsed_s else float("inf")

    def best(self, k: int) -> list[Scored]:
        """The ``k`` fastest plans; near-ties (< 1e-6 relative) go to lower memory, then to the
        plan with fewer model-parallel ranks and fewer moving parts."""
        return sorted(self.scored, key=_rank_key)[:k]


def _rank_key(s: Scored) -> tuple:
    p = s.plan
    simplicity = (p.tp * p.pp * p.cp * (p.vpp or 1), p.ep * p.etp_size, p.a2a != "flat", p.a2a_chunks,
                  p.ep_comm_overlap, p.recompute != "none", p.micro_batch_size)
    return (round(math.log(s.step_s) * 1e6), s.peak_bytes, simplicity)


@functools.cache
def layout_weights(model: ModelSpec) -> dict[str, float]:
    """The loss and an MTP layer in mean decoder layers, by model FLOPs per token, for :func:`balanced_layout`."""
    layer = sum(layer_flops_per_token(model, i) for i in range(model.num_layers)) / model.num_layers
    return {"loss": logit_flops_per_token(model) / layer, "mtp": mtp_flops_per_token(model) / layer}


def _structural(model: ModelSpec, gpus: int, gbs: int, combo: tuple, sequence_parallel: bool = True,
                shared_overlap: bool = True, pinned_layout: str | None = None) -> tuple[dict | None, str | None]:
    """Kwargs for ParallelPlan, or the first Megatron rule the combination breaks."""
    tp, pp, vpp, cp, ep, etp_is_tp, mbs, recompute, dist_opt = combo
    etp = tp if etp_is_tp else 1
    if gpus % (tp * pp * cp):
        return None, "gpus not divisible by tp*pp*cp"
    if vpp > 1 and pp == 1:
        return None, "vpp needs pp > 1"
    if model.num_attention_heads % tp or (model.mla is None and model.query_groups % tp) or model.ffn_hidden_size % tp:
        return None, "heads, query groups or ffn not divisible by tp"
    dp = gpus // (tp * pp * cp)
    if model.is_moe:
        if model.num_experts % ep:
            return None, "experts % ep != 0"
        if (tp * cp * dp) % (etp * ep):
            return None, "etp*ep does not divide tp*cp*dp"
        if model.moe_ffn_hidden_size % etp or model.moe_shared_expert_intermediate_size % tp:
            return None, "expert ffn not divisible by etp/tp"
    if cp > 1 and model.seq_length % (2 * cp):
        return None, "seq_length not divisible by 2*cp"
    last, reason = pipeline_split(model.num_layers, pp, vpp)
    layout = None
    if pinned_layout is not None:  # the user's layout, whatever split would do
        stages = len(parse_layout(pinned_layout))
        if pp * vpp != stages:
            return None, f"pp*vpp is not the pinned layout's {stages} stages"
        last, reason, layout = None, None, pinned_layout
    elif reason and vpp > 1:  # no even split over pp x vpp: Megatron's layout, embedding and loss a layer each
        layout = balanced_layout(model.num_layers, pp, vpp, model.mtp_num_layers, **layout_weights(model))
        reason = None if layout is not None else reason
    if reason:
        return None, reason
    if gbs % (mbs * dp):
        return None, "gbs not divisible by mbs*dp"
    kwargs = dict(gpus=gpus, tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, cp=cp, ep=ep, etp=etp,
                  sequence_parallel=tp > 1 and sequence_parallel, micro_batch_size=mbs, global_batch_size=gbs,
                  recompute=recompute, recompute_num_layers=1 if recompute == "full" else None,
                  distributed_optimizer=dist_opt, shared_expert_overlap=shared_overlap and bool(model.moe_shared_expert_intermediate_size),
                  num_layers_in_last_pipeline_stage=last, pipeline_layout=layout)
    return kwargs, None


def search(model: ModelSpec, cluster: ClusterSpec, gpus: int, gbs: int, *, space: SearchSpace | None = None,
           memory_headroom: float = 0.0, attention_backend: str = "flash", progress=None,
           workers: int = 1) -> SearchResult:
    """Evaluate every plan of ``space`` (default: :func:`default_space`).

    ``memory_headroom`` is the fraction of capacity kept free (0.1: plans must fit in 90 %).
    ``progress(done, total)`` is called now and then for a progress bar.

    Every candidate is evaluated -- nothing is pruned, the counts and the scored list are complete
    and in the grid's order -- but work that candidates share is done once: a structural rule
    rejects all recompute and optimizer options of a combination at once (they enter no rule); the
    exchange variants of a base plan share its memory and all of its step time but the MoE layer
    cost (:class:`ExchangeVariants`), and layer costs and the other step-time terms are memoised for
    the whole search; two plans that differ only in the distributed optimizer share their checks and
    activations (:class:`_Memory`).

    ``workers`` > 1 scans the grid in this process and ``workers - 1`` forked ones, which take its
    groups of combinations (by ep) from a shared counter (:mod:`.parallel`): the result is the same,
    in the same order. Only for a process that may fork (the ``piper plan`` CLI); the adapters plan inside
    training processes and keep the default.

    The cyclic garbage collector is paused meanwhile: the search allocates hundreds of thousands of
    short-lived objects and makes no reference cycles, and the collections those allocations set off
    cost about 12 % of its time (deepseek-v3 at 1024 GPUs, 2026-12-05).
    """
    space = space or default_space(model, cluster, gpus)
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _search(model, cluster, gpus, space, gbs, memory_headroom, attention_backend, progress, workers)
    finally:
        if collecting:
            gc.enable()


def _search(model: ModelSpec, cluster: ClusterSpec, gpus: int, space: SearchSpace, gbs: int, memory_headroom: float,
            attention_backend: str, progress, workers: int) -> SearchResult:
    start = time.perf_counter()
    # grid(space)'s order: the first seven dimensions outside, recompute and optimizer inside
    outer = list(itertools.product(space.tp, space.pp, space.vpp, space.cp, space.ep, space.etp_equals_tp, space.mbs))
    job = _Scan(model=model, cluster=cluster, gpus=gpus, gbs=gbs, space=space, attention_backend=attention_backend,
                limit=cluster.capacity_gib * GIB * (1.0 - memory_headroom))
    if workers > 1:
        from piper_core.scheduler.parallel import scan_forked

        result = scan_forked(job, outer, workers, progress)
    else:
        result = job.scan(outer, progress)
    _retime(model, cluster, result)
    result.elapsed_s = time.perf_counter() - start
    return result


@dataclass(frozen=True, kw_only=True)
class _Scan:
    """What one scan of part of the grid needs (a forked worker inherits it)."""

    model: ModelSpec
    cluster: ClusterSpec
    gpus: int
    gbs: int
    space: SearchSpace
    attention_backend: str
    limit: float

    @functools.cached_property
    def inner(self) -> list[tuple]:
        return list(itertools.product(self.space.recompute, self.space.distributed_optimizer))

    def structural(self, prefix: tuple) -> bool:
        """Whether the outer combination ``prefix`` passes the structural rules (the scan's first
        filter; cheap, so a split of the grid can weigh its parts by it)."""
        inner = self.inner
        if not inner or (prefix[5] and prefix[0] == 1):
            return False
        kwargs, _ = _structural(self.model, self.gpus, self.gbs, prefix + inner[0], self.space.sequence_parallel,
                                self.space.shared_expert_overlap, self.space.pipeline_layout)
        return kwargs is not None

    def scan(self, outer: list[tuple], progress=None) -> SearchResult:
        """Candidates, rejections and scored plans of the combinations ``outer`` x inner, in order."""
        result = self.scan_with(outer, self.new_state(), progress)
        if progress:
            progress(len(outer) * len(self.inner), len(outer) * len(self.inner))
        return result

    def new_state(self) -> tuple:
        """The caches scans share: memory fits, step-time terms shared by the plans
        (ExchangeVariants), the variants built once through ParallelPlan's checks (see _score), the
        exchange variants per kind of combination."""
        return _Memory(self.model, self.cluster, self.space, self.limit), {}, set(), {}

    def scan_with(self, outer: list[tuple], state: tuple, progress=None) -> SearchResult:
        """:meth:`scan` with the caches ``state`` (:meth:`new_state`), kept for later scans."""
        total = len(outer) * len(self.inner)
        model, cluster, gpus, gbs, space = self.model, self.cluster, self.gpus, self.gbs, self.space
        inner = self.inner
        result = SearchResult()
        memory, cache, checked, variants_of = state
        scored, rejected = result.scored, result.rejected
        for n, prefix in enumerate(outer):
            if progress and n % 64 == 0:
                progress(n * len(inner), total)
            tp, etp_is_tp = prefix[0], prefix[5]
            if (etp_is_tp and tp == 1) or not inner:
                continue  # the same plan as etp=1
            combos = []
            for rest in inner:
                combo = prefix + rest
                key = (combo[0], combo[1], combo[2], combo[4], combo[5], combo[7])
                variants = variants_of.get(key)
                if variants is None:
                    variants = variants_of[key] = _variants(space, combo, cluster)
                combos.append((combo, variants))
            kwargs, reason = _structural(model, gpus, gbs, combos[0][0], space.sequence_parallel, space.shared_expert_overlap,
                                         space.pipeline_layout)
            if kwargs is None:  # the rules read only the first seven dimensions: all of inner fail alike
                k = sum(len(v) for _, v in combos)
                result.candidates += k
                rejected[reason] += k
                continue
            checked_base: tuple = (None, None, None)  # (combo without dist_opt, plan, error key)
            for combo, variants in combos:
                result.candidates += len(variants)
                same = combo[:-1]
                if checked_base[0] == same:
                    # neither ParallelPlan's checks nor check_plan read the distributed optimizer (only an
                    # optimizer offload does, and a base has none): the twin passes or fails alike
                    _, twin, error = checked_base
                    base = None if twin is None else _copy(twin, distributed_optimizer=combo[8])
                else:
                    kwargs, _ = _structural(model, gpus, gbs, combo, space.sequence_parallel, space.shared_expert_overlap,
                                            space.pipeline_layout)
                    kwargs["attention_backend"] = self.attention_backend
                    kwargs["defer_wgrad"] = space.defer_wgrad and combo[4] > 1
                    kwargs["precision"] = space.precision
                    kwargs["fp8"], kwargs["fp8_recipe"] = space.fp8, space.fp8_recipe
                    try:
                        base, error = ParallelPlan(**kwargs), None
                        check_plan(model, base)
                    except SpecError as exc:
                        base, error = None, exc.key
                    checked_base = (same, base, error)
                if base is None:
                    rejected[f"invalid {error}"] += len(variants)
                    continue
                try:
                    base, peak, reason = memory.fit(combo, base)
                    if base is not None:
                        timer = ExchangeVariants(model, base, cluster, cache)
                        # a pipelined exchange keeps more (activations.PIPELINED_EXPERT_OUTPUT)
                        piped = memory.pipelined_peak(combo, base) if any(v[1] > 1 for v in variants) else peak
                        fits = [v for v in variants if v[1] == 1 or piped is not None]
                        if len(fits) < len(variants):
                            rejected[MEMORY] += len(variants) - len(fits)
                        scored += [_score(model, cluster, base, peak if v[1] == 1 else piped, v, timer=timer,
                                          checked=checked) for v in fits]
                except Infeasible as exc:  # a host-framework rule the structural checks do not know
                    base, reason = None, exc.reason
                if base is None:
                    rejected[reason] += len(variants)
        return result


def _variants(space: SearchSpace, combo: tuple, cluster: ClusterSpec) -> tuple[A2AVariant, ...]:
    """The exchange variants of a combination: none but the plain one without expert parallelism;
    Megatron's EP overlap only where its rules allow it (vpp when pp > 1, no full recompute); the
    per-node deduplicated exchange only where the expert-parallel group spans more than one domain of
    the innermost link level (inside one it is the flat exchange, and would only tie with it)."""
    tp, pp, vpp, _, ep, etp_is_tp, _, recompute, _ = combo
    if ep == 1:
        return (UNPIPELINED,)
    overlap_ok = (pp == 1 or vpp > 1) and recompute != "full"
    group = Group(name="ep", size=ep, stride=tp if etp_is_tp else 1)
    spans = members_per_domain(group, cluster.links[0].domain_gpus) < ep
    return tuple(v for v in space.a2a if (not v[2] or overlap_ok) and (v[0] != "dedup" or spans))


def _score(model: ModelSpec, cluster: ClusterSpec, base: ParallelPlan, peak: int, variant: A2AVariant, *,
           timer: ExchangeVariants | None = None, checked: set | None = None) -> Scored:
    """``base`` with the all-to-all ``variant`` (algorithm, chunks, EP overlap), timed by the closed form.

    ``timer`` (the base's :class:`ExchangeVariants`) gives the same closed form re-pricing only the
    MoE layers. ``checked`` (a set kept for one search) holds the variants already built once through
    ParallelPlan's checks: the fields a variant changes are checked on their first use, and the rules
    that tie them to the rest of the plan (EP overlap: ep > 1, vpp where pp > 1, no full recompute)
    are those :func:`_variants` applies, so later bases take an unchecked copy (the same plan).
    """
    if variant == UNPIPELINED:
        plan = base
    elif checked is None or variant not in checked:
        plan = _with_a2a(base, *variant)
        if checked is not None:
            checked.add(variant)
    else:
        plan = _copy_a2a(base, *variant)
    step = step_time(model, plan, cluster, exact=False).step if timer is None else timer.step(plan)
    return Scored(plan=plan, step_s=step, peak_bytes=peak)


def _retime(model: ModelSpec, cluster: ClusterSpec, result: SearchResult) -> None:
    """Re-time the leading plans with the exact 1F1B simulation.

    The closed form the loop uses is an upper bound that is exact when the last stage is the
    slowest, so a plan can only move up: the ``RETIME`` best by the bound are simulated and
    the list is re-ranked. Plans without a simulated schedule (pp = 1, or interleaved: the closed
    form is what ``step_time`` gives them) keep their time.
    """
    ranked = sorted(result.scored, key=_rank_key)
    head = [dataclasses.replace(s, step_s=step_time(model, s.plan, cluster).step) if _simulated(s.plan) else s
            for s in ranked[:RETIME]]
    result.scored = head + ranked[RETIME:]


def _with(plan: ParallelPlan, **changes) -> ParallelPlan:
    kwargs = {f.name: getattr(plan, f.name) for f in _PLAN_FIELDS}
    kwargs.update(changes)
    return ParallelPlan(**kwargs)


# What Megatron's EP overlap turns off: its shared-expert overlap (Megatron refuses both) and Piper's
# deferred weight gradients (the EP overlap brings Megatron's own --delay-wgrad-compute).
_EP_OVERLAP = dict(ep_comm_overlap=True, shared_expert_overlap=False, defer_wgrad=False)


# What the flex dispatcher (a2a=dedup) turns off: shared-expert overlap (it refuses it) and Piper's
# deferred weight gradients (Piper's runtime does not run it).
_DEDUP = dict(shared_expert_overlap=False, defer_wgrad=False)


def _a2a_changes(algo: str, chunks: int, ep_overlap: bool) -> dict:
    return {"a2a": algo, "a2a_chunks": chunks, **(_EP_OVERLAP if ep_overlap else {}),
            **(_DEDUP if algo == "dedup" else {})}


def _with_a2a(plan: ParallelPlan, algo: str, chunks: int, ep_overlap: bool = False) -> ParallelPlan:
    return _with(plan, **_a2a_changes(algo, chunks, ep_overlap))


_SLOTS = tuple(f.name for f in _PLAN_FIELDS)


def _copy(plan: ParallelPlan, **changes) -> ParallelPlan:
    """What :func:`_with` returns, without ParallelPlan's checks: for changes already checked on
    another plan of the search whose other fields they do not interact with. Its stored hash is
    ``freeze_hash``'s (the hash of the compared fields in order)."""
    values = list(_ALL_FIELDS(plan))
    for name, value in changes.items():
        values[_INDEX[name]] = value
    return plan_from_values(values)


def plan_values(plan: ParallelPlan) -> tuple:
    """Every field of ``plan`` in :data:`_SLOTS` order (what :func:`plan_from_values` rebuilds)."""
    return _ALL_FIELDS(plan)


def plan_from_values(values) -> ParallelPlan:
    """The plan whose fields are ``values`` (:func:`plan_values` of a plan that passed the checks),
    without running them again."""
    new = object.__new__(ParallelPlan)
    for slot, value in zip(_SLOT_SETTERS, values):
        slot(new, value)
    if _HASHED == _SLOTS:
        _HASH_SETTER(new, hash(tuple(values)))
    else:
        freeze_hash(new)
    return new


_ALL_FIELDS = operator.attrgetter(*_SLOTS)
_INDEX = {name: i for i, name in enumerate(_SLOTS)}
_SLOT_SETTERS = tuple(getattr(ParallelPlan, name).__set__ for name in _SLOTS)
_HASHED = tuple(f.name for f in dataclasses.fields(ParallelPlan) if f.compare)
_HASH_SETTER = ParallelPlan._hash.__set__


def _copy_a2a(plan: ParallelPlan, algo: str, chunks: int, ep_overlap: bool = False) -> ParallelPlan:
    """What :func:`_with_a2a` returns, without ParallelPlan's checks (for a variant already checked)."""
    return _copy(plan, **_a2a_changes(algo, chunks, ep_overlap))


def _rest(stages: tuple) -> tuple:
    """What of each distinct stage the state does not move: (params, activations + buffers, overhead
    + workspace: both held through the step as the state is)."""
    return tuple(dict.fromkeys((s.params, s.activations + s.buffers, s.overhead + s.workspace) for s in stages))


def _peak(state: dict, rest: tuple) -> int:
    """The largest stage peak of ``rest`` under ``state`` ({params: (persistent, host, step copy)})."""
    return max(peak_bytes(state[params][0], overhead, r, state[params][2]) for params, r, overhead in rest)


class _Memory:
    """Memory fit of the search's base plans: :meth:`fit` gives the plan with the first memory saver
    of ``space.memory_savers`` that fits GPU memory (peak <= limit) and the hosts' memory (the
    offloaded optimizer), its peak bytes, or the last reason none does ("exceeds memory", or
    "offloaded optimizer exceeds host memory" when a saver fit the GPU but not the host). Savers only
    ever cost time, so a plan uses one only when it does not fit without it (offload needs the
    distributed optimizer and host memory in the cluster spec; bf16 gradients need bf16).

    The outcome is that of pricing each plan from scratch (``stage_memory``, ``with_state_of``; the
    tests compare the two), with what combinations share computed once. A plan's memory is its state
    (weights, gradients, optimizer: ``with_state_of`` re-prices it for a memory saver) plus what the
    state does not move (activations, buffers, overhead). In the grid's order (``space.grid``) the last
    dimension, the distributed optimizer, moves only the state, so the
    second of two such plans reuses the first's activations; micro-batch size and recompute move only
    the activations, so plans differing in them share the state of each memory saver. And when the
    state alone exceeds the limit under every saver, the plan is rejected for memory without pricing
    its activations (which only add to it) -- after the activation model's own feasibility check,
    so that a plan it refuses keeps its reason.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, limit: float) -> None:
        self.model, self.cluster, self.space, self.limit = model, cluster, space, limit
        self.host_limit = cluster.host_capacity_gib * GIB
        self.rest: tuple = (None, None)  # (combo without dist_opt, ((params, activations+buffers, overhead), ...))
        self.piped: tuple = (None, None)  # the same for the plan with its exchange pipelined (chunks > 1)
        self.states: dict = {}  # (state key, saver) -> {params: (weights+gradients+optimizer, host, step copy)}
        self.checked: set = set()  # savers built once through ParallelPlan's checks
        self.probed: tuple | None = None  # the last combo (without dist_opt) whose activations were checked

    def _savers(self, plan: ParallelPlan) -> list[tuple[bool, float]]:
        """The memory savers that apply to ``plan``, in the space's order."""
        out = []
        for bf16_grads, offload in self.space.memory_savers:
            if offload > 0 and (not plan.distributed_optimizer or self.host_limit == 0):
                continue
            if (bf16_grads or offload > 0) and plan.precision != "bf16":
                continue
            out.append((bf16_grads, offload))
        return out

    def _candidate(self, plan: ParallelPlan, saver: tuple[bool, float]) -> ParallelPlan:
        if saver == (False, 0.0):
            return plan
        bf16_grads, offload = saver
        if saver not in self.checked:  # the saver's own fields, checked once (their ties: _savers)
            self.checked.add(saver)
            return _with(plan, grad_reduce_in_bf16=bf16_grads, optimizer_offload_fraction=offload)
        return _copy(plan, grad_reduce_in_bf16=bf16_grads, optimizer_offload_fraction=offload)

    def _state(self, combo: tuple, plan: ParallelPlan, saver: tuple[bool, float]) -> dict:
        # the state of a pipeline rank depends on its parameters and the plan's sizes and options,
        # not on the micro-batch size or recompute (combo[6], combo[7])
        key = (combo[:6], combo[8], saver)
        state = self.states.get(key)
        if state is None:
            candidate = self._candidate(plan, saver)
            state = {}
            for params, fp8 in zip(stage_params(self.model, plan), fp8_weights(self.model, plan)):
                if params not in state:
                    bytes_ = _state_bytes(params, candidate, fp8)
                    state[params] = (bytes_.persistent, bytes_.host, bytes_.step_gradients)
            self.states[key] = state
        return state

    def pipelined_peak(self, combo: tuple, plan: ParallelPlan) -> int | None:
        """The peak of ``plan`` (as :meth:`fit` returned it, with its memory saver) with its exchange
        in chunks > 1, which keeps each chunk's expert output until backward
        (:data:`activations.PIPELINED_EXPERT_OUTPUT`; any chunk count alike), or None when that
        exceeds the limit. The saver is the one the unpipelined plan needed: a pipelined variant that
        would fit only with a further saver is rejected, not given it."""
        same = combo[:-1]
        if self.piped[0] != same:
            stages = stage_memory(self.model, _copy(plan, a2a_chunks=2), self.cluster)
            self.piped = (same, _rest(stages))
        peak = _peak(self._state(combo, plan, (plan.grad_reduce_in_bf16, plan.optimizer_offload_fraction)), self.piped[1])
        return None if peak > self.limit else peak

    def fit(self, combo: tuple, plan: ParallelPlan) -> tuple[ParallelPlan | None, int, str]:
        savers = self._savers(plan)
        same = combo[:-1]
        if self.rest[0] == same:
            rest = self.rest[1]
        else:
            if all(max(w for w, _, _ in self._state(combo, plan, saver).values()) > self.limit
                   for saver in reversed(savers)):
                if self.probed != same:  # the twin's activations are the same (see above)
                    activations.layer_activation_bytes(self.model, plan, moe=False)  # raises what stage_memory would
                    self.probed = same
                return None, 0, MEMORY
            stages = stage_memory(self.model, plan, self.cluster)
            rest = _rest(stages)
            self.rest = (same, rest)
        reason = MEMORY
        for saver in savers:
            state = self._state(combo, plan, saver)
            peak = _peak(state, rest)
            if peak > self.limit:
                continue
            if max(state[params][1] for params, _, _ in rest) * self.cluster.gpus_per_node > self.host_limit:
                reason = HOST_MEMORY
                continue
            return self._candidate(plan, saver), peak, ""
        return None, 0, reason


RANK_RULES = ("faster", "lower peak memory", "fewer model-parallel ranks", "fewer expert-parallel ranks",
              "a flat exchange (not staged)", "fewer exchange chunks", "no Megatron EP overlap", "no recompute",
              "a smaller micro-batch")


def deciding_rule(first: Scored, second: Scored) -> int | None:
    """Index into :data:`RANK_RULES` of the rule of :func:`_rank_key` that puts ``first`` before
    ``second`` (None: their keys are equal and the grid's order decided)."""
    a, b = _rank_key(first), _rank_key(second)
    for i, (x, y) in enumerate(zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2]))):
        if x != y:
            return i
    return None


def as_run_by(plan: ParallelPlan, rule) -> ParallelPlan | None:
    """``plan`` as a runtime whose ``rule`` (:data:`piper_core.runners.RUNNERS`) it is would run it: as
    it is, or -- when only the shared expert's overlap with the exchange is out of its reach -- with
    the shared expert after the routed experts (as Piper's DeepSpeed model runs it); None if neither.
    A runtime that runs the experts one GEMM each (:func:`piper_core.runners.sequential_experts`)
    gets the plan with ``moe_grouped_gemm`` off (priced that way: it only adds launches)."""
    from piper_core.runners import sequential_experts

    if plan.moe_grouped_gemm is not False and sequential_experts(rule, plan):
        plan = _copy(plan, moe_grouped_gemm=False)
    if rule(plan) is None:
        return plan
    if plan.shared_expert_overlap and not plan.ep_comm_overlap:
        plain = _copy(plan, shared_expert_overlap=False)  # always a valid plan: the overlap only hides time
        if rule(plain) is None:
            return plain
    return None


def why_not_runnable(plan: ParallelPlan, rule) -> str | None:
    """Why a runtime cannot run ``plan`` even as :func:`as_run_by` would reshape it (None: it can)."""
    if as_run_by(plan, rule) is not None:
        return None
    if plan.shared_expert_overlap and not plan.ep_comm_overlap:
        return rule(_copy(plan, shared_expert_overlap=False))
    return rule(plan)


def best_runnable(model: ModelSpec, cluster: ClusterSpec, result: SearchResult, rule, *,
                  ranked: list[Scored] | None = None, exact: dict | None = None) -> Scored | None:
    """The best plan of the search that a runtime can run (``rule(plan)`` is None; see :func:`as_run_by`),
    ranked as the search ranks its own list: by the closed form, the ``RETIME`` leading ones re-timed
    by the exact schedule. No second search: the scored plans are filtered; a plan run without its
    shared-expert overlap is re-timed, and as that overlap only hides time, a plan's search time bounds
    it from below, so the scan stops once no later plan can enter the leading ``RETIME``.

    ``ranked``: ``result.best(result.feasible)`` when the caller has it; ``exact``: a dict of exact step
    times by plan, shared between calls.
    """
    ranked = result.best(result.feasible) if ranked is None else ranked
    exact = {} if exact is None else exact
    head: list[tuple[float, Scored]] = []  # (closed form, plan as run), the RETIME best so far
    for s in ranked:
        if len(head) >= RETIME and s.step_s > head[-1][0] * (1 + 1e-5):
            break  # s.step_s <= its closed form <= that of its as-run plan; later plans are slower still
        plan = as_run_by(s.plan, rule)
        if plan is None:
            continue
        closed = step_time(model, plan, cluster, exact=False).step if plan is not s.plan or _simulated(plan) \
            else s.step_s
        head.append((closed, Scored(plan=plan, step_s=closed, peak_bytes=s.peak_bytes)))
        head.sort(key=lambda e: _rank_key(e[1]))
        del head[RETIME:]
    best = None
    for _, s in head:
        if _simulated(s.plan):
            if s.plan not in exact:
                exact[s.plan] = step_time(model, s.plan, cluster).step
            s = dataclasses.replace(s, step_s=exact[s.plan])
        if best is None or _rank_key(s) < _rank_key(best):
            best = s
    return best


def _simulated(plan: ParallelPlan) -> bool:
    """Whether ``step_time`` simulates the plan's schedule (else its exact time is the closed form)."""
    return plan.pp > 1 and plan.vpp is None


def best_predictions(model: ModelSpec, cluster: ClusterSpec, result: SearchResult, k: int) -> list[Prediction]:
    """Full predictions (memory, time, MFU, bottleneck) for the ``k`` best plans."""
    return [predict(model, cluster, s.plan) for s in result.best(k)]
