"""End-to-end training benchmark: the stock dispatcher / MoE layer against Piper's exchanges, in real
Megatron-Core and DeepSpeed-MoE training on the emulated cluster (:mod:`piper_core.emulate`; root).

Run: ``python -m piper_core.bench.e2e [--frameworks megatron,deepspeed] [--topologies 2x1,2x2]
[--mbits 5,1000] [--workloads small,wide] [--rounds 5] [--profiles DIR] [--json FILE]`` (``make
bench-e2e``; the full grid takes hours on 2 cores: see :func:`estimate_s`).

For each case (workload x framework x topology x link rate) the benchmark

1. calibrates the model on this machine for that case (``piper calibrate --emulate NxR
   --inter-node-mbit M --framework F --quick``), unless ``--profiles DIR`` already holds the profile;
2. **declares** before any timed run, from that profile and the rule in :func:`declare` (committed
   code, not a choice made after the fact): the plan's sizes (fixed: ep = world, the model and batch
   below), the chunk count ``N`` of the pipelined variants (the model's best count >= 2) and the
   **judged variant**, the model's pick among Piper's exchanges (algorithm x chunks 1/2/4/8). The
   declaration is written to the results before the first measurement and printed;
3. runs every variant, ``stock``, ``flat/1``, ``hierarchical/1``, ``flat/N``, ``hierarchical/N``,
   ``flat/tune``, ``hierarchical/tune``, as separate jobs, rounds interleaved (round r runs every
   variant once, in an order rotated by r), ``--rounds`` rounds (>= 5 for a result);
4. reports per variant the median step (the slowest rank's step time, median over timed steps, then
   median over rounds) with its spread (min-max over rounds), the speedup over stock, the gain of
   pipelining apart from the transport (``X/N`` over ``X/1``, same algorithm), the exchange share of
   the stock step (the model's, from the profile), and the model's predicted step beside each.

Every run counts: nothing is dropped, a failed run is recorded with its error and fails the verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

# The jobs (fixed before any run), each a workload: a model and the micro-batches each data-parallel
# rank runs per step (micro-batch size MICRO_BATCH). Capacity factor 1.0, padded (as piper validate's
# models: dropless routing would time oneDNN's primitive creation for every new expert row count,
# piper_core/validate/cases.py).
# ``small``: a 4-layer MoE decoder whose bf16 step on a CPU core is a fraction of a second, so a slow
# link makes the exchange a large share of the step, with little expert compute to hide it behind.
MODEL = ModelSpec(name="e2e-moe", num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                  num_experts=4, moe_ffn_hidden_size=512, moe_router_topk=1, moe_capacity_factor=1.0,
                  vocab_size=1024, seq_length=128, normalization="LayerNorm", gated_linear_unit=False)
# ``wide``: experts 16x wider (expert GEMMs comparable to the exchange at tens of Mbit/s on a core with
# bf16 instructions), a small vocabulary (a smaller dense-gradient all-reduce over the same link) and 16
# micro-batches of 256 tokens (the exchange grows with the tokens, the all-reduce does not). Sized with
# the model (piper_core/timing) on this machine's 50 Mbit/s calibration so that the exchange is >= 40 %
# of the stock step, before any run; the declaration then comes from each case's own calibration.
# ``wide-2k``: the same model and tokens per step in 2 micro-batches of 2048 tokens (micro-batch 16),
# as real MoE training exchanges thousands of tokens per micro-batch (sequences of 4k and more): 8x
# fewer, 8x larger messages, so a chunk of the pipelined exchange is not mostly per-message overhead.
# Added after ``wide``'s runs measured pipelining at about 1x (docs/e2e.md); both are reported.
WIDE = dataclasses.replace(MODEL, name="e2e-moe-wide", hidden_size=256, moe_ffn_hidden_size=8192, vocab_size=256)
MICRO_BATCH = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A model, its micro-batch size and the micro-batches per data-parallel rank and step."""

    name: str
    model: ModelSpec
    micro_batches: int
    micro_batch: int = MICRO_BATCH


WORKLOADS = {w.name: w for w in (Workload(name="small", model=MODEL, micro_batches=2),
                                 Workload(name="wide", model=WIDE, micro_batches=16),
                                 Workload(name="wide-2k", model=WIDE, micro_batch=16, micro_batches=2))}


