"""``piper_deepspeed.initialize``: ``deepspeed.initialize`` with Piper's plan and all-to-all.

With no ``"piper"`` block, or ``"enabled": false``, the call is forwarded to ``deepspeed.initialize``
with the very same arguments. Otherwise, in this order:

1. the block is validated (:mod:`piper_deepspeed.config`); ZeRO-3 with MoE is refused (DeepSpeed's
   engine refuses it only after building the ZeRO-3 optimizer, ``_validate_zero3_moe_compatibility``);
2. the scheduler searches the plans DeepSpeed can express for the world size (tp = cp = vpp = etp = 1,
   pipeline stages only for a ``PipelineModule`` and only even splits, no recompute or optimizer
   offload, which Piper cannot impose on a user's model; only ep > 1 when the block names an
   all-to-all), or takes the block's pinned ``plan`` (refused over the memory limit the search
   applies, ``memory_headroom`` included), either priced in the config's precision
   (:func:`planned_precision`: fp32 when neither bf16 nor fp16 is enabled);
3. the config is rewritten (a copy): ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``
   (``train_batch_size`` kept, so the three agree), ``zero_optimization.stage`` (the user's stage is
   a floor: the plan's distributed optimizer needs >= 1), ``pipeline.stages``, and the block itself
   (the plan that runs, its prediction); rank 0 prints the plan and why;
4. the model is checked against the plan (each MoE layer's ``ep_size``, experts, top-k and width;
   a ``PipelineModule``'s stage count): a conflict is an error naming the layer;
5. every DeepSpeed ``MOELayer`` with ep > 1 is swapped for :class:`PiperMOELayer`; ``deepspeed.initialize``
   builds the engine from the rewritten config less the block (plain ``deepspeed.initialize`` refuses
   an active block, :mod:`piper_deepspeed.guard`), which is then put back in ``engine.config``;
   Piper's all-to-all groups are created over DeepSpeed's expert-parallel groups.

:func:`plan_for` runs steps 1-2 without a model or torch.distributed (to build the model for the plan
with :func:`piper_deepspeed.builder.build_model` first).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

from piper_core.cli.plan import describe, render
from piper_core.errors import Infeasible, SpecError
from piper_core.export import deepspeed_compatible
from piper_core.resource.memory import GIB
from piper_core.resource.predict import Prediction, predict, to_json
from piper_core.runtime import NodeTopology
from piper_core.runtime.autochunks import ADAPTER_TUNING
from piper_core.runners import deepspeed_piper, with_grouped_gemm
from piper_core.resource.routing import predict_routed
from piper_core.scheduler.routed import reprice, search_by_ep
from piper_core.scheduler.search import Scored, SearchResult, best_predictions, search
from piper_core.scheduler.space import UNPIPELINED, SearchSpace, default_space
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.routing import load_routing
from piper_core.timing.step import step_time
from piper_deepspeed.builder import MODEL_SPEC_ATTR
from piper_deepspeed.config import BLOCK, PiperConfig, read_block
from piper_deepspeed.guard import user_config
from piper_deepspeed.moe import A2ASettings, Tracer, attach_comm, moe_modules, swap_moe_layers

TOP = 3  # plans shown in the printout
FIX_BUILD = ("build the model for the plan: piper_deepspeed.plan_for(config, world_size) then "
             "piper_deepspeed.builder.build_model(spec, plan), or pass ep_size=plan.ep to every MoE layer")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanChoice:
    """The plan Piper runs and how it was chosen. ``search`` None: pinned by ``piper.plan``.
    ``zero_stage``: the stage written to the config (``user_zero_stage``: the one asked for);
    ``notes``: how the block's settings of an older spelling were read."""

    prediction: Prediction
    search: SearchResult | None
    top: tuple[Prediction, ...]
    world_size: int
    global_batch: int
    zero_stage: int
    user_zero_stage: int
    pipeline: bool
    notes: tuple[str, ...] = ()

    @property
    def plan(self) -> ParallelPlan:
        return self.prediction.plan


