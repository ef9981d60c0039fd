"""What a Megatron command line pins for ``--piper``: the sizes and options written on it, the
switches ``--piper-off`` keeps off, and the search space restricted to both.

Sizes written on the command line are kept by the search and never overwritten. Megatron's
switches that ``--piper`` may turn on (the distributed optimizer, overlapped gradient reduction,
...) are ``store_true`` flags with no off form, so ``--piper-off NAME[,NAME...]`` says which the
plan must leave off; NAME is the Megatron flag without its leading dashes. Pure Python over the
specs (no torch, no Megatron import).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from piper_core.errors import SpecError, nearest
from piper_core.scheduler.space import A2A_CHOICES, A2AVariant, SearchSpace
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

if TYPE_CHECKING:  # args imports this module
    from piper_megatron.args import A2AFlag, PiperOptions

# flag -> (dest, type (None: a switch), Megatron default): sizes and options the search chooses.
PINNABLE: dict[str, tuple[str, Callable[[str], Any] | None, Any]] = {
    "--tensor-model-parallel-size": ("tensor_model_parallel_size", int, 1),
    "--pipeline-model-parallel-size": ("pipeline_model_parallel_size", int, 1),
    "--num-layers-per-virtual-pipeline-stage": ("num_layers_per_virtual_pipeline_stage", int, None),
    "--num-virtual-stages-per-pipeline-rank": ("num_virtual_stages_per_pipeline_rank", int, None),
    "--decoder-first-pipeline-num-layers": ("decoder_first_pipeline_num_layers", int, None),
    "--decoder-last-pipeline-num-layers": ("decoder_last_pipeline_num_layers", int, None),
    "--context-parallel-size": ("context_parallel_size", int, 1),
    "--expert-model-parallel-size": ("expert_model_parallel_size", int, 1),
    "--expert-tensor-parallel-size": ("expert_tensor_parallel_size", int, None),
    "--micro-batch-size": ("micro_batch_size", int, None),
    "--recompute-granularity": ("recompute_granularity", str, None),
    "--recompute-method": ("recompute_method", str, None),
    "--recompute-num-layers": ("recompute_num_layers", int, None),
    "--sequence-parallel": ("sequence_parallel", None, False),
    "--use-distributed-optimizer": ("use_distributed_optimizer", None, False),
    "--overlap-grad-reduce": ("overlap_grad_reduce", None, False),
    "--overlap-param-gather": ("overlap_param_gather", None, False),
    "--grad-reduce-in-bf16": ("grad_reduce_in_bf16", None, False),
    "--optimizer-cpu-offload": ("optimizer_cpu_offload", None, False),
    "--optimizer-offload-fraction": ("optimizer_offload_fraction", float, 1.0),
    "--use-precision-aware-optimizer": ("use_precision_aware_optimizer", None, False),
    "--moe-token-dispatcher-type": ("moe_token_dispatcher_type", str, "allgather"),
    "--moe-shared-expert-overlap": ("moe_shared_expert_overlap", None, False),
    "--pipeline-model-parallel-layout": ("pipeline_model_parallel_layout", str, None),
}

# Whether Piper's token dispatcher runs Megatron's --moe-shared-expert-overlap. It does: the stock
# dispatcher overlaps the shared expert inside its own phases, and PiperTokenDispatcher runs the same
# pieces beside its own exchanges (piper_megatron.dispatcher module doc). Were it False, --piper plans
# would run the shared expert after the exchange (install.plan_job re-times the searched plans so) and
# the flag would be refused on the line.
SHARED_EXPERT_OVERLAP = True

# --piper-off NAME: the Megatron flags --piper may turn on (NAME is the flag without "--"; its dest
# is NAME with underscores). recompute-granularity off means no activation recompute.
OFF_NAMES: tuple[str, ...] = ("use-distributed-optimizer", "overlap-grad-reduce", "overlap-param-gather",
                              "sequence-parallel", "grad-reduce-in-bf16", "optimizer-cpu-offload",
                              "use-precision-aware-optimizer", "recompute-granularity")
# What else must stay off with one of them, by Megatron's validate_args: --overlap-param-gather needs
# the distributed optimizer and --overlap-grad-reduce; --optimizer-cpu-offload needs the distributed
# optimizer and --use-precision-aware-optimizer.
_IMPLIED: dict[str, tuple[str, ...]] = {
    "use-distributed-optimizer": ("overlap-param-gather", "optimizer-cpu-offload"),
    "overlap-grad-reduce": ("overlap-param-gather",),
    "use-precision-aware-optimizer": ("optimizer-cpu-offload",),
}


def off_names(values: Iterable[str] | None) -> tuple[str, ...]:
    """The names of ``--piper-off`` (each value a comma-separated list), checked, in OFF_NAMES order."""
    names: set[str] = set()
    for value in values or ():
        for name in value.split(","):
            name = name.strip()
            if name not in OFF_NAMES:
                near = nearest(name, OFF_NAMES)
                raise SpecError("--piper-off", name, "names a Megatron switch --piper may turn on, without its "
                                f"dashes: one of {', '.join(OFF_NAMES)}",
                                f"write --piper-off {near}" if near else "write one of those names")
            names.add(name)
    return tuple(n for n in OFF_NAMES if n in names)


def explicit_flags(argv: Sequence[str]) -> dict[str, Any]:
    """dest -> value of every pinnable flag written on the command line (defaults suppressed)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False, argument_default=argparse.SUPPRESS)
    for flag, (dest, kind, _) in PINNABLE.items():
        if kind is None:
            parser.add_argument(flag, dest=dest, action="store_true")
        else:
            parser.add_argument(flag, dest=dest, type=kind)
    known, _ = parser.parse_known_args(list(argv))
    return vars(known)


