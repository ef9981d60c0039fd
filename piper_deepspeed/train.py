"""Train a Switch-style decoder on DeepSpeed-MoE, built from a Piper model spec.

    python -m piper_deepspeed.train --config ds.json --model tiny-moe --steps 20 --spawn 4
    deepspeed --num_gpus 8 --module piper_deepspeed.train --config ds.json --model switch-1t ...
    torchrun --nproc-per-node 8 -m piper_deepspeed.train --config ds.json --model switch-1t ...

With a ``"piper"`` block in the config, the plan comes from :func:`piper_deepspeed.plan_for` for the
world size, the model is built for it (:func:`piper_deepspeed.builder.build_model`) and
:func:`piper_deepspeed.initialize` takes over; without one, stock ``deepspeed.initialize`` runs the
model built with ``--ep`` (and ``--stages`` with ``--pipeline``). Data: ``--data FILE`` trains on the
file's bytes (a byte-level vocabulary, so the model's vocab_size must be >= 256), otherwise on
synthetic arithmetic sequences (token t+1 = token t + a per-sequence stride, mod the vocabulary),
which a small model learns within tens of steps. Each data-parallel rank draws its own batches from
(seed, step, micro-batch, data-parallel rank). Rank 0 logs the loss (mean over data-parallel ranks
and micro-batches) and throughput every step; ``--log FILE`` also writes them as JSON lines.

``--spawn N`` starts N local processes itself (gloo on CPU, NCCL on GPUs), as torchrun would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from piper_core.errors import Infeasible, SpecError
from piper_core.presets import load_model
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainArgs:
    """What to train. ``config``: the DeepSpeed config (dict); ``model``: a preset name or ModelSpec
    YAML path (None: the block's ``model``); ``ep``/``stages``: the layout without a piper block."""

    config: dict[str, Any]
    model: str | None = None
    steps: int = 20
    data: Path | None = None
    seed: int = 1234
    ep: int = 1
    pipeline: bool = False
    stages: int = 1
    aux_loss_coeff: float = 0.01
    log: Path | None = None
    quiet: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class StepLog:
    step: int
    loss: float
    step_s: float
    tokens_per_s: float


@dataclass(kw_only=True)
class Run:
    """What :func:`train` returns on every rank."""

    steps: list[StepLog] = field(default_factory=list)
    plan: ParallelPlan | None = None
    engine_config: dict[str, Any] | None = None
    moe_classes: list[str] = field(default_factory=list)  # the engine's MoE layers, by class name
    # Piper's MoE layers (engine order): how each exchanges (A2ASettings.label()) and over how many
    # nodes of its expert-parallel group (2 or more: a hierarchical exchange crosses nodes)
    exchanges: list[tuple[str, int]] = field(default_factory=list)
    # "chunks": "tune": per MoE layer (engine order), the chunk count it chose (None: still measuring)
    # and the slowest rank's median layer time per candidate (s)
    tuned: list[tuple[int | None, dict[int, float] | None]] = field(default_factory=list)


# ---- data -----------------------------------------------------------------------------------------

class Batches:
    """Micro-batches ``(tokens [mbs, T], labels [mbs, T])`` for one data-parallel rank."""

    def __init__(self, spec: ModelSpec, mbs: int, *, seed: int, dp_rank: int, text: bytes | None):
        if text is not None and spec.vocab_size < 256:
            raise SpecError("vocab_size", spec.vocab_size, "must be >= 256 to train on bytes (--data)",
                            "use a model with vocab_size >= 256 or synthetic data")
        if text is not None and len(text) <= spec.seq_length + 1:
            raise SpecError("--data", f"{len(text)} bytes", f"must be longer than seq_length + 1 ({spec.seq_length + 1})",
                            "give a longer text file")
        self.spec, self.mbs, self.seed, self.dp_rank = spec, mbs, seed, dp_rank
        self.text = None if text is None else torch.frombuffer(bytearray(text), dtype=torch.uint8).long()

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(hash((self.seed, step, micro, self.dp_rank)) % (2 ** 62))
        t, v = self.spec.seq_length, self.spec.vocab_size
        if self.text is None:
            start = torch.randint(0, v, (self.mbs, 1), generator=g)
            stride = torch.randint(1, 8, (self.mbs, 1), generator=g)
            seq = (start + stride * torch.arange(t + 1)) % v
        else:
            offsets = torch.randint(0, self.text.numel() - t - 1, (self.mbs,), generator=g)
            seq = torch.stack([self.text[o:o + t + 1] for o in offsets.tolist()])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def iterate(self, step: int, micros: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.get(step, m) for m in range(micros))


# ---- training -------------------------------------------------------------------------------------

def model_spec(args: TrainArgs) -> ModelSpec:
    if args.model is not None:
        return load_model(args.model)
    block = args.config.get("piper") or {}
    if isinstance(block, dict) and isinstance(block.get("model"), str):
        return load_model(block["model"])
    if isinstance(block, dict) and isinstance(block.get("model"), dict):
        from piper_core.specs.yamlio import from_dict
        return from_dict(ModelSpec, block["model"], where='"piper" block', prefix="piper.model.")
    raise SpecError("--model", None, "the model to train is needed", "pass --model PRESET|YAML or set piper.model")


def _plan_only(args: TrainArgs, spec: ModelSpec, world: int, rank: int) -> None:
    """With ``piper.plan_only``: print the plan (rank 0) and stop before any model is built (a
    plan-only run of a 1T model must not allocate it)."""
    from piper_deepspeed.config import read_block
    from piper_deepspeed.initialize import PlanOnly, node_topology, plan_for, report, rewrite_config

    block = read_block(args.config)
    if block is None or not block.enabled or not block.plan_only:
        return
    choice = plan_for(args.config, world, pipeline=args.pipeline, model_spec=spec)
    _, changes = rewrite_config(args.config, choice)
    if rank == 0:
        print(report(choice, changes, args.config, topology=node_topology(choice.prediction.cluster, world)), flush=True)
    raise PlanOnly(choice)


def _layout(args: TrainArgs, spec: ModelSpec, world: int) -> ParallelPlan:
    """The plan the model is built for: Piper's with an enabled block, else ``--ep``/``--stages``."""
    from piper_deepspeed.config import read_block
    from piper_deepspeed.initialize import plan_for, planned_precision

    block = read_block(args.config)
    if block is not None and block.enabled:
        return plan_for(args.config, world, pipeline=args.pipeline, model_spec=spec).plan
    stages = args.stages if args.pipeline else 1
    return ParallelPlan(gpus=world, pp=stages, ep=args.ep, global_batch_size=world // stages,
                        precision=planned_precision(args.config))


def train(args: TrainArgs) -> Run:
    """Build, initialise and train on the current torch.distributed group (every rank calls it)."""
    import piper_deepspeed
    from piper_deepspeed.builder import build_model, lm_loss
    from piper_deepspeed.config import read_block

    world, rank = dist.get_world_size(), dist.get_rank()
    spec = model_spec(args)
    _plan_only(args, spec, world, rank)
    plan = _layout(args, spec, world)
    block = read_block(args.config)  # its placement (checked by _layout's plan_for): the slots get their experts
    placement = block.expert_placement() if block is not None and block.enabled and plan.ep > 1 else None
    model = build_model(spec, plan, seed=args.seed, pipeline=args.pipeline, aux_loss_coeff=args.aux_loss_coeff,
                        placement=placement)
    engine, _, _, _ = piper_deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.config)
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp_rank = engine.grid.get_data_parallel_rank() if args.pipeline else rank
    dp = engine.grid.get_data_parallel_world_size() if args.pipeline else world
    text = args.data.read_bytes() if args.data is not None else None
    data = Batches(spec, mbs, seed=args.seed, dp_rank=dp_rank, text=text)
    run = Run(plan=plan, engine_config=dict(engine.config), moe_classes=[type(m).__name__ for m in engine.moe_layers],
              exchanges=[(m.piper_a2a.label(), m.piper_comm.layout.num_nodes) for m in engine.moe_layers
                         if getattr(m, "piper_comm", None) is not None and m.piper_a2a is not None])
    tokens_per_step = mbs * gas * dp * spec.seq_length
    for step in range(args.steps):
        start = time.perf_counter()
        if args.pipeline:
            loss = engine.train_batch(data_iter=data.iterate(step, gas)).detach().float()
        else:
            total = torch.zeros(())
            for tokens, labels in data.iterate(step, gas):
                loss_m = lm_loss(engine(tokens), labels, aux_loss_coeff=args.aux_loss_coeff)
                engine.backward(loss_m)
                engine.step()
                total += loss_m.detach().float()
            loss = total / gas
            dist.all_reduce(loss)
            loss /= world
        elapsed = time.perf_counter() - start
        log = StepLog(step=step + 1, loss=loss.item(), step_s=elapsed, tokens_per_s=tokens_per_step / elapsed)
        run.steps.append(log)
        if rank == 0:
            _log(args, log)
    tuners = [m.piper_auto for m in engine.moe_layers if getattr(m, "piper_auto", None) is not None]
    run.tuned = [(t.chosen, t.medians_s) for t in tuners]
    if rank == 0 and tuners and not args.quiet:
        chosen = ", ".join("still measuring" if c is None else f"x{c}" for c, _ in run.tuned)
        print(f"piper: chunk counts measured per MoE layer: {chosen}", flush=True)
    return run


