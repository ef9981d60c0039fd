"""The 1T Switch recipe's CPU twin, trained through Piper's ``--piper`` path: ``make run``'s second half.

    python -m piper_megatron.twin [--ranks 2] [--steps 6] [--profiles DIR] [--json]

The twin is the recipe's model family scaled to a laptop (``recipes/switch-1t/README.md``): top-1
routing, an MoE layer in every FFN, capacity factor 1.25 with padding, non-gated experts, RMSNorm,
RoPE, untied embeddings -- 4 layers of width 128 with 8 experts. It is written as Megatron-LM
``pretrain_gpt.py`` flags plus ``--piper --piper-profile PROFILE``, and goes through what ``--piper``
does in a Megatron-LM job (:func:`piper_megatron.install.plan_job`: the model spec read off the
flags, the scheduler's search, the argument rewrite), then trains the chosen plan for a few steps
on local CPU ranks with Megatron-Core and Piper's dispatcher (:mod:`piper_megatron.train`), and
prints the plan and the predicted and measured step time side by side.

The search is limited to what the CPU trainer runs (tp 1, no vpp/cp, no distributed optimizer, no
recompute, no memory savers); the profile is this machine's calibration for the rank count
(``piper calibrate``; made on first use and kept in ``--profiles``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from piper_core.scheduler.space import SearchSpace
from piper_core.specs.yamlio import to_dict

TWIN_ARGS: tuple[str, ...] = (
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "2", "--ffn-hidden-size", "512",
    "--num-experts", "8", "--moe-router-topk", "1", "--moe-expert-capacity-factor", "1.25",
    "--moe-pad-expert-input-to-capacity", "--moe-token-dispatcher-type", "alltoall",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--seq-length", "128", "--max-position-embeddings", "128",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--make-vocab-size-divisible-by", "128",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--attention-backend", "unfused",
    "--global-batch-size", "8", "--bf16",
)
STEPS, WARMUP = 8, 3


def cpu_trainer_space(space: SearchSpace) -> SearchSpace:
    """The part of the space :mod:`piper_megatron.train` runs on CPU ranks."""
    return dataclasses.replace(space, tp=(1,), vpp=(1,), cp=(1,), etp_equals_tp=(False,), recompute=("none",),
                               distributed_optimizer=(False,), memory_savers=((False, 0.0),))


def main(argv: Sequence[str] | None = None) -> int:
    from piper_core.cli.validate import DEFAULT_PROFILES, profiles_for
    from piper_megatron.args import apply_settings, megatron_settings, parse_megatron_args, parse_piper_options
    from piper_megatron.install import dispatcher_description, plan_job, report
    from piper_megatron.train import TrainJob, run, summary

    p = argparse.ArgumentParser(prog="python -m piper_megatron.twin", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="local CPU ranks (default 2)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps, the first {WARMUP} untimed")
    p.add_argument("--profiles", type=Path, default=DEFAULT_PROFILES, help="calibrated profiles directory")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--realtime", action="store_true", help="ranks under SCHED_FIFO (root): steadier timings on a "
                   "busy machine")
    a = p.parse_args(argv)
    start = time.perf_counter()
    if a.realtime:
        from piper_core.emulate.launch import check_realtime
        check_realtime()
    topology = f"local-{a.ranks}"
    profiles_for([topology], a.profiles, recalibrate=False, quick=True, realtime=a.realtime)
    profile = a.profiles / f"{topology}.yaml"
    flags = [*TWIN_ARGS, "--piper", "--piper-profile", str(profile)]
    ns = parse_megatron_args(flags)
    planned = plan_job(ns, flags, parse_piper_options(flags), world_size=a.ranks, limit=cpu_trainer_space)
    changes = apply_settings(ns, megatron_settings(planned.model, planned.top.plan, planned.pins))
    if not a.json:
        print("pretrain_gpt.py " + " ".join(flags))
        print(report(planned, changes, dispatcher_description(planned)), flush=True)
    plan = planned.top.plan
    reports = run(TrainJob(model=planned.model, plan=plan, steps=a.steps, warmup=WARMUP), realtime=a.realtime)
    s = summary(reports)
    measured = statistics.median(s["step_s"][WARMUP:])
    predicted = planned.top.time.step
    result = {"model": planned.model.name, "profile": str(profile), "ranks": a.ranks,
              "plan": to_dict(plan),
              "predicted_step_s": round(predicted, 5), "measured_step_s": round(measured, 5),
              "error": round((predicted - measured) / measured, 4), "step_s": [round(x, 5) for x in s["step_s"]],
              "losses": [round(x, 4) for x in s["losses"]], "wall_s": round(time.perf_counter() - start, 1)}
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    how = " (SCHED_FIFO)" if a.realtime else ""
    print(f"twin trained {a.steps} steps on {a.ranks} CPU ranks{how}: loss {s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}")
    print(f"step time: predicted {predicted:.3f} s | measured {measured:.3f} s (median of steps {WARMUP + 1}-{a.steps}) | "
          f"error {100 * result['error']:+.1f}%   [{result['wall_s']:.0f} s wall]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
