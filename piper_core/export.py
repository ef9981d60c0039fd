"""Turn a predicted plan into launch settings: Megatron-LM arguments (a bash array) and a DeepSpeed
JSON config with a ``piper`` block. Pure Python over the specs; no torch, no framework import.

Megatron flag names and the rules they obey were read from Megatron-LM
``megatron/training/arguments.py`` at tag core_v0.16.1 (the megatron-core installed here; flags
generated from ``TransformerConfig`` fields included) and checked against the parser and
``validate_args`` it builds; the same names exist on Megatron-LM main (d98e8a6, 2026-08).
DeepSpeed keys follow ``deepspeed/runtime/config.py`` (batch triple, ``bf16``/``fp16``,
``zero_optimization``).
"""

from __future__ import annotations

import shlex
from typing import Any

from piper_core.errors import SpecError
from piper_core.resource.memory import GIB
from piper_core.resource.predict import Prediction
from piper_core.specs.cluster import AcceleratorSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

Flag = tuple[str, str | int | float | None]  # (flag, value); value None: a switch


def overlap_suffix(plan: ParallelPlan) -> str:
    """``+shx`` / ``+epov`` / ``+dwg`` for the overlaps a plan's exchange runs with (labels)."""
    return "".join(s for on, s in ((plan.shared_expert_overlap, "+shx"), (plan.ep_comm_overlap, "+epov"),
                                   (plan.defer_wgrad, "+dwg")) if on)


def fp8_label(plan: ParallelPlan) -> str:
    """`` fp8:hybrid/delayed`` (``+param`` with FP8 parameters) for an FP8 plan, else ``""``."""
    if plan.fp8 is None:
        return ""
    return f" fp8:{plan.fp8}/{plan.fp8_recipe}" + ("+param" if plan.fp8_param else "")


def plan_label(plan: ParallelPlan, *, gbs: bool = False) -> str:
    """Compact plan label used by every report, e.g.
    ``tp2 pp4 vpp2 cp1 ep8 etp1 mbs1 sel dopt hierarchical/4`` (``gbs``: with the global batch;
    ``/N``: the exchange pipelined in N chunks; ``+shx``: shared expert overlapped; ``+epov``:
    Megatron's EP overlap; ``+dwg``: expert weight gradients deferred)."""
    a2a = plan.a2a + (f"/{plan.a2a_chunks}" if plan.a2a_chunks > 1 else "") + overlap_suffix(plan)
    rc = {"none": "norc", "selective": "sel", "full": f"full{plan.recompute_num_layers}"}[plan.recompute]
    split = "".join(f" {k}{v}" for k, v in (("first", plan.num_layers_in_first_pipeline_stage),
                                            ("last", plan.num_layers_in_last_pipeline_stage)) if v)
    split += " layout" if plan.pipeline_layout is not None else ""
    batch = f" gbs{plan.global_batch_size}" if gbs else ""
    savers = (" gbf16" if plan.grad_reduce_in_bf16 else "") + (
        f" off{plan.optimizer_offload_fraction:g}" if plan.optimizer_offload_fraction else "") + fp8_label(plan)
    return (f"tp{plan.tp} pp{plan.pp}{split} vpp{plan.virtual_stages} cp{plan.cp} ep{plan.ep} etp{plan.etp_size} "
            f"mbs{plan.micro_batch_size}{batch} {rc} {'dopt' if plan.distributed_optimizer else 'nodopt'}{savers} {a2a}")


# ---- Megatron-LM --------------------------------------------------------------------------------

def moe_layer_freq(model: ModelSpec) -> int | str:
    """Megatron ``--moe-layer-freq``: an int N (layer i is MoE when i % N == 0) or, with leading
    dense layers, a run-length list expression such as ``([0]*3+[1]*58)`` (``moe_freq_type``)."""
    if model.moe_first_k_dense == 0:
        return model.moe_layer_freq
    runs: list[list[int]] = []
    for moe in model.moe_layer_pattern:
        if runs and runs[-1][0] == int(moe):
            runs[-1][1] += 1
        else:
            runs.append([int(moe), 1])
    return "(" + "+".join(f"[{v}]*{n}" for v, n in runs) + ")"