def _log(args: TrainArgs, log: StepLog) -> None:
    if not args.quiet:
        print(f"step {log.step}/{args.steps}  loss {log.loss:.4f}  {log.step_s:.3f} s/step  "
              f"{log.tokens_per_s:,.0f} tokens/s", flush=True)
    if args.log is not None:
        with args.log.open("a") as f:
            f.write(json.dumps(asdict(log)) + "\n")


# ---- command line ---------------------------------------------------------------------------------

def parse(argv: Sequence[str] | None = None) -> tuple[TrainArgs, int]:
    p = argparse.ArgumentParser(prog="python -m piper_deepspeed.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="DeepSpeed JSON config (with or without a \"piper\" block)")
    p.add_argument("--model", help="model preset or ModelSpec YAML (default: the block's piper.model)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--data", type=Path, help="a small local text file to train on (bytes); default synthetic")
    p.add_argument("--seed", type=int, default=1234, help="weights and data seed (default 1234)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size without a piper block (default 1)")
    p.add_argument("--pipeline", action="store_true", help="build a PipelineModule (Piper picks its stages)")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages with --pipeline and no piper block")
    p.add_argument("--aux-loss-coeff", type=float, default=0.01, help="load-balancing loss weight (default 0.01)")
    p.add_argument("--log", type=Path, help="append one JSON line per step to this file (rank 0)")
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="start N local processes (no launcher)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    a = p.parse_args(argv)
    config = json.loads(Path(a.config).read_text())
    return TrainArgs(config=config, model=a.model, steps=a.steps, data=a.data, seed=a.seed, ep=a.ep,
                     pipeline=a.pipeline, stages=a.stages, aux_loss_coeff=a.aux_loss_coeff, log=a.log), a.spawn


def _run_rank(args: TrainArgs) -> None:
    import deepspeed

    from piper_deepspeed.initialize import PlanOnly

    deepspeed.init_distributed()
    try:
        train(args)
    except PlanOnly:
        pass
    except (SpecError, Infeasible) as exc:  # the message, not a traceback
        if dist.get_rank() == 0:
            print(f"piper_deepspeed.train: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        dist.destroy_process_group()


def _spawned(local_rank: int, world: int, port: int, args: TrainArgs) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if not torch.cuda.is_available():  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _run_rank(args)


def main(argv: Sequence[str] | None = None) -> int:
    args, spawn = parse(argv)
    if spawn:
        from piper_core.emulate.launch import free_port

        torch.multiprocessing.spawn(_spawned, args=(spawn, free_port(), args), nprocs=spawn, join=True)
    else:
        _run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
