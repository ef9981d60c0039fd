"""Rules that tie a ParallelPlan to a ModelSpec, and the layer -> pipeline-stage layout.

Each rule is Megatron's own (the source is named next to it) and raises :class:`SpecError` with
its own message; :func:`check_plan` runs them all. :func:`stage_layers` reproduces Megatron's
assignment of layers to (virtual) pipeline stages.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from piper_core.errors import SpecError
from piper_core.specs._check import divides
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan


def check_plan(model: ModelSpec, plan: ParallelPlan) -> None:
    """Raise :class:`SpecError` for the first Megatron rule that ``plan`` breaks for ``model``."""
    # TransformerConfig.__post_init__: heads and query groups split evenly over tp.
    divides("tp", plan.tp, "num_attention_heads", model.num_attention_heads)
    if model.mla is None:
        divides("tp", plan.tp, "num_query_groups", model.query_groups)
    # ColumnParallelLinear/RowParallelLinear use megatron.core.utils.divide on the ffn widths.
    divides("tp", plan.tp, "ffn_hidden_size", model.ffn_hidden_size)
    if model.is_moe:
        _check_moe(model, plan)
    elif plan.ep > 1 or plan.etp not in (None, plan.tp):
        raise SpecError("ep", plan.ep, "expert parallelism needs a MoE model (num_experts > 0)",
                        "set ep=1 and leave etp unset for a dense model")
    if plan.cp > 1 and model.seq_length % (2 * plan.cp):
        raise SpecError("cp", plan.cp, f"seq_length ({model.seq_length}) must be divisible by 2*cp for the "
                        "causal load-balanced split (Megatron get_batch_on_this_cp_rank)",
                        "choose cp so that 2*cp divides seq_length")
    if plan.recompute_num_layers is not None:
        _check_recompute(model, plan)
    stage_layers(model, plan)  # raises for layer counts that do not split over pp*vpp


def _check_moe(model: ModelSpec, plan: ParallelPlan) -> None:
    # TransformerConfig: num_moe_experts % expert_model_parallel_size.
    divides("ep", plan.ep, "num_experts", model.num_experts)
    divides("etp", plan.etp_size, "moe_ffn_hidden_size", model.moe_ffn_hidden_size)
    if model.moe_shared_expert_intermediate_size:
        divides("tp", plan.tp, "moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size)
    elif plan.shared_expert_overlap:
        raise SpecError("shared_expert_overlap", True, f"{model.name} has no shared expert to overlap",
                        "set shared_expert_overlap=false")
    # megatron.training.arguments.validate_args: MoE with tp > 1 needs sequence parallelism.
    if plan.tp > 1 and not plan.sequence_parallel:
        raise SpecError("sequence_parallel", False, f"MoE with tp={plan.tp} > 1 requires sequence parallelism "
                        "(Megatron validate_args)", "set sequence_parallel=true (sp=1)")
    # TransformerConfig: bias in MoE experts only with etp == 1.
    if model.add_bias_linear and plan.etp_size > 1:
        raise SpecError("etp", plan.etp_size, "MoE experts with add_bias_linear support only etp=1 "
                        "(Megatron TransformerConfig)", "set etp=1")


def _check_recompute(model: ModelSpec, plan: ParallelPlan) -> None:
    per_chunk = max(len(c) for stage in stage_layers(model, plan) for c in stage)
    n = plan.recompute_num_layers
    if plan.recompute_method == "uniform" and n > model.num_layers:
        raise SpecError("recompute_num_layers", n, f"must be <= num_layers ({model.num_layers}) with the "
                        "uniform method", "lower it")
    if plan.recompute_method == "block" and n > per_chunk:
        raise SpecError("recompute_num_layers", n, f"must be <= layers per pipeline chunk ({per_chunk}) with the "
                        "block method", f"use at most {per_chunk}")


@dataclass(frozen=True, kw_only=True, slots=True)
class _LayoutPlan:
    """The fields of a plan that decide the layer layout (the cache key of :func:`stage_layers`)."""

    pp: int
    vpp: int | None
    num_layers_in_first_pipeline_stage: int | None
    num_layers_in_last_pipeline_stage: int | None

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1


def _pp_layer_counts(model: ModelSpec, plan: ParallelPlan) -> list[int]:
    """Layers on each pipeline rank (TransformerConfig uneven-split rules)."""
    first, last = plan.num_layers_in_first_pipeline_stage, plan.num_layers_in_last_pipeline_stage
    rest, middle = model.num_layers, plan.pp
    for key, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if value is None:
            continue
        if plan.pp == 1:
            raise SpecError(key, value, "an uneven pipeline split needs pp > 1", f"remove {key} or raise pp")
        if plan.vpp and value % plan.vpp:
            raise SpecError(key, value, f"must be divisible by vpp ({plan.vpp})", f"use a multiple of {plan.vpp}")
        rest, middle = rest - value, middle - 1
    if (rest > 0) != (middle > 0) or rest < 0:
        raise SpecError("num_layers", model.num_layers, f"{rest} layers remain for {middle} middle pipeline "
                        "stages after the first/last stage counts", "adjust the first/last stage layer counts")
    chunk = middle * plan.virtual_stages
    if middle and rest % chunk:
        what = "pp*vpp" if plan.vpp else "pp"
        if first is None and last is None:
            raise SpecError(what, chunk, f"must divide the {rest} layers of the pipeline stages (Megatron "
                            "TransformerConfig)", f"choose {what} dividing {rest}, or set an uneven first/last "
                            "stage split")
        raise SpecError(what, plan.pp * plan.virtual_stages, f"leaves {chunk} middle stage chunks, which must divide "
                        f"the {rest} layers left after the first ({first}) and last ({last}) stages (Megatron "
                        "TransformerConfig)", f"change the first/last stage layer counts so that {chunk} divides "
                        "what is left, or change pp")
    each = rest // middle if middle else 0
    counts = [each] * plan.pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layers(model: ModelSpec, plan: ParallelPlan) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Global layer indices per pipeline rank, per virtual chunk: ``[pp_rank][vp_chunk] -> layers``.

    Megatron assigns layers to virtual stages in the order ``v * pp + p`` (chunk-major), each pp rank
    holding ``count / vpp`` consecutive layers per chunk (``get_transformer_layer_offset``), or as
    many as the plan's pipeline layout puts in that stage (``PipelineParallelLayerLayout.
    get_layer_offset``).
    """
    return _stage_layers(model, plan.pp, plan.vpp, plan.num_layers_in_first_pipeline_stage,
                         plan.num_layers_in_last_pipeline_stage, plan.pipeline_layout)


