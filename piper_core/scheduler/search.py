"""``piper plan``'s engine: enumerate the space, reject with a counted reason, score the rest.

Each raw combination is first checked with cheap structural rules (Megatron's divisibility
rules, in the order below, the first failure being the reason); survivors become a
``ParallelPlan``, their memory is predicted once, and the all-to-all variants share it and are
timed separately. A candidate the resource model finds infeasible (``Infeasible``: a rule of the
host framework the structural checks do not cover) is rejected with its reason like any other; it
never ends the search. Plans are ranked by predicted tokens/s (equivalently MFU) and, at equal speed,
by lower peak memory.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from piper_core.errors import Infeasible, SpecError
from piper_core.resource.memory import GIB, stage_memory, with_state_of
from piper_core.resource.predict import Prediction, predict
from piper_core.scheduler.space import SearchSpace, default_space, grid, pipeline_split
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import check_plan
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.timing.step import step_time

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
                  p.recompute != "none", p.micro_batch_size)
    return (round(math.log(s.step_s) * 1e6), s.peak_bytes, simplicity)


def _structural(model: ModelSpec, gpus: int, gbs: int, combo: tuple,
                sequence_parallel: bool = True) -> tuple[dict | None, str | None]:
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
    if reason:
        return None, reason
    if gbs % (mbs * dp):
        return None, "gbs not divisible by mbs*dp"
    kwargs = dict(gpus=gpus, tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, cp=cp, ep=ep, etp=etp,
                  sequence_parallel=tp > 1 and sequence_parallel, micro_batch_size=mbs, global_batch_size=gbs,
                  recompute=recompute, recompute_num_layers=1 if recompute == "full" else None,
                  distributed_optimizer=dist_opt,
                  num_layers_in_last_pipeline_stage=last)
    return kwargs, None


def search(model: ModelSpec, cluster: ClusterSpec, gpus: int, gbs: int, *, space: SearchSpace | None = None,
           memory_headroom: float = 0.0, attention_backend: str = "flash", progress=None) -> SearchResult:
    """Evaluate every plan of ``space`` (default: :func:`default_space`).

    ``memory_headroom`` is the fraction of capacity kept free (0.1: plans must fit in 90 %).
    ``progress(done, total)`` is called now and then for a progress bar.
    """
    space = space or default_space(model, cluster, gpus)
    limit = cluster.capacity_gib * GIB * (1.0 - memory_headroom)
    result, start = SearchResult(), time.perf_counter()
    combos = list(grid(space))
    for n, combo in enumerate(combos):
        tp, ep, etp_is_tp = combo[0], combo[4], combo[5]
        if etp_is_tp and tp == 1:
            continue  # the same plan as etp=1
        variants = space.a2a if ep > 1 else (("flat", 1),)
        result.candidates += len(variants)
        kwargs, reason = _structural(model, gpus, gbs, combo, space.sequence_parallel)
        if kwargs is None:
            result.rejected[reason] += len(variants)
            continue
        kwargs["attention_backend"] = attention_backend
        try:
            base = ParallelPlan(**kwargs)
            check_plan(model, base)
        except SpecError as exc:
            result.rejected[f"invalid {exc.key}"] += len(variants)
            continue
        try:
            base, peak, reason = _fit(model, cluster, base, space, limit)
            scored = [] if base is None else [_score(model, cluster, base, peak, v) for v in variants]
        except Infeasible as exc:  # a host-framework rule the structural checks do not know
            base, reason = None, exc.reason
        if base is None:
            result.rejected[reason] += len(variants)
            continue
        result.scored += scored
        if progress and n % 256 == 0:
            progress(n, len(combos))
    if progress:
        progress(len(combos), len(combos))
    _retime(model, cluster, result)
    result.elapsed_s = time.perf_counter() - start
    return result


def _score(model: ModelSpec, cluster: ClusterSpec, base: ParallelPlan, peak: int, variant: tuple[str, int]) -> Scored:
    """``base`` with the all-to-all ``variant`` (algorithm, chunks), timed by the closed form."""
    plan = base if variant == ("flat", 1) else _with_a2a(base, *variant)
    return Scored(plan=plan, step_s=step_time(model, plan, cluster, exact=False).step, peak_bytes=peak)


def _retime(model: ModelSpec, cluster: ClusterSpec, result: SearchResult) -> None:
    """Re-time the leading plans with the exact 1F1B simulation.

    The closed form the loop uses is an upper bound that is exact when the last pipeline stage is
    the slowest, so a plan can only move up: the ``RETIME`` best by the bound are simulated and
    the list is re-ranked.
    """
    ranked = sorted(result.scored, key=_rank_key)
    head = [dataclasses.replace(s, step_s=step_time(model, s.plan, cluster).step) for s in ranked[:RETIME]]
    result.scored = head + ranked[RETIME:]


def _with(plan: ParallelPlan, **changes) -> ParallelPlan:
    kwargs = {f.name: getattr(plan, f.name) for f in _PLAN_FIELDS}
    kwargs.update(changes)
    return ParallelPlan(**kwargs)


def _with_a2a(plan: ParallelPlan, algo: str, chunks: int) -> ParallelPlan:
    return _with(plan, a2a=algo, a2a_chunks=chunks)


def _fit(model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan, space: SearchSpace,
         limit: float) -> tuple[ParallelPlan | None, int, str]:
    """The plan with the first memory saver that fits GPU and host memory, or the last reason."""
    host_limit = cluster.host_capacity_gib * GIB
    reason = MEMORY
    plain = stage_memory(model, plan, cluster)
    for bf16_grads, offload in space.memory_savers:
        if offload > 0 and (not plan.distributed_optimizer or host_limit == 0):
            continue
        if bf16_grads and plan.precision != "bf16":
            continue
        candidate = plan if (bf16_grads, offload) == (False, 0.0) else _with(
            plan, grad_reduce_in_bf16=bf16_grads, optimizer_offload_fraction=offload)
        stages = plain if candidate is plan else with_state_of(plain, candidate)
        peak = max(s.total for s in stages)
        if peak > limit:
            continue
        if max(s.host for s in stages) * cluster.gpus_per_node > host_limit:
            reason = HOST_MEMORY
            continue
        return candidate, peak, ""
    return None, 0, reason


def best_predictions(model: ModelSpec, cluster: ClusterSpec, result: SearchResult, k: int) -> list[Prediction]:
    """Full predictions (memory, time, MFU, bottleneck) for the ``k`` best plans."""
    return [predict(model, cluster, s.plan) for s in result.best(k)]