class PlanOnly(SystemExit):
    """Raised by :func:`initialize` on every rank when ``piper.plan_only`` is true, after rank 0
    printed the plan; exits with status 0 unless caught (``.choice`` holds the plan)."""

    def __init__(self, choice: PlanChoice):
        super().__init__(0)
        self.choice = choice


# ---- planning (no torch.distributed) ------------------------------------------------------------

def zero_stage(config: Mapping[str, Any]) -> int:
    """``zero_optimization.stage`` of a DeepSpeed config (DeepSpeed's default: 0)."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise SpecError("zero_optimization.stage", stage, "must be 0, 1, 2 or 3", "write an int")
    return stage


def refuse_zero3(stage: int, moe: str | None) -> None:
    """Piper's message for DeepSpeed's refusal of ZeRO-3 with its native MoE; ``moe`` names the
    MoE layers (None: there are none)."""
    if stage == 3 and moe:
        raise SpecError("zero_optimization.stage", 3, f"DeepSpeed-MoE does not run under ZeRO-3 (the engine refuses "
                        f"native MoE layers with stage 3; this model has {moe}); Piper plans MoE models with "
                        "ZeRO 0-2", "set zero_optimization.stage to 1 or 2, or remove it and let Piper choose 0 or 1")


def _named(layers: list[str]) -> str | None:
    if not layers:
        return None
    shown = ", ".join(repr(n) for n in layers[:3]) + (", ..." if len(layers) > 3 else "")
    return f"{len(layers)} MoE layer{'s' if len(layers) > 1 else ''}: {shown}"


def global_batch(config: Mapping[str, Any], world_size: int, stages: int) -> int:
    """The global batch the user asked for: ``train_batch_size``, else micro x GAS x dp."""
    tbs = config.get("train_batch_size")
    if isinstance(tbs, int) and not isinstance(tbs, bool) and tbs > 0:
        return tbs
    micro, gas = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
    if isinstance(micro, int) and isinstance(gas, int) and micro > 0 and gas > 0:
        return micro * gas * (world_size // stages)
    raise SpecError("train_batch_size", tbs, "Piper plans for a fixed global batch (it picks the micro-batch "
                    "size and derives gradient accumulation)", "set train_batch_size (sequences per step)")


def trains_in_fp32(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` trains in fp32: neither ``bf16`` (or its old spelling ``bfloat16``) nor
    ``fp16`` enabled, read as DeepSpeed reads them (``deepspeed.runtime.precision_config``)."""
    return not (get_bfloat16_config(config).enabled or get_float16_config(config).enabled)


def planned_precision(config: Mapping[str, Any]) -> str:
    """The precision the plans of ``config`` are priced in: fp32 for an fp32 config (fp32 weights and
    gradients; at ZeRO 0 the engine steps torch's optimizer on the parameters themselves), else bf16
    (an fp16 config is priced as bf16: DeepSpeed's fp16 loss scaling is not modelled)."""
    return "fp32" if trains_in_fp32(config) else "bf16"


def deepspeed_space(block: PiperConfig, model: ModelSpec, cluster: ClusterSpec, world_size: int, *,
                    pipeline: bool, min_stage: int, precision: str) -> SearchSpace:
    """The plans DeepSpeed(-MoE) can run (see the module doc), in ``precision``. An explicit all-to-all
    (``block.requested_exchange``) keeps only ep > 1, as ``piper_megatron.pins.restrict`` does; with
    none left it is refused, never dropped for an ep = 1 plan."""
    base = default_space(model, cluster, world_size)
    pp = tuple(p for p in base.pp if model.num_layers % p == 0 and world_size % p == 0) if pipeline else (1,)
    ep, request = base.ep, block.requested_exchange
    if request is not None:
        ep = tuple(e for e in base.ep if e > 1) if model.is_moe else ()
        if not ep:
            why = f"{model.name} has no experts" if not model.is_moe else \
                f"no ep > 1 is possible on {world_size} rank{'s' if world_size > 1 else ''}"
            raise _needs_ep(request, why, 'run on more ranks, or set "a2a" and "chunks" to "auto" (or remove them) '
                            "to plan without an expert all-to-all")
    return SearchSpace(tp=(1,), pp=pp, vpp=(1,), cp=(1,), ep=ep, etp_equals_tp=(False,), mbs=base.mbs,
                       recompute=("none",), distributed_optimizer=(True,) if min_stage >= 1 else (True, False),
                       a2a=block.a2a_choices() if model.is_moe else (UNPIPELINED,),
                       memory_savers=((False, 0.0),), defer_wgrad=block.defer_wgrad and model.is_moe,
                       precision=precision)


