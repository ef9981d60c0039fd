"""The scheduler judged on its real output: for each validation job, train the search's top plans and
plans drawn at random from the rest of its feasible plans, and compare the order the model gives
them with the order they measure in.

    python -m piper_core.validate.scheduler [--suite full-fp32] [--profiles DIR] [--recalibrate] [--jobs A,B]
        [--top 3] [--random 3] [--seed 0] [--repeats 3] [--steps 12] [--json FILE]   # trains the chosen plans
    python -m piper_core.validate.scheduler --report FILE.json            # a recorded run's tables

A job is what the cases of one group of a suite share (framework, model, world size, global batch,
cluster, precision, attention kernel; stock cases are not jobs: the search plans Piper's exchange).
Its plans come from :func:`~piper_core.scheduler.search.search` over the part of the space the
job's CPU trainer runs (:func:`trainer_space`), priced from the calibrated profile of the job's
topology, as ``piper validate`` predicts its cases. The ``--top`` fastest predicted plans are
trained, and ``--random`` plans drawn from the other feasible ones with a generator seeded by
``--seed`` and the job's name -- so which plans run is fixed by the committed code, the suite and
the profile before any of them is timed. Every chosen plan is trained ``--repeats`` times (12 steps,
3 untimed, as ``piper validate``), in interleaved rounds, and its median judged: single runs of one
plan spread 13-24 % on this 2-core machine (docs/validation.md). Every run counts; a run that fails is reported with its error, and the
verdict fails.

Per job: Kendall's tau-b between the predicted and the measured step over its plans, the pick's
regret (the measured step of the search's pick over the fastest measured step, less one) and each
run's step error. Over all jobs: the worst regret against the 5 % limit, mean and least tau, and the
step MAPE over every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from piper_core.scheduler.search import Scored, SearchResult, search
from piper_core.scheduler.space import CHUNK_CHOICES, UNPIPELINED, SearchSpace, default_space
from piper_core.specs.cluster import ClusterSpec
from piper_core.validate.compare import PICK_LIMIT, Row
from piper_core.validate.suite import Case, Suite

TOP, RANDOM, SEED, REPEATS = 3, 3, 0, 3


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A validation job: the first non-stock case of its group stands for what the group shares."""

    name: str
    template: Case

    def case(self, plan: Any, label: str) -> Case:
        return dataclasses.replace(self.template, name=f"{self.name}:{label}", group=self.name, plan=plan, stock=False)


def jobs_of(suite: Suite) -> tuple[Job, ...]:
    """One job per distinct (framework, model, world size, global batch, nodes, link, precision,
    attention kernel) among the suite's non-stock cases, named after the first case's group."""
    seen: dict[tuple, Case] = {}
    for c in suite.cases:
        if not c.stock:
            key = (c.framework, c.model.name, c.plan.gpus, c.plan.global_batch_size, c.nodes, c.inter_node_mbit,
                   c.plan.precision, c.plan.attention_backend)
            seen.setdefault(key, c)
    return tuple(Job(name=c.group, template=c) for c in seen.values())


def trainer_space(case: Case, cluster: ClusterSpec) -> SearchSpace:
    """The plans the CPU trainer of ``case``'s framework runs for its job: no cp or memory savers, the
    distributed optimizer on and off with Megatron-Core (its trainer runs Megatron-Core's own since
    2026-12-06; DeepSpeed's runs ZeRO 0), and no tp, etp or vpp yet (Megatron-Core's trainer runs tp
    with sp and vpp at pp >= 3 since 2026-12-06; this check's recorded run predates that, and
    widening its space to them is left to its next run); Piper's
    exchange flat (and hierarchical where a node has more than one rank) in 1-8 chunks, never
    Megatron's EP overlap or the deduplicated exchange (Piper's runtime refuses it); the shared expert
    after the exchange, as Megatron's ``MoELayer`` runs it without ``moe_shared_expert_overlap``.
    Megatron-Core: pp and the three recompute settings; DeepSpeed: ep > 1 (at ep 1 DeepSpeed keeps its
    own layer) and no pipeline or recompute."""
    model, plan = case.model, case.plan
    base = default_space(model, cluster, plan.gpus)
    algos = ("flat", "hierarchical") if case.nodes > 1 and case.ranks_per_node > 1 else ("flat",)
    a2a = tuple((a, c, False) for a in algos for c in CHUNK_CHOICES) if model.is_moe else (UNPIPELINED,)
    space = dataclasses.replace(base, tp=(1,), vpp=(1,), cp=(1,), etp_equals_tp=(False,),
                                distributed_optimizer=(False, True) if case.framework == "megatron" else (False,),
                                memory_savers=((False, 0.0),), a2a=a2a, shared_expert_overlap=False,
                                precision=plan.precision, recompute=("none", "selective", "full"))
    if case.framework == "deepspeed":
        space = dataclasses.replace(space, pp=(1,), ep=tuple(e for e in base.ep if e > 1), recompute=("none",))
    return space


