"""``piper plan MODEL --cluster C --gpus N``: search every plan, print the best and why."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TextIO

from piper_core.cli.parse import add_model_args, add_target_args, target_cluster, target_model
from piper_core.cli.progress import Progress
from piper_core.cli.routing import add_routing_args
from piper_core.errors import SpecError
from piper_core.export import overlap_suffix
from piper_core.export import plan_label as describe
from piper_core.resource.memory import GIB
from piper_core.resource.params import total_params
from piper_core.resource.predict import Prediction, predict, to_json
from piper_core.runners import RUNNERS
from piper_core.scheduler.search import (RANK_RULES, SearchResult, best_runnable, deciding_rule, search,
                                         why_not_runnable)
from piper_core.specs.model import ModelSpec
from piper_core.scheduler.space import SearchSpace, default_space

DEFAULT_TOKENS_PER_STEP = 4 * 1024 * 1024


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search all parallel plans and pick the best that fits",
                       description="Enumerate every valid plan, reject the infeasible with a reason, and rank the "
                                   "rest by predicted throughput (MFU).")
    add_target_args(p)
    p.add_argument("--gbs", type=int, help="global batch size in sequences (default: the smallest multiple of "
                                           "--gpus reaching 4 Mi tokens per step)")
    add_model_args(p)
    p.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    p.add_argument("--memory-headroom", type=float, default=0.0,
                   help="fraction of usable memory to keep free, e.g. 0.1 (default 0)")
    p.add_argument("--attention", choices=("flash", "unfused"), default="flash", help="attention kernel (default flash)")
    p.add_argument("--fp8", choices=("e4m3", "hybrid"),
                   help="every plan trains with FP8 GEMMs (Megatron --fp8-format; bf16 otherwise); MFU stays against "
                        "the dense bf16 peak")
    p.add_argument("--fp8-recipe", choices=("delayed", "tensorwise", "blockwise", "mxfp8"),
                   help="FP8 scaling (Megatron --fp8-recipe; default delayed); needs --fp8")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_routing_args(p, placement=False)
    p.add_argument("--export-megatron", metavar="FILE", help="write Megatron-LM arguments for the best plan")
    p.add_argument("--export-deepspeed", metavar="FILE", help="write a DeepSpeed JSON config for the best plan")
    p.add_argument("--plot", metavar="DIR", help="write timeline, memory and Pareto PNGs for the best plan")
    p.add_argument("--report", metavar="FILE", help="write one self-contained HTML page for a review: the ranked "
                                                   "plans, the best plan's memory, timeline and exports, the Pareto "
                                                   "front and the rejections")
    p.add_argument("--detail", action="store_true", help="also print the full prediction of the best plan")
    p.add_argument("--workers", type=int, default=None,
                   help="processes that search (forked; default: the CPUs this process may use, at most "
                        f"{MAX_WORKERS}); 1 searches in this process. The result does not depend on it")
    p.set_defaults(func=run)


MAX_WORKERS = 8


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                      os.cpu_count() or 1))


def default_gbs(model: ModelSpec, gpus: int) -> int:
    per_step = -(-DEFAULT_TOKENS_PER_STEP // model.seq_length)
    return -(-per_step // gpus) * gpus


def _fp8_space(args: argparse.Namespace, model: ModelSpec, cluster) -> SearchSpace | None:
    """The default space with every plan in FP8 (``--fp8``), or None (the default space, bf16)."""
    recipe = getattr(args, "fp8_recipe", None)
    if getattr(args, "fp8", None) is None:
        if recipe is not None:
            raise SpecError("--fp8-recipe", recipe, "applies only to FP8 training", "add --fp8 hybrid (or e4m3)")
        return None
    cluster.accelerator.peak_flops("fp8")  # a cluster without an FP8 peak says so before the search
    return dataclasses.replace(default_space(model, cluster, args.gpus), fp8=args.fp8, fp8_recipe=recipe or "delayed")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "routing", None) or getattr(args, "optimize_placement", False):
        from piper_core.cli.routing import run_plan
        return run_plan(args)
    model, cluster = target_model(args), target_cluster(args)
    if args.gpus <= 0:
        raise SpecError("--gpus", args.gpus, "must be a positive number", "give the world size, e.g. --gpus 64")
    if not 0.0 <= args.memory_headroom < 1.0:
        raise SpecError("--memory-headroom", args.memory_headroom, "must be in [0, 1)", "use e.g. 0.1 to keep 10 % free")
    if args.top < 1:
        raise SpecError("--top", args.top, "must be at least 1", "show e.g. --top 5 plans")
    if args.workers is not None and args.workers < 1:
        raise SpecError("--workers", args.workers, "must be at least 1", "use 1 to search in this process")
    if args.report:
        writable("--report", Path(args.report))  # before the search, which may take a while
    gbs = args.gbs or default_gbs(model, args.gpus)
    result = search(model, cluster, args.gpus, gbs, space=_fp8_space(args, model, cluster),
                    memory_headroom=args.memory_headroom, attention_backend=args.attention,
                    progress=Progress("searching"), workers=args.workers or default_workers())
    # --json: standard output carries the JSON object alone; notes go to standard error
    notes = sys.stderr if args.json else sys.stdout
    ranked = result.best(result.feasible)
    # the runner-up of the whole search explains the pick, whatever --top shows
    leading = [predict(model, cluster, s.plan) for s in ranked[:max(args.top, 2)]]
    best = leading[:args.top]
    runtimes = runtime_bests(model, cluster, result, ranked, leading)
    if best:
        _exports(args, model, cluster, best[0], result, runtimes, notes)
    if args.json:
        print(json.dumps(plan_json(result, best, gbs, runtimes=runtimes,
                                   needs=None if best else min_gpus(model, cluster)), indent=2))
    else:
        print(render(model.name, cluster.name, args.gpus, gbs, result, best, leading=leading, ranked=ranked,
                     runtimes=runtimes))
        if best and args.detail:
            from piper_core.cli.predict import render as render_prediction
            print("\n" + render_prediction(best[0]))
        if not best:
            print(no_fit(model, cluster))
    if args.report:
        _report(args, model, cluster, gbs, result, best, (leading, ranked), runtimes, notes)
    return 0 if best else 1


def no_fit(model: ModelSpec, cluster) -> str:
    n, what = min_gpus(model, cluster)
    return f"{model.name} needs at least {n:,} GPUs of {cluster.name} for {what} alone"


def writable(flag: str, path: Path) -> None:
    """Raise a SpecError naming ``flag`` when ``path`` cannot be written as a file."""
    if path.is_dir():
        raise SpecError(flag, str(path), "is a folder", f"give a file name, e.g. {flag} {path / 'plan.html'}")
    folder = path.parent
    if not folder.is_dir():
        raise SpecError(flag, str(path), f"the folder {folder} does not exist", "create it first or give another path")
    if not os.access(folder, os.W_OK):
        raise SpecError(flag, str(path), f"the folder {folder} is not writable", "give a path in a writable folder")


def _report(args, model, cluster, gbs: int, result: SearchResult, best: list[Prediction], order: tuple[list, list],
            runtimes: dict, notes: TextIO) -> None:
    """Write ``--report FILE`` (:mod:`piper_core.report`) and say so on ``notes``."""
    import shlex

    from piper_core.export import megatron_args
    from piper_core.report import Exports, PlanReport, render_html

    exports = None
    if best:
        ds, reason = deepspeed_choice(best[0], runtimes)
        note = reason if ds is None or not reason else \
            f"{reason}; this is the best plan DeepSpeed-MoE can run: {_deepspeed_label(ds)}"
        exports = Exports(megatron=megatron_args(best[0]), deepspeed_note=note,
                          deepspeed=None if ds is None else deepspeed_text(ds))
    page = PlanReport(command=shlex.join(["piper", *args.argv]), model=model, cluster=cluster, gpus=args.gpus,
                      gbs=gbs, result=result, best=best, verdict=verdict(*order) if best else (), exports=exports,
                      no_fit="" if best else no_fit(model, cluster))
    path = Path(args.report)
    try:
        path.write_text(render_html(page), encoding="utf-8")
    except OSError as exc:
        raise SpecError("--report", str(path), f"cannot be written ({exc.strerror})",
                        "give a path in a writable folder") from exc
    print(f"wrote {path}", file=notes)


def deepspeed_choice(best: Prediction, runtimes: dict) -> tuple[Prediction | None, str]:
    """The plan ``--export-deepspeed`` writes (the fastest DeepSpeed-MoE runs with Piper's layer;
    None when there is none) and why it is not ``best`` ('' when it is; why none when None)."""
    from piper_core.export import deepspeed_compatible

    ds = runtimes["deepspeed piper"].prediction
    if ds is None:
        return None, f"no feasible plan can run on DeepSpeed-MoE ({runtimes['deepspeed piper'].why_none})"
    if ds.plan == best.plan:
        return ds, ""
    why_not = deepspeed_compatible(best.plan) or RUNNERS["deepspeed piper"](best.plan)
    return ds, f"the best plan needs Megatron ({why_not})"


def deepspeed_text(ds: Prediction) -> str:
    """The ``--export-deepspeed`` file of ``ds``."""
    from piper_core.export import deepspeed_config

    return json.dumps(deepspeed_config(ds), indent=2) + "\n"


def _deepspeed_label(ds: Prediction) -> str:
    return f"{describe(ds.plan)}, predicted MFU {100 * ds.rate.mfu:.1f}%"


def _exports(args, model, cluster, best: Prediction, result: SearchResult, runtimes: dict, notes: TextIO) -> None:
    if args.export_megatron:
        from piper_core.export import megatron_args
        Path(args.export_megatron).write_text(megatron_args(best))
    if args.export_deepspeed:
        ds, reason = deepspeed_choice(best, runtimes)
        if ds is None:
            raise SpecError("--export-deepspeed", args.export_deepspeed, reason, "add GPUs or export for Megatron only")
        Path(args.export_deepspeed).write_text(deepspeed_text(ds))
        if reason:
            print(f"DeepSpeed export: {reason}; wrote the best plan DeepSpeed-MoE can run instead: "
                  f"{_deepspeed_label(ds)}", file=notes)
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
    """The fastest feasible plan Piper's DeepSpeed-MoE integration can run, fully predicted (None if
    there is none); see :func:`runtime_bests`."""
    best = best_runnable(model, cluster, result, RUNNERS["deepspeed piper"])
    return None if best is None else predict(model, cluster, best.plan)


# ---- the same search, per runtime ----------------------------------------------------------------

RUNTIME_NAMES = {"megatron --piper": "Megatron --piper", "megatron stock": "Megatron stock",
                 "deepspeed piper": "DeepSpeed piper", "deepspeed stock": "DeepSpeed stock"}
FRAMEWORKS = (("megatron", "Megatron-LM", "megatron --piper", "megatron stock"),
              ("deepspeed", "DeepSpeed", "deepspeed piper", "deepspeed stock"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeBest:
    """The best plan one runtime can run (``prediction`` None: none of the feasible plans)."""

    runtime: str
    prediction: Prediction | None
    why_none: str = ""
    reshaped: bool = False  # run with the shared expert after the routed experts (no overlap)


def runtime_bests(model: ModelSpec, cluster, result: SearchResult, ranked: list | None = None,
                  predicted: list[Prediction] = ()) -> dict[str, RuntimeBest]:
    """Per runtime of :data:`piper_core.runners.RUNNERS`, the best plan of this one search it can run."""
    ranked = result.best(result.feasible) if ranked is None else ranked
    known = {p.plan: p for p in predicted}
    exact: dict = {}
    out = {}
    for name, rule in RUNNERS.items():
        scored = best_runnable(model, cluster, result, rule, ranked=ranked, exact=exact)
        if scored is None:
            why = (f"none of the {result.feasible:,} feasible plans (the best: "
                   f"{why_not_runnable(ranked[0].plan, rule)})" if ranked else "no plan fits")
            out[name] = RuntimeBest(runtime=name, prediction=None, why_none=why)
            continue
        prediction = known.get(scored.plan) or predict(model, cluster, scored.plan)
        known[scored.plan] = prediction
        plan = scored.plan  # the search overlaps a shared expert wherever Megatron can (see as_run_by)
        reshaped = bool(model.moe_shared_expert_intermediate_size) and not plan.shared_expert_overlap \
            and not plan.ep_comm_overlap
        out[name] = RuntimeBest(runtime=name, prediction=prediction, reshaped=reshaped)
    return out


def _exchange(plan) -> str:
    return f"{plan.a2a}/{plan.a2a_chunks}" + overlap_suffix(plan)


def _a2a_share(p: Prediction) -> float:
    return p.time.breakdown()["exposed_a2a"] / p.time.step


def compare(piper: RuntimeBest, stock: RuntimeBest) -> tuple[float | None, str]:
    """(predicted speedup of the best --piper plan over the best stock plan, one sentence why)."""
    a, b = piper.prediction, stock.prediction
    if a is None and b is None:
        return None, "neither runs a feasible plan"
    if a is None:
        return None, f"--piper runs {piper.why_none}; stock runs {describe(b.plan)}"
    if b is None:
        return None, f"only --piper runs a feasible plan; stock runs {stock.why_none}"
    speedup = b.time.step / a.time.step
    if a.plan == b.plan:
        return speedup, f"same plan: the exchange is {_exchange(a.plan)} in both"
    shares = f"exposed all-to-all {100 * _a2a_share(a):.1f}% vs {100 * _a2a_share(b):.1f}% of the step"
    same_exchange = (a.plan.a2a, a.plan.a2a_chunks, a.plan.ep_comm_overlap) == (b.plan.a2a, b.plan.a2a_chunks,
                                                                              b.plan.ep_comm_overlap)
    others = _differences(a.plan, b.plan, exchange=False)
    rest = f"; also {others}" if others else ""
    if speedup >= 1.0005:
        if same_exchange:
            return speedup, f"--piper {speedup:.2f}x: same exchange ({_exchange(a.plan)}); {others}"
        return speedup, (f"--piper {speedup:.2f}x: {_exchange(a.plan)} vs stock {_exchange(b.plan)}, {shares}{rest}")
    if speedup > 1 / 1.0005:
        return speedup, (f"--piper not faster ({speedup:.3f}x): as fast as stock's {_exchange(b.plan)} "
                         f"({describe(b.plan)}), {shares}")
    return speedup, (f"--piper not faster ({speedup:.2f}x): stock's {_exchange(b.plan)} wins over "
                     f"{_exchange(a.plan)}, {shares}{rest}")


def _differences(a, b, *, exchange: bool = True) -> str:
    keys = ["tp", "pp", "vpp", "cp", "ep", "etp_size", "micro_batch_size", "recompute", "distributed_optimizer",
            "grad_reduce_in_bf16", "optimizer_offload_fraction", "num_layers_in_last_pipeline_stage"]
    if exchange:
        keys += ["a2a", "a2a_chunks", "shared_expert_overlap", "ep_comm_overlap"]
    return ", ".join(f"{k}={getattr(a, k)} vs {getattr(b, k)}" for k in keys if getattr(a, k) != getattr(b, k))


def runtimes_json(runtimes: dict) -> dict:
    plans = {}
    for name in RUNNERS:
        r = runtimes[name]
        p = r.prediction
        plans[name] = {"plan": None, "why_none": r.why_none} if p is None else {
            "plan": describe(p.plan), "settings": to_json(p)["plan"], "step_s": p.time.step, "mfu": p.rate.mfu,
            "tokens_per_s": p.rate.tokens_per_s, "exposed_a2a_share": _a2a_share(p),
            "peak_gib": round(p.peak_stage.total / GIB, 4), "shared_expert_after_experts": r.reshaped}
    vs = {}
    for key, _, piper, stock in FRAMEWORKS:
        speedup, note = compare(runtimes[piper], runtimes[stock])
        vs[key] = {"piper": piper, "stock": stock, "speedup": speedup, "why": note}
    return {"best": plans, "piper_vs_stock": vs}


def plan_json(result: SearchResult, best: list[Prediction], gbs: int, *, runtimes: dict | None = None,
              needs: tuple[int, str] | None = None) -> dict:
    out = {"candidates": result.candidates, "feasible": result.feasible, "rejected": dict(result.rejected),
           "global_batch_size": gbs,
           "search": {"elapsed_s": result.elapsed_s, "plans_per_s": result.plans_per_s},
           "plans": [to_json(p) for p in best]}
    if runtimes is not None:
        out["runtimes"] = runtimes_json(runtimes)
    if needs is not None:
        out["needs"] = {"gpus": needs[0], "for": needs[1]}
    return out


def render(model: str, cluster: str, gpus: int, gbs: int, result: SearchResult, best: list[Prediction], *,
           leading: list[Prediction] | None = None, ranked: list | None = None, runtimes: dict | None = None) -> str:
    lines = [f"piper plan: {model} on {gpus} GPUs of {cluster}, global batch {gbs}",
             f"searched {result.candidates:,} plans in {result.elapsed_s:.2f} s ({result.plans_per_s:,.0f} plans/s): "
             f"{result.feasible:,} feasible"]
    if result.rejected:
        lines.append("rejected: " + ", ".join(f"{n:,} {reason}" for reason, n in result.rejected.most_common()))
    if not best:
        lines.append("no plan fits: add GPUs, lower --gbs or --seq, or relax --memory-headroom")
        return "\n".join(lines)
    if leading is None or ranked is None:  # a caller's own list: explain best[0] against best[1]
        by_plan = {s.plan: s for s in result.scored}
        leading = best
        ranked = [by_plan[p.plan] for p in best[:2] if p.plan in by_plan]
    head = f"{'#':>2}  {'plan':<68} {'MFU':>6} {'step s':>8} {'peak/cap GiB':>14} {'a2a exp':>8} {'bubble':>7}"
    lines += ["", head]
    for i, p in enumerate(best, 1):
        b = p.time.breakdown()
        lines.append(f"{i:>2}  {describe(p.plan):<68} {100 * p.rate.mfu:5.1f}% {p.time.step:8.3f} "
                     f"{p.peak_stage.total / GIB:6.1f}/{p.capacity_bytes / GIB:<6.1f} "
                     f"{100 * b['exposed_a2a'] / p.time.step:7.1f}% {100 * b['bubble'] / p.time.step:6.1f}%")
    lines += ["", *verdict(leading, ranked)]
    if runtimes is not None:
        lines += ["", *render_runtimes(runtimes)]
    return "\n".join(lines)


def verdict(leading: list[Prediction], ranked: list) -> list[str]:
    """The lines under the ranked table (``leading[0]`` the best plan): its prediction, its
    bottleneck and :func:`why` it beat the runner-up."""
    top = leading[0]
    return [f"best: {describe(top.plan)}",
            f"  predicted MFU {100 * top.rate.mfu:.1f}% ({top.rate.tflops_per_gpu:.0f} TFLOPS/GPU, "
            f"{top.rate.tokens_per_s:,.0f} tokens/s), step {top.time.step:.3f} s, peak memory "
            f"{top.peak_stage.total / GIB:.1f} of {top.capacity_bytes / GIB:.1f} GiB",
            f"  bottleneck: {top.rate.bottleneck}",
            f"  why: {why(leading, ranked)}"]


def render_runtimes(runtimes: dict) -> list[str]:
    lines = ["by runtime: the fastest plan each can run, from the same search",
             f"  {'runtime':<17} {'plan':<68} {'MFU':>6} {'step s':>8} {'a2a exp':>8}"]
    for name in RUNNERS:
        r = runtimes[name]
        p = r.prediction
        if p is None:
            lines.append(f"  {RUNTIME_NAMES[name]:<17} none: {r.why_none}")
            continue
        label = describe(p.plan) + (" *" if r.reshaped else "")
        lines.append(f"  {RUNTIME_NAMES[name]:<17} {label:<68} {100 * p.rate.mfu:5.1f}% {p.time.step:8.3f} "
                     f"{100 * _a2a_share(p):7.1f}%")
    if any(runtimes[name].reshaped for name in RUNNERS):
        lines.append("  * the shared expert runs after the routed experts (this runtime cannot overlap it with the "
                     "exchange), re-timed so")
    for _, title, piper, stock in FRAMEWORKS:
        speedup, note = compare(runtimes[piper], runtimes[stock])
        lines.append(f"  {title}: {note}")
    return lines


def why(leading: list[Prediction], ranked: list) -> str:
    """One sentence comparing the winner with the runner-up of the whole search, naming the rule of
    the search's ranking (:data:`piper_core.scheduler.search.RANK_RULES`) that decided."""
    if len(leading) < 2 or len(ranked) < 2:
        return "the only feasible plan"
    top, second = leading[0], leading[1]
    what = _differences(top.plan, second.plan) or "same sizes"
    rule = deciding_rule(ranked[0], ranked[1])
    if rule == 0:
        gain = 100 * (second.time.step / top.time.step - 1)
        return f"{gain:.1f}% faster than the runner-up ({what})" if gain >= 0.05 else \
            f"{gain:.3g}% faster than the runner-up ({what})"
    if rule == 1:
        saved = (second.peak_stage.total - top.peak_stage.total) / GIB
        return f"as fast as the runner-up and {saved:.2f} GiB lighter per GPU ({what})"
    if rule is None:
        return f"as fast, as heavy and as simple as the runner-up; the search's order decided ({what})"
    a, b = top.plan, second.plan
    name, value = {2: ("tp*pp*cp*vpp", lambda p: p.tp * p.pp * p.cp * p.virtual_stages),
                   3: ("ep*etp", lambda p: p.ep * p.etp_size), 4: ("a2a", lambda p: p.a2a),
                   5: ("a2a_chunks", lambda p: p.a2a_chunks), 6: ("ep_comm_overlap", lambda p: p.ep_comm_overlap),
                   7: ("recompute", lambda p: p.recompute), 8: ("micro_batch_size", lambda p: p.micro_batch_size)}[rule]
    detail = f"{name} {value(a)} vs {value(b)}; " if rule in (2, 3) else ""
    return f"as fast and as heavy as the runner-up; the tie goes to {RANK_RULES[rule]} ({detail}{what})"