def plan_for(config: Mapping[str, Any] | str, world_size: int, *, pipeline: bool = False,
             model_spec: ModelSpec | None = None, stages: int | None = None) -> PlanChoice:
    """The plan :func:`initialize` will pick for ``config`` on ``world_size`` ranks (deterministic).

    ``pipeline``: the model is (will be) a ``PipelineModule``, so pp is searched; ``model_spec``:
    the shape when the block has no ``model``; ``stages``: an existing PipelineModule's stage count
    (for a global batch given as micro x GAS)."""
    raw = load_ds_config(config) if isinstance(config, str) else config
    block = read_block(raw)
    if block is None or not block.enabled:
        raise SpecError(BLOCK, raw.get(BLOCK), "plan_for needs an enabled \"piper\" block",
                        'add "piper": {"cluster": ..., "model": ...}')
    spec = block.model_spec(model_spec)
    user_stage = zero_stage(raw)
    refuse_zero3(user_stage, f"{spec.num_moe_layers} MoE layers ({spec.name})" if spec.is_moe else None)
    if pipeline and user_stage >= 2:
        raise SpecError("zero_optimization.stage", user_stage, "DeepSpeed's pipeline engine runs ZeRO 0 or 1 only",
                        "set zero_optimization.stage to 0 or 1")
    gbs = global_batch(raw, world_size, stages or 1)
    cluster = with_grouped_gemm(block.cluster_spec(), False)  # DeepSpeed's experts run one GEMM each
    precision = planned_precision(raw)
    routing = _routing(block, spec)
    notes = block.notes
    if block.plan is not None:
        best, result = _pinned(block, spec, cluster, world_size, gbs, pipeline=pipeline, min_stage=user_stage,
                               precision=precision), None
        if routing is not None:
            best = predict_routed(spec, cluster, best.plan, routing, _routed_placements(block, routing)).prediction
        top = (best,)
    else:
        space = deepspeed_space(block, spec, cluster, world_size, pipeline=pipeline, min_stage=user_stage,
                                precision=precision)
        space = _placement_ep(block, spec, space)
        if routing is None:
            result = search(spec, cluster, world_size, gbs, space=space, memory_headroom=block.memory_headroom)
        else:
            placed, result = search_by_ep(spec, cluster, world_size, gbs, routing, space=space,
                                          memory_headroom=block.memory_headroom)
            fixed = _routed_placements(block, routing)
            if fixed is not None:
                placed = {ep: fixed for ep in placed}
        result.scored = _without_shared_overlap(spec, cluster, result.scored)
        if routing is None:
            predictions = best_predictions(spec, cluster, result, TOP)
        else:
            runnable = [s for s in result.scored if deepspeed_piper(s.plan) is None]
            predictions = [r.prediction for r in reprice(spec, cluster, routing, placed,
                                                         dataclasses.replace(result, scored=runnable))][:TOP]
            notes += (f"{BLOCK}.routing {routing.source}: every ep searched at its busiest MoE layer's load, the "
                      "leading plans re-priced layer by layer",)
        top = tuple(p for p in predictions if deepspeed_piper(p.plan) is None)
        if not top:
            rejected = ", ".join(f"{n} {why}" for why, n in result.rejected.most_common()) or "none"
            request = block.requested_exchange
            only = f", ep > 1 only as {request[0]}={request[1]!r} asks" if request else ""
            raise Infeasible(f"no plan DeepSpeed can run fits {spec.name} on {world_size} ranks of {cluster.name} at "
                             f"global batch {gbs} (searched {result.candidates} plans{only}; rejected: {rejected}); "
                             "add ranks, change train_batch_size or lower piper.memory_headroom"
                             + (', or set "a2a" and "chunks" to "auto"' if request else ""), rule="deepspeed")
        best = top[0]
    if block.placement is not None:  # a pinned plan's ep, or the search's (restricted to the placement's)
        if not spec.is_moe:
            raise SpecError(f"{BLOCK}.placement", block.placement, f"places experts, and {spec.name} has none",
                            "remove piper.placement")
        block.checked_placement(num_experts=spec.num_experts, ep=best.plan.ep)
    stage = max(user_stage, 1 if best.plan.distributed_optimizer else 0)
    return PlanChoice(prediction=best, search=result, top=top, world_size=world_size, global_batch=gbs,
                      zero_stage=stage, user_zero_stage=user_stage, pipeline=pipeline, notes=notes)