@dataclass(frozen=True, kw_only=True, slots=True)
class Pins:
    """What the command line fixed (dest -> value, as written) and the search must keep, and the
    switches ``--piper-off`` keeps off (``off``, as written; :attr:`off_all` adds what they imply)."""

    given: tuple[tuple[str, Any], ...]
    a2a: A2AFlag = "auto"
    chunks: int | None = None
    tune: bool = False
    min_chunks: int = 1  # 2: the old --piper-a2a pipelined (PiperOptions.min_chunks)
    off: tuple[str, ...] = ()

    @property
    def values(self) -> dict[str, Any]:
        return dict(self.given)

    @property
    def off_all(self) -> tuple[str, ...]:
        """``off`` and the switches that must stay off with them, in OFF_NAMES order."""
        names = set(self.off).union(*(_IMPLIED.get(n, ()) for n in self.off))
        return tuple(n for n in OFF_NAMES if n in names)

    @property
    def off_dests(self) -> dict[str, Any]:
        """Megatron dest -> its off value for every switch kept off."""
        return {n.replace("-", "_"): None if n == "recompute-granularity" else False for n in self.off_all}

    def describe(self) -> str:
        """e.g. ``--tensor-model-parallel-size 4, --piper-a2a hierarchical, --piper-chunks 2`` (or ``none``)."""
        flags = {dest: flag for flag, (dest, _, _) in PINNABLE.items()}
        parts = [flags[d] if v is True else f"{flags[d]} {v}" for d, v in self.given]
        parts += [f"--piper-a2a {self.a2a}"] if self.a2a != "auto" else []
        parts += [f"--piper-chunks {self.chunks}"] if self.chunks is not None else []
        parts += ["--piper-chunks tune"] if self.tune else []
        parts += [f"--piper-chunks auto >= {self.min_chunks}"] if self.min_chunks > 1 and self.chunks is None \
            and not self.tune else []
        if self.off:
            implied = [n for n in self.off_all if n not in self.off]
            parts.append(f"--piper-off {','.join(self.off)}" + (f" (so also off: {', '.join(implied)})"
                                                                 if implied else ""))
        return ", ".join(parts) or "none"


LAYOUT_FLAG = "--pipeline-model-parallel-layout"


