"""Train a Piper model spec with DeepSpeed-MoE and Piper's MoE layer on CPU ranks, instrumented (the
DeepSpeed side of ``piper validate``; :mod:`piper_megatron.train` is the Megatron-Core side).

The real DeepSpeed path: :func:`piper_deepspeed.builder.build_model` builds the Switch-style decoder
for the plan (DeepSpeed ``MoE`` layers with ``ep_size = plan.ep``), :func:`piper_deepspeed.initialize`
reads a ``"piper"`` block pinned to the plan, swaps in Piper's MoE layer and hands the engine a
config in the plan's precision -- bf16 (``"bf16": {"enabled": true}``: fp32 master weights beside the
bf16 ones, as the memory model prices a non-distributed optimizer) or fp32 (no bf16/fp16 block,
DeepSpeed's default: torch's Adam steps the fp32 parameters themselves, no master copy) --, ZeRO 0
and torch's Adam; each step runs ``engine(tokens)``,
``engine.backward``, ``engine.step`` per micro-batch. Each rank measures, as the Megatron trainer does,
the wall time of each step between two barriers, the bytes of its parameters and the peak of the
activation storages held for backward (saved-tensor hooks). Pipeline parallel plans are refused
(DeepSpeed's pipeline engine is not measured here).

:func:`rank_main` is the rank side, for :func:`piper_core.emulate.run_local` and
:func:`piper_core.emulate.run_emulated`; :func:`run` launches it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from piper_core.errors import SpecError
from piper_core.specs.yamlio import to_dict
from piper_core.trainers import Trainer
from piper_core.validate.instrument import ActivationPeak, TrainJob, median, tensor_ledger

TIMEOUT_S = 600.0


def init_deepspeed_comm() -> None:
    """Initialise ``deepspeed.comm`` over the existing torch.distributed group, without building
    DeepSpeed's shared-memory all-reduce op: ``TorchBackend`` compiles it with g++ on first use
    (~25 s, then cached) and it serves only ``inference_all_reduce``, which training never calls."""
    import deepspeed.comm

    # importlib: ``import deepspeed.comm.torch as m`` binds torch itself (deepspeed.comm re-exports it)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    os.environ.setdefault("LOCAL_RANK", "0")  # PipelineModule and the engine read it
    deepspeed.comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)


def ds_config(job: TrainJob) -> dict[str, Any]:
    """The DeepSpeed config of ``job``: its batch, its precision (a ``bf16`` block for bf16, none for
    fp32; fp16 is refused: its loss scaling is not modelled), ZeRO 0, Adam, and a piper block pinned to its
    plan (so :func:`piper_deepspeed.initialize` rewrites nothing and runs the plan's all-to-all; its
    chunk count tuned at run time with ``job.tune``). ``job.stock``: no block, so DeepSpeed's own MoE
    layer runs (the model is built for ``plan.ep`` either way)."""
    plan = job.plan
    if plan.pp != 1 or plan.cp != 1 or plan.tp != 1 or plan.etp_size != 1:
        from piper_core.export import plan_label

        raise SpecError("plan", plan_label(plan),
                        "the DeepSpeed trainer measures pp = cp = tp = etp = 1 plans (no PipelineModule, no "
                        "Megatron tensor parallelism in Piper's builder)",
                        "validate pipeline- and tensor-parallel plans with the Megatron-Core trainer")
    if plan.attention_backend != "flash":
        raise SpecError("attention_backend", plan.attention_backend, "Piper's DeepSpeed builder runs torch's "
                        "scaled_dot_product_attention, which keeps no score matrix: the model prices it as flash",
                        "set attention_backend=flash in the plan")
    if plan.distributed_optimizer:
        raise SpecError("distributed_optimizer", True, "the DeepSpeed trainer runs ZeRO stage 0 (ZeRO 1/2 on CPU "
                        "ranks is not measured)", "set dist_opt=false, or validate the distributed optimizer with "
                        "the Megatron-Core trainer")
    uneven = (("router_bias", bool(job.router_bias)), ("placement", job.placement is not None),
              ("trace_dir", job.trace_dir is not None), ("migrate_every", job.migrate_every is not None))
    if any(given for _, given in uneven):
        raise SpecError(next(key for key, given in uneven if given),
                        "set", "the DeepSpeed trainer runs no skewed router, placement, migration or kept trace (the "
                        "Megatron-Core trainer does: python -m piper_core.bench.placement)",
                        "train the job with the Megatron-Core trainer, or drop the field")
    if plan.precision not in ("bf16", "fp32"):
        raise SpecError("precision", plan.precision, "the DeepSpeed trainer runs bf16 mixed precision and fp32 "
                        "training; fp16 needs DeepSpeed's loss scaling, which Piper does not model",
                        "set precision bf16 or fp32")
    config = {"train_batch_size": plan.global_batch_size, "train_micro_batch_size_per_gpu": plan.micro_batch_size,
              "gradient_accumulation_steps": plan.num_microbatches,
              **({"bf16": {"enabled": True}} if plan.precision == "bf16" else {}),  # fp32: no block (the default)
              "zero_optimization": {"stage": 0},
              "optimizer": {"type": "Adam", "params": {"lr": job.lr, "torch_adam": True}}}
    if job.stock:  # no block: piper_deepspeed.initialize hands DeepSpeed the very same objects
        return config
    return config | {"piper": {"cluster": "cpu-local", "model": to_dict(job.model), "a2a": plan.a2a,
                               "chunks": "tune" if job.tune else plan.a2a_chunks, "defer_wgrad": plan.defer_wgrad,
                               "plan": {"ep": plan.ep, "mbs": plan.micro_batch_size}}}


def _train(job: TrainJob) -> dict[str, Any]:
    import deepspeed.comm

    from piper_core.runtime.groups import released_groups

    # the host-overhead probe trains many jobs in one process: destroy each job's groups (Piper's
    # all-to-all groups, DeepSpeed's expert and expert-data groups) through deepspeed.comm, which
    # also drops DeepSpeed's cached references, so the next job builds its own
    # a memory job runs whole (model, engine, optimizer) under the tensor ledger
    with released_groups(destroy=deepspeed.comm.destroy_process_group), \
            (tensor_ledger() if job.memory else contextlib.nullcontext()) as tensors:
        return _train_job(job, tensors)


def _train_job(job: TrainJob, tensors: Any = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import piper_deepspeed
    from piper_deepspeed.builder import build_model, lm_loss

    model, plan = job.model, job.plan
    rank = dist.get_rank()
    config = ds_config(job)
    net = build_model(model, plan, seed=job.seed, aux_loss_coeff=0.0)
    with contextlib.redirect_stdout(io.StringIO()):  # rank 0's plan report
        engine, _, _, _ = piper_deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    mbs, m, s = plan.micro_batch_size, plan.num_microbatches, model.seq_length
    g = torch.Generator().manual_seed(job.seed + rank)  # every DeepSpeed rank is a data-parallel rank
    batches = [torch.randint(0, model.vocab_size, (mbs, s + 1), generator=g) for _ in range(m)]
    excluded = {t.untyped_storage().data_ptr() for t in [*engine.module.parameters(), *batches]}
    # sync_grads False (the host-overhead probe): no data-parallel gradient all-reduce, one rank's own work
    engine.enable_backward_allreduce = job.sync_grads
    steps, losses, peak = [], [], 0
    for _ in range(job.steps):
        ledger = ActivationPeak(excluded)
        dist.barrier()
        start = time.perf_counter()
        total = 0.0
        for batch in batches:
            with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack):
                loss = lm_loss(engine(batch[:, :-1]), batch[:, 1:], aux_loss_coeff=0.0)
                engine.backward(loss)
            engine.step()
            total += loss.detach().float().item()
        dist.barrier()
        steps.append(time.perf_counter() - start)
        peak = max(peak, ledger.peak)
        losses.append(total / m)
    state = tensors.now if tensors is not None else None  # after the last step: no activations left
    forward = []
    for _ in range(job.forward_steps):
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            for batch in batches:
                engine(batch[:, :-1])
        dist.barrier()
        forward.append(time.perf_counter() - start)
    params = list(engine.module.parameters())
    return {"rank": rank, "pp_rank": 0, "ep_rank": rank % plan.ep, "step_s": steps,
            "step_median_s": median(steps[job.warmup:]), "losses": losses, "forward_s": forward,
            "params": sum(p.numel() for p in params), "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "activation_peak_bytes": peak, "moe_phases_ms_per_step": {},
            "moe_classes": sorted({type(x).__name__ for x in engine.moe_layers}),
            **({} if tensors is None else {"peak_tensor_bytes": tensors.peak, "state_tensor_bytes": state})}


def rank_main(info: Any, job_json: dict[str, Any]) -> dict[str, Any]:
    """Target for the local / emulated launchers: train ``job_json`` with DeepSpeed on this rank."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    init_deepspeed_comm()
    return _train(TrainJob.from_json(job_json))