def _routing(block: PiperConfig, model: ModelSpec) -> Any:
    """The block's ``routing`` read for ``model`` (None without one); errors name ``piper.routing``."""
    if block.routing is None:
        return None
    paths = [block.routing] if isinstance(block.routing, str) else list(block.routing)
    try:
        return load_routing(paths, model)
    except SpecError as exc:
        raise SpecError(f"{BLOCK}.routing", exc.value, exc.rule, exc.fix, where=exc.where) from None


def _routed_placements(block: PiperConfig, routing: Any) -> dict | None:
    """The block's placement for every MoE layer of ``routing`` (None without one: Megatron's contiguous)."""
    placement = block.expert_placement()
    return None if placement is None else {n: placement.ranks for n, _ in routing.layers}


def _without_shared_overlap(model: ModelSpec, cluster: ClusterSpec, scored: list[Scored]) -> list[Scored]:
    """``scored`` with the shared expert run after the routed experts, as Piper's DeepSpeed model does
    (``builder``: ``moe(h) + shared(h)``), re-timed: the search overlaps a shared expert with the
    exchange wherever Megatron allows it (``search._structural``), which DeepSpeed-MoE cannot."""
    out = []
    for s in scored:
        if s.plan.shared_expert_overlap:
            plan = dataclasses.replace(s.plan, shared_expert_overlap=False)
            s = dataclasses.replace(s, plan=plan, step_s=step_time(model, plan, cluster).step)
        out.append(s)
    return out


def _placement_ep(block: PiperConfig, model: ModelSpec, space: SearchSpace) -> SearchSpace:
    """``space`` restricted to the ep of the block's placement (unchanged without one); refused when
    the search could not run that ep or the placement is for another expert count."""
    placement = block.expert_placement()
    if placement is None:
        return space
    if not model.is_moe:
        return space  # refused once the plan is chosen (plan_for)
    placement.check(num_experts=model.num_experts, ep=placement.ep, key=f"{BLOCK}.placement")
    if placement.ep not in space.ep:
        raise SpecError(f"{BLOCK}.placement", placement.where or "inline", f"is for ep={placement.ep}, which this job "
                        f"cannot run (expert-parallel sizes DeepSpeed can run here: {sorted(space.ep)})",
                        f"write a placement for one of {sorted(space.ep)}")
    return dataclasses.replace(space, ep=(placement.ep,))


def _needs_ep(request: tuple[str, Any], why: str, fix: str) -> SpecError:
    key, value = request
    return SpecError(key, value, f"asks for an expert all-to-all, which needs expert parallelism (ep > 1), and "
                     f"{why}", fix)