def pins_from(argv: Sequence[str], options: PiperOptions) -> Pins:
    """The pins of a command line; rejects flags the search cannot honour (SpecError)."""
    given = explicit_flags(argv)
    layout = given.get("pipeline_model_parallel_layout")
    if layout is not None:
        _check_pinned_layout(layout, given)
    if "decoder_first_pipeline_num_layers" in given:
        raise SpecError("--decoder-first-pipeline-num-layers", given["decoder_first_pipeline_num_layers"],
                        "Piper's search splits layers evenly or shortens the last stage only",
                        "drop it (or use --decoder-last-pipeline-num-layers), or run without --piper")
    dispatcher = given.get("moe_token_dispatcher_type", "alltoall")
    if dispatcher != "alltoall":
        raise SpecError("--moe-token-dispatcher-type", dispatcher, "--piper replaces Megatron's alltoall token "
                        "dispatcher with Piper's; other dispatchers cannot be combined with it",
                        "drop the flag, or plan with `piper plan --export-megatron` and run without --piper")
    if given.get("moe_shared_expert_overlap") and not SHARED_EXPERT_OVERLAP:
        raise SpecError("--moe-shared-expert-overlap", True, "Piper's dispatcher runs its own exchanges "
                        "(Megatron overlaps the shared expert inside the stock token_dispatch/token_combine)",
                        "drop --moe-shared-expert-overlap")
    etp, tp = given.get("expert_tensor_parallel_size"), given.get("tensor_model_parallel_size")
    if etp is not None and etp != 1 and tp is not None and etp != tp:
        raise SpecError("--expert-tensor-parallel-size", etp, f"the search runs the experts with expert tensor "
                        f"parallel size 1 or equal to --tensor-model-parallel-size ({tp})",
                        f"pin --expert-tensor-parallel-size 1 or {tp}, or drop one of the two flags")
    if options.tune and given.get("recompute_granularity") == "full":
        raise SpecError("--piper-chunks", "tune", "full recompute runs each MoE layer's forward twice, and a layer "
                        "still tuning would run the two with different chunk counts", "give a chunk count "
                        "(--piper-chunks N or auto), or drop --recompute-granularity full")
    pins = Pins(given=tuple(sorted(given.items())), a2a=options.a2a, chunks=options.chunks, tune=options.tune,
                min_chunks=options.min_chunks, off=options.off)
    _check_off(pins)
    return pins


def _check_pinned_layout(layout: str, given: dict[str, Any]) -> None:
    """A layout on the command line pins the plan's layout: its syntax and Megatron's rules that need
    no model now (the model's, when planning), and no other way of splitting the layers beside it."""
    from piper_core.specs.layout import check_layout, parse_layout

    stages = parse_layout(layout, key=LAYOUT_FLAG)
    pp = given.get("pipeline_model_parallel_size")
    if pp is not None:
        check_layout(stages, pp, text=layout, key=LAYOUT_FLAG)
    else:
        check_layout(stages, 1, text=layout, key=LAYOUT_FLAG)
    other = [flag for flag, (dest, _, _) in PINNABLE.items() if dest in given and dest in (
        "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")]
    if other:
        raise SpecError(LAYOUT_FLAG, layout, f"places every layer itself, so {', '.join(other)} cannot be given "
                        "beside it (Megatron refuses the pair)", f"drop {', '.join(other)}")


def _check_off(pins: Pins) -> None:
    """A switch kept off (or implied off) must not be written on the command line too."""
    given = pins.values
    for name in pins.off_all:
        if given.get(name.replace("-", "_")) not in (None, False):
            why = "" if name in pins.off else f" (implied by --piper-off {', '.join(pins.off)}: Megatron's " \
                                                "validate_args allows it only with those on)"
            raise SpecError("--piper-off", name, f"keeps --{name} off{why}, and --{name} is on the command line too",
                            f"drop --{name} or take {name} out of --piper-off")


PIPER_ALGORITHMS = ("flat", "hierarchical")  # the exchanges Piper's dispatcher runs (its PLAN_ALGORITHMS)


def _a2a_choices(pins: Pins, space: SearchSpace) -> tuple[A2AVariant, ...]:
    """The (algorithm, chunks, EP overlap) variants ``--piper-a2a`` and ``--piper-chunks`` leave, each
    chosen independently. Never Megatron's EP overlap: it runs inside Megatron's own dispatcher, which
    --piper replaces (:func:`piper_core.runners.megatron_piper`); never an exchange Piper's dispatcher
    does not run (``dedup``, Megatron's flex dispatcher)."""
    choices = tuple(v for v in dict.fromkeys(A2A_CHOICES + space.a2a)  # space: maybe a recorded one
                    if not v[2] and v[0] in PIPER_ALGORITHMS)
    algorithms = tuple(dict.fromkeys(a for a, _, _ in choices)) if pins.a2a == "auto" else (pins.a2a,)
    if pins.chunks is not None:
        counts: tuple[int, ...] = (pins.chunks,)
    else:  # auto, or tune (the plan's count is what the step-time model assumes until a layer decides)
        counts = tuple(dict.fromkeys(c for _, c, _ in choices if c >= pins.min_chunks))
    return tuple((a, c, False) for a in algorithms for c in counts)