def choose(job: Job, result: SearchResult, *, top: int = TOP, draws: int = RANDOM,
           seed: int = SEED) -> list[tuple[str, Scored]]:
    """The ``top`` best plans (``top1`` is the search's pick), then ``draws`` of the other feasible
    plans drawn at random (seeded by ``seed`` and the job's name)."""
    ranked = result.best(len(result.scored))
    rest = ranked[top:]
    picked = random.Random(f"{seed}:{job.name}").sample(rest, min(draws, len(rest)))
    picked.sort(key=ranked.index)
    return [(f"top{i + 1}", s) for i, s in enumerate(ranked[:top])] + [(f"random{i + 1}", s) for i, s in enumerate(picked)]


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b of two equally long sequences (ties in either lower the denominator);
    NaN when either is constant."""
    conc = disc = only_x = only_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = (x[i] > x[j]) - (x[i] < x[j]), (y[i] > y[j]) - (y[i] < y[j])
            if dx and dy:
                conc, disc = conc + (dx == dy), disc + (dx != dy)
            elif dx:
                only_x += 1
            elif dy:
                only_y += 1
    denom = math.sqrt((conc + disc + only_x) * (conc + disc + only_y))
    return (conc - disc) / denom if denom else float("nan")


def job_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Tau, the pick's regret and the fastest plan of one job's ``runs`` (``kind``, ``predicted_s``,
    ``measured_s``; a failed run has ``failure`` and no measurement and is left out of both figures)."""
    done = [r for r in runs if "failure" not in r]
    out: dict[str, Any] = {"failed": [r["kind"] for r in runs if "failure" in r]}
    if len(done) < 2 or done[0]["kind"] != "top1":
        return out | {"tau": None, "regret": None, "regret_ok": False, "measured_fastest": None}
    fastest = min(done, key=lambda r: r["measured_s"])
    regret = done[0]["measured_s"] / fastest["measured_s"] - 1
    tau = kendall_tau([r["predicted_s"] for r in done], [r["measured_s"] for r in done])
    return out | {"tau": None if math.isnan(tau) else round(tau, 4), "regret": round(regret, 4),
                  "regret_ok": regret <= PICK_LIMIT, "measured_fastest": fastest["kind"]}


