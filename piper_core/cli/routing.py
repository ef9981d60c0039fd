"""Routing as an input on the command line (issue 17):

* ``piper predict ... --routing FILE [FILE ...] [--placement FILE]``: the prediction with each MoE
  layer priced at its busiest rank under the placement (Megatron's default unless given), and a
  routing summary (max/mean per layer, dropped fraction);
* ``piper plan ... --routing FILE``: the search under the routing (:func:`run_plan`);
* ``piper placement MODEL --routing FILE --ep N [--cluster C --gpus G --parallel ...] [--out FILE]``:
  the optimised placement (:mod:`piper_core.scheduler.placement`), and with a plan the predicted step
  under the default and the optimised placement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from piper_core.errors import SpecError
from piper_core.resource.routing import (RoutedPrediction, default_placement, load_placement, predict_routed,
                                         routed_to_json, routing_json)
from piper_core.scheduler.migration import layer_range
from piper_core.specs.routing import load_routing

HELP_ROUTING = ("tokens per expert per MoE layer: a histogram (YAML/JSON: num_experts, layers: {layer_number: "
                "[counts]}, optional default) or the JSON-lines files of --piper-trace (all ranks'); docs/routing.md")
MAX_LAYER_ROWS = 16
MAX_MOVES_SHOWN = 6  # per layer, in the text of piper placement --current


def add_routing_args(p: argparse.ArgumentParser, *, placement: bool) -> None:
    p.add_argument("--routing", nargs="+", metavar="FILE", help=HELP_ROUTING)
    if placement:
        p.add_argument("--placement", metavar="FILE",
                       help="experts per expert-parallel rank, per MoE layer (written by `piper placement --out`; "
                            "default: Megatron's contiguous placement); needs --routing")
    else:
        p.add_argument("--optimize-placement", action="store_true",
                       help="price every plan with the experts placed by `piper placement` for its ep (default: "
                            "Megatron's contiguous placement); needs --routing")


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g}"


def routing_lines(r: RoutedPrediction) -> list[str]:
    """The text summary: per MoE layer (runs of layers that price alike share a row), the busiest
    expert and rank over the mean, the busiest rank's tokens and its receive per link level (one
    dispatch of one micro-batch), and the dropped share of the routed token copies."""
    info = routing_json(r)
    levels = [name for name, _ in r.loads[0].exchange_bytes] if r.loads else []
    cf = r.prediction.model.moe_capacity_factor
    head = (f"routing: {info['source']} ({len(r.loads)} MoE layers, {r.routing.num_experts} experts), placement "
            f"{info['placement']} over ep={r.prediction.plan.ep}; busiest rank up to "
            f"{info['max_rank_over_mean']:.3g}x the mean (layer {r.max_load.layer})")
    cols = ["layers", "expert max/mean", "rank max/mean", "busiest rank", "tokens/mb"]
    cols += [f"{name} MiB" for name in levels] + ["dropped"]
    rows: list[tuple[list[int], tuple[str, ...]]] = []
    for x in r.loads:
        cells = (f"{x.expert_max_over_mean:.3f}", f"{x.rank_max_over_mean:.3f}", str(x.busiest_rank),
                 f"{x.busiest_rank_tokens:,.0f}", *(_mib(b) for _, b in x.exchange_bytes),
                 f"{100 * x.dropped_fraction:.2f}%" if cf is not None else "dropless")
        if rows and rows[-1][1] == cells:
            rows[-1][0].append(x.layer)
        else:
            rows.append(([x.layer], cells))
    widths = [max(len(c), 7) for c in cols]
    lines = ["", head, "  " + "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths))]
    for layers, cells in rows[:MAX_LAYER_ROWS]:
        lines.append("  " + "  ".join(f"{c:>{w}}" for c, w in zip((layer_range(layers), *cells), widths)))
    if len(rows) > MAX_LAYER_ROWS:
        lines.append(f"  ... {len(rows) - MAX_LAYER_ROWS} more rows (--json lists every layer)")
    if cf is not None:
        mean = sum(x.dropped_fraction for x in r.loads) / len(r.loads)
        lines.append(f"  capacity factor {cf:g}: {100 * mean:.2f}% of the routed token copies dropped on average "
                     "(buffers padded to capacity do not grow with the load)")
    return lines


def _routed(args: argparse.Namespace, model, cluster, plan) -> RoutedPrediction:
    routing = load_routing(args.routing, model)
    given = load_placement(args.placement, model, plan.ep) if getattr(args, "placement", None) else None
    return predict_routed(model, cluster, plan, routing, given)


def run_predict(args: argparse.Namespace, model, cluster, plan, *, overrides: str) -> int:
    """``piper predict`` with ``--routing`` (and ``--placement``)."""
    from piper_core.cli.predict import render

    if not args.routing:
        raise SpecError("--placement", args.placement, "prices a routing distribution", "add --routing FILE")
    r = _routed(args, model, cluster, plan)
    if args.json:
        print(json.dumps(routed_to_json(r), indent=2))
    else:
        print(render(r.prediction, overrides=overrides) + "\n" + "\n".join(routing_lines(r)))
    return 0


# ---- piper plan --routing --------------------------------------------------------------------------

def run_plan(args: argparse.Namespace) -> int:
    """The search under a routing distribution, in two passes.

    1. One search per expert-parallel size ``ep`` of the default space, each with every MoE layer
       at the largest load any layer has on ep ranks under the placement (Megatron's, or with
       ``--optimize-placement`` the optimizer's for that ep): an upper bound on each layer's cost
       and memory (:func:`_search_by_ep`);
    2. the :data:`REPRICED` leading plans (``--top`` if more) re-priced exactly, each layer at its
       own load (:func:`predict_routed`), and ranked again.
    """
    from piper_core.cli import plan as plan_cli
    from piper_core.cli.parse import target_cluster, target_model
    from piper_core.scheduler.routed import REPRICED, reprice, scored

    if args.optimize_placement and not args.routing:
        raise SpecError("--optimize-placement", True, "places experts for a routing distribution", "add --routing FILE")
    for flag in ("export_megatron", "export_deepspeed", "plot", "report", "detail"):
        if getattr(args, flag):
            raise SpecError(f"--{flag.replace('_', '-')}", getattr(args, flag), "is not yet available with --routing",
                            "plan without --routing for exports, plots and reports")
    model, cluster = target_model(args), target_cluster(args)
    routing = load_routing(args.routing, model)
    if args.gpus <= 0:
        raise SpecError("--gpus", args.gpus, "must be a positive number", "give the world size, e.g. --gpus 64")
    if not 0.0 <= args.memory_headroom < 1.0:
        raise SpecError("--memory-headroom", args.memory_headroom, "must be in [0, 1)", "use e.g. 0.1 to keep 10 % free")
    if args.top < 1 or (args.workers is not None and args.workers < 1):
        raise SpecError("--top/--workers", f"{args.top}/{args.workers}", "must be at least 1", "use e.g. --top 5")
    gbs = args.gbs or plan_cli.default_gbs(model, args.gpus)
    placed, result = _search_by_ep(args, model, cluster, routing, gbs)
    routed = reprice(model, cluster, routing, placed, result, max(REPRICED, args.top))
    ranked = [scored(r) for r in routed]
    leading = [r.prediction for r in routed]
    best = leading[:args.top]
    note = (f"routing: searched each ep at its busiest layer's load, then re-priced the {len(routed)} leading "
            "plans layer by layer; experts placed " + ("by `piper placement` for each ep" if args.optimize_placement
                                                        else "as Megatron does (contiguous)"))
    if args.json:
        out = plan_cli.plan_json(result, best, gbs)
        for entry, r in zip(out["plans"], routed):
            entry["routing"] = routing_json(r)
        out["routing_search"] = {"repriced": len(routed), "source": routing.source}
        print(json.dumps(out, indent=2))
        print(note, file=sys.stderr)
    else:
        print(plan_cli.render(model.name, cluster.name, args.gpus, gbs, result, best, leading=leading, ranked=ranked)
              if best else plan_cli.render(model.name, cluster.name, args.gpus, gbs, result, best))
        if best:
            print(note)
            print("\n".join(routing_lines(routed[0])))
    return 0 if best else 1


def _search_by_ep(args: argparse.Namespace, model, cluster, routing, gbs: int):
    """(placements per ep, the merged result of one search per ep at its busiest layer's load)."""
    from piper_core.cli import plan as plan_cli
    from piper_core.cli.progress import Progress
    from piper_core.scheduler.routed import search_by_ep
    from piper_core.scheduler.space import default_space

    space = plan_cli._fp8_space(args, model, cluster) or default_space(model, cluster, args.gpus)
    return search_by_ep(model, cluster, args.gpus, gbs, routing, space=space, optimize_placement=args.optimize_placement,
                        progress=lambda ep: Progress(f"searching ep={ep}"), memory_headroom=args.memory_headroom,
                        attention_backend=args.attention, workers=args.workers or plan_cli.default_workers())


# ---- piper placement -------------------------------------------------------------------------------

def add_placement_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("placement", help="place experts on expert-parallel ranks for a measured routing",
                       description="Assign each MoE layer's experts to the ep ranks (equal slots) to minimise the "
                                   "busiest rank's tokens under a routing distribution; report the lower bound "
                                   "and, with a plan, the predicted step under the default and optimised placement.")
    p.add_argument("model", help="model preset name or ModelSpec YAML path")
    p.add_argument("--routing", nargs="+", metavar="FILE", required=True, help=HELP_ROUTING)
    p.add_argument("--ep", type=int, help="expert-parallel size (default: the plan's, from --parallel)")
    p.add_argument("--cluster", help="cluster preset or YAML: with --gpus and --parallel, price the step")
    p.add_argument("--profile", metavar="PROFILE.yaml", help="calibrated profile instead of --cluster")
    p.add_argument("--gpus", type=int, help="world size, for --parallel")
    p.add_argument("--parallel", help="the plan to price (as piper predict --parallel)")
    p.add_argument("--seq-length", "--seq", dest="seq_length", metavar="N", help="sequence length")
    p.add_argument("--capacity-factor", metavar="F", help="MoE capacity factor, or 'none' (dropless)")
    p.add_argument("--out", metavar="FILE", help="write the placement as JSON (piper predict --placement reads it)")
    p.add_argument("--shared", action="store_true",
                   help="one placement for every MoE layer, the file Megatron's --piper-placement and the DeepSpeed "
                        "block's \"placement\" run ({num_experts, ep, ranks}); default: one per layer")
    p.add_argument("--current", metavar="FILE", help="the placement the job runs now (a placement file; layers not "
                   "listed: Megatron's default): price moving from it to a better placement (swaps from it, or the "
                   "optimizer's, whichever gains more net of the move); needs --parallel, --gpus, --cluster and "
                   "--horizon")
    p.add_argument("--horizon", type=int, metavar="N", help="steps the new placement would run: migrate only when "
                   "its predicted saving over N steps exceeds the predicted move (docs/migration.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_placement)


def run_placement(args: argparse.Namespace) -> int:
    from piper_core.cli.parse import parse_parallel, target_cluster, target_model
    from piper_core.scheduler.placement import optimize, placement_json, summary_json

    model = target_model(args)
    routing = load_routing(args.routing, model)
    plan = None
    if args.parallel is not None:
        if args.gpus is None:
            raise SpecError("--gpus", None, "--parallel needs the world size", "add --gpus N")
        plan = parse_parallel(args.parallel, args.gpus)
        if args.ep is not None and args.ep != plan.ep:
            raise SpecError("--ep", args.ep, f"differs from the plan's ep ({plan.ep})", "drop --ep or make them equal")
    ep = plan.ep if plan is not None else args.ep
    if ep is None:
        raise SpecError("--ep", None, "the expert-parallel size is required", "give --ep N or --parallel with ep=N")
    _check_migration_args(args, plan)
    if args.shared:
        if args.current:
            raise SpecError("--shared", True, "writes one placement for every layer from scratch; --current prices a "
                            "migration per layer", "drop --shared or --current")
        return _run_shared(args, model, routing, ep, plan)
    found = optimize(routing, ep)
    data = placement_json(found, num_experts=model.num_experts, ep=ep)
    migration = None
    if args.current:
        migration = _migration(args, model, routing, plan, found)
        data = migration[0]["target"]
    if args.out:
        from pathlib import Path
        Path(args.out).write_text(placement_text(data))
    priced = None
    if plan is not None:
        cluster = target_cluster(args)
        chosen = {p.layer: p.placement for p in found}
        priced = (predict_routed(model, cluster, plan, routing), predict_routed(model, cluster, plan, routing, chosen))
    if args.json:
        out = {"model": model.name, "source": routing.source, "ep": ep, "layers": summary_json(found),
               "placement": data}
        if priced is not None:
            out["predicted"] = {"default": routed_to_json(priced[0]), "optimized": routed_to_json(priced[1])}
        if migration is not None:
            out["migration"] = migration[0]
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(_placement_text(model, routing, ep, found, priced, args.out)))
        if migration is not None:
            print("\n".join(migration[1]))
    return 0


def _run_shared(args: argparse.Namespace, model, routing, ep: int, plan) -> int:
    """``piper placement --shared``: one placement for every layer (:func:`optimize_shared`), written in
    the runtime's format and priced as the runtime runs it (the same placement on every layer)."""
    from pathlib import Path

    from piper_core.cli.parse import target_cluster
    from piper_core.runtime.placement import ExpertPlacement
    from piper_core.scheduler.placement import optimize_shared

    found = optimize_shared(routing, ep)
    data = ExpertPlacement(num_experts=model.num_experts, ep=ep, ranks=found.placement).to_json()
    if args.out:
        Path(args.out).write_text(json.dumps(data) + "\n")
    priced = None
    if plan is not None:
        cluster = target_cluster(args)
        every = {n: found.placement for n, _ in routing.layers}
        priced = (predict_routed(model, cluster, plan, routing), predict_routed(model, cluster, plan, routing, every))
    if args.json:
        out = {"model": model.name, "source": routing.source, "ep": ep, "shared": True, "placement": data,
               "objective": found.objective, "default_objective": found.default_objective,
               "lower_bound": found.lower_bound, "gap": found.gap, "start": found.start}
        if priced is not None:
            out["predicted"] = {"default": routed_to_json(priced[0]), "optimized": routed_to_json(priced[1])}
        print(json.dumps(out, indent=2))
        return 0
    print(f"piper placement: {model.name}, {model.num_experts} experts on ep={ep} ranks, one placement for every MoE "
          f"layer, routing {routing.source}")
    print(f"sum over layers of the busiest rank's tokens: default {found.default_objective:,.0f}, placed "
          f"{found.objective:,.0f} (lower bound {found.lower_bound:,.0f}, gap {100 * found.gap:.2f}%; descent from "
          f"{found.start})")
    print("experts per rank: " + "; ".join(f"rank {r}: {list(e)}" for r, e in enumerate(found.placement)))
    if priced is not None:
        a, b = priced[0].prediction, priced[1].prediction
        print(f"predicted step: default placement {a.time.step:.4g} s, placed {b.time.step:.4g} s: "
              f"{a.time.step / b.time.step:.3f}x")
    if args.out:
        print(f"written to {args.out} (Megatron: --piper-placement {args.out}; DeepSpeed: \"placement\": \"{args.out}\")")
    return 0


def _check_migration_args(args: argparse.Namespace, plan) -> None:
    if args.horizon is not None and not args.current:
        raise SpecError("--horizon", args.horizon, "prices a migration from the current placement",
                        "add --current FILE (the placement the job runs now)")
    if not args.current:
        return
    if plan is None or not (args.cluster or args.profile):
        raise SpecError("--current", args.current, "prices the move and the step on a plan and cluster",
                        "add --parallel ... --gpus N --cluster C (or --profile)")
    if args.horizon is None:
        raise SpecError("--current", args.current, "decides only with a horizon (the steps the new placement runs)",
                        "add --horizon N, e.g. --horizon 100")


def _migration(args: argparse.Namespace, model, routing, plan, found) -> tuple[dict, list[str]]:
    """(the ``migration`` JSON, the text lines) of moving from ``--current`` to the optimised placement
    (:func:`piper_core.scheduler.migration.choose`)."""
    from piper_core.cli.parse import target_cluster
    from piper_core.scheduler.migration import choose, migration_json, move_rows

    cluster = target_cluster(args)
    current = load_placement(args.current, model, plan.ep)
    choice = choose(model, cluster, plan, routing, current, horizon=args.horizon,
                    optimized={p.layer: p.placement for p in found})
    names = {"swaps": "swaps from --current", "optimizer": "the optimizer's placement"}
    chosen = choice.chosen
    migration, decision = chosen.migration, chosen.decision
    cost = decision.cost
    b = cost.bytes_per_expert
    others = "; ".join(f"{names[c.name]}: {c.decision.cost.experts} moves, step {c.decision.step_after_s:.4g} s, "
                       f"move {c.decision.cost.seconds:.4g} s" for c in choice.candidates)
    lines = [f"candidates ({others}): chose {names[chosen.name]} (the larger gain net of the move)",
             f"migration from {args.current}: {cost.experts} experts change rank in "
             f"{len({m.layer for m in migration.crossing})} layers (+ {len(migration.moves) - cost.experts} slot "
             f"changes within a rank); per expert {b.params:,} parameters, {b.total / 2**20:.4g} MiB moved "
             f"(weights {b.weights / 2**20:.4g}, gradients {b.gradients / 2**20:.4g}, optimizer "
             f"{b.optimizer / 2**20:.4g})"]
    rows = move_rows(migration, max_shown=MAX_MOVES_SHOWN)
    for layers, text in rows[:MAX_LAYER_ROWS]:
        if not text.startswith("expert "):
            text += " (--json lists them)"
        lines.append(f"  layer {layer_range(layers)}: {text}")
    if len(rows) > MAX_LAYER_ROWS:
        lines.append(f"  ... {len(rows) - MAX_LAYER_ROWS} more rows (--json lists every move)")
    levels = ", ".join(f"{name} {n / 2**20:.4g} MiB" for name, n in cost.levels) or "none"
    lines += [f"predicted move {cost.seconds:.4g} s (busiest rank {cost.busiest_rank_bytes / 2**20:.4g} MiB; over "
              f"{levels}); step {decision.step_before_s:.4g} s -> {decision.step_after_s:.4g} s",
              f"decision: {decision.reason()}"]
    if args.out:
        lines.append(f"{args.out} holds the target aligned to --current (experts that stay on a rank keep their slot)")
    return migration_json(migration, decision, candidate=names[chosen.name]), lines


def placement_text(data: dict) -> str:
    """The placement file as JSON with one line per layer (each rank's experts in a list)."""
    layers = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data["layers"].items())
    return (f'{{"num_experts": {data["num_experts"]}, "ep": {data["ep"]},\n "layers": {{\n{layers}\n }}\n}}\n')


def _placement_text(model, routing, ep: int, found, priced, out: str | None) -> list[str]:
    lines = [f"piper placement: {model.name}, {model.num_experts} experts on ep={ep} ranks "
             f"({model.num_experts // ep} each), routing {routing.source}",
             "busiest rank over the mean rank, per MoE layer (lower bound: no placement does better; gap: how far "
             "above the optimum it can be)",
             "  " + "  ".join(f"{c:>12}" for c in ("layer", "default", "optimized", "lower bound", "gap"))]
    rows: list[tuple[list[int], tuple[str, ...]]] = []
    for p in found:
        mean = p.busiest / p.rank_max_over_mean if p.rank_max_over_mean else 0.0
        cells = (f"{p.default_rank_max_over_mean:.3f}", f"{p.rank_max_over_mean:.3f}",
                 f"{p.lower_bound / mean if mean else 1.0:.3f}", f"{100 * p.gap:.2f}%")
        if rows and rows[-1][1] == cells:
            rows[-1][0].append(p.layer)
        else:
            rows.append(([p.layer], cells))
    for layers, cells in rows[:MAX_LAYER_ROWS]:
        name = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}" if \
            layers[-1] - layers[0] == len(layers) - 1 else f"{layers[0]},..,{layers[-1]}"
        lines.append("  " + "  ".join(f"{c:>12}" for c in (name, *cells)))
    if len(rows) > MAX_LAYER_ROWS:
        lines.append(f"  ... {len(rows) - MAX_LAYER_ROWS} more rows (--json lists every layer)")
    worst = max(found, key=lambda p: p.gap)
    lines.append(f"largest gap to the lower bound: {100 * worst.gap:.2f}% (layer {worst.layer}); the experts of each "
                 "rank: --out FILE or --json")
    if priced is not None:
        a, b = priced[0].prediction, priced[1].prediction
        lines.append(f"predicted step: default placement {a.time.step:.4g} s (MFU {100 * a.rate.mfu:.1f}%), "
                     f"optimized {b.time.step:.4g} s (MFU {100 * b.rate.mfu:.1f}%): {a.time.step / b.time.step:.3f}x; "
                     f"peak memory {a.peak_stage.total / 2**30:.2f} -> {b.peak_stage.total / 2**30:.2f} GiB")
    if out:
        lines.append(f"wrote {out} (piper predict ... --routing FILE --placement {out}; Megatron: --piper-placement "
                     f"{out}, each slot holding its expert's weights)")
    return lines