def model_flags(model: ModelSpec) -> list[Flag]:
    """Shape flags of ``pretrain_gpt.py`` for every ModelSpec field Megatron has a flag for."""
    flags: list[Flag] = [
        ("--num-layers", model.num_layers), ("--hidden-size", model.hidden_size),
        ("--num-attention-heads", model.num_attention_heads), ("--ffn-hidden-size", model.ffn_hidden_size),
        ("--seq-length", model.seq_length), ("--max-position-embeddings", model.seq_length),
        ("--make-vocab-size-divisible-by", model.make_vocab_size_divisible_by),
        ("--position-embedding-type", model.position_embedding), ("--normalization", model.normalization),
        # Megatron's dropout default is 0.1; always state ours.
        ("--attention-dropout", model.attention_dropout), ("--hidden-dropout", model.hidden_dropout),
    ]
    switches = (("--swiglu", model.gated_linear_unit),
                ("--untie-embeddings-and-output-weights", not model.tie_embeddings),
                ("--disable-bias-linear", not model.add_bias_linear), ("--add-qkv-bias", model.add_qkv_bias),
                ("--qk-layernorm", model.qk_layernorm))
    flags += [(name, None) for name, on in switches if on]
    if model.mla is not None:  # validate_args: GQA and MLA are mutually exclusive
        mla = model.mla
        flags.append(("--multi-latent-attention", None))
        if mla.q_lora_rank is not None:
            flags.append(("--q-lora-rank", mla.q_lora_rank))
        flags += [("--kv-lora-rank", mla.kv_lora_rank), ("--qk-head-dim", mla.qk_head_dim),
                  ("--qk-pos-emb-head-dim", mla.qk_pos_emb_head_dim), ("--v-head-dim", mla.v_head_dim)]
    else:
        if model.kv_channels is not None:
            flags.append(("--kv-channels", model.kv_channels))
        if model.query_groups != model.num_attention_heads:
            flags += [("--group-query-attention", None), ("--num-query-groups", model.query_groups)]
    if model.mtp_num_layers:
        flags.append(("--mtp-num-layers", model.mtp_num_layers))
    return flags + _moe_flags(model)


DISPATCHER = "--moe-token-dispatcher-type"


def _moe_flags(model: ModelSpec) -> list[Flag]:
    if not model.is_moe:
        return []
    flags: list[Flag] = [("--num-experts", model.num_experts), ("--moe-ffn-hidden-size", model.moe_ffn_hidden_size),
                         ("--moe-router-topk", model.moe_router_topk), ("--moe-layer-freq", moe_layer_freq(model)),
                         (DISPATCHER, "alltoall")]
    if model.moe_shared_expert_intermediate_size:
        flags.append(("--moe-shared-expert-intermediate-size", model.moe_shared_expert_intermediate_size))
    if model.moe_router_topk == 1:  # TransformerConfig: "Please use --moe-router-pre-softmax when topk is 1"
        flags.append(("--moe-router-pre-softmax", None))  # (Switch: softmax over all experts, then top-1)
    if model.moe_capacity_factor is not None:
        flags.append(("--moe-expert-capacity-factor", model.moe_capacity_factor))
    if model.moe_router_num_groups is not None:
        flags += [("--moe-router-num-groups", model.moe_router_num_groups),
                  ("--moe-router-group-topk", model.moe_router_group_topk)]
    return flags