def _pinned(block: PiperConfig, model: ModelSpec, cluster: ClusterSpec, world_size: int, gbs: int, *,
            pipeline: bool, min_stage: int, precision: str) -> Prediction:
    """The pinned plan, with the block's all-to-all (auto: the fastest predicted variant). Refused
    when it exceeds the memory limit the search applies (capacity less ``memory_headroom``), or when
    it has ep = 1 and the block asks for an exchange other than flat (the export's value for ep = 1)."""
    pin = block.plan
    if pin.recompute != "none":
        raise SpecError("piper.plan.recompute", pin.recompute, "Piper cannot make a DeepSpeed model recompute",
                        'set "recompute": "none" or remove piper.plan')
    if pin.pp > 1 and not pipeline:
        raise SpecError("piper.plan.pp", pin.pp, "pipeline stages need a PipelineModule model",
                        "build the model with piper_deepspeed.builder.build_model(..., pipeline=True) or set pp to 1")
    try:
        base = ParallelPlan(gpus=world_size, tp=pin.tp, pp=pin.pp, vpp=pin.vpp if pin.vpp > 1 else None, cp=pin.cp,
                            ep=pin.ep, etp=pin.etp, micro_batch_size=pin.mbs, global_batch_size=gbs,
                            distributed_optimizer=min_stage >= 1, precision=precision,
                            defer_wgrad=block.defer_wgrad and model.is_moe and pin.ep > 1)
    except SpecError as exc:
        raise SpecError(exc.key, exc.value, exc.rule, exc.fix, where=f"piper.plan on {world_size} ranks") from None
    reason = deepspeed_compatible(base)
    if reason is not None:
        raise SpecError("piper.plan", pin.model_dump(), f"cannot be expressed in DeepSpeed ({reason})",
                        "remove piper.plan to let Piper search the plans DeepSpeed can run")
    request = block.requested_exchange
    if (pin.ep == 1 or not model.is_moe) and request not in (None, ("piper.a2a", "flat")):
        raise _needs_ep(request, "piper.plan pins ep=1", 'pin ep > 1 in piper.plan, or set "a2a" to "auto" or '
                        '"flat" and remove "chunks"')
    variants = block.a2a_choices() if model.is_moe and pin.ep > 1 else (UNPIPELINED,)
    preds = [predict(model, cluster, dataclasses.replace(base, a2a=a, a2a_chunks=c)) for a, c, _ in variants]
    best = max(preds, key=lambda p: p.rate.tokens_per_s)
    limit = cluster.capacity_gib * GIB * (1.0 - block.memory_headroom)  # search()'s limit
    if best.peak_stage.total > limit:
        less = f" less memory_headroom {block.memory_headroom:g}" if block.memory_headroom else ""
        raise SpecError("piper.plan", pin.model_dump(), f"is predicted to need {best.peak_stage.total / GIB:.2f} GiB "
                        f"per GPU at its peak, over the {limit / GIB:.2f} GiB limit the search applies "
                        f"({cluster.name}'s usable {cluster.capacity_gib:.2f} GiB{less})",
                        "pin a plan that fits (a larger ep or a smaller mbs), lower piper.memory_headroom, or remove "
                        "piper.plan to let Piper search")
    return best


def node_topology(cluster: ClusterSpec, world_size: int) -> NodeTopology:
    """The exchange's domains from the cluster spec (a node, or an NVLink domain across nodes:
    :meth:`~piper_core.specs.cluster.ClusterSpec.exchange_domain_ranks`), consecutive global ranks
    (the launchers' layout)."""
    per = min(cluster.exchange_domain_ranks(), world_size)
    if world_size % per:
        what = "nodes" if per == cluster.gpus_per_node else f"{cluster.links[0].name} domains"
        raise SpecError("world size", world_size, f"is not a whole number of {cluster.name} {what} "
                        f"({per} GPUs each)", "launch whole nodes or fix piper.cluster")
    return NodeTopology.uniform(world_size=world_size, ranks_per_node=per)


# ---- config rewrite and report -----------------------------------------------------------------

Change = tuple[str, Any, Any]  # (key, old value or None, new value)


