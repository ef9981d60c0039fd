"""The 1T Switch recipe's CPU twin, trained through ``--piper``: ``make run``'s second half.

    python -m piper_megatron.twin [--ranks 2] [--steps 8] [--profiles DIR] [--megatron-lm DIR] [--json]

The twin is the recipe's model family scaled to a laptop (``recipes/switch-1t/README.md``): top-1
routing, an MoE layer in every FFN, capacity factor 1.25 with padding, non-gated experts, RMSNorm,
RoPE, untied embeddings -- 4 layers of width 128 with 8 experts, bf16 as the recipe where the CPU
has bf16 instructions (AVX512-BF16 or AMX), else fp32 (``--precision auto``, the default, says
which; on such a CPU a bf16 step is torch's emulation, 50-100x slower, nothing like a GPU's bf16),
written as Megatron-LM ``pretrain_gpt.py`` flags plus ``--piper --piper-profile PROFILE`` (this
machine's calibration for the rank count and precision, made on first use with ``piper calibrate
--quick [--precision fp32]`` and kept in ``--profiles``).

* With a Megatron-LM checkout (``--megatron-lm DIR``, else ``$PIPER_MEGATRON_LM``, else
  ``../shared/third_party/megatron-lm-core_v0.16.1`` beside the repository), its own
  ``pretrain_gpt.py`` trains the twin on local CPU ranks: ``torchrun ... -m
  piper_megatron.cpu_launch pretrain_gpt.py <flags> --piper ...`` (:mod:`piper_megatron.cpu_run`).
  ``--piper`` plans inside Megatron's argument validation, rewrites the arguments and installs
  Piper's dispatcher; Megatron trains on mock data. Measured: Megatron's ``elapsed time per
  iteration``.
* Without one, Piper's own instrumented trainer (:mod:`piper_megatron.train`: Megatron-Core's
  GPTModel, DDP and schedule, not ``megatron.training``) trains the plan ``--piper`` makes from the
  same flags, the search limited to what that trainer runs (tp 1, no vpp/cp, no distributed
  optimizer, no recompute, no memory savers). Measured: the slowest rank's step between barriers.

Either way the command, Piper's plan and the predicted and measured step time are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piper_core.scheduler.space import SearchSpace
from piper_core.specs.yamlio import to_dict

TWIN_ARGS: tuple[str, ...] = (
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "2", "--ffn-hidden-size", "512",
    "--num-experts", "8", "--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-expert-capacity-factor", "1.25",
    "--moe-pad-expert-input-to-capacity", "--moe-token-dispatcher-type", "alltoall",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--seq-length", "128", "--max-position-embeddings", "128",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--make-vocab-size-divisible-by", "128",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--attention-backend", "unfused",
    "--global-batch-size", "8",
)
STEPS, WARMUP = 8, 3
ENV_CHECKOUT = "PIPER_MEGATRON_LM"
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300.0


def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def twin_precision(asked: str) -> tuple[str, str | None]:
    """The precision the twin trains in (``bf16`` or ``fp32``) and, for ``auto``, why."""
    if asked != "auto":
        return asked, None
    if native_bf16():
        return "bf16", None
    return "fp32", ("this CPU has no bf16 instructions (avx512_bf16/amx_bf16): the twin trains in fp32 (no --bf16), "
                    "predicted from an fp32 calibration; --precision bf16 trains the recipe's bf16 in torch's emulation")


def twin_args(precision: str) -> list[str]:
    """The twin's Megatron-LM flags in ``precision`` (fp32: Megatron's default, no flag)."""
    return [*TWIN_ARGS, *(["--bf16"] if precision == "bf16" else [])]


def cpu_trainer_space(space: SearchSpace) -> SearchSpace:
    """The part of the space :mod:`piper_megatron.train` runs on CPU ranks."""
    return dataclasses.replace(space, tp=(1,), vpp=(1,), cp=(1,), etp_equals_tp=(False,), recompute=("none",),
                               distributed_optimizer=(False,), memory_savers=((False, 0.0),))


def script_flags(steps: int) -> list[str]:
    """What ``pretrain_gpt.py`` needs beyond the twin's flags on CPU ranks: the CPU flags it lacks,
    mock data, ``steps`` iterations logged one by one, no evaluation, a short collective timeout."""
    from piper_megatron.cpu_launch import missing_cpu_flags

    cpu = [word for flag in missing_cpu_flags(twin_args("bf16")) for word in flag.split()]
    return [*cpu, "--mock-data", "--train-iters", str(steps), "--lr", "1e-3", "--log-interval", "1",
            "--eval-iters", "0", "--eval-interval", str(steps + 1), "--distributed-timeout-minutes", "3"]


def _short(path: Path | str) -> str:
    """``path`` relative to the working directory when it lies below its parent (shorter to print)."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("../../") else str(path)


