"""``piper predict MODEL --cluster C --gpus N --parallel "..." [--seq-length N] [--capacity-factor F] [--json]
[--routing FILE [--placement FILE]]`` (routing: piper_core/cli/routing.py)."""

from __future__ import annotations

import argparse
import json

from piper_core.cli.routing import add_routing_args
from piper_core.cli.routing import run_predict as run_routed
from piper_core.cli.parse import add_model_args, add_target_args, parse_parallel, target_cluster, target_model
from piper_core.export import overlap_suffix
from piper_core.resource.memory import GIB
from piper_core.resource.predict import Prediction, predict, to_json

HELP_PARALLEL = ("comma-separated key=value: tp, pp, vpp, ep, etp, cp, sp (0/1), mbs, gbs, "
                 "recompute (none|selective|full), recompute_method (uniform|block), recompute_layers, "
                 "dist_opt (0/1), grad_bf16 (0/1), offload (optimizer offload fraction 0..1), precision (bf16|fp16|fp32), "
                 "attention (flash|unfused), a2a "
                 "(flat|hierarchical|dedup: once per node, Megatron's flex dispatcher), chunks (N > 1 pipelines the exchange), shx (shared expert overlap), "
                 "epov (Megatron's EP overlap), dwg (deferred expert weight gradients), p2pov (0/1: Megatron's p2p "
                 "overlap with vpp, default 1), grouped_gemm (0/1: --moe-grouped-gemm; default: the accelerator's), "
                 "first_stage_layers, last_stage_layers, layout (Megatron's --pipeline-model-parallel-layout, "
                 "e.g. layout=Ett|(tt|)*29,tL; vpp must match its stage count)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="parameters, FLOPs and memory per GPU of one plan",
                       description="Predict parameters, FLOPs and per-stage memory of one parallel plan.")
    add_target_args(p)
    add_model_args(p)
    p.add_argument("--parallel", default="", help=HELP_PARALLEL)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_routing_args(p, placement=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model, cluster = target_model(args), target_cluster(args)
    plan = parse_parallel(args.parallel, args.gpus)
    if getattr(args, "routing", None) or getattr(args, "placement", None):
        return run_routed(args, model, cluster, plan, overrides=overrides(args, model))
    result = predict(model, cluster, plan)
    print(json.dumps(to_json(result), indent=2) if args.json else render(result, overrides=overrides(args, model)))
    return 0


def overrides(args: argparse.Namespace, model) -> str:
    """``seq_length 4096, moe_capacity_factor 1.5`` for the model settings the command line set."""
    given = (("seq_length", args.seq_length), ("moe_capacity_factor", args.capacity_factor),
             ("moe_expert_load_skew", getattr(args, "expert_load_skew", None)))
    shown = {"seq_length": model.seq_length, "moe_capacity_factor": model.moe_capacity_factor or "none (dropless)",
             "moe_expert_load_skew": f"{model.moe_expert_load_skew:g}"}
    return ", ".join(f"{key} {shown[key]}" for key, raw in given if raw is not None)


def _si(n: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def _settings(plan) -> str:
    """The kernel and schedule settings a plan gives explicitly (defaults are not shown)."""
    out = " p2pov=0" if plan.vpp and not plan.overlap_p2p_comm else ""
    if plan.fp8 is not None:
        out += f" fp8={plan.fp8}/{plan.fp8_recipe}" + (" fp8_param=1" if plan.fp8_param else "")
    if plan.pipeline_layout is not None:
        out += f" layout={plan.pipeline_layout}"
    return out + (f" grouped_gemm={int(plan.moe_grouped_gemm)}" if plan.moe_grouped_gemm is not None else "")


def _placement_lines(p: Prediction) -> list[str]:
    """Where expert parallelism lands: the link levels a rank's ep peers sit behind, and what the
    exchange costs (one way per MoE layer; exposed over the step)."""
    place = p.expert_placement()
    if place is None:
        return []
    links = ", ".join(f"{x['peers']} over {x['link']} ({x['bandwidth_gb_per_s']:g} GB/s)" for x in place["links"])
    fast = p.cluster.links[0]
    domains = (f"inside one {fast.name} domain" if place["fast_domains"] == 1 else
               f"across {place['fast_domains']} {fast.name} domains of {fast.domain_gpus} GPUs")
    t = p.time
    return [f"expert parallelism: ep={place['ep']} (ranks {place['stride']} apart), {domains}; peers per rank: {links}",
            f"  dispatch {1e3 * t.a2a_one_way:.3g} ms one way per MoE layer and micro-batch; exposed all-to-all "
            f"{t.exposed_a2a:.3g} s, {100 * t.exposed_a2a / t.step:.1f}% of the step"]


def render(p: Prediction, *, overrides: str = "") -> str:
    """Human-readable report: plan, parameters, FLOPs, memory per stage, verdict (``overrides``: the
    model settings the command line changed, shown beside the model's name)."""
    plan, c = p.plan, p.cluster
    name = f"{p.model.name} ({overrides})" if overrides else p.model.name
    lines = [
        f"piper predict: {name} on {c.name} ({plan.gpus} x {c.accelerator.name})",
        f"plan: tp={plan.tp} pp={plan.pp} vpp={plan.vpp or 1} cp={plan.cp} dp={plan.dp} | ep={plan.ep} "
        f"etp={plan.etp_size} edp={plan.edp} | mbs={plan.micro_batch_size} gbs={plan.global_batch_size} "
        f"({plan.num_microbatches} micro-batches) | sp={int(plan.sequence_parallel)} recompute={plan.recompute} "
        f"dist_opt={int(plan.distributed_optimizer)} {plan.precision} attention={plan.attention_backend} "
        f"a2a={plan.a2a}/{plan.a2a_chunks}{overlap_suffix(plan)}{_settings(plan)}",
        f"parameters: total {_si(p.params_total)}, active per token {_si(p.params_active)} with the input "
        f"embedding, {_si(p.params_active_without_input_embedding)} without",
        f"FLOPs/step: model {p.flops.model:.3e} (Megatron definition), hardware {p.flops.hardware:.3e} "
        f"({p.flops.tokens:,} tokens)",
        "",
        "memory per GPU (GiB)",
    ]
    cols = ("stage", "layers", "params", "weights", "grads", "optim", "activ", "buffers", "overhead", "total")
    lines.append("  ".join(f"{h:>8}" for h in cols))
    for s in p.stages:
        cells = [str(s.stage), str(s.layers), _si(s.params.total)] + [
            f"{v / GIB:.2f}" for v in (s.weights, s.gradients, s.optimizer, s.activations, s.buffers, s.overhead, s.total)]
        lines.append("  ".join(f"{x:>8}" for x in cells))
    lines += [f"stage {s.stage}: total counts the optimizer step's fp32 gradient copy ({s.step_gradients / GIB:.2f} "
              f"GiB) instead of activ + buffers (freed by then)"
              for s in p.stages if s.step_gradients > s.activations + s.buffers]
    lines += [f"stage {s.stage}: total counts Megatron's global memory buffer ({s.workspace / GIB:.4f} GiB, the local "
              f"spec's unfused attention input), kept through the step" for s in p.stages if s.workspace]
    t, r = p.time, p.rate
    if plan.pp > 1:  # each pipeline rank's own time per micro-batch (the schedule adds the bubble)
        lines += ["", "time per pipeline stage (ms per micro-batch, forward and backward; the schedule adds the bubble)",
                  "  ".join(f"{h:>8}" for h in ("stage", "compute", "a2a", "comm", "p2p", "total"))]
        lines += ["  ".join(f"{x:>8}" for x in (str(st.stage), *(f"{1e3 * v:.3g}" for v in (st.compute, st.a2a, st.comm,
                                                                                           st.p2p, st.total))))
                  for st in t.stages]
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3g} s" for k, v in t.breakdown().items())
    lines += ["", f"step time {t.step:.3g} s ({parts})",
              f"MFU {100 * r.mfu:.1f}% of dense {plan.precision} peak | {r.tflops_per_gpu:.1f} TFLOPS/GPU | "
              f"{r.tokens_per_s:,.0f} tokens/s",
              f"bottleneck: {r.bottleneck}"]
    lines += _placement_lines(p)
    peak = p.peak_stage
    verdict = (f"fits with {p.headroom_bytes / GIB:.2f} GiB to spare" if p.feasible
               else f"DOES NOT FIT: {-p.headroom_bytes / GIB:.2f} GiB over")
    lines += ["", f"peak {peak.total / GIB:.2f} GiB on stage {peak.stage} of {p.capacity_bytes / GIB:.2f} GiB usable "
              f"({c.accelerator.hbm_gib} GiB HBM x {c.usable_memory_fraction}): {verdict}"]
    return "\n".join(lines)
