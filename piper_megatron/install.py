"""``piper_megatron.install()``: ``--piper`` for Megatron-LM training scripts, on megatron-core
0.16-0.19 (:mod:`piper_megatron.versions`: both ways a script reaches argument validation).

With ``--piper`` on the command line, :func:`install` hooks Megatron before it parses and
validates its arguments (without it, nothing of Megatron is imported or changed):

1. ``arguments.add_megatron_arguments`` also adds Piper's flags (both APIs: ``parse_args`` looks
   the name up in ``megatron.training.arguments`` when it runs).
2. ``validate_args`` first plans: the model spec from Megatron's parsed arguments, the world size
   from the launcher (``args.world_size``, Megatron's reading of WORLD_SIZE), the search restricted
   by the sizes written on the command line (and ``--piper-off``), or to the plan a ``--load``
   checkpoint was saved with (:mod:`piper_megatron.resume`), then the rewrite of tp/pp/vpp/ep/etp/cp,
   micro batch, recompute, sequence parallelism, memory savers and the dispatcher type. Rank 0
   prints the plan and, with ``--save``, records it there.
   An infeasible request raises :class:`piper_core.errors.Infeasible` here, before any model
   exists; ``--piper-plan-only`` exits here. Hooked where each release calls it: 0.18-0.19's
   ``parse_and_validate_args`` calls ``arguments.validate_args``; 0.16-0.17's ``initialize_megatron``
   calls the ``validate_args`` that ``megatron.training.initialize`` imported by name, so that
   binding is replaced as well.
3. ``parallel_state.initialize_model_parallel`` (MoE models only), once the expert-parallel groups
   exist: creates Piper's all-to-all groups and installs :class:`~piper_megatron.dispatcher.
   PiperTokenDispatcher` (and the ``--piper-trace`` tracer) before the model is built.
4. Megatron-LM's training loop (MoE models, when ``megatron.training.training`` runs the job), looked
   up by name in that module when ``train`` and ``setup_model_and_optimizer`` call them:
   ``save_checkpoint`` also writes ``piper_placement.json`` (every MoE layer's placement) into the
   saved iteration's directory (rank 0); ``load_checkpoint`` then routes each MoE layer by the loaded
   iteration's ``piper_placement.json`` where it has one (the slots' weights and optimizer state are
   the checkpoint's); with ``--piper-migrate-every N``, ``train_step`` is followed every N iterations
   by the migration decision of :mod:`piper_megatron.live`.

:meth:`Installation.restore` undoes every hook. The release comes from
``megatron.core.package_info.__version__`` (:func:`piper_megatron.versions.installed_release`);
releases outside 0.16-0.19 are refused with the range and the fix.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from piper_core.cli.plan import describe, min_gpus, render
from piper_core.errors import Infeasible, SpecError
from piper_core.calibrate.profile import load_profile
from piper_core.presets import load_cluster
from piper_core.resource.predict import Prediction
from piper_core.runners import with_grouped_gemm
from piper_core.scheduler.routed import reprice, search_by_ep
from piper_core.scheduler.search import RETIME, SearchResult, best_predictions, search
from piper_core.scheduler.space import SearchSpace, default_space
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import check_layout_model
from piper_core.specs.model import ModelSpec
from piper_core.specs.routing import load_routing
from piper_core.timing.step import step_time
from piper_megatron.args import (
    Change,
    PiperOptions,
    add_piper_arguments,
    apply_settings,
    check_piper_flags,
    megatron_settings,
    model_spec_from_args,
    parse_piper_options,
    piper_options,
    vocab_notes,
)
from piper_megatron.pins import LAYOUT_FLAG, SHARED_EXPERT_OVERLAP, Pins, admits, pins_from, restrict
from piper_megatron.resume import PlanRecord, check_save, make_record, narrow, resume_from, widen, write_record
from piper_megatron.versions import MegatronRelease, check_relied_on, installed_release

TOP = 5


# ---- planning (no Megatron import) ----------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """The search for one job and its outcome (``best[0]`` is the plan)."""

    model: ModelSpec
    cluster: ClusterSpec
    gpus: int
    gbs: int
    pins: Pins
    result: SearchResult
    best: tuple[Prediction, ...]
    notes: tuple[str, ...]
    placement: Any = None  # the --piper-placement ExpertPlacement, whose ep every plan of the search has

    @property
    def top(self) -> Prediction:
        return self.best[0]


def _cluster(options: PiperOptions) -> tuple[ClusterSpec, list[str]]:
    if options.profile is not None:
        if not options.profile.is_file():
            raise SpecError("--piper-profile", str(options.profile), "is not a file",
                            "pass the profile `piper calibrate --out` wrote")
        cluster = load_profile(options.profile)
        instead = f" in place of --piper-cluster {options.cluster}" if options.cluster else ""
        return cluster, [f"--piper-profile {options.profile}: calibrated cluster {cluster.name}{instead}"]
    if options.cluster is None:
        raise SpecError("--piper-cluster", None, "is required with --piper (the plan depends on the hardware)",
                        "name a preset (dgx-h100, dgx-a100, ...) or a ClusterSpec YAML")
    return load_cluster(options.cluster), []


# Pinnable flags that only mean something in bf16 mixed precision: validate_args reads
# --grad-reduce-in-bf16 only under --bf16 (fp32 gradients stay fp32), and the offloaded optimizer runs
# the precision-aware optimizer, whose savings Piper prices as fp32 master copies of bf16 weights.
_BF16_ONLY = (("grad_reduce_in_bf16", "--grad-reduce-in-bf16"), ("optimizer_cpu_offload", "--optimizer-cpu-offload"))
FP32_NOTE = ("this job trains in fp32 (no --bf16): planned for fp32 training (fp32 weights, gradients and "
             "activations, Adam on the weights themselves); the search leaves out bf16 gradient reduction and "
             "optimizer offload")


def _precision(ns: Any, pins: Pins) -> str:
    """The precision the job trains in, which the search plans for: bf16 (--bf16), or fp32 (neither
    --bf16 nor --fp16, Megatron's default) unless a bf16-only flag is pinned; fp16 is refused (its
    loss scaling is not modelled)."""
    if getattr(ns, "bf16", False):
        return "bf16"
    if getattr(ns, "fp16", False):
        raise SpecError("precision", "fp16", "Piper's search plans bf16 mixed precision and fp32 training; fp16's "
                        "loss scaling is not modelled", "use --bf16, or drop --fp16 to train in fp32")
    bf16_only = [flag for dest, flag in _BF16_ONLY if pins.values.get(dest)]
    if bf16_only:
        raise SpecError(bf16_only[0], True, "acts only in bf16 mixed precision, and this job trains in fp32 (no "
                        "--bf16)", f"add --bf16, or drop {', '.join(bf16_only)}")
    return "fp32"


def _fp32_space(space: SearchSpace) -> SearchSpace:
    """fp32 plans, without bf16 gradient reduction or optimizer offload (see :data:`_BF16_ONLY`)."""
    return dataclasses.replace(space, precision="fp32", memory_savers=((False, 0.0),))


def _attention(ns: Any) -> str:
    backend = getattr(ns, "attention_backend", "auto")
    return "unfused" if getattr(backend, "name", backend) in ("unfused", "local") else "flash"


def plan_job(ns: Any, argv: Sequence[str], options: PiperOptions, *, world_size: int,
             defaults: dict[str, Any] | None = None,
             limit: Callable[[SearchSpace], SearchSpace] | None = None,
             release: MegatronRelease | None = None) -> Planned:
    """Search the plans for the job ``ns`` describes (Megatron's argument names) on ``world_size``
    GPUs, keeping the sizes written in ``argv``. Raises Infeasible when none fits. ``limit``
    narrows the search space further (e.g. to what a CPU trainer runs). A checkpoint in ``--load``
    restricts the search to the plan it was saved with (:mod:`piper_megatron.resume`). ``release``:
    the megatron-core that will run the job, where it reads an argument its own way (None: unknown,
    read as the newest release does; :func:`piper_megatron.args.vocab_size`)."""
    check_piper_flags(argv)
    if getattr(ns, "use_checkpoint_args", False) or getattr(ns, "yaml_cfg", None):
        raise SpecError("--use-checkpoint-args/--yaml-cfg", "given", "with --piper the sizes come from the "
                        "command line and the plan", "drop --use-checkpoint-args/--yaml-cfg, or run without --piper")
    if world_size < 1:
        raise SpecError("world size", world_size, "must be >= 1", "launch with torchrun, or pass --piper-world-size N "
                        "with --piper-plan-only")
    model, pins = model_spec_from_args(ns, defaults, release=release), pins_from(argv, options)
    layout = pins.values.get("pipeline_model_parallel_layout")
    if layout is not None:
        check_layout_model(model, layout, key=LAYOUT_FLAG)
    fp32 = _precision(ns, pins) == "fp32"
    _check_migrate(ns, options, model)
    cluster, notes = _cluster(options)
    cluster = _experts_as_written(ns, options, cluster)
    notes += [*options.notes, *([FP32_NOTE] if fp32 else []), *vocab_notes(ns, defaults or {}, release)]
    gbs = getattr(ns, "global_batch_size", None)
    if gbs is None:
        raise SpecError("--global-batch-size", None, "is required with --piper (Megatron's default, micro batch x "
                        "data parallel size, would change with the plan)", "add --global-batch-size N")
    resume = resume_from(ns, model, world_size, pins)
    space = restrict(widen(default_space(model, cluster, world_size), resume), pins)
    if options.defer_wgrad:  # every ep > 1 plan defers (search.py); ep = 1 plans have nothing to defer behind
        space = dataclasses.replace(space, defer_wgrad=True)
    if fp32:
        space = _fp32_space(space)
    if limit is not None:
        space = limit(space)
    placement = _placement(options, model, space.ep)
    if placement is not None:
        space = dataclasses.replace(space, ep=(placement.ep,))
        notes.append(f"--piper-placement {options.placement}: ep={placement.ep} as the placement says; "
                     f"{placement.describe()}")
    if resume is not None:
        space = narrow(space, resume, model, pins, world_size=world_size, gbs=gbs, attention=_attention(ns))
        notes.append(resume.note(cluster.name))
    routing = _routing(options, model)
    if routing is None:
        result = search(model, cluster, world_size, gbs, space=space, attention_backend=_attention(ns))
    else:
        placed, result = search_by_ep(model, cluster, world_size, gbs, routing, space=space,
                                      attention_backend=_attention(ns))
        if placement is not None:
            from piper_core.runtime.placement import ExpertPlacement

            default = ExpertPlacement.default(model.num_experts, placement.ep)
            placed = {placement.ep: {n: (placement.for_layer(n) or default).ranks for n, _ in routing.layers}}
    if model.moe_shared_expert_intermediate_size and not SHARED_EXPERT_OVERLAP:
        _without_shared_overlap(model, cluster, result)
        notes.append(SHARED_NOTE)
    kept = [s for s in result.scored if admits(s.plan, model, pins)]
    if len(kept) < len(result.scored):
        result.rejected["breaks a pinned pipeline split"] += len(result.scored) - len(kept)
        result.scored = kept
    if routing is None:
        best = tuple(best_predictions(model, cluster, result, TOP))
    else:
        best = tuple(r.prediction for r in reprice(model, cluster, routing, placed, result)[:TOP])
        notes.append(f"--piper-routing {routing.source}: every ep searched at its busiest MoE layer's load, the "
                     f"leading plans re-priced layer by layer; experts placed "
                     + ("as --piper-placement says" if placement is not None else "as Megatron does (contiguous)"))
    if not best:
        hint = resume.hint() if resume is not None else ""
        raise Infeasible(_no_plan(model, cluster, world_size, gbs, pins, result) + hint, rule="no feasible plan")
    check_save(ns, resume, model, best[0].plan)
    _check_migrate_plan(options, best[0].plan)
    return Planned(model=model, cluster=cluster, gpus=world_size, gbs=gbs, pins=pins, result=result, best=best,
                   notes=tuple(notes + _pin_notes(pins)), placement=placement)


MIGRATE_FLAG = "--piper-migrate-every"


def _check_migrate(ns: Any, options: PiperOptions, model: ModelSpec) -> None:
    """SpecError when ``--piper-migrate-every`` cannot run on this job (no experts, experts in shared
    tensors, optimizer state kept scaled): before any search."""
    every = options.migrate_every
    if every is None:
        return
    if not model.is_moe:
        raise SpecError(MIGRATE_FLAG, every, "moves experts between expert-parallel ranks, and this model has none",
                        f"drop {MIGRATE_FLAG}, or add --num-experts")
    if getattr(ns, "moe_grouped_gemm", False):
        raise SpecError(MIGRATE_FLAG, every, "moves experts one module each (Megatron's SequentialMLP); "
                        "--moe-grouped-gemm keeps all of a rank's experts in shared tensors",
                        f"drop --moe-grouped-gemm or {MIGRATE_FLAG}")
    if getattr(ns, "use_precision_aware_optimizer", False):
        raise SpecError(MIGRATE_FLAG, every, "moves the distributed optimizer's state as fp32; "
                        "--use-precision-aware-optimizer keeps it scaled in lower precision",
                        f"drop --use-precision-aware-optimizer or {MIGRATE_FLAG}")


def _check_migrate_plan(options: PiperOptions, plan: Any) -> None:
    """SpecError when the chosen plan offloads optimizer state, which migration does not move."""
    if options.migrate_every is not None and plan.optimizer_offload_fraction:
        raise SpecError(MIGRATE_FLAG, options.migrate_every, f"moves optimizer state between ranks, and the plan "
                        f"{describe(plan)} offloads {plan.optimizer_offload_fraction:g} of it to the host",
                        f"add --piper-off optimizer-cpu-offload, or drop {MIGRATE_FLAG}")


def _routing(options: PiperOptions, model: ModelSpec) -> Any:
    """``--piper-routing``'s Routing (None without the flag), checked against the model."""
    if not options.routing:
        return None
    if not model.is_moe:
        raise SpecError("--piper-routing", " ".join(map(str, options.routing)), "routes tokens to experts, and this "
                        "model has none", "drop --piper-routing, or add --num-experts")
    return load_routing([str(p) for p in options.routing], model)


def _placement(options: PiperOptions, model: ModelSpec, eps: Sequence[int]) -> Any:
    """``--piper-placement``'s placements (None without the flag): one ExpertPlacement for every MoE
    layer, or a LayerPlacements per layer (``piper placement --out``, a migrated checkpoint's
    piper_placement.json), checked against the model's experts and MoE layers and the expert-parallel
    sizes the search may still pick (``eps``); its ep restricts the search. Imports the runtime
    package only when the flag is given."""
    if options.placement is None:
        return None
    from piper_core.runtime.placement import LayerPlacements, read_placements
    from piper_core.specs.routing import moe_layer_numbers

    if not model.is_moe:
        raise SpecError("--piper-placement", str(options.placement), "places experts, and this model has none",
                        "drop --piper-placement, or add --num-experts")
    placement = read_placements(options.placement, key="--piper-placement")
    placement.check(num_experts=model.num_experts, ep=placement.ep, key="--piper-placement")
    if isinstance(placement, LayerPlacements):
        moe = moe_layer_numbers(model)
        stray = sorted(set(placement.layers) - set(moe))
        if stray:
            raise SpecError("--piper-placement", str(options.placement), f"places layers {stray}, which are not MoE "
                            f"layers of this model (its MoE layer numbers: {moe[0]}..{moe[-1]}, "
                            f"{len(moe)} layers)", "write the placement for this model's MoE layers "
                            "(piper placement --routing a trace of this model)")
    if placement.ep not in eps:
        raise SpecError("--piper-placement", str(options.placement), f"is for ep={placement.ep}, which this job "
                        f"cannot run (expert-parallel sizes left by the command line and the world size: "
                        f"{sorted(eps)})", f"write a placement for one of {sorted(eps)}, or drop or change "
                        "--expert-model-parallel-size")
    return placement


def _experts_as_written(ns: Any, options: PiperOptions, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` pricing the experts as the command line runs them: grouped GEMMs with
    ``--moe-grouped-gemm`` (Megatron's default is off), one GEMM per local expert without; the
    preset's own default is the hardware's habit, not this job's setting."""
    grouped = bool(getattr(ns, "moe_grouped_gemm", False))
    if grouped and options.defer_wgrad:
        raise SpecError("--moe-grouped-gemm", True, "--piper-defer-wgrad splits each expert linear's backward into "
                        "its input and weight parts, which a grouped GEMM's fused function does not allow",
                        "drop --moe-grouped-gemm (the experts then run one GEMM each) or --piper-defer-wgrad")
    return with_grouped_gemm(cluster, grouped)


SHARED_NOTE = ("the shared expert runs after the exchange, not beside it: Piper's dispatcher does not run Megatron's "
               "--moe-shared-expert-overlap, so the plans are timed without that overlap")


def _without_shared_overlap(model: ModelSpec, cluster: ClusterSpec, result: SearchResult) -> None:
    """The search's plans with ``shared_expert_overlap`` off (see :data:`piper_megatron.pins.
    SHARED_EXPERT_OVERLAP`), re-timed as the search times them: the closed form for every plan,
    then the exact 1F1B simulation for the ``RETIME`` best (piper_core.scheduler.search)."""
    for n, s in enumerate(result.scored):
        if s.plan.shared_expert_overlap:
            plan = dataclasses.replace(s.plan, shared_expert_overlap=False)
            step_s = step_time(model, plan, cluster, exact=False).step
            result.scored[n] = dataclasses.replace(s, plan=plan, step_s=step_s)
    head = result.best(RETIME)
    retimed = {id(s) for s in head}
    result.scored = [dataclasses.replace(s, step_s=step_time(model, s.plan, cluster).step) for s in head] + \
        [s for s in result.scored if id(s) not in retimed]


def _pin_notes(pins: Pins) -> list[str]:
    """What the predictions assume that the pins change."""
    notes, given = [], pins.values
    if given.get("recompute_granularity") == "full" and (given.get("recompute_method", "uniform"),
                                                         given.get("recompute_num_layers", 1)) != ("uniform", 1):
        notes.append("your --recompute-method/--recompute-num-layers are kept; the predictions assume full "
                     "recompute with --recompute-method uniform --recompute-num-layers 1")
    overlap = [name for name in pins.off_all if name.startswith("overlap-")]
    if overlap:
        notes.append(f"--piper-off {', '.join(overlap)}: the predicted step time assumes Megatron overlaps the "
                     "data-parallel gradient reduction and parameter gathering with compute (piper_core.timing.step); "
                     "without it the step takes longer than predicted")
    return notes


def _no_plan(model: ModelSpec, cluster: ClusterSpec, gpus: int, gbs: int, pins: Pins, result: SearchResult) -> str:
    rejected = ", ".join(f"{n:,} {reason}" for reason, n in result.rejected.most_common(4)) or "none"
    need, what = min_gpus(model, cluster)
    bound = f" {model.name} needs at least {need:,} GPUs of {cluster.name} for {what} alone." if need > gpus else ""
    return (f"no plan for {model.name} fits {gpus} GPUs of {cluster.name} at global batch {gbs} "
            f"(pinned: {pins.describe()}): {result.candidates:,} plans searched, rejected: {rejected}.{bound} "
            "Add GPUs, lower --global-batch-size or --seq-length, or drop pinned sizes.")


def report(planned: Planned, changes: Sequence[Change], dispatcher: str | None) -> str:
    """What rank 0 prints: the search, the plan with its predicted MFU and memory, why, what was
    pinned and what was set."""
    params = planned.top.params_total
    size = (f"{params / 1e12:.2f} T" if params >= 1e12 else f"{params / 1e9:.2f} B" if params >= 1e9
            else f"{params / 1e6:.2f} M")
    lines = [f"piper: planning {planned.model.name} ({size} parameters) from the Megatron arguments for "
             f"{planned.gpus} GPUs of {planned.cluster.name}",
             *(f"piper: note: {note}" for note in planned.notes),
             f"piper: pinned by the command line: {planned.pins.describe()}",
             render(planned.model.name, planned.cluster.name, planned.gpus, planned.gbs, planned.result,
                    list(planned.best)),
             "piper: Megatron arguments set:" + ("" if changes else " none (they already were the plan)"),
             *(f"piper:   {c.describe()}" for c in changes)]
    if dispatcher is not None:
        lines.append(f"piper: token dispatcher: {dispatcher}")
    return "\n".join(lines)


def dispatcher_description(planned: Planned) -> str | None:
    """The token dispatcher line of the report: the plan's exchange algorithm and its chunks (or
    the run-time tuning of them), None for a dense model."""
    plan = planned.top.plan
    if not planned.model.is_moe:
        return None
    stages = "intra-node, then inter-node" if plan.a2a == "hierarchical" else ""
    if planned.pins.tune:
        from piper_core.runtime.autochunks import ADAPTER_TUNING
        a2a = (f"Piper pipelined all-to-all of {plan.a2a} exchanges{f' ({stages})' if stages else ''}, chunk count "
               f"measured per MoE layer at run time ({ADAPTER_TUNING}, then the fastest; planned with "
               f"{plan.a2a_chunks})")
    elif plan.a2a_chunks > 1:
        a2a = (f"Piper pipelined all-to-all, {plan.a2a_chunks} chunks of {plan.a2a} exchanges "
               f"({f'{stages}; ' if stages else ''}chunk k+1's exchange overlaps chunk k's experts)")
    else:
        a2a = f"Piper {plan.a2a} all-to-all{f' ({stages})' if stages else ''}"
    a2a += f" over expert-parallel groups of {plan.ep}" if plan.ep > 1 else " (ep=1: local permutation only)"
    a2a += "; the experts' weight gradients computed while each dispatch gradient is in flight" \
        if plan.defer_wgrad else ""
    return a2a + ("; the shared expert overlaps the exchange" if plan.shared_expert_overlap else "")


# ---- hooks -------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchRequest:
    """What the ``initialize_model_parallel`` hook installs: the plan's all-to-all, the ranks of one
    domain for the hierarchical stages (a node, or an NVLink domain across nodes:
    :meth:`~piper_core.specs.cluster.ClusterSpec.exchange_domain_ranks`), the collective timeout and the ``--piper-trace`` path (or None)."""

    a2a: str
    chunks: int
    ranks_per_node: int
    tune: bool = False
    defer_wgrad: bool = False
    timeout_minutes: float
    trace: Any = None
    placement: Any = None  # an ExpertPlacement or LayerPlacements (--piper-placement), or None for the default
    count_tokens: bool = False  # the dispatchers count tokens per logical expert (--piper-migrate-every)


class Installation:
    """The hooks of one :func:`install` call; :meth:`restore` removes them (and the dispatcher)."""

    def __init__(self, release: MegatronRelease, argv: Sequence[str] | None, out: TextIO):
        self.release, self._argv, self._out = release, None if argv is None else list(argv), out
        self._saved: list[tuple[Any, str, Any]] = []
        self._validated: set[int] = set()
        self._request: DispatchRequest | None = None
        self._dispatcher: Any = None
        self._tracer: Any = None
        self.planned: Planned | None = None
        self.changes: list[Change] = []
        self._args: Any = None  # Megatron's arguments (prepare)
        self._options: PiperOptions | None = None
        self._training_hooked = False
        self._live: Any = None  # piper_megatron.live.LiveSettings with --piper-migrate-every
        self.placements: dict[int, Any] | None = None  # every MoE layer's placement now (piper_megatron.live)
        self._counted_since = 0  # the iteration the migration decision's token counts start after
        self._iteration = 0  # the last iteration trained (as Megatron logs them, from 1)

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.restore()
            self._dispatcher = None
        if self._tracer is not None:
            self._tracer.close()
            self._tracer = None
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

    def apply(self) -> None:
        try:
            arguments = importlib.import_module("megatron.training.arguments")
        except ImportError as exc:
            raise _import_error(exc) from exc
        series = self.release.series
        if self.release.entry == "parse_and_validate_args" and not hasattr(arguments, "parse_and_validate_args"):
            raise SpecError("megatron.training.arguments", "parse_and_validate_args missing", f"megatron-core reports "
                            f"{series}, whose scripts call it, but this megatron.training has the API of 0.16-0.17",
                            f"use a Megatron-LM checkout of megatron-core's version (tag core_v{series}.x)")
        add = arguments.add_megatron_arguments
        self._set(arguments, "add_megatron_arguments", lambda parser: add_piper_arguments(add(parser)))
        self._set(arguments, "validate_args", self._validation_hook(arguments.validate_args))
        if self.release.entry == "pretrain":
            initialize = importlib.import_module("megatron.training.initialize")
            if not hasattr(initialize, "validate_args"):
                raise SpecError("megatron.training.initialize", "validate_args missing", f"megatron-core reports "
                                f"{series}, whose initialize_megatron calls validate_args imported by name",
                                f"use a Megatron-LM checkout of megatron-core's version (tag core_v{series}.x)")
            self._set(initialize, "validate_args", self._validation_hook(initialize.validate_args))

    def _validation_hook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def validate_args(args: Any, defaults: dict[str, Any] | None = None, *rest: Any, **kwargs: Any) -> Any:
            if getattr(args, "piper", False) and id(args) not in self._validated:
                self._validated.add(id(args))
                self.prepare(args, defaults or {})
            return original(args, {} if defaults is None else defaults, *rest, **kwargs)

        validate_args.__wrapped__ = original  # type: ignore[attr-defined]
        validate_args.piper_installation = self  # type: ignore[attr-defined]
        return validate_args

    def prepare(self, args: Any, defaults: dict[str, Any]) -> None:
        """Plan, rewrite ``args`` in place, report on rank 0; exits for ``--piper-plan-only``. With
        ``--save DIR``, rank 0 records the plan in DIR for a run that resumes from it."""
        options = piper_options(args)
        self._args, self._options = args, options
        argv = self._argv if self._argv is not None else sys.argv[1:]
        world = options.world_size or getattr(args, "world_size", 1)
        self.planned = plan_job(args, argv, options, world_size=world, defaults=defaults, release=self.release)
        plan = self.planned.top.plan
        self.changes = apply_settings(args, megatron_settings(self.planned.model, plan, self.planned.pins))
        if getattr(args, "rank", 0) == 0:
            print(report(self.planned, self.changes, dispatcher_description(self.planned)), file=self._out, flush=True)
        if options.plan_only:
            raise SystemExit(0)
        if getattr(args, "save", None) and getattr(args, "rank", 0) == 0:
            path = write_record(Path(args.save), self._record(args))
            print(f"piper: plan recorded in {path} (a run with --load {args.save} resumes with it)", file=self._out,
                  flush=True)
        if self.planned.model.is_moe:
            self.hook_model_parallel(dispatch_request(self.planned, options,
                                                      getattr(args, "distributed_timeout_minutes", 10)))

    def _record(self, args: Any) -> PlanRecord:
        """The plan's record, with the values ``args`` now holds for every setting Piper owns."""
        planned, plan = self.planned, self.planned.top.plan
        owned = [*megatron_settings(planned.model, plan, Pins(given=(), off=planned.pins.off)), *planned.pins.values]
        return make_record(model=planned.model, cluster=planned.cluster.name, plan=plan, label=describe(plan),
                           megatron={dest: getattr(args, dest, None) for dest in owned})

    def hook_model_parallel(self, request: DispatchRequest) -> None:
        """Install Piper's dispatcher as ``request`` says once ``initialize_model_parallel`` has made
        the expert-parallel groups (and again if it runs again)."""
        self._request = request
        parallel_state = importlib.import_module("megatron.core.parallel_state")
        self._set(parallel_state, "initialize_model_parallel",
                  self._model_parallel_hook(parallel_state.initialize_model_parallel))

    def _model_parallel_hook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self._install_dispatcher()
            return result

        initialize_model_parallel.__wrapped__ = original  # type: ignore[attr-defined]
        return initialize_model_parallel

    def _install_dispatcher(self) -> None:
        import torch.distributed as dist

        from piper_core.runtime import NodeTopology
        from piper_megatron.dispatcher import DispatchSettings, create_ep_comm, install_dispatcher
        from piper_megatron.trace import Tracer

        check_relied_on(self.release)  # before Piper's dispatcher binds to Megatron's phases
        request, world = self._request, dist.get_world_size()
        per_node = request.ranks_per_node if world % request.ranks_per_node == 0 else world
        topology = NodeTopology.uniform(world_size=world, ranks_per_node=per_node)
        comm = create_ep_comm(topology, timeout=timedelta(minutes=request.timeout_minutes),
                              host_timeout=dist.get_backend() != "nccl")
        if self._dispatcher is not None:  # initialize_model_parallel ran again: rebind to the new groups
            self._dispatcher.restore()
        if request.trace is not None and self._tracer is None:
            self._tracer = Tracer.for_rank(request.trace, rank=dist.get_rank(), world_size=world)
            atexit.register(self._tracer.close)
        settings = DispatchSettings.from_plan(request.a2a, request.chunks, tune=request.tune,
                                              defer_wgrad=request.defer_wgrad, placement=request.placement,
                                              count_tokens=request.count_tokens)
        self._dispatcher = install_dispatcher(comm, settings, tracer=self._tracer)
        self._hook_training(request)

    # ---- Megatron-LM's training loop ------------------------------------------------------------------

    def _hook_training(self, request: DispatchRequest) -> None:
        """Hook 4 of the module docstring, once, where Megatron-LM's training loop runs the job."""
        training = sys.modules.get("megatron.training.training")
        if training is None or self.planned is None or self._training_hooked:
            return
        from piper_megatron.live import LiveSettings, job_placements

        self._training_hooked = True
        planned, options = self.planned, self._options
        self.placements = job_placements(planned.model, planned.top.plan.ep, planned.placement)
        self._set(training, "save_checkpoint", self._save_hook(training.save_checkpoint))
        self._set(training, "load_checkpoint", self._load_hook(training.load_checkpoint))
        if options is not None and options.migrate_every is not None:
            self._live = LiveSettings(every=options.migrate_every, horizon=options.migrate_horizon,
                                      model=planned.model, plan=planned.top.plan, cluster=planned.cluster,
                                      timeout=timedelta(minutes=request.timeout_minutes))
            self._set(training, "train_step", self._train_step_hook(training.train_step))

    def _train_step_hook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def train_step(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            given = signature.bind(*args, **kwargs).arguments
            self._after_iteration(given["model"], given["optimizer"], given.get("iteration"))
            return result

        train_step.__wrapped__ = original  # type: ignore[attr-defined]
        return train_step

    def _after_iteration(self, model: list[Any], optimizer: Any, iteration: int | None) -> None:
        """Every ``--piper-migrate-every`` iterations (counted as Megatron logs them, from 1): decide,
        and migrate when it pays (:func:`piper_megatron.live.decide`); rank 0 prints the decision."""
        import torch.distributed as dist

        from piper_megatron.live import decide

        done = self._iteration = (iteration if iteration is not None else self._iteration) + 1
        if done % self._live.every:
            return
        outcome = decide(self._live, model, optimizer, self.placements, iteration=done, since=self._counted_since)
        self.placements, self._counted_since = outcome.placements, done
        if dist.get_rank() == 0:
            print(outcome.line(), file=self._out, flush=True)

    def _save_hook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            given = signature.bind(*args, **kwargs).arguments
            if not given.get("non_persistent_ckpt", False):
                self._save_placements(given["iteration"], bool(given.get("release", False)))
            return result

        save_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
        return save_checkpoint

    def _save_placements(self, iteration: int, release: bool) -> None:
        """Rank 0 writes every MoE layer's placement into the saved iteration's directory."""
        import torch.distributed as dist

        from piper_megatron.migrate import write_placements

        save = getattr(self._args, "save", None)
        if save is None or dist.get_rank() != 0:
            return
        checkpointing = importlib.import_module("megatron.training.checkpointing")
        directory = checkpointing.get_checkpoint_name(save, iteration, release=release, return_base_dir=True)
        write_placements(directory, self.placements)

    def _load_hook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            given = signature.bind(*args, **kwargs).arguments
            self._load_placements(given["ddp_model"], given.get("load_arg", "load"), result)
            return result

        load_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
        return load_checkpoint

    def _load_placements(self, model: list[Any], load_arg: str, result: Any) -> None:
        """Route by the loaded iteration's ``piper_placement.json`` where it has one (a checkpoint without
        one: the dispatchers keep what they route by, Megatron's default or ``--piper-placement``)."""
        import torch.distributed as dist

        from piper_megatron.live import saved_placements
        from piper_megatron.migrate import apply_placements

        iteration = result[0] if isinstance(result, tuple) and result and isinstance(result[0], int) else 0
        self._counted_since = self._iteration = iteration
        if getattr(self._args, load_arg, None) is None:
            return
        checkpointing = importlib.import_module("megatron.training.checkpointing")
        # the directory load_checkpoint read: the tracker's iteration, or --ckpt-step
        directory = checkpointing.get_load_checkpoint_path_by_args(self._args, load_arg)
        placements = saved_placements(directory, self.planned.model, self.planned.top.plan.ep)
        if placements is None:
            return
        apply_placements(model, placements)
        self.placements = placements
        if dist.get_rank() == 0:
            moved = [n for n, p in placements.items() if not p.is_default]
            print(f"piper: each MoE layer routes by the loaded checkpoint's expert placement, {directory}/"
                  f"piper_placement.json (layers {moved or 'none'} off the default)", file=self._out, flush=True)


# megatron.training's imports beyond the megatron-core wheel's requirements (pyproject's megatron-lm extra).
TRAINING_EXTRAS = ("six", "regex")


def _import_error(exc: ImportError) -> SpecError:
    """Why ``megatron.training.arguments`` did not import: no checkout, a checkout of another
    version than megatron-core, or a package Megatron-LM's training code needs (named)."""
    name = getattr(exc, "name", None) or ""
    if isinstance(exc, ModuleNotFoundError) and name in ("megatron", "megatron.training",
                                                         "megatron.training.arguments"):
        return SpecError("megatron.training", "not importable", f"--piper hooks Megatron-LM's argument parsing "
                         f"({exc}); the megatron-core 0.16 wheel ships only megatron/core",
                         "run the script from a Megatron-LM checkout (python -m piper_megatron puts the script's "
                         "directory first on sys.path), or plan without it: --piper-plan-only")
    if name == "megatron" or name.startswith("megatron."):
        return SpecError("megatron.training", f"needs {name}", f"Megatron-LM's training code imports {name}, which "
                         f"the installed megatron-core lacks ({exc})", "use a Megatron-LM checkout of the same version "
                         "as megatron-core (tag core_vX.Y.Z for megatron-core X.Y.Z)")
    if isinstance(exc, ModuleNotFoundError) and name:
        package = name.split(".")[0]
        packages = TRAINING_EXTRAS if package in TRAINING_EXTRAS else (package, *TRAINING_EXTRAS)
        extra = " (or the extra that holds them: pip install 'piper-moe[megatron-lm]')" if package in TRAINING_EXTRAS \
            else ""
        return SpecError("megatron.training", f"needs {package}", f"Megatron-LM's training code imports {name}, "
                         f"which is not installed ({exc}); it needs packages the megatron-core wheel does not "
                         f"declare, e.g. {' and '.join(TRAINING_EXTRAS)}", f"pip install {' '.join(packages)}{extra}")
    return SpecError("megatron.training", "not importable", f"importing megatron.training.arguments failed: {exc}",
                     "use a Megatron-LM checkout that matches megatron-core and this Python (0.17 and later need "
                     "Python 3.12)")


def dispatch_request(planned: Planned, options: PiperOptions, timeout_minutes: int) -> DispatchRequest:
    """What the dispatcher of ``planned``'s best plan is installed with: its exchange, the ranks of one
    exchange domain (a node's, or the NVLink domain's where it spans nodes, as on GB200 NVL72:
    :meth:`~piper_core.specs.cluster.ClusterSpec.exchange_domain_ranks` of the launcher's
    LOCAL_WORLD_SIZE), the collective timeout, the trace path and the placement."""
    plan = planned.top.plan
    return DispatchRequest(a2a=plan.a2a, chunks=plan.a2a_chunks, tune=options.tune, defer_wgrad=plan.defer_wgrad,
                           ranks_per_node=planned.cluster.exchange_domain_ranks(_ranks_per_node()),
                           timeout_minutes=timeout_minutes, trace=options.trace, placement=planned.placement,
                           count_tokens=options.migrate_every is not None)


def _ranks_per_node() -> int | None:
    """Ranks per node as the launcher states it (torchrun's LOCAL_WORLD_SIZE), read once at install."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def install(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> Installation | None:
    """Hook ``--piper`` into Megatron-LM (see the module docstring). Call before Megatron parses its
    arguments (``parse_and_validate_args`` / ``pretrain``). ``argv`` defaults to ``sys.argv[1:]``
    as Megatron will read it. Returns None, touching nothing, when ``--piper`` is not given, and
    the existing installation when the hooks are in place already."""
    options = parse_piper_options(sys.argv[1:] if argv is None else argv)
    if not options.enabled:
        return None
    found = installed_release()
    arguments = sys.modules.get("megatron.training.arguments")
    existing = getattr(getattr(arguments, "validate_args", None), "piper_installation", None)
    if existing is not None:  # installed already (e.g. by the launcher and again by the script)
        return existing
    installation = Installation(found, argv, out or sys.stdout)
    installation.apply()
    return installation


__all__ = ["Installation", "Planned", "dispatcher_description", "install", "plan_job", "report"]