def rewrite_config(config: Mapping[str, Any], choice: PlanChoice) -> tuple[dict[str, Any], list[Change]]:
    """A rewritten copy of ``config`` for ``choice`` and the list of changed keys."""
    plan, new = choice.plan, copy.deepcopy(dict(config))
    changes: list[Change] = []

    def put(where: dict[str, Any], key: str, label: str, value: Any) -> None:
        if where.get(key) != value:
            changes.append((label, where.get(key), value))
        where[key] = value

    put(new, "train_batch_size", "train_batch_size", choice.global_batch)
    put(new, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", plan.micro_batch_size)
    put(new, "gradient_accumulation_steps", "gradient_accumulation_steps", plan.num_microbatches)
    new["zero_optimization"] = dict(new.get("zero_optimization") or {})
    put(new["zero_optimization"], "stage", "zero_optimization.stage", choice.zero_stage)
    if choice.pipeline:
        new["pipeline"] = dict(new.get("pipeline") or {})
        put(new["pipeline"], "stages", "pipeline.stages", plan.pp)
    p = choice.prediction
    new[BLOCK] = dict(new[BLOCK]) | {
        "a2a": plan.a2a, "chunks": "tune" if new[BLOCK].get("chunks") == "tune" and plan.ep > 1 else plan.a2a_chunks,
        "plan": {"tp": plan.tp, "pp": plan.pp, "ep": plan.ep, "etp": plan.etp_size, "cp": plan.cp,
                 "vpp": plan.virtual_stages, "mbs": plan.micro_batch_size, "recompute": plan.recompute},
        "predicted": {"mfu": p.rate.mfu, "step_s": p.time.step, "peak_memory_gib": round(p.peak_stage.total / GIB, 4)}}
    if new[BLOCK].get("defer_wgrad"):  # a plan with ep = 1 has no exchange to defer them behind: say so
        put(new[BLOCK], "defer_wgrad", "piper.defer_wgrad (needs ep > 1)", plan.defer_wgrad)
    return new, changes


def report(choice: PlanChoice, changes: list[Change], config: Mapping[str, Any], *, topology: NodeTopology) -> str:
    """What rank 0 prints: the plan, why, the config changes and the MoE layers' all-to-all."""
    p, plan = choice.prediction, choice.plan
    nodes = len(topology.nodes)
    lines = [f"piper: {p.model.name} on {choice.world_size} DeepSpeed ranks of {p.cluster.name} ({nodes} node"
             f"{'s' if nodes > 1 else ''} x {len(topology.nodes[0])}), global batch {choice.global_batch}"]
    if choice.search is not None:
        body = render(p.model.name, p.cluster.name, choice.world_size, choice.global_batch, choice.search,
                      list(choice.top))
        lines += ["  " + line for line in body.splitlines()[1:]]
    else:  # pinned: _pinned refuses a plan over the memory limit, so this one fits
        headroom = (config.get(BLOCK) or {}).get("memory_headroom") or 0
        kept = f", memory_headroom {headroom:g}" if headroom else ""
        lines += [f"  plan pinned by piper.plan: {describe(plan)}",
                  f"  predicted MFU {100 * p.rate.mfu:.1f}%, step {p.time.step:.3f} s, {p.rate.tokens_per_s:,.0f} "
                  f"tokens/s, peak memory {p.peak_stage.total / GIB:.1f} of {p.capacity_bytes / GIB:.1f} GiB "
                  f"(fits{kept})", f"  bottleneck: {p.rate.bottleneck}"]
    why = {"zero_optimization.stage": " (the plan shards optimizer state)" if plan.distributed_optimizer
           and choice.user_zero_stage == 0 else ""}
    rewritten = [f"{k} {'unset' if old is None else old} -> {new}{why.get(k, '')}" for k, old, new in changes]
    lines.append("piper: DeepSpeed config: " + ("; ".join(rewritten) if rewritten else "unchanged")
                 + f" (train_batch_size {choice.global_batch} = {plan.micro_batch_size} x "
                 f"{plan.num_microbatches} x {plan.dp} ranks)")
    if plan.ep > 1:
        tuned = (config.get(BLOCK) or {}).get("chunks") == "tune"
        chunks = f"{plan.a2a_chunks} chunks" if not tuned else (
            f"a chunk count measured per layer at run time ({ADAPTER_TUNING}, then the fastest; "
            f"planned with {plan.a2a_chunks})")
        how = {"flat": "flat", "hierarchical": "hierarchical (intra-node stage, then inter-node)"}[plan.a2a]
        if tuned or plan.a2a_chunks > 1:
            how = f"pipelined: {plan.a2a} exchanges in {chunks} overlapping the experts"
        deferred = ("; each computes its experts' weight gradients while the dispatch's gradient is in flight "
                    "(defer_wgrad)") if plan.defer_wgrad else ""
        placed = read_block(config).expert_placement() if (config.get(BLOCK) or {}).get("placement") else None
        where = f"; experts placed as piper.placement says: {placed.describe()}" if placed is not None else ""
        lines.append(f"piper: {p.model.num_moe_layers} MoE layers with ep_size {plan.ep} run Piper's all-to-all, "
                     f"{how}{deferred}{where}")
        every = (config.get(BLOCK) or {}).get("migrate_every")
        if every:
            horizon = (config.get(BLOCK) or {}).get("migrate_horizon") or every
            lines.append(f"piper: expert migration: every {every} steps, experts move when the predicted gain over "
                         f"{horizon} steps (on {p.cluster.name}) exceeds the move's cost")
    else:
        lines.append("piper: ep=1: no expert-parallel all-to-all; MoE layers stay DeepSpeed's")
    lines += [f"piper: note: {note}" for note in choice.notes]
    if plan.precision == "fp32":
        lines.append("piper: note: this config trains in fp32 (neither bf16 nor fp16 enabled): planned for fp32 "
                     "weights, gradients and activations")
    return "\n".join(lines)


# ---- the drop-in -------------------------------------------------------------------------------

def _check_model(model: torch.nn.Module, spec: ModelSpec, plan: ParallelPlan, mpu: Any) -> None:
    """The built model agrees with the plan and the spec; the first conflict names the layer."""
    if isinstance(model, PipelineModule) and model.num_stages != plan.pp:
        raise SpecError("PipelineModule.num_stages", model.num_stages, f"conflicts with the plan's pp={plan.pp}",
                        FIX_BUILD + ", or PipelineModule(num_stages=plan.pp)")
    if mpu is not None and bwc_tensor_model_parallel_world_size(mpu) > 1:
        raise SpecError("mpu", type(mpu).__name__, "has model parallelism, but Piper's DeepSpeed plans have tp=1",
                        "pass no mpu (Piper plans expert, data and pipeline parallelism for DeepSpeed)")
    layers = moe_modules(model)
    if not isinstance(model, PipelineModule) and len(layers) != spec.num_moe_layers:
        raise SpecError("model", type(model).__name__, f"has {len(layers)} DeepSpeed MoE layers but {spec.name} has "
                        f"{spec.num_moe_layers}", "build the model from the same spec as piper.model")
    for name, m in layers:
        gate = m.deepspeed_moe.gate
        found = (("ep_size", m.ep_size, plan.ep, "the plan's ep"), ("num_experts", m.num_experts, spec.num_experts,
                 "num_experts of the spec"), ("k", gate.k, spec.moe_router_topk, "moe_router_topk of the spec"),
                 ("hidden size", gate.wg.in_features, spec.hidden_size, "hidden_size of the spec"))
        for key, have, want, what in found:
            if have != want:
                raise SpecError(f"MoE layer '{name}' {key}", have, f"conflicts with {what} ({want})", FIX_BUILD)


def initialize(args: Any = None, model: torch.nn.Module = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """Drop-in for ``deepspeed.initialize`` (same signature, same return value); see the module doc."""
    raw = user_config(args, config, config_params)
    block = read_block(raw) if raw is not None else None
    passthrough = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                       training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                       mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                       mesh_param=mesh_param, config_params=config_params)
    if block is None or not block.enabled:
        return deepspeed.initialize(**passthrough)
    if model is None:
        raise SpecError("model", None, "deepspeed.initialize requires a model", "pass model=...")
    layers = [name for name, _ in moe_modules(model)]
    refuse_zero3(zero_stage(raw), _named(layers))
    deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                    distributed_port=distributed_port, dist_init_required=dist_init_required)
    world, rank = dist.get_world_size(), dist.get_rank()
    pipeline = isinstance(model, PipelineModule)
    choice = plan_for(raw, world, pipeline=pipeline, model_spec=getattr(model, MODEL_SPEC_ATTR, None),
                      stages=model.num_stages if pipeline else None)
    rewritten, changes = rewrite_config(raw, choice)
    topology = node_topology(choice.prediction.cluster, world)
    if rank == 0:
        print(report(choice, changes, raw, topology=topology), flush=True)
        if block.trace:
            _write_plan(Path(block.trace), choice, changes)
    if block.plan_only:
        raise PlanOnly(choice)
    _check_model(model, choice.prediction.model, choice.plan, mpu)
    plan = choice.plan
    if block.migrate_every is not None:
        _check_migration(block, plan, pipeline, zero_stage(raw))
    placement = block.checked_placement(num_experts=choice.prediction.model.num_experts, ep=plan.ep) \
        if choice.prediction.model.is_moe else None
    if plan.ep > 1:
        tracer = Tracer(Path(block.trace) / f"a2a-rank{rank}.jsonl") if block.trace else None
        swap_moe_layers(model, A2ASettings.from_plan(plan.a2a, plan.a2a_chunks, tune=block.chunks == "tune",
                                                     defer_wgrad=plan.defer_wgrad), tracer=tracer,
                        placement=placement)
    # DeepSpeed gets the config without the block (the guard around deepspeed.initialize refuses an
    # active one; DeepSpeed ignores it anyway), then engine.config shows the block that ran. The dict
    # is our copy, the very one the engine (and its DeepSpeedConfig) keeps.
    for_deepspeed = {k: v for k, v in rewritten.items() if k != BLOCK}
    passthrough |= dict(args=_without_config(args), config=for_deepspeed, config_params=None)
    result = deepspeed.initialize(**passthrough)
    result[0].config[BLOCK] = rewritten[BLOCK]
    if plan.ep > 1:
        # Only the hierarchical exchange (in one chunk or pipelined) uses the node layout; the runtime's
        # groups need every expert-parallel group to hold as many ranks on each node as on the others,
        # which flat exchanges do not, so those get the whole job as one "node".
        comm_topology = topology if plan.a2a == "hierarchical" else NodeTopology(nodes=(tuple(range(world)),))
        comm = attach_comm(result[0].module, comm_topology)
        if block.migrate_every is not None and comm is not None:
            from piper_core.runtime.live import LiveSettings
            from piper_deepspeed.live import install

            install(result[0], LiveSettings(every=block.migrate_every,
                                            horizon=block.migrate_horizon or block.migrate_every,
                                            model=choice.prediction.model, plan=plan,
                                            cluster=choice.prediction.cluster, timeout=comm.timeout), placement)
    return result