FRAMEWORKS = ("megatron", "deepspeed")
TOPOLOGIES = ((2, 1), (2, 2))
MBITS = (5.0, 1000.0)  # a slow link (the exchange a large share of the step) and a fast one (a small share)
ROUNDS, TIMED_STEPS, WARMUP = 5, 4, 2
CHUNK_CHOICES = (1, 2, 4, 8)
TUNE_CALLS = 4 * 3  # AutoChunks over 1/2/4/8 chunks, 3 trials each, counted in MoE layer calls (micro-batches)
RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One framework on one emulated cluster."""

    framework: str
    nodes: int
    ranks_per_node: int
    mbit: float
    workload: str = "small"

    @property
    def name(self) -> str:
        tag = "" if self.workload == "small" else f"-{self.workload}"
        return f"{self.cluster_name}{tag}"

    @property
    def cluster_name(self) -> str:
        """The emulated cluster's name (its calibration profile's): the workload does not enter it."""
        return f"{self.framework}-{self.nodes}x{self.ranks_per_node}-{self.mbit:g}mbit"

    @property
    def load(self) -> Workload:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload {self.workload!r} is not one of {sorted(WORKLOADS)}: "
                             f"pass --workloads with names from that list")
        return WORKLOADS[self.workload]

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


def base_plan(case: Case) -> ParallelPlan:
    """The plan every variant of ``case`` shares: ep = world (every rank holds its experts), bf16,
    no distributed optimizer (DeepSpeed's CPU trainer runs ZeRO 0; Megatron-Core's has run Megatron's
    distributed optimizer since 2026-12-06, after the recorded runs, which stay comparable without it);
    Megatron's CPU path runs unfused attention, Piper's DeepSpeed model torch's SDPA (priced as flash)."""
    return ParallelPlan(gpus=case.world, ep=case.world, micro_batch_size=case.load.micro_batch,
                        global_batch_size=case.load.micro_batch * case.load.micro_batches * case.world, distributed_optimizer=False,
                        attention_backend="unfused" if case.framework == "megatron" else "flash")


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """``stock``, or Piper's ``algorithm`` in ``chunks`` (``tune``: counted at run time; ``defer``:
    the experts' weight gradients deferred, ``+dwg``)."""

    name: str
    stock: bool = False
    algorithm: str = "flat"
    chunks: int = 1
    tune: bool = False
    defer: bool = False

    def plan(self, base: ParallelPlan) -> ParallelPlan:
        return dataclasses.replace(base, a2a=self.algorithm, a2a_chunks=self.chunks, defer_wgrad=self.defer)


def variants(chunks: int) -> tuple[Variant, ...]:
    """Every variant the issue asks for, with the declared chunk count ``chunks`` (>= 2)."""
    out = [Variant(name="stock", stock=True)]
    for algorithm in ("flat", "hierarchical"):
        out.append(Variant(name=f"{algorithm}/1", algorithm=algorithm))
    for algorithm in ("flat", "hierarchical"):
        out.append(Variant(name=f"{algorithm}/{chunks}", algorithm=algorithm, chunks=chunks))
    for algorithm in ("flat", "hierarchical"):
        out.append(Variant(name=f"{algorithm}/tune", algorithm=algorithm, chunks=chunks, tune=True))
    return tuple(out)


def parse_variant(name: str) -> Variant:
    """The variant named ``name``: ``stock``, ``ALGORITHM/CHUNKS`` or ``ALGORITHM/tune``, the last two
    optionally with ``+dwg`` (the experts' weight gradients deferred) (``--variants``)."""
    if name == "stock":
        return Variant(name=name, stock=True)
    exchange, plus, suffix = name.partition("+")
    algorithm, _, chunks = exchange.partition("/")
    if algorithm not in ("flat", "hierarchical") or not (chunks == "tune" or chunks.isdigit() and int(chunks) >= 1) \
            or (plus and suffix != "dwg"):
        raise ValueError(f"--variants: {name!r} is not a variant; name stock, ALGORITHM/CHUNKS or ALGORITHM/tune "
                         f"with ALGORITHM flat or hierarchical, each optionally +dwg (e.g. stock,flat/1,flat/1+dwg)")
    defer = bool(plus)
    if chunks == "tune":
        return Variant(name=name, algorithm=algorithm, chunks=max(CHUNK_CHOICES), tune=True, defer=defer)
    return Variant(name=name, algorithm=algorithm, chunks=int(chunks), defer=defer)