def parallel_flags(model: ModelSpec, plan: ParallelPlan, accelerator: AcceleratorSpec | None = None) -> list[Flag]:
    """Parallel sizes, batch, precision, recompute and optimizer flags for ``plan``; ``--moe-grouped-gemm``
    where the plan asks for grouped GEMMs (its ``moe_grouped_gemm``, or with ``accelerator`` that
    accelerator's default when the plan leaves it unset)."""
    flags: list[Flag] = [("--tensor-model-parallel-size", plan.tp), ("--pipeline-model-parallel-size", plan.pp),
                         ("--context-parallel-size", plan.cp), ("--expert-model-parallel-size", plan.ep),
                         ("--expert-tensor-parallel-size", plan.etp_size)]
    first, last = plan.num_layers_in_first_pipeline_stage, plan.num_layers_in_last_pipeline_stage
    if first is not None:
        flags.append(("--decoder-first-pipeline-num-layers", first))
    if last is not None:
        flags.append(("--decoder-last-pipeline-num-layers", last))
    if plan.pipeline_layout is not None:  # validate_args derives vpp from it (and refuses the vpp flags beside it)
        flags.append(("--pipeline-model-parallel-layout", plan.pipeline_layout))
        if plan.vpp and not plan.overlap_p2p_comm:
            flags.append(("--no-overlap-p2p-communication", None))
    elif plan.vpp and plan.vpp > 1:
        # validate_args: an uneven split takes the virtual stage count, an even one layers per virtual stage.
        if first is None and last is None:
            flags.append(("--num-layers-per-virtual-pipeline-stage", model.num_layers // (plan.pp * plan.vpp)))
        else:
            flags.append(("--num-virtual-stages-per-pipeline-rank", plan.vpp))
        if not plan.overlap_p2p_comm:  # on by default with interleaving (validate_args)
            flags.append(("--no-overlap-p2p-communication", None))
    if plan.sequence_parallel:
        flags.append(("--sequence-parallel", None))
    flags += [("--micro-batch-size", plan.micro_batch_size), ("--global-batch-size", plan.global_batch_size)]
    if plan.precision != "fp32":  # fp32 training is Megatron's default: neither --bf16 nor --fp16
        flags.append((f"--{plan.precision}", None))
    if plan.fp8 is not None:  # TransformerConfig.fp8 / fp8_recipe / fp8_param (--fp8-param-gather)
        flags += [("--fp8-format", plan.fp8), ("--fp8-recipe", plan.fp8_recipe)]
        if plan.fp8_param:
            flags.append(("--fp8-param-gather", None))
    flags.append(("--attention-backend", plan.attention_backend))
    if plan.recompute == "selective":  # validate_args: no --recompute-method with selective
        flags.append(("--recompute-granularity", "selective"))
    elif plan.recompute == "full":
        flags += [("--recompute-granularity", "full"), ("--recompute-method", plan.recompute_method),
                  ("--recompute-num-layers", plan.recompute_num_layers)]
    # The step-time model assumes overlapped gradient reduction (and parameter gathering with the
    # distributed optimizer); validate_args allows --overlap-param-gather only with it.
    if plan.distributed_optimizer:
        flags += [("--use-distributed-optimizer", None), ("--overlap-grad-reduce", None),
                  ("--overlap-param-gather", None)]
    else:
        flags.append(("--overlap-grad-reduce", None))
    if plan.grad_reduce_in_bf16:
        flags.append(("--grad-reduce-in-bf16", None))
    grouped = plan.moe_grouped_gemm if accelerator is None else plan.grouped_gemm_on(accelerator)
    if model.is_moe and grouped:
        flags.append(("--moe-grouped-gemm", None))
    if plan.shared_expert_overlap:
        flags.append(("--moe-shared-expert-overlap", None))
    if plan.a2a == "dedup":  # each token to a node once: DeepEP through Megatron-Core's flex dispatcher
        flags += [(DISPATCHER, "flex"), ("--moe-flex-dispatcher-backend", "deepep")]
    if plan.ep_comm_overlap:  # Megatron-Core's own EP overlap; delayed wgrad fills the backward's exchanges
        flags += [("--overlap-moe-expert-parallel-comm", None), ("--delay-wgrad-compute", None)]
    if plan.optimizer_offload_fraction > 0:  # validate_args: CPU offload runs the precision-aware optimizer
        flags += [("--optimizer-cpu-offload", None), ("--optimizer-offload-fraction", plan.optimizer_offload_fraction),
                  ("--use-precision-aware-optimizer", None)]
    return flags


def piper_flags(plan: ParallelPlan) -> list[Flag]:
    """Flags that only ``python -m piper_megatron`` understands (stock pretrain_gpt.py rejects them)."""
    return [("--piper-a2a", plan.a2a), ("--piper-chunks", plan.a2a_chunks)] + (
        [("--piper-defer-wgrad", None)] if plan.defer_wgrad else [])


def environment(plan: ParallelPlan) -> list[tuple[str, str, tuple[str, ...]]]:
    """(variable, value, comment lines saying why) that Megatron needs for ``plan``."""
    env = []
    if plan.tp > 1 or plan.cp > 1:
        env.append(("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                    (f"tp={plan.tp}, cp={plan.cp}: validate_args asserts this before Blackwell GPUs; one hardware",
                     "queue keeps the TP/SP/CP collectives ordered ahead of the GEMMs they overlap")))
    return env


def _bash_array(name: str, flags: list[Flag]) -> list[str]:
    lines = [f"{name}=("]
    for flag, value in flags:
        lines.append(f"  {flag}" if value is None else f"  {flag} {shlex.quote(str(value))}")
    return lines + [")"]


def megatron_args(p: Prediction) -> str:
    """A bash-sourceable file defining ``PIPER_MEGATRON_ARGS`` (pretrain_gpt.py flags for the model
    and plan), ``PIPER_ARGS`` (Piper's all-to-all flags) and the environment the plan needs."""
    plan, model = p.plan, p.model
    lines = [f"# Megatron-LM arguments for {model.name} on {plan.gpus} GPUs of {p.cluster.name} "
             f"({p.cluster.accelerator.name}), generated by piper plan.",
             f"# plan: {plan_label(plan, gbs=True)}",
             f"# predicted: MFU {100 * p.rate.mfu:.1f}%, step {p.time.step:.3f} s, "
             f"{p.rate.tokens_per_s:,.0f} tokens/s, peak memory {p.peak_stage.total / GIB:.1f} of "
             f"{p.capacity_bytes / GIB:.1f} GiB (pipeline stage {p.peak_stage.stage})",
             "# Flag names: Megatron-LM megatron/training/arguments.py (core_v0.16.1).",
             "# Use: source this file, then add data, tokenizer, optimizer and schedule flags:",
             '#   torchrun ... pretrain_gpt.py "${PIPER_MEGATRON_ARGS[@]}" --data-path ... --tokenizer-type ...',
             f"# The vocabulary ({model.vocab_size}) comes from your tokenizer.", ""]
    for var, value, why in environment(plan):
        lines += [f"# {line}" for line in why] + [f"export {var}={value}"]
    sizes = parallel_flags(model, plan, p.cluster.accelerator)
    chosen = {flag for flag, _ in sizes}
    flags = [f for f in model_flags(model) if f[0] not in chosen] + sizes  # the plan's dispatcher wins
    lines += ["", *_bash_array("PIPER_MEGATRON_ARGS", flags), ""]
    if plan.a2a == "dedup":
        return "\n".join(lines + ["# This plan's exchange sends each token to a node once (DeepEP, Megatron's flex",
                                   "# dispatcher, installed separately): run it stock; Piper's all-to-all sends a copy",
                                   "# per expert, so there are no Piper flags for it.", "PIPER_ARGS=()"]) + "\n"
    # Piper's token dispatcher runs every plan the search makes, expert tensor parallelism (etp = tp) included
    lines += ["# Piper's all-to-all for the MoE layers: these flags need the Piper launcher, which runs the",
              "# script with the sizes above pinned, e.g. torchrun ... -m piper_megatron pretrain_gpt.py",
              f'#   "${{PIPER_MEGATRON_ARGS[@]}}" --piper --piper-cluster {p.cluster.name} "${{PIPER_ARGS[@]}}" ...']
    lines += _bash_array("PIPER_ARGS", piper_flags(plan))
    return "\n".join(lines) + "\n"


# ---- DeepSpeed --------------------------------------------------------------------------------

def deepspeed_compatible(plan: ParallelPlan) -> str | None:
    """Why DeepSpeed(-MoE) cannot run ``plan``, or None when it can.

    DeepSpeed-MoE carves expert-parallel groups out of data parallelism: it has no expert tensor
    parallelism of its own and no context parallelism (its Ulysses sequence parallelism is another
    scheme); tensor parallelism needs an external model-parallel unit (Megatron-DeepSpeed), which
    this export does not assume. Its pipeline engine has no interleaved (virtual-stage) schedule,
    and PipelineModule's ``partition_method`` gives remainder layers to the first stages, not the
    smaller last stage Megatron's uneven split uses. ZeRO-Offload moves all of the optimizer or,
    with ``ratio``, part of it under ZeRO-3 only (``DeepSpeedZeroOffloadOptimizerConfig``).
    """
    if plan.fp8 is not None:
        return f"fp8={plan.fp8}: DeepSpeed-MoE's layers run no FP8 GEMMs (Transformer Engine's are Megatron's)"
    if plan.pipeline_layout is not None:
        return "pipeline layout: DeepSpeed's PipelineModule has no per-stage layout of Megatron's kind"
    if plan.tp > 1:
        return f"tp={plan.tp}: the DeepSpeed export has no tensor parallelism (it would need Megatron-DeepSpeed's mpu)"
    if plan.etp_size > 1:
        return f"etp={plan.etp_size}: DeepSpeed-MoE has no expert tensor parallelism"
    if plan.cp > 1:
        return f"cp={plan.cp}: DeepSpeed has no context parallelism"
    if plan.virtual_stages > 1:
        return f"vpp={plan.vpp}: DeepSpeed's pipeline engine has no interleaved schedule"
    if plan.num_layers_in_first_pipeline_stage or plan.num_layers_in_last_pipeline_stage:
        return "uneven pipeline split: DeepSpeed's PipelineModule cannot give the last stage fewer layers"
    if 0 < plan.optimizer_offload_fraction < 1:
        return (f"optimizer_offload_fraction={plan.optimizer_offload_fraction:g}: DeepSpeed offloads part of the "
                "optimizer only under ZeRO-3, which DeepSpeed-MoE refuses")
    if plan.recompute != "none":
        return (f"recompute={plan.recompute}: a DeepSpeed config cannot make the model recompute (activation "
                "checkpointing is in the model's code)")
    return None


def deepspeed_config(p: Prediction) -> dict[str, Any]:
    """DeepSpeed JSON config for ``p.plan`` plus the ``piper`` block the DeepSpeed adapter reads.

    Raises SpecError when the plan cannot be expressed in DeepSpeed (:func:`deepspeed_compatible`).
    ZeRO stage 1 stands for Megatron's distributed optimizer; DeepSpeed refuses ZeRO-3 with its
    native MoE (``_validate_zero3_moe_compatibility``), so stage 3 is never written.
    """
    plan = p.plan
    reason = deepspeed_compatible(plan)
    if reason is not None:
        raise SpecError("plan", plan_label(plan, gbs=True), f"cannot be expressed in DeepSpeed ({reason})",
                        "`piper plan ... --export-deepspeed FILE` writes the best DeepSpeed-compatible plan; "
                        "export this one for Megatron-LM with --export-megatron")
    zero: dict[str, Any] = {"stage": 1 if plan.distributed_optimizer else 0}
    if plan.optimizer_offload_fraction == 1:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        # fp32 training: no bf16/fp16 block (DeepSpeed's default)
        **({} if plan.precision == "fp32" else {plan.precision: {"enabled": True}}),
        "zero_optimization": zero,
    }
    if plan.grad_reduce_in_bf16:  # Megatron --grad-reduce-in-bf16: keep and reduce gradients in bf16
        config |= {"communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "bf16"}}
    return config | {
        "piper": {
            "enabled": True, "cluster": p.cluster.name, "profile": None, "a2a": plan.a2a, "chunks": plan.a2a_chunks,
            "defer_wgrad": plan.defer_wgrad, "memory_headroom": 0.0, "plan_only": False, "trace": None,
            "plan": {"tp": plan.tp, "pp": plan.pp, "ep": plan.ep, "etp": plan.etp_size, "cp": plan.cp,
                     "vpp": plan.virtual_stages, "mbs": plan.micro_batch_size, "recompute": plan.recompute},
            "predicted": {"mfu": p.rate.mfu, "step_s": p.time.step,
                          "peak_memory_gib": round(p.peak_stage.total / GIB, 4)},
        },
    }