def probe_setup(info: Any) -> Callable[[TrainJob, Path], dict[str, Any]]:
    """Rank side of the host-overhead probe (:mod:`piper_core.calibrate.probe`): many small jobs in
    this process."""
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    init_deepspeed_comm()
    return lambda job, tmp: _train(job)


TRAINER = Trainer(name="deepspeed", rank_target="piper_deepspeed.measure:rank_main", probe_setup=probe_setup,
                  check=ds_config, requires=("deepspeed",), gradients_after_step=False)
"""Registered as the ``deepspeed`` trainer (entry-point group ``piper.trainers``, pyproject.toml);
``check``: :func:`ds_config` refuses what the trainer cannot run before any process starts. The
engine frees the gradients after each step (``DeepSpeedEngine._take_model_step`` calls the
optimizer's ``zero_grad``, set_to_none, or its own, ``param.grad = None``)."""


def run(job: TrainJob, *, nodes: int = 1, inter_node_mbit: float | None = None, timeout_s: float = TIMEOUT_S,
        realtime: bool = False) -> list[dict[str, Any]]:
    """Train ``job`` on ``job.plan.gpus`` ranks, local or on an emulated cluster of ``nodes`` nodes;
    every rank's report in rank order (as :func:`piper_megatron.train.run`)."""
    return TRAINER.run(job, nodes=nodes, inter_node_mbit=inter_node_mbit, timeout_s=timeout_s, realtime=realtime)