def _check_migration(block: PiperConfig, plan: ParallelPlan, pipeline: bool, stage: int) -> None:
    """``migrate_every`` refused before DeepSpeed starts where it cannot run (piper_deepspeed/live.py)."""
    if stage > 0:
        raise SpecError("piper.migrate_every", block.migrate_every, f"moves each expert's optimizer state, which ZeRO "
                        f"stage {stage} keeps in flat buffers partitioned over the data-parallel ranks",
                        "set zero_optimization.stage 0, or remove migrate_every")
    if plan.ep == 1:
        raise SpecError("piper.migrate_every", block.migrate_every, "moves experts between expert-parallel ranks, "
                        "and the plan has ep=1", 'remove migrate_every, or pin "plan": {"ep": 2, ...} or more')
    if pipeline:
        raise SpecError("piper.migrate_every", block.migrate_every, "needs the engine's step between two batches; "
                        "DeepSpeed's pipeline engine steps the optimizer inside train_batch",
                        "remove migrate_every, or train without PipelineModule")


def _without_config(args: Any) -> Any:
    """A copy of ``args`` whose config fields are cleared (the rewritten config is passed instead)."""
    if args is None or not (hasattr(args, "deepspeed_config") or hasattr(args, "deepscale_config")):
        return args
    copied = copy.copy(args)
    for name in ("deepspeed_config", "deepscale_config"):
        if hasattr(copied, name):
            setattr(copied, name, None)
    return copied


def _write_plan(directory: Path, choice: PlanChoice, changes: list[Change]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = {"prediction": to_json(choice.prediction), "global_batch": choice.global_batch,
            "zero_stage": choice.zero_stage, "config_changes": [list(c) for c in changes]}
    (directory / "plan.json").write_text(json.dumps(data, indent=2) + "\n")


__all__ = ["PlanChoice", "PlanOnly", "initialize", "plan_for", "rewrite_config", "report"]