@functools.cache
def _stage_layers(model: ModelSpec, pp: int, vpp_or_none: int | None, first: int | None,
                  last: int | None, layout: str | None = None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    vpp = vpp_or_none or 1
    if layout is not None:
        per_stage = _layout_counts(model, layout)
        _mtp_layers(model, pp, layout)  # raises for MTP layers the layout misplaces
    else:
        plan = _LayoutPlan(pp=pp, vpp=vpp_or_none, num_layers_in_first_pipeline_stage=first,
                           num_layers_in_last_pipeline_stage=last)
        counts = _pp_layer_counts(model, plan)  # type: ignore[arg-type]
        per_stage = tuple(counts[p] // vpp for v in range(vpp) for p in range(pp))
    out: list[list[tuple[int, ...]]] = [[] for _ in range(pp)]
    start = 0
    for v in range(vpp):
        for p in range(pp):
            n = per_stage[v * pp + p]
            out[p].append(tuple(range(start, start + n)))
            start += n
    return tuple(tuple(chunks) for chunks in out)


def _layout_counts(model: ModelSpec, layout: str) -> tuple[int, ...]:
    """Layers per virtual stage of ``layout`` for ``model``, after the rules that need the model."""
    from piper_core.specs.layout import decoder_counts, parse_layout

    stages = parse_layout(layout)
    counts = decoder_counts(stages)
    if sum(counts) != model.num_layers:
        raise SpecError("pipeline_layout", layout, f"places {sum(counts)} transformer layers (t), but {model.name} has "
                        f"{model.num_layers}", f"write {model.num_layers} t's over the stages")
    return counts


def check_layout_model(model: ModelSpec, layout: str, key: str = "pipeline_layout") -> None:
    """Megatron's layout rules that need the model but no pipeline size: as many ``t`` as its layers and
    ``m`` as its MTP layers (SpecError naming ``key``)."""
    try:
        _layout_counts(model, layout)
        from piper_core.specs.layout import mtp_ranks, parse_layout

        stages = parse_layout(layout)
        mtp_ranks(stages, len(stages), model.mtp_num_layers, text=layout)  # the count (one rank a stage)
    except SpecError as exc:
        if exc.key != "pipeline_layout" or key == "pipeline_layout":
            raise
        raise SpecError(key, exc.value, exc.rule, exc.fix) from None


def mtp_layers(model: ModelSpec, plan: ParallelPlan) -> tuple[int, ...]:
    """Per pipeline rank: the MTP layers it runs, all in its last virtual stage -- the last rank's
    without a layout (Megatron ``get_mtp_num_layers_to_build``), where the layout puts them with one."""
    return _mtp_layers(model, plan.pp, plan.pipeline_layout)


@functools.cache
def _mtp_layers(model: ModelSpec, pp: int, layout: str | None) -> tuple[int, ...]:
    if layout is not None:
        from piper_core.specs.layout import mtp_ranks, parse_layout

        return mtp_ranks(parse_layout(layout), pp, model.mtp_num_layers, text=layout)
    return (0,) * (pp - 1) + (model.mtp_num_layers,)


def stage_kinds(model: ModelSpec, plan: ParallelPlan) -> tuple[tuple[tuple[bool, ...], ...], ...]:
    """Like :func:`stage_layers`, but each layer replaced by whether it is a MoE layer."""
    return _stage_kinds(model, plan.pp, plan.vpp, plan.num_layers_in_first_pipeline_stage,
                        plan.num_layers_in_last_pipeline_stage, plan.pipeline_layout)


@functools.cache
def _stage_kinds(model: ModelSpec, pp: int, vpp: int | None, first: int | None,
                 last: int | None, layout: str | None = None) -> tuple[tuple[tuple[bool, ...], ...], ...]:
    pattern = model.moe_layer_pattern
    return tuple(tuple(tuple(pattern[i] for i in chunk) for chunk in rank)
                 for rank in _stage_layers(model, pp, vpp, first, last, layout))


def stage_blocks(model: ModelSpec, plan: ParallelPlan) -> tuple[tuple[tuple[bool, ...], ...], ...]:
    """Like :func:`stage_kinds`, with each MTP layer's transformer layer (a MoE layer when the last
    decoder layer is one, :attr:`ModelSpec.mtp_is_moe`) appended to the last chunk of the rank that
    runs it: the transformer layers whose parameters and activations a rank holds."""
    return _stage_blocks(model, plan.pp, plan.vpp, plan.num_layers_in_first_pipeline_stage,
                         plan.num_layers_in_last_pipeline_stage, plan.pipeline_layout)


@functools.cache
def _stage_blocks(model: ModelSpec, pp: int, vpp: int | None, first: int | None,
                  last: int | None, layout: str | None = None) -> tuple[tuple[tuple[bool, ...], ...], ...]:
    kinds = _stage_kinds(model, pp, vpp, first, last, layout)
    mtp = _mtp_layers(model, pp, layout)
    return tuple(chunks[:-1] + (chunks[-1] + (model.mtp_is_moe,) * k,) if k else chunks
                 for chunks, k in zip(kinds, mtp))