def restrict(space: SearchSpace, pins: Pins) -> SearchSpace:
    """``space`` with each pinned dimension reduced to the pinned value (which may lie outside the
    default range; a pinned expert tensor parallel size > 1 is the tensor parallel size, as the search
    sets it: pins_from refuses other values), the all-to-all choices of ``--piper-a2a``/
    ``--piper-chunks`` and the switches of ``--piper-off`` left off."""
    v = pins.values
    out: dict[str, Any] = {"a2a": _a2a_choices(pins, space)}
    for dest, dim in (("tensor_model_parallel_size", "tp"), ("pipeline_model_parallel_size", "pp"),
                      ("context_parallel_size", "cp"), ("expert_model_parallel_size", "ep"),
                      ("micro_batch_size", "mbs"), ("num_virtual_stages_per_pipeline_rank", "vpp")):
        if dest in v:
            out[dim] = (v[dest],)
    if pins.tune:  # a layer still tuning must not run its forward twice (recompute) with two chunk counts
        out["recompute"] = tuple(r for r in space.recompute if r != "full")
    if pins.a2a != "auto" or (pins.chunks or 1) > 1 or pins.tune or pins.min_chunks > 1:  # needs expert parallelism
        out["ep"] = tuple(e for e in out.get("ep", space.ep) if e > 1)
        if not out["ep"]:
            raise SpecError("--piper-a2a/--piper-chunks", f"{pins.a2a}/{'tune' if pins.tune else pins.chunks or 'auto'}",
                            "choose the "
                            "expert all-to-all, which needs expert parallelism (ep > 1; the model has no experts or "
                            "ep is pinned to 1)", "drop --piper-a2a/--piper-chunks or pin ep > 1")
    if v.get("sequence_parallel") and "tensor_model_parallel_size" not in v:
        out["tp"] = tuple(t for t in space.tp if t > 1) or space.tp
    etp = v.get("expert_tensor_parallel_size")
    if etp is not None:
        out["etp_equals_tp"] = (False,) if etp == 1 else (True,)
        if etp != 1:
            out["tp"] = (etp,)
    if "recompute_granularity" in v:
        out["recompute"] = (v["recompute_granularity"],)
    layout = v.get("pipeline_model_parallel_layout")
    if layout is not None:  # the plan takes the layout; pp x vpp must give its stages
        from piper_core.specs.layout import parse_layout

        stages = len(parse_layout(layout, key=LAYOUT_FLAG))
        out["pipeline_layout"] = layout
        out["pp"] = tuple(p for p in out.get("pp", space.pp) if stages % p == 0 and stages // p >= 1)
        if not out["pp"]:
            raise SpecError(LAYOUT_FLAG, layout, f"has {stages} stages, which no pipeline size of the search "
                            f"({', '.join(map(str, space.pp))}) divides", "pin --pipeline-model-parallel-size")
        out["vpp"] = tuple(sorted({stages // p for p in out["pp"]}))
    if v.get("use_distributed_optimizer") or v.get("overlap_param_gather") or v.get("optimizer_cpu_offload"):
        out["distributed_optimizer"] = (True,)  # validate_args: param gather overlap and offload need it
    off = pins.off_all
    if "use-distributed-optimizer" in off:
        out["distributed_optimizer"] = (False,)
    if "sequence-parallel" in off:
        out["sequence_parallel"] = False
    if "recompute-granularity" in off:
        out["recompute"] = ("none",)
    out["memory_savers"] = _savers(space.memory_savers, v, off)
    return dataclasses.replace(space, **out)


def _savers(savers: tuple[tuple[bool, float], ...], v: dict[str, Any],
            off: tuple[str, ...]) -> tuple[tuple[bool, float], ...]:
    """(grad_reduce_in_bf16, optimizer_offload_fraction) pairs the pins leave to try, in order."""
    if v.get("grad_reduce_in_bf16"):
        savers = tuple(s for s in savers if s[0])
    if v.get("optimizer_cpu_offload"):
        fraction = v.get("optimizer_offload_fraction", 1.0)
        savers = tuple((bf16, fraction) for bf16, offload in savers if offload > 0) or ((True, fraction),)
    if "grad-reduce-in-bf16" in off:  # offloading with fp32 gradients stays possible
        savers = tuple((False, offload) for _, offload in savers)
    if "optimizer-cpu-offload" in off:
        savers = tuple(s for s in savers if s[1] == 0)
    return tuple(dict.fromkeys(savers))


def admits(plan: ParallelPlan, model: ModelSpec, pins: Pins) -> bool:
    """Pins the search space cannot express: layers per virtual stage and the last stage's layers."""
    v = pins.values
    per_vstage = v.get("num_layers_per_virtual_pipeline_stage")
    if per_vstage is not None and (plan.vpp or 1) * plan.pp * per_vstage != model.num_layers:
        return False
    last = v.get("decoder_last_pipeline_num_layers")
    return last is None or plan.num_layers_in_last_pipeline_stage == last