def warmup_steps(variant: Variant, micro_batches: int = 2) -> int:
    """Untimed steps: :data:`WARMUP`, plus the tuning steps of a tuned variant (every MoE layer
    measures :data:`TUNE_CALLS` calls, one per micro-batch), so the timed steps run the choice."""
    if not variant.tune:
        return WARMUP
    return WARMUP + -(-TUNE_CALLS // micro_batches)


def declare(case: Case, cluster: Any) -> dict[str, Any]:
    """The declaration of ``case`` from the calibrated ``cluster``, made before any timed run: the
    predicted step of stock and of every Piper exchange (algorithm x chunks), the judged variant
    (Piper's best predicted; ties to fewer chunks, then flat) and the chunk count of the pipelined
    variants (the best predicted >= 2 of either algorithm), and the exchange's share of the
    predicted stock step."""
    from piper_core.timing.step import step_time

    base, model = base_plan(case), case.load.model
    predicted = {}
    for algorithm in ("flat", "hierarchical"):
        for chunks in CHUNK_CHOICES:
            predicted[f"{algorithm}/{chunks}"] = step_time(model, dataclasses.replace(
                base, a2a=algorithm, a2a_chunks=chunks), cluster).step
    stock = step_time(model, base, cluster)  # the stock dispatcher's exchange is priced as flat/1
    order = sorted(predicted, key=lambda k: (round(predicted[k], 9), int(k.split("/")[1]), k.split("/")[0] != "flat"))
    for key in list(predicted):  # +dwg (--variants): priced beside, never judged
        algorithm, chunks = key.split("/")
        predicted[f"{key}+dwg"] = step_time(model, dataclasses.replace(
            base, a2a=algorithm, a2a_chunks=int(chunks), defer_wgrad=True), cluster).step
    piped = [k for k in order if k.split("/")[1] != "1"]
    return {"case": case.name, "workload": case.workload, "model": model.name, "plan": {"gpus": base.gpus, "ep": base.ep, "mbs": base.micro_batch_size,
                                        "gbs": base.global_batch_size, "attention": base.attention_backend},
            "judged": order[0], "chunks": int(piped[0].split("/")[1]), "predicted_s": predicted,
            "predicted_stock_s": stock.step, "exchange_share_of_stock": stock.exposed_a2a / stock.step,
            "cluster": cluster.name}


def calibrate(case: Case, profiles: Path) -> Path:
    """The calibration profile of ``case`` in ``profiles`` (made with ``piper calibrate --quick`` if
    absent; a profile is of the machine it was made on)."""
    path = profiles / f"{case.cluster_name}.yaml"
    if not path.exists():
        profiles.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "piper_core.cli.main", "calibrate", "--out", str(path), "--emulate",
               f"{case.nodes}x{case.ranks_per_node}", "--inter-node-mbit", f"{case.mbit:g}", "--framework",
               case.framework, "--quick", "--realtime"]
        print("$ " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
    return path


def run_variant(case: Case, variant: Variant, timed_steps: int = TIMED_STEPS) -> dict[str, Any]:
    """One job of ``variant`` on ``case``'s emulated cluster, ``timed_steps`` steps timed after the
    warm-up: the slowest rank's step times, the losses, or the error."""
    from piper_core import trainers
    from piper_core.validate.instrument import TrainJob, summary

    warm = warmup_steps(variant, case.load.micro_batches)
    job = TrainJob(model=case.load.model, plan=variant.plan(base_plan(case)), steps=warm + timed_steps, warmup=warm,
                   stock=variant.stock, tune=variant.tune)
    start = time.perf_counter()
    try:
        reports = trainers.get(case.framework).run(job, nodes=case.nodes, inter_node_mbit=case.mbit,
                                                   timeout_s=RUN_TIMEOUT_S, realtime=True)
    except Exception as exc:  # recorded, counted as a failure of the verdict
        return {"variant": variant.name, "error": f"{type(exc).__name__}: {exc}", "wall_s": time.perf_counter() - start}
    s = summary(reports)
    timed = s["step_s"][warm:]
    out = {"variant": variant.name, "step_s": statistics.median(timed), "steps_s": s["step_s"], "warmup": warm,
           "losses": s["losses"], "wall_s": time.perf_counter() - start}
    if s.get("moe_phases_ms_per_step"):  # Piper's tracer (Megatron): rank 0's forward phases per timed step
        out["moe_phases_ms_per_step"] = s["moe_phases_ms_per_step"]
    return out


def rounds_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: the variants rotated by ``r`` (so no variant always runs first)."""
    k = r % len(names)
    return names[k:] + names[:k]


def stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread (min, max) of the per-round medians; failures counted."""
    ok = [r["step_s"] for r in runs if "step_s" in r]
    failed = len(runs) - len(ok)
    if not ok:
        return {"median_s": None, "min_s": None, "max_s": None, "rounds": 0, "failed": failed}
    return {"median_s": statistics.median(ok), "min_s": min(ok), "max_s": max(ok), "rounds": len(ok),
            "failed": failed}


def predicted_step(prediction: dict[str, Any], chunks: int, name: str) -> float | None:
    """The predicted step of variant ``name`` in a declaration's ``prediction`` (``X/tune`` priced as
    ``X/chunks``, the declared chunk count)."""
    if name == "stock":
        return prediction["predicted_stock_s"]
    exchange, plus, suffix = name.partition("+")
    key = exchange if not exchange.endswith("/tune") else f"{exchange.split('/')[0]}/{chunks}"
    return prediction["predicted_s"].get(key + plus + suffix)


def model_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1 (None where either is missing)."""
    return predicted / measured - 1 if predicted and measured else None


def summarize(declared: dict[str, Any], runs: list[dict[str, Any]], *, diagnostic: bool = False) -> dict[str, Any]:
    """Per variant: stats, speedup over stock, predicted step; the pipelining gain per algorithm
    (X/N over X/1); and the verdicts the issue states, with the judged variant. ``diagnostic`` (a
    ``--variants`` subset): the same table, and no verdict."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    table = {name: stats(rs) for name, rs in by.items()}
    stock = table.get("stock", {}).get("median_s")
    n = declared["chunks"]
    for name, row in table.items():
        row["speedup_vs_stock"] = stock / row["median_s"] if stock and row["median_s"] else None
        row["predicted_s"] = predicted_step(declared, n, name)
        row["model_error"] = model_error(row["predicted_s"], row["median_s"])
    gains = {}
    for algorithm in ("flat", "hierarchical"):
        one, piped = table.get(f"{algorithm}/1", {}), table.get(f"{algorithm}/{n}", {})
        if one.get("median_s") and piped.get("median_s"):
            gains[algorithm] = one["median_s"] / piped["median_s"]
    judged = table.get(declared["judged"], {})
    share = declared["exchange_share_of_stock"]
    verdict = {"judged": declared["judged"], "speedup_vs_stock": judged.get("speedup_vs_stock"),
               "pipelining_gain": gains, "failed_runs": sum(r["failed"] for r in table.values())}
    if diagnostic:
        verdict["target"] = "diagnostic run of chosen variants (--variants): no verdict"
        verdict["met"] = None
    elif share >= 0.40:
        verdict["target"] = "exchange >= 40 % of the stock step: judged >= 1.3x stock, pipelining >= 1.2x"
        verdict["met"] = bool(verdict["speedup_vs_stock"] and verdict["speedup_vs_stock"] >= 1.3
                              and max(gains.values(), default=0) >= 1.2 and not verdict["failed_runs"])
    elif share < 0.10:
        verdict["target"] = "exchange < 10 % of the stock step: judged no more than 3 % slower than stock"
        verdict["met"] = bool(verdict["speedup_vs_stock"] and verdict["speedup_vs_stock"] >= 1 / 1.03
                              and not verdict["failed_runs"])
    else:
        verdict["target"] = "exchange 10-40 % of the stock step: no target; reported"
        verdict["met"] = None
    return {"table": table, "pipelining_gain": gains, "verdict": verdict}


def estimate_s(cases: list[Case], rounds: int, count: int = 7, per_run_s: float = 45.0) -> float:
    """A rough wall time: ``count`` variants x rounds x cases runs of about ``per_run_s``, plus ~3 min
    of calibration per case."""
    return len(cases) * (rounds * count * per_run_s + 180.0)


def machine() -> dict[str, Any]:
    """What the measurement ran on: the CPU's model name, whether it has bf16 instructions (without
    them a bf16 GEMM runs 50-100x slower here, which moves every predicted and measured step), the
    core count and Python."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": name, "bf16_instructions": bool(flags & {"avx512_bf16", "amx_bf16"}),
            "cores": os.cpu_count(), "python": platform.python_version()}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    from piper_core.calibrate.profile import load_profile
    from piper_core.emulate import emulation_available

    p = argparse.ArgumentParser(prog="python -m piper_core.bench.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--topologies", default=",".join(f"{n}x{r}" for n, r in TOPOLOGIES), help="NODESxRANKS,...")
    p.add_argument("--mbits", default=",".join(f"{m:g}" for m in MBITS), help="inter-node link rates, Mbit/s")
    p.add_argument("--workloads", default="small", help=f"jobs to train, of {', '.join(WORKLOADS)} (see WORKLOADS)")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--timed-steps", type=int, default=TIMED_STEPS,
                   help="steps timed per run after the warm-up (more for short steps: the median's resolution)")
    p.add_argument("--profiles", type=Path, default=Path(".piper/e2e-profiles"),
                   help="calibration profiles of this machine, one per case (made if absent)")
    p.add_argument("--json", type=Path, default=Path("docs/e2e/results.json"), help="results (written after every run)")
    p.add_argument("--variants", metavar="NAMES",
                   help="a diagnostic run of these variants only (e.g. flat/1,flat/4); no verdict is given")
    a = p.parse_args(argv)
    try:
        chosen = None if a.variants is None else [parse_variant(n) for n in a.variants.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    why = emulation_available()
    if why is not None:
        print(f"piper bench-e2e: the emulated cluster cannot be built here: {why}", file=sys.stderr)
        return 2
    for key, value in (("--rounds", a.rounds), ("--timed-steps", a.timed_steps)):
        if value < 1:
            p.error(f"{key} {value}: must be at least 1 (a result needs --rounds 5 or more)")
    unknown = [w for w in a.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        p.error(f"--workloads {a.workloads!r}: {', '.join(unknown)} is not one of {', '.join(WORKLOADS)}")
    cases = [Case(framework=f, nodes=int(t.split("x")[0]), ranks_per_node=int(t.split("x")[1]), mbit=float(m),
                  workload=w)
             for w in a.workloads.split(",") for f in a.frameworks.split(",") for t in a.topologies.split(",")
             for m in a.mbits.split(",")]
    out: dict[str, Any] = {"command": "python -m piper_core.bench.e2e " + " ".join(argv or sys.argv[1:]),
                           "commit": _git_commit(), "machine": machine(),
                           "workloads": {w: {"model": dataclasses.asdict(WORKLOADS[w].model), "micro_batch": WORKLOADS[w].micro_batch,
                                             "micro_batches": WORKLOADS[w].micro_batches}
                                         for w in a.workloads.split(",")},
                           "rounds": a.rounds, "steps_timed": a.timed_steps,
                           "cases": []}
    count = len(chosen) if chosen else 7
    print(f"piper bench-e2e: {len(cases)} cases x {count} variants x {a.rounds} rounds, about "
          f"{estimate_s(cases, a.rounds, count) / 3600:.1f} h", flush=True)
    for case in cases:
        cluster = load_profile(calibrate(case, a.profiles))
        declared = declare(case, cluster)
        entry = {"declared": declared, "runs": []} | ({"variants": [v.name for v in chosen]} if chosen else {})
        out["cases"].append(entry)
        _write(a.json, out)
        print(f"[{case.name}] declared before the runs: judged {declared['judged']}, pipelined variants in "
              f"{declared['chunks']} chunks; predicted exchange share of the stock step "
              f"{declared['exchange_share_of_stock']:.0%}", flush=True)
        run_these = chosen or variants(declared["chunks"])
        names, by_name = [v.name for v in run_these], {v.name: v for v in run_these}
        for r in range(a.rounds):
            for name in rounds_order(names, r):
                run = run_variant(case, by_name[name], a.timed_steps) | {"round": r}
                entry["runs"].append(run)
                _write(a.json, out)
                shown = f"{run['step_s']:.3f} s" if "step_s" in run else run["error"]
                print(f"[{case.name}] round {r + 1}/{a.rounds} {name:18s} {shown}  ({run['wall_s']:.0f} s wall)",
                      flush=True)
        entry["summary"] = summarize(declared, entry["runs"], diagnostic=chosen is not None)
        _write(a.json, out)
    from piper_core.bench.e2e_report import report

    print(report(out))
    return 0


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
