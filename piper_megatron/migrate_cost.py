"""Measure what moving experts costs, against the model's prediction (issue 17, deliverable 3).

    python -m piper_megatron.migrate_cost --ranks 2 --experts 1,2,4 --hidden 512 --ffn 2048 [--profile P.yaml]

On ``--ranks`` local CPU ranks (ep = ranks), a Megatron-Core GPTModel with one MoE layer of
``--num-experts`` experts (SequentialMLP, hidden ``--hidden``, expert FFN ``--ffn``), Megatron's DDP,
Piper's dispatcher and the host Adam trains one step (so that the optimizer state exists); then, for
each ``k`` of ``--experts``, :func:`piper_megatron.migrate.migrate` swaps ``k`` experts of rank 0 with
``k`` of rank 1 and back, ``--repeats`` times. The measured time is the migration's own (packing,
the point-to-point exchange, unpacking; between two barriers of the expert-parallel group), the
median over the repeats; the prediction is :func:`piper_core.scheduler.migration.move_time` for the
same move on ``--cluster`` (default ``cpu-local``) or a calibrated ``--profile``. Prints one row per
``k``: bytes per expert, measured and predicted seconds, and the error. Timings on a shared machine
are noisy: run it on a quiet one.

``--nodes N`` (root) spreads the ranks over ``N`` emulated nodes (network namespaces, links shaped to
``--inter-node-mbit``, :mod:`piper_core.emulate`), so that rank 0's experts cross the inter-node link;
predict it with a profile calibrated on the same emulated cluster (whose ``gpus_per_node`` puts ranks
0 and 1 on different nodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan


def model_and_plan(ranks: int, hidden: int, ffn: int, num_experts: int, precision: str) -> tuple[ModelSpec,
                                                                                                    ParallelPlan]:
    from piper_core.validate.cases import VAL_MODEL

    model = dataclasses.replace(VAL_MODEL, name=f"migrate-{hidden}h-{ffn}f-{num_experts}e", num_layers=1,
                                hidden_size=hidden, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
                                num_experts=num_experts, moe_capacity_factor=None, seq_length=32)
    plan = ParallelPlan(gpus=ranks, ep=ranks, micro_batch_size=1, global_batch_size=ranks, precision=precision)
    return model, plan


def swap_placement(num_experts: int, ep: int, k: int) -> tuple[tuple[int, ...], ...]:
    """The default placement with the first ``k`` experts of ranks 0 and 1 exchanged."""
    per = num_experts // ep
    ranks = [list(range(r * per, (r + 1) * per)) for r in range(ep)]
    ranks[0][:k], ranks[1][:k] = ranks[1][:k], ranks[0][:k]
    return tuple(map(tuple, ranks))


def rank_main(info: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Target of :func:`piper_core.emulate.run_local`: the rank side (module docstring)."""
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    import piper_core
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from piper_core.runtime import NodeTopology
    from piper_core.runtime.placement import ExpertPlacement
    from piper_megatron.build import gpt_model_chunks
    from piper_megatron.cpu import install_cpu_training_shims
    from piper_megatron.dispatcher import DispatchSettings, create_ep_comm, install_dispatcher
    from piper_megatron.migrate import migrate
    from piper_megatron.train import _config_overrides, host_optimizer

    install_cpu_training_shims()
    model, plan = model_and_plan(info.world_size, job["hidden"], job["ffn"], job["num_experts"], job["precision"])
    parallel_state.initialize_model_parallel(expert_model_parallel_size=plan.ep, expert_tensor_parallel_size=1)
    patches = None
    try:
        comm = create_ep_comm(NodeTopology.uniform(world_size=info.world_size, ranks_per_node=info.ranks_per_node))
        patches = install_dispatcher(comm, DispatchSettings.from_plan("flat", 1))
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        torch.manual_seed(1)
        chunks = gpt_model_chunks(model, plan, device="cpu", **_config_overrides())
        ddps = [DistributedDataParallel(c.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=plan.precision == "bf16"), c) for c in chunks]
        chunks[0].config.finalize_model_grads_func = finalize_model_grads
        optimizer = host_optimizer([p for d in ddps for p in d.parameters()], plan, lr=1e-3)
        g = torch.Generator().manual_seed(1)
        batch = torch.randint(0, model.vocab_size, (1, model.seq_length + 1), generator=g)
        positions = torch.arange(model.seq_length).unsqueeze(0)

        def forward_step(data: Any, module: Any):
            b = next(data)
            return module(b[:, :-1], positions, None, labels=b[:, 1:]), lambda t: (t.float().mean(), {})

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=ddps,
                                    num_microbatches=1, seq_length=model.seq_length, micro_batch_size=1,
                                    forward_only=False)
        optimizer.step()
        default = ExpertPlacement.default(model.num_experts, plan.ep)
        rows = []
        for k in job["experts"]:
            swapped = ExpertPlacement(num_experts=model.num_experts, ep=plan.ep,
                                      ranks=swap_placement(model.num_experts, plan.ep, k))
            seconds, sent, phases = [], 0, []
            for _ in range(job["repeats"]):
                for target in (swapped, default):
                    report = migrate(ddps, optimizer, target)
                    seconds.append(report.seconds)
                    phases.append(report.phases)
                    sent = max(sent, report.sent_bytes)
            rows.append({"k": k, "seconds": seconds, "sent_bytes": sent, "phases": phases})
        return {"rank": info.rank, "rows": rows, "piper_core": piper_core.__file__}
    finally:
        if patches is not None:
            patches.restore()
        parallel_state.destroy_model_parallel()