def _report_lines(stdout: str) -> list[str]:
    """Piper's report as rank 0 printed it inside Megatron's validate_args (planning ... dispatcher)."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("piper: planning ")), None)
    end = next((i for i, line in enumerate(lines) if line.startswith("piper: token dispatcher:")), None)
    return [] if start is None or end is None else lines[start:end + 1]


def run_real_script(script: Path, flags: list[str], planned: Any, a: argparse.Namespace) -> dict[str, Any]:
    """Train the twin with ``script`` (Megatron-LM's pretrain_gpt.py) on local CPU ranks."""
    from piper_core.cli.plan import describe
    from piper_core.emulate.launch import REALTIME_PRIORITY
    from piper_megatron.cpu_run import RunFailed, run_script

    args = [*flags, *script_flags(a.steps)]
    try:
        run = run_script(Path(_short(script)), args, ranks=a.ranks, timeout_s=TIMEOUT_S,
                         realtime_priority=REALTIME_PRIORITY if a.realtime else None,
                         executable=_short(sys.executable), announce=None if a.json else sys.stdout)
    except RunFailed as exc:
        raise SystemExit(f"piper: the twin's pretrain_gpt.py run failed: {exc}") from None
    chosen = f"best: {describe(planned.top.plan)}"
    if chosen not in run.stdout.splitlines():
        raise SystemExit(f"piper: pretrain_gpt.py planned differently from this process ({chosen!r} not in its "
                         f"output):\n{run.stdout[-3000:]}")
    timed = run.step_ms[WARMUP:]
    return {"runner": "pretrain_gpt.py", "command": list(run.command), "report": _report_lines(run.stdout),
            "step_s": [round(ms / 1e3, 5) for ms in run.step_ms], "losses": run.losses,
            "measured_step_s": statistics.median(timed) / 1e3 if timed else float("nan")}


def run_own_trainer(planned: Any, a: argparse.Namespace) -> dict[str, Any]:
    """Train the plan with :mod:`piper_megatron.train` (Piper's trainer, no megatron.training)."""
    from piper_megatron.train import TrainJob, run, summary

    s = summary(run(TrainJob(model=planned.model, plan=planned.top.plan, steps=a.steps, warmup=WARMUP),
                    realtime=a.realtime))
    return {"runner": "piper_megatron.train", "step_s": [round(x, 5) for x in s["step_s"]], "losses": s["losses"],
            "measured_step_s": statistics.median(s["step_s"][WARMUP:])}


def _checkout(given: Path | None) -> Path:
    """``--megatron-lm``, else ``$PIPER_MEGATRON_LM``, else the project's copy beside the repository."""
    from piper_megatron.cpu_run import default_checkout

    if given is not None:
        return given
    env = os.environ.get(ENV_CHECKOUT)
    return Path(env) if env else default_checkout(REPO)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m piper_megatron.twin", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="local CPU ranks (default 2)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps, the first {WARMUP} untimed")
    p.add_argument("--profiles", type=Path, default=None, help="calibrated profiles directory")
    p.add_argument("--megatron-lm", type=Path, default=None, metavar="DIR",
                   help=f"Megatron-LM checkout with pretrain_gpt.py (default ${ENV_CHECKOUT}, else the project's "
                        "core_v0.16.1 copy); without one Piper's own trainer runs the twin")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16 (the recipe's) or fp32; auto (default): bf16 where the CPU has bf16 instructions")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--realtime", action="store_true", help="ranks under SCHED_FIFO (root): steadier timings on a "
                   "busy machine")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from piper_core.cli.validate import DEFAULT_PROFILES, profiles_for
    from piper_megatron.args import apply_settings, megatron_settings, parse_megatron_args, parse_piper_options
    from piper_megatron.cpu_run import find_script
    from piper_megatron.install import dispatcher_description, plan_job, report
    from piper_megatron.versions import distribution_release

    a = _parser().parse_args(argv)
    start = time.perf_counter()
    if a.realtime:
        from piper_core.emulate.launch import check_realtime
        check_realtime()
    profiles = a.profiles or DEFAULT_PROFILES
    precision, why = twin_precision(a.precision)
    if why and not a.json:
        print(f"piper: {why}", flush=True)
    topology = f"local-{a.ranks}" + ("-fp32" if precision == "fp32" else "")
    profiles_for([topology], profiles, recalibrate=False, quick=True, realtime=a.realtime)
    profile = profiles / f"{topology}.yaml"
    flags = [*twin_args(precision), "--piper", "--piper-profile", str(profile)]
    checkout = _checkout(a.megatron_lm)
    script = find_script(checkout)
    ns = parse_megatron_args(flags)
    planned = plan_job(ns, flags, parse_piper_options(flags), world_size=a.ranks,
                       limit=None if script else cpu_trainer_space,
                       release=distribution_release() if script else None)  # as pretrain_gpt.py's --piper plans
    if script is not None:
        if not a.json:
            print(f"piper: training the twin with Megatron-LM's own {_short(script)} on {a.ranks} CPU ranks:")
        result = run_real_script(script, flags, planned, a)
        if not a.json:
            print("\n".join(result["report"]))
    else:
        if not a.json:
            print(f"piper: no Megatron-LM checkout at {_short(checkout)} (pass --megatron-lm DIR or set "
                  f"{ENV_CHECKOUT}): training the twin with Piper's own trainer (piper_megatron.train: "
                  "Megatron-Core's model, DDP and schedule; not pretrain_gpt.py), on the plan --piper makes "
                  "from these flags, limited to what that trainer runs:")
            print("the twin's Megatron-LM flags: " + " ".join(flags))
            changes = apply_settings(ns, megatron_settings(planned.model, planned.top.plan, planned.pins))
            print(report(planned, changes, dispatcher_description(planned)), flush=True)
        result = run_own_trainer(planned, a)
    predicted, measured = planned.top.time.step, result["measured_step_s"]
    result |= {"model": planned.model.name, "profile": str(profile), "ranks": a.ranks, "precision": precision,
               "plan": to_dict(planned.top.plan),
               "predicted_step_s": round(predicted, 5), "measured_step_s": round(measured, 5),
               "error": round((predicted - measured) / measured, 4), "losses": [round(x, 4) for x in result["losses"]],
               "wall_s": round(time.perf_counter() - start, 1)}
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    how = " (SCHED_FIFO)" if a.realtime else ""
    losses = result["losses"]
    what = "Megatron-LM's pretrain_gpt.py" if script is not None else "Piper's trainer"
    print(f"{what} trained the twin {a.steps} steps on {a.ranks} CPU ranks{how}: loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}")
    clock = "Megatron's elapsed time per iteration" if script is not None else "slowest rank"
    print(f"step time: predicted {predicted:.3f} s | measured {measured:.3f} s (median of steps {WARMUP + 1}-"
          f"{a.steps}, {clock}) | error {100 * result['error']:+.1f}%   [{result['wall_s']:.0f} s wall]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