def headline(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every job and every run counts: a failed run or a job without figures fails the verdict."""
    runs = [r for j in jobs for r in j["runs"]]
    done = [r for r in runs if "failure" not in r]
    taus = [j["tau"] for j in jobs if j["tau"] is not None]
    judged = [j for j in jobs if j["regret"] is not None]
    worst = max(judged, key=lambda j: j["regret"]) if judged else None
    return {"jobs": len(jobs), "runs": len(runs), "failed_runs": len(runs) - len(done),
            "step_mape": round(sum(abs(r["step_error"]) for r in done) / len(done), 4) if done else None,
            "mean_tau": round(sum(taus) / len(taus), 4) if taus else None, "least_tau": min(taus) if taus else None,
            "worst_regret": worst and worst["regret"], "worst_regret_job": worst and worst["name"],
            "jobs_within_regret_limit": sum(j["regret_ok"] for j in jobs), "regret_limit": PICK_LIMIT,
            "ok": bool(jobs) and len(done) == len(runs) and all(j["regret_ok"] for j in jobs)}


def run_job(job: Job, cluster: ClusterSpec, *, top: int = TOP, draws: int = RANDOM, seed: int = SEED,
            repeats: int = REPEATS, train: Callable[[Case, ClusterSpec], Row],
            progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Search ``job`` on ``cluster``, train each chosen plan ``repeats`` times with ``train(case,
    cluster)`` in interleaved rounds (every plan once per round, the order rotated by the round) and
    judge the medians. A plan that fails is not run again."""
    import statistics

    from piper_core.export import plan_label
    from piper_core.specs.yamlio import to_dict
    from piper_core.validate.rounds import in_rounds

    t = job.template
    result = search(t.model, cluster, t.plan.gpus, t.plan.global_batch_size, space=trainer_space(t, cluster),
                    attention_backend=t.plan.attention_backend)
    chosen = choose(job, result, top=top, draws=draws, seed=seed)
    runs = [{"kind": kind, "plan": plan_label(s.plan), "plan_fields": to_dict(s.plan)} for kind, s in chosen]
    # every plan once per round, the order rotated by the round; a plan that fails is reported and
    # counted (the verdict fails), never dropped, and not run again
    trained, failed = in_rounds(len(chosen), repeats, lambda i: train(job.case(chosen[i][1].plan, chosen[i][0]), cluster),
                                rotate=True, keep_going=True, tick=progress)
    for i, why in failed.items():
        runs[i]["failure"] = why
    for entry, rows in zip(runs, trained):
        if "failure" not in entry:
            steps, pred = [row.measured_step_s for row in rows], rows[-1].predicted_step_s
            median = statistics.median(steps)
            entry |= {"predicted_s": round(pred, 5), "measured_s": round(median, 5),
                      "measured_runs_s": [round(x, 5) for x in steps], "step_error": round((pred - median) / median, 4)}
    return {"name": job.name, "framework": t.framework, "topology": t.topology, "model": t.model.name,
            "gpus": t.plan.gpus, "gbs": t.plan.global_batch_size, "candidates": result.candidates,
            "feasible": result.feasible, "runs": runs} | job_figures(runs)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def report(data: dict[str, Any]) -> str:
    """The recorded run as Markdown: the headline, one row per job, then each job's plans."""
    h = data["headline"]
    lines = [f"Command: `{data['command']}` at commit `{data['source'].get('commit')}` on {data['machine']}; "
             f"seed {data['seed']}, top {data['top']} + {data['random']} random feasible plans per job, "
             f"{data['steps']} steps per run ({data['warmup']} untimed), "
             f"{data.get('repeats', 1)} run(s) per plan in interleaved rounds (median).", "",
             f"**{h['jobs']} jobs, {h['runs']} runs ({h['failed_runs']} failed): worst pick regret "
             f"{_pct(h['worst_regret'])} ({h['worst_regret_job']}; limit {100 * h['regret_limit']:.0f} %), "
             f"{h['jobs_within_regret_limit']} of {h['jobs']} jobs within it; Kendall tau mean "
             f"{h['mean_tau']}, least {h['least_tau']}; step MAPE over every run {_pct(h['step_mape'])[1:]}.**", "",
             "| job | topology | feasible plans | pick | measured fastest | regret | tau |",
             "|---|---|---|---|---|---|---|"]
    for j in data["jobs"]:
        pick = j["runs"][0]["plan"] if j["runs"] else "-"
        fastest = next((r["plan"] for r in j["runs"] if r["kind"] == j["measured_fastest"]), "-")
        lines.append(f"| {j['name']} | {j['topology']} | {j['feasible']} | `{pick}` | `{fastest}` | "
                     f"{_pct(j['regret'])} | {'-' if j['tau'] is None else j['tau']} |")
    for j in data["jobs"]:
        lines += ["", f"**{j['name']}** ({j['model']}, {j['gpus']} ranks, gbs {j['gbs']}, {j['topology']}):", "",
                  "| plan | chosen as | predicted s | measured s | runs (min-max) s | error |", "|---|---|---|---|---|---|"]
        for r in j["runs"]:
            if "failure" in r:
                lines.append(f"| `{r['plan']}` | {r['kind']} | - | failed: {r['failure']} | - | - |")
            else:
                runs = r.get("measured_runs_s") or [r["measured_s"]]
                lines.append(f"| `{r['plan']}` | {r['kind']} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | "
                             f"{min(runs):.4f}-{max(runs):.4f} ({len(runs)}) | {_pct(r['step_error'])} |")
    return "\n".join(lines)


def _train(steps: int, warmup: int, realtime: bool) -> Callable[[Case, ClusterSpec], Row]:
    from piper_core.validate.run import run_case

    return lambda case, cluster: run_case(case, cluster, steps=steps, warmup=warmup, realtime=realtime, peak=False)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m piper_core.validate.scheduler", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="full-fp32", help="the suite whose jobs are searched (default full-fp32)")
    p.add_argument("--jobs", help="comma-separated job names (the suite's group names; default: every job)")
    p.add_argument("--profiles", type=Path, default=Path(".piper/profiles"),
                   help="calibrated profiles, DIR/<topology>.yaml (calibrated first where missing)")
    p.add_argument("--recalibrate", action="store_true",
                   help="calibrate each topology afresh right before its jobs, even where a profile exists")
    p.add_argument("--top", type=int, default=TOP, help=f"best predicted plans trained per job (default {TOP})")
    p.add_argument("--random", type=int, default=RANDOM, help=f"other feasible plans drawn per job (default {RANDOM})")
    p.add_argument("--seed", type=int, default=SEED, help=f"the draw's seed, with the job's name (default {SEED})")
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help=f"runs per plan, in interleaved rounds; the median is judged (default {REPEATS})")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 12, the first 3 untimed)")
    p.add_argument("--list", action="store_true", help="print each job's chosen plans and their predictions; train nothing")
    p.add_argument("--realtime", action="store_true", help="ranks under SCHED_FIFO (root)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the runs and the figures as JSON")
    p.add_argument("--report", type=Path, metavar="FILE", help="print the tables of a recorded JSON and exit")
    return p


