"""Rank side of tests/megatron/test_migrate.py and of the move-cost measurement (piper_megatron.migrate):
a real Megatron-Core GPTModel (2 MoE layers, 8 experts, fp32), Megatron's DDP and schedule, Piper's
dispatcher, trained on ``world`` gloo ranks (ep = ``job["ep"]``, default world) with a different batch each step.

``run_rank(rank, world, job)``: ``job["mode"]`` is

* ``"plain"``: train ``sum(job["segments"])`` steps;
* ``"migrate"``: train ``segments[0]`` steps, migrate to ``job["targets"][0]``, train ``segments[1]``,
  ... (one migration between segments), with the optimizer state moved, or not (``move_optimizer``);
* ``"checkpoint"``: as ``"migrate"``, then save the model, the optimizer and the placement to
  ``job["dir"]`` after the last migration, build a fresh model (other initial weights), route it
  by the saved placement (or not: ``apply``), load the state and train the last segment with it.

Each target is a placement for every MoE layer (``{"ranks": ...}``) or per layer (``{"layers": {n:
ranks}}``). Returns the losses, the placement reports, ``piper_core.__file__``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXPERTS = 8


def _model(world: int, precision: str, dopt: bool, ep: int):
    from piper_core.specs.parallel import ParallelPlan
    from piper_core.validate.cases import VAL_MODEL

    model = dataclasses.replace(VAL_MODEL, num_layers=2, moe_capacity_factor=None, seq_length=64)
    plan = ParallelPlan(gpus=world, ep=ep, micro_batch_size=2, global_batch_size=2 * world, precision=precision,
                        distributed_optimizer=dopt)
    return model, plan


def _build(model: Any, plan: Any, seed: int, lr: float):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from piper_megatron.build import gpt_model_chunks
    from piper_megatron.train import _config_overrides, host_optimizer, megatron_distributed_optimizer

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    chunks = gpt_model_chunks(model, plan, device="cpu", **_config_overrides())
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=plan.precision == "bf16", overlap_grad_reduce=False,
                                           use_distributed_optimizer=plan.distributed_optimizer)
    ddps = [DistributedDataParallel(c.config, config, c) for c in chunks]
    from megatron.core.distributed import finalize_model_grads
    chunks[0].config.finalize_model_grads_func = finalize_model_grads
    chunks[0].config.no_sync_func = ddps[0].no_sync
    optimizer = megatron_distributed_optimizer(ddps, plan, lr=lr) if plan.distributed_optimizer else \
        host_optimizer([p for d in ddps for p in d.parameters()], plan, lr=lr)
    return ddps, optimizer


def _step(ddps: list[Any], optimizer: Any, model: Any, plan: Any, step: int) -> float:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    s, mbs, m = model.seq_length, plan.micro_batch_size, plan.num_microbatches
    g = torch.Generator().manual_seed(1000 * step + parallel_state.get_data_parallel_rank())
    batches = [torch.randint(0, model.vocab_size, (mbs, s + 1), generator=g) for _ in range(m)]
    positions = torch.arange(s).unsqueeze(0).expand(mbs, s)

    def forward_step(data: Any, module: Any):
        batch = next(data)
        out = module(batch[:, :-1], positions, None, labels=batch[:, 1:])

        def loss_func(per_token: Any):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}
        return out, loss_func

    for d in ddps:
        d.zero_grad_buffer()
    if hasattr(optimizer, "zero_grad"):
        optimizer.zero_grad()
    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=ddps,
                                      num_microbatches=m, seq_length=s, micro_batch_size=mbs, forward_only=False)
    optimizer.step()
    loss = torch.tensor([sum(r["lm loss"].item() for r in out)], dtype=torch.float64)
    dist.all_reduce(loss)  # the mean over data-parallel ranks: every rank reports the same number
    return loss.item() / dist.get_world_size()


def _target(spec: dict[str, Any], world: int) -> Any:
    from piper_core.runtime.placement import ExpertPlacement

    if "ranks" in spec:
        return ExpertPlacement(num_experts=EXPERTS, ep=world, ranks=spec["ranks"])
    return {int(n): ExpertPlacement(num_experts=EXPERTS, ep=world, ranks=r) for n, r in spec["layers"].items()}


def _optimizer_state(optimizer: Any) -> Any:
    return optimizer.adam.state_dict() if hasattr(optimizer, "adam") else optimizer.state_dict()


def _load_optimizer(optimizer: Any, state: Any) -> None:
    (optimizer.adam if hasattr(optimizer, "adam") else optimizer).load_state_dict(state)


def run_rank(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    import piper_core
    from megatron.core import parallel_state

    from piper_core.runtime import NodeTopology
    from piper_megatron import migrate as mig
    from piper_megatron.cpu import install_cpu_training_shims
    from piper_megatron.dispatcher import DispatchSettings, create_ep_comm, install_dispatcher

    install_cpu_training_shims()
    ep = job.get("ep", world)
    model, plan = _model(world, job.get("precision", "fp32"), job.get("dopt", False), ep)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    patches = None
    try:
        comm = create_ep_comm(NodeTopology.uniform(world_size=world, ranks_per_node=world))
        world = ep  # placements are over the expert-parallel ranks
        patches = install_dispatcher(comm, DispatchSettings.from_plan("flat", 1))
        ddps, optimizer = _build(model, plan, 1234, job.get("lr", 1e-2))
        segments, targets = job["segments"], job.get("targets", [])
        losses, reports, step = [], [], 0
        if job["mode"] == "straggler":  # rank 1 never migrates: rank 0's migration must fail in time
            return _straggler(rank, ddps, optimizer, _target(targets[0], world))
        for i, n in enumerate(segments):
            if i and job["mode"] != "plain":
                report = mig.migrate(ddps, optimizer, _target(targets[i - 1], world),
                                     move_optimizer=job.get("move_optimizer", True))
                reports.append({"moves": len(report.plan.crossing), "sent": report.sent_bytes,
                                "received": report.received_bytes, "seconds": report.seconds,
                                "placements": {n: p.ranks for n, p in report.placements.items()}})
                if job["mode"] == "checkpoint" and i == len(segments) - 1:
                    ddps, optimizer = _reload(ddps, optimizer, model, plan, Path(job["dir"]), rank, job)
            for _ in range(n):
                losses.append(_step(ddps, optimizer, model, plan, step))
                step += 1
        return {"losses": losses, "reports": reports, "piper_core": piper_core.__file__,
                "placements": {n: p.ranks for n, p in mig.current_placements(ddps).items()}}
    finally:
        if patches is not None:
            patches.restore()
        parallel_state.destroy_model_parallel()


def _reload(ddps: list[Any], optimizer: Any, model: Any, plan: Any, directory: Path, rank: int,
            job: dict[str, Any]) -> tuple[list[Any], Any]:
    """Save model, optimizer and placement; build a fresh model with other weights; load it back."""
    from piper_megatron import migrate as mig

    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"model": [d.module.state_dict() for d in ddps], "optimizer": _optimizer_state(optimizer)},
               directory / f"rank{rank}.pt")
    if rank == 0:
        mig.write_placements(directory, mig.current_placements(ddps))
    dist.barrier()
    fresh, fresh_optimizer = _build(model, plan, 4321, job.get("lr", 1e-2))
    saved = torch.load(directory / f"rank{rank}.pt", weights_only=False)
    if job.get("apply", True):
        mig.apply_placements(fresh, mig.read_placements(directory))
    for d, state in zip(fresh, saved["model"]):
        d.module.load_state_dict(state)
    _load_optimizer(fresh_optimizer, saved["optimizer"])
    return fresh, fresh_optimizer


def _straggler(rank: int, ddps: list[Any], optimizer: Any, target: Any) -> dict[str, Any]:
    import time
    from datetime import timedelta

    from piper_core.runtime.timeouts import CollectiveError
    from piper_megatron import migrate as mig

    if rank == 1:
        time.sleep(6)  # past rank 0's deadline, then leave without migrating
        return {"error": None}
    start = time.perf_counter()
    try:
        mig.migrate(ddps, optimizer, target, timeout=timedelta(seconds=2))
    except CollectiveError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - start}
    return {"error": "migrated", "seconds": time.perf_counter() - start}
