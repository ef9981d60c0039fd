"""``piper plan MODEL --cluster C --gpus N``: search every plan, print the best and why."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from piper_core.cli.parse import add_target_args, target_cluster
from piper_core.cli.progress import Progress
from piper_core.errors import SpecError
from piper_core.export import plan_label as describe
from piper_core.presets import load_model
from piper_core.resource.memory import GIB
from piper_core.resource.params import total_params
from piper_core.resource.predict import Prediction, predict, to_json
from piper_core.scheduler.search import SearchResult, best_predictions, search
from piper_core.specs.model import ModelSpec

DEFAULT_TOKENS_PER_STEP = 4 * 1024 * 1024


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search all parallel plans and pick the best that fits",
                       description="Enumerate every valid plan, reject the infeasible with a reason, and rank the "
                                   "rest by predicted throughput (MFU).")
    add_target_args(p)
    p.add_argument("--gbs", type=int, help="global batch size in sequences (default: the smallest multiple of "
                                           "--gpus reaching 4 Mi tokens per step)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    p.add_argument("--memory-headroom", type=float, default=0.0,
                   help="fraction of usable memory to keep free, e.g. 0.1 (default 0)")
    p.add_argument("--attention", choices=("flash", "unfused"), default="flash", help="attention kernel (default flash)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--export-megatron", metavar="FILE", help="write Megatron-LM arguments for the best plan")
    p.add_argument("--export-deepspeed", metavar="FILE", help="write a DeepSpeed JSON config for the best plan")
    p.add_argument("--plot", metavar="DIR", help="write timeline, memory and Pareto PNGs for the best plan")
    p.add_argument("--detail", action="store_true", help="also print the full prediction of the best plan")
    p.set_defaults(func=run)


def default_gbs(model: ModelSpec, gpus: int) -> int:
    per_step = -(-DEFAULT_TOKENS_PER_STEP // model.seq_length)
    return -(-per_step // gpus) * gpus


def run(args: argparse.Namespace) -> int:
    model, cluster = load_model(args.model), target_cluster(args)
    if args.seq is not None:
        model = dataclasses.replace(model, seq_length=args.seq)
    if args.gpus <= 0:
        raise SpecError("--gpus", args.gpus, "must be a positive number", "give the world size, e.g. --gpus 64")
    if not 0.0 <= args.memory_headroom < 1.0:
        raise SpecError("--memory-headroom", args.memory_headroom, "must be in [0, 1)", "use e.g. 0.1 to keep 10 % free")
    gbs = args.gbs or default_gbs(model, args.gpus)
    result = search(model, cluster, args.gpus, gbs, memory_headroom=args.memory_headroom,
                    attention_backend=args.attention, progress=Progress("searching"))
    best = best_predictions(model, cluster, result, args.top)
    if best:
        _exports(args, model, cluster, best[0], result)
    if args.json:
        print(json.dumps(plan_json(result, best, gbs), indent=2))
    else:
        print(render(model.name, cluster.name, args.gpus, gbs, result, best))
        if best and args.detail:
            from piper_core.cli.predict import render as render_prediction
            print("\n" + render_prediction(best[0]))
        if not best:
            n, what = min_gpus(model, cluster)
            print(f"{model.name} needs at least {n:,} GPUs of {cluster.name} for {what} alone")
    return 0 if best else 1


def _exports(args, model, cluster, best: Prediction, result: SearchResult) -> None:
    from piper_core.export import deepspeed_compatible

    if args.export_megatron:
        from piper_core.export import megatron_args
        Path(args.export_megatron).write_text(megatron_args(best))
    if args.export_deepspeed:
        from piper_core.export import deepspeed_config
        ds = best_for_deepspeed(model, cluster, result)
        if ds is None:
            raise SpecError("--export-deepspeed", args.export_deepspeed, "no feasible plan can run on DeepSpeed-MoE "
                            "(no tp, etp, cp, vpp or uneven split there)", "add GPUs or export for Megatron only")
        Path(args.export_deepspeed).write_text(json.dumps(deepspeed_config(ds), indent=2) + "\n")
        if ds.plan != best.plan:
            print(f"DeepSpeed export: the best plan needs Megatron ({deepspeed_compatible(best.plan)}); wrote the "
                  f"best DeepSpeed-compatible plan instead: {describe(ds.plan)}, predicted MFU {100 * ds.rate.mfu:.1f}%")
    if args.plot:
        from piper_core.plots import write_plots
        write_plots(Path(args.plot), best, result)


HOST_BYTES_PER_PARAM = 16


def min_gpus(model: ModelSpec, cluster) -> tuple[int, str]:
    """Lower bound on GPUs for the model state alone, before activations: bf16 weights and
    gradients (4 bytes per parameter) when the optimizer can be offloaded to the host, else
    weights, fp32 gradients and Adam state (18 bytes), fully sharded over all GPUs."""
    per_param, what = (4, "bf16 weights and gradients with the optimizer on the host") \
        if cluster.host_memory_gib_per_node > 0 else (18, "weights, gradients and Adam state")
    usable = (cluster.capacity_gib - cluster.memory_overhead_gib) * GIB
    need = -(-total_params(model) * per_param // int(usable))
    what = f"{what} ({per_param} bytes per parameter)"
    if cluster.host_memory_gib_per_node > 0:
        # the offloaded optimizer (fp32 master, Adam m and v, a pinned fp32 gradient: 16 bytes per
        # parameter, memory.py) must fit the hosts of the nodes the job spans
        nodes = -(-total_params(model) * HOST_BYTES_PER_PARAM // int(cluster.host_capacity_gib * GIB))
        if nodes * cluster.gpus_per_node > need:
            need = nodes * cluster.gpus_per_node
            what = (f"the offloaded optimizer state ({HOST_BYTES_PER_PARAM} bytes per parameter) in "
                    f"{cluster.host_capacity_gib:g} GiB of host memory per node ({nodes} nodes)")
    return need, what


def best_for_deepspeed(model: ModelSpec, cluster, result: SearchResult) -> Prediction | None:
    """The fastest feasible plan DeepSpeed-MoE can run, fully predicted (None if there is none)."""
    from piper_core.export import deepspeed_compatible
    for scored in result.best(result.feasible):
        if deepspeed_compatible(scored.plan) is None:
            return predict(model, cluster, scored.plan)
    return None


def plan_json(result: SearchResult, best: list[Prediction], gbs: int) -> dict:
    return {"candidates": result.candidates, "feasible": result.feasible, "rejected": dict(result.rejected),
            "global_batch_size": gbs,
            "search": {"elapsed_s": result.elapsed_s, "plans_per_s": result.plans_per_s},
            "plans": [to_json(p) for p in best]}


def render(model: str, cluster: str, gpus: int, gbs: int, result: SearchResult, best: list[Prediction]) -> str:
    lines = [f"piper plan: {model} on {gpus} GPUs of {cluster}, global batch {gbs}",
             f"searched {result.candidates:,} plans in {result.elapsed_s:.2f} s ({result.plans_per_s:,.0f} plans/s): "
             f"{result.feasible:,} feasible"]
    if result.rejected:
        lines.append("rejected: " + ", ".join(f"{n:,} {reason}" for reason, n in result.rejected.most_common()))
    if not best:
        lines.append("no plan fits: add GPUs, lower --gbs or --seq, or relax --memory-headroom")
        return "\n".join(lines)
    head = f"{'#':>2}  {'plan':<68} {'MFU':>6} {'step s':>8} {'peak/cap GiB':>14} {'a2a exp':>8} {'bubble':>7}"
    lines += ["", head]
    for i, p in enumerate(best, 1):
        b = p.time.breakdown()
        lines.append(f"{i:>2}  {describe(p.plan):<68} {100 * p.rate.mfu:5.1f}% {p.time.step:8.3f} "
                     f"{p.peak_stage.total / GIB:6.1f}/{p.capacity_bytes / GIB:<6.1f} "
                     f"{100 * b['exposed_a2a'] / p.time.step:7.1f}% {100 * b['bubble'] / p.time.step:6.1f}%")
    top = best[0]
    lines += ["", f"best: {describe(top.plan)}",
              f"  predicted MFU {100 * top.rate.mfu:.1f}% ({top.rate.tflops_per_gpu:.0f} TFLOPS/GPU, "
              f"{top.rate.tokens_per_s:,.0f} tokens/s), step {top.time.step:.3f} s, peak memory "
              f"{top.peak_stage.total / GIB:.1f} of {top.capacity_bytes / GIB:.1f} GiB",
              f"  bottleneck: {top.rate.bottleneck}",
              f"  why: {why(top, best)}"]
    return "\n".join(lines)


def why(top: Prediction, best: list[Prediction]) -> str:
    """One sentence comparing the winner with the runner-up."""
    if len(best) < 2:
        return "the only feasible plan"
    second = best[1]
    gain = 100 * (second.time.step / top.time.step - 1)
    diffs = [f"{k}={getattr(top.plan, k)} vs {getattr(second.plan, k)}"
             for k in ("tp", "pp", "vpp", "cp", "ep", "etp_size", "micro_batch_size", "recompute",
                       "distributed_optimizer", "grad_reduce_in_bf16", "optimizer_offload_fraction", "a2a",
                       "a2a_chunks") if getattr(top.plan, k) != getattr(second.plan, k)]
    what = ", ".join(diffs) or "same sizes"
    if gain >= 0.05:
        return f"{gain:.1f}% faster than the runner-up ({what})"
    saved = (second.peak_stage.total - top.peak_stage.total) / GIB
    if saved > 0.005:
        return f"as fast as the runner-up and {saved:.2f} GiB lighter per GPU ({what})"
    return f"as fast and as heavy as the runner-up; preferred for fewer model-parallel ranks ({what})"