def _select(jobs: tuple[Job, ...], names: str | None) -> tuple[Job, ...]:
    from piper_core.errors import SpecError

    if not names:
        return jobs
    known = {j.name: j for j in jobs}
    for n in names.split(","):
        if n not in known:
            raise SpecError("--jobs", n, "is not a job of the suite", f"choose from {', '.join(known)}")
    return tuple(known[n] for n in names.split(","))


def main(argv: Sequence[str] | None = None) -> int:
    from piper_core.cli.progress import Progress
    from piper_core.cli.validate import profiles_for
    from piper_core.errors import SpecError
    from piper_core.validate.report import commit_state, profile_record, provenance
    from piper_core.validate.run import STEPS, WARMUP
    from piper_core.validate.suite import load_suite

    a = _parser().parse_args(argv)
    if a.report:
        print(report(json.loads(a.report.read_text())))
        return 0
    try:
        if a.top < 1 or a.random < 0 or a.repeats < 1:
            raise SpecError("--top/--random/--repeats", f"{a.top}/{a.random}/{a.repeats}", "top >= 1 (the pick is "
                            "judged), random >= 0 and repeats >= 1", "give e.g. --top 3 --random 3 --repeats 3")
        suite = load_suite(a.suite)
        jobs = _select(jobs_of(suite), a.jobs)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.realtime:
        from piper_core.emulate.launch import check_realtime
        check_realtime()  # before any calibration or run
    steps = a.steps or STEPS
    warmup = min(WARMUP, steps - 1)
    topologies = sorted({j.template.topology for j in jobs})
    if a.list:
        return _list(jobs, profiles_for(topologies, a.profiles, recalibrate=False, quick=False), a)
    total, done = len(jobs) * (a.top + a.random) * a.repeats, [0]
    bar = Progress("piper validate scheduler")

    def tick() -> None:
        done[0] += 1
        bar(done[0], total)

    train = _train(steps, warmup, a.realtime)
    results: dict[str, dict[str, Any]] = {}
    source, records = commit_state(), {}  # the code and each profile as the jobs were predicted
    # one topology at a time, its calibration right before its jobs (as piper validate does): the
    # profile should describe the machine the runs meet
    for topo in topologies:
        cluster = profiles_for([topo], a.profiles, recalibrate=a.recalibrate, quick=False, realtime=a.realtime)[topo]
        records[topo] = profile_record(a.profiles / f"{topo}.yaml")
        for j in jobs:
            if j.template.topology == topo:
                results[j.name] = run_job(j, cluster, top=a.top, draws=a.random, seed=a.seed, repeats=a.repeats,
                                          train=train, progress=tick)
    results = [results[j.name] for j in jobs]
    data = provenance(suite, records, source) | {
        "command": "python -m piper_core.validate.scheduler " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": _machine(), "seed": a.seed, "top": a.top, "random": a.random, "repeats": a.repeats,
        "steps": steps, "warmup": warmup,
        "jobs": results, "headline": headline(results)}
    print(report(data))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(data, indent=1))
        print(f"wrote {a.json}")
    return 0 if data["headline"]["ok"] else 1


def _list(jobs: tuple[Job, ...], profiles: Mapping[str, ClusterSpec], a: argparse.Namespace) -> int:
    from piper_core.export import plan_label

    for j in jobs:
        cluster = profiles[j.template.topology]
        t = j.template
        result = search(t.model, cluster, t.plan.gpus, t.plan.global_batch_size, space=trainer_space(t, cluster),
                        attention_backend=t.plan.attention_backend)
        print(f"{j.name} ({j.template.topology}): {result.feasible} feasible of {result.candidates}")
        for kind, s in choose(j, result, top=a.top, draws=a.random, seed=a.seed):
            print(f"  {kind:<8} {plan_label(s.plan):<40} predicted {s.step_s:.4f} s")
    return 0


def _machine() -> str:
    from piper_core.bench.e2e import machine

    m = machine()
    return f"{m['cpu']}, {m['cores']} cores, {'bf16 instructions' if m['bf16_instructions'] else 'no bf16 instructions'}"


if __name__ == "__main__":
    sys.exit(main())