def measure(*, ranks: int, experts: list[int], hidden: int, ffn: int, num_experts: int, precision: str,
            repeats: int, cluster: Any, timeout_s: float = 600.0, realtime: bool = False, nodes: int = 1,
            inter_node_mbit: float | None = None) -> dict[str, Any]:
    """Measured and predicted seconds per ``k`` (module docstring); ``realtime``: SCHED_FIFO ranks, as
    the project's other measured runs take them as root; ``nodes`` > 1: the ranks on that many emulated
    nodes, ``inter_node_mbit`` between them."""
    from piper_core.emulate import run_emulated, run_local
    from piper_core.errors import SpecError
    from piper_core.scheduler.migration import expert_state_bytes, move_time, plan_migration

    model, plan = model_and_plan(ranks, hidden, ffn, num_experts, precision)
    per = num_experts // ranks
    if ranks < 2 or num_experts % ranks or any(not 1 <= k <= per for k in experts):
        raise SpecError("--experts", experts, f"each k must be in 1 .. num_experts / ranks ({per}) on >= 2 ranks",
                        f"choose k <= {per}, or more --num-experts")
    if nodes < 1 or ranks % nodes:
        raise SpecError("--nodes", nodes, f"must divide --ranks ({ranks}): every emulated node holds as many ranks",
                        f"use --nodes {ranks} (one rank per node) or 1")
    if nodes > 1 and cluster.gpus_per_node != ranks // nodes:
        raise SpecError("--profile", cluster.name, f"has {cluster.gpus_per_node} ranks per node; the emulated "
                        f"cluster has {ranks // nodes}, so the move would be priced on another link",
                        "predict with a profile of the same emulated cluster (piper calibrate --emulate NODESxRANKS "
                        "--inter-node-mbit R)")
    job = {"experts": experts, "hidden": hidden, "ffn": ffn, "num_experts": num_experts, "precision": precision,
           "repeats": repeats}
    target = "piper_megatron.migrate_cost:rank_main"
    reports = run_local(ranks, target, [job], timeout_s=timeout_s, realtime=realtime) if nodes == 1 else \
        run_emulated(nodes, ranks // nodes, inter_node_mbit, target, [job], timeout_s=timeout_s, realtime=realtime)
    rows = []
    for i, k in enumerate(experts):
        move = plan_migration({}, {1: swap_placement(num_experts, ranks, k)}, num_experts=num_experts, ep=ranks)
        predicted = move_time(move, model, plan, cluster)
        # the slowest rank of each migration, then the median over the migrations
        per_move = [max(r["rows"][i]["seconds"][j] for r in reports) for j in range(2 * repeats)]
        measured = statistics.median(per_move)
        rows.append({"k": k, "bytes_per_expert": expert_state_bytes(model, plan).total,
                     "sent_bytes": reports[0]["rows"][i]["sent_bytes"], "measured_s": measured,
                     "measured_all_s": per_move, "predicted_s": predicted.seconds,
                     "error": predicted.seconds / measured - 1 if measured > 0 else None,
                     "phases_s": {name: statistics.median(ph[name] for r in reports for ph in r["rows"][i]["phases"])
                                  for name in ("pack", "exchange", "unpack")},
                     # the first move of each k grows the kept buffers (migrate.py): not in the median
                     "first_phases_s": {name: max(r["rows"][i]["phases"][0][name] for r in reports)
                                        for name in ("pack", "exchange", "unpack")}})
    return {"model": model.name, "ranks": ranks, "nodes": nodes, "inter_node_mbit": inter_node_mbit if nodes > 1 else None,
            "precision": precision, "cluster": cluster.name,
            "piper_core": reports[0]["piper_core"], "rows": rows}


def report_table(paths: Sequence[Path]) -> str:
    """A Markdown table of recorded runs (``--out`` files): one row per run and ``k``, every row counted."""
    lines = ["| run | profile (sha256) | k | MiB sent/rank | measured s (median) | first move s | predicted s | error |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for path in paths:
        run = json.loads(Path(path).read_text())
        profile = run.get("source", {}).get("profile") or {"path": run["cluster"], "sha256": "-"}
        for r in run["rows"]:
            worst = max(worst, abs(r["error"]))
            lines.append(f"| {Path(path).name} | {Path(profile['path']).name} ({profile['sha256'][:8]}) | {r['k']} | "
                         f"{r['sent_bytes'] / 2**20:.0f} | {r['measured_s']:.4f} | {r['measured_all_s'][0]:.4f} | "
                         f"{r['predicted_s']:.4f} | {100 * r['error']:+.1f} % |")
    lines.append(f"\nWorst |error| over every row: {100 * worst:.1f} %.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from piper_core.errors import SpecError
    from piper_core.presets import load_cluster
    from piper_core.validate.report import commit_state, profile_record

    p = argparse.ArgumentParser(prog="python -m piper_megatron.migrate_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--experts", default="1,2,4", help="k values: experts swapped each way (default 1,2,4)")
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes the ranks are spread over (root; default 1: "
                   "local ranks)")
    p.add_argument("--inter-node-mbit", type=float, default=1000.0, help="the emulated link between nodes (--nodes > 1)")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048, help="expert FFN hidden size")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cluster", default="cpu-local", help="cluster preset or YAML for the prediction")
    p.add_argument("--profile", help="a calibrated profile (piper calibrate) instead of --cluster")
    p.add_argument("--realtime", action="store_true", help="run the ranks under SCHED_FIFO (root), as piper "
                   "calibrate --realtime does, so other work on the machine does not disturb the timings")
    p.add_argument("--json", action="store_true", help="print the record as JSON instead of the table")
    p.add_argument("--out", type=Path, help="also write the record (JSON) here")
    p.add_argument("--check", type=float, metavar="PCT",
                   help="exit 1 unless every k's predicted time is within PCT %% of the measured one")
    p.add_argument("--report", type=Path, nargs="+", metavar="RUN.json",
                   help="print recorded runs (--out files) as a Markdown table; measures nothing")
    a = p.parse_args(argv)
    if a.report:
        missing = [str(x) for x in a.report if not x.is_file()]
        if missing:
            print(f"migrate_cost: error: --report {' '.join(missing)}: no such file; give the JSON files "
                  "`--out` wrote (docs/migration/move-cost-*.json)", file=sys.stderr)
            return 2
        print(report_table(a.report))
        return 0
    try:
        experts = [int(x) for x in a.experts.split(",")]
        if a.check is not None and a.check <= 0:
            raise SpecError("--check", a.check, "must be a percentage > 0", "e.g. --check 30")
        cluster = load_cluster(a.profile or a.cluster)
        if a.realtime:
            from piper_core.emulate.launch import check_realtime
            check_realtime()
        if a.nodes > 1:
            from piper_core.emulate import emulation_available
            why = emulation_available()
            if why is not None:
                raise SpecError("--nodes", a.nodes, f"needs an emulated cluster, which this machine cannot build: {why}",
                                "run as root on Linux with iproute2, or use --nodes 1")
        # what the prediction came from and the code that measured, taken before the run
        source = {"commit": commit_state(), "profile": profile_record(Path(a.profile)) if a.profile else None,
                  "command": "python -m piper_megatron.migrate_cost " + " ".join(sys.argv[1:] if argv is None else argv)}
        out = measure(ranks=a.ranks, experts=experts, hidden=a.hidden, ffn=a.ffn, num_experts=a.num_experts,
                      precision=a.precision, repeats=a.repeats, cluster=cluster, realtime=a.realtime, nodes=a.nodes,
                      inter_node_mbit=a.inter_node_mbit)
    except (SpecError, ValueError) as exc:
        print(f"migrate_cost: error: {exc}", file=sys.stderr)
        return 2
    out = {"source": source, **out}
    if a.check is not None:
        worst = max(abs(r["error"]) if r["error"] is not None else float("inf") for r in out["rows"])
        out["check"] = {"limit_pct": a.check, "worst_abs_error_pct": round(100 * worst, 2), "met": 100 * worst <= a.check}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out, indent=1))
        return 0 if out.get("check", {}).get("met", True) else 1
    where = f" on {out['nodes']} emulated nodes ({out['inter_node_mbit']:g} Mbit/s)" if out["nodes"] > 1 else ""
    print(f"expert migration on {out['ranks']} CPU ranks{where}, {out['model']} ({out['precision']}), predicted on "
          f"{out['cluster']}; piper_core from {out['piper_core']}")
    print(f"{'k':>3} {'MiB/expert':>11} {'MiB sent/rank':>14} {'measured s':>11} {'predicted s':>12} {'error':>8}"
          "   median per rank: pack / exchange / unpack s")
    for r in out["rows"]:
        error = f"{100 * r['error']:+.1f}%" if r["error"] is not None else "n/a"
        print(f"{r['k']:>3} {r['bytes_per_expert'] / 2**20:>11.3f} {r['sent_bytes'] / 2**20:>14.3f} "
              f"{r['measured_s']:>11.4f} {r['predicted_s']:>12.4f} {error:>8}   "
              + " / ".join(f"{r['phases_s'][n]:.4f}" for n in ("pack", "exchange", "unpack")))
    if "check" in out:
        c = out["check"]
        print(f"check: worst |error| {c['worst_abs_error_pct']:.1f}% against the {c['limit_pct']:g}% limit: "
              + ("met" if c["met"] else "NOT met"))
        return 0 if c["met"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
