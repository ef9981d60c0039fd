"""Train a Piper model spec with Megatron-Core on local CPU ranks, instrumented.

    python -m piper_megatron.train --model tiny-moe --ranks 4 --parallel "ep=2,pp=2,mbs=2,gbs=8" --steps 5

The real Megatron-Core path: :mod:`piper_megatron.build` builds the GPTModel of each pipeline rank
(local modules, parameters in the plan's precision), Megatron's ``DistributedDataParallel`` (main
gradients in fp32, or bf16 with ``grad_reduce_in_bf16``, as ``validate_args`` sets them), the Adam that
``get_megatron_optimizer`` picks for the precision (:func:`host_optimizer`: bf16 steps fp32 master
copies, fp32 steps the parameters themselves; fp16's loss scaling is not run), and Megatron's schedule
(``get_forward_backward_func``: 1F1B with pp > 1); the MoE layers use Piper's token dispatcher
(:func:`piper_megatron.dispatcher.install_dispatcher`) with the plan's all-to-all, or Megatron's
own with ``--stock``. Each rank measures, per step, the wall time between two barriers, and once:
the bytes of its parameters, the peak of activation storages held for backward during a step
(saved-tensor hooks, unique storages, parameters and model inputs excluded), and the forward
dispatch / expert / combine times of its MoE layers (Piper's tracer).

:func:`rank_main` is the rank side (a target for :func:`piper_core.emulate.run_local` and
:func:`piper_core.emulate.run_emulated`, so the same job runs on local ranks or on the emulated
multi-node cluster); :func:`run` launches it and returns every rank's :class:`RankReport` as a
dict. ``piper validate`` and ``make run`` build on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from piper_core.errors import SpecError
from piper_core.specs.parallel import ParallelPlan
from piper_core.trainers import Trainer
from piper_core.validate.instrument import ActivationPeak, TrainJob, median, summary, tensor_ledger

__all__ = ["ActivationPeak", "TrainJob", "rank_main", "run", "summary"]

TIMEOUT_S = 600.0


def _phases(trace: Path) -> dict[str, float]:
    """Per step: the forward dispatch / expert / combine ms of all MoE layer calls, summed."""
    from piper_megatron.trace import PHASES, read_trace

    records = read_trace(trace) if trace.exists() else []
    return {p: sum(r[f"{p}_ms"] for r in records) for p in PHASES} | {"calls": len(records)}


def _expert_tokens(trace: Path) -> dict[str, dict[str, Any]]:
    """Per MoE layer (Megatron's layer_number, as a string key): this rank's first physical slot and
    the tokens each of its slots received over the timed steps' forward calls (with a placement,
    slots hold the placement's logical experts: ``ExpertPlacement.logical_at``)."""
    from piper_megatron.trace import read_trace

    out: dict[str, dict[str, Any]] = {}
    for r in read_trace(trace) if trace.exists() else []:
        layer = out.setdefault(str(r["layer"]), {"first_expert": r["first_expert"],
                                                 "tokens": [0] * len(r["tokens_per_expert"])})
        layer["tokens"] = [a + b for a, b in zip(layer["tokens"], r["tokens_per_expert"])]
    return out


# ---- rank side ------------------------------------------------------------------------------------

class MixedPrecisionAdam:
    """Megatron's mixed-precision step without its CUDA-only optimizer classes: Adam on fp32 master
    copies of the bf16 parameters, reading DDP's ``main_grad`` (as fp32), writing the bf16 copies back
    (``Float16OptimizerWithFloat16Params``; the state Piper's memory model prices for a
    non-distributed optimizer)."""

    def __init__(self, params: list[Any], *, lr: float):
        import torch

        self.params = params
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in params]
        self.adam = torch.optim.Adam(self.masters, lr=lr)

    def step(self) -> None:
        import torch

        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad.float()  # _copy_model_grads_to_main_grads (a no-op on fp32 main grads)
        self.adam.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)


class FP32Adam:
    """Megatron's ``FP32Optimizer`` (fp32 training: neither --bf16 nor --fp16) without its CUDA-only
    loss-scale tensor: Adam steps the fp32 parameters themselves, each ``grad`` set to DDP's
    ``main_grad`` (``prepare_grads``), so its state is Adam's m and v alone -- no master copy."""

    def __init__(self, params: list[Any], *, lr: float):
        import torch

        self.params = params
        self.adam = torch.optim.Adam(params, lr=lr)

    def step(self) -> None:
        for p in self.params:
            p.grad = p.main_grad
        self.adam.step()
        # FP32Optimizer.zero_grad, which Megatron's train_step calls before the next backward: a grad
        # left aliasing DDP's buffer would take autograd's accumulation, then DDP's hook adds it again
        for p in self.params:
            p.grad = None


def megatron_distributed_optimizer(ddps: list[Any], plan: ParallelPlan, *, lr: float) -> Any:
    """Megatron-Core's own ``DistributedOptimizer`` (``get_megatron_optimizer`` with
    ``use_distributed_optimizer``; torch's Adam where neither Transformer Engine nor Apex is
    installed), on the host (:func:`piper_megatron.cpu_training.install_core_optimizer_shims`): the
    optimizer state and fp32 main parameters sharded over the data-parallel ranks (experts' over
    the expert data-parallel ranks), gradients reduce-scattered, parameters all-gathered after the
    step. No weight decay and no clipping, as the host Adam of the other plans."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from piper_megatron.cpu_training import install_core_optimizer_shims

    import torch

    check_precision(plan)
    install_core_optimizer_shims()
    config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=0.0, bf16=plan.precision == "bf16",
                             params_dtype=torch.bfloat16 if plan.precision == "bf16" else torch.float32,
                             use_distributed_optimizer=True)
    return get_megatron_optimizer(config, ddps)


def host_optimizer(params: list[Any], plan: ParallelPlan, *, lr: float) -> MixedPrecisionAdam | FP32Adam:
    """The Adam ``get_megatron_optimizer`` builds for ``plan.precision`` (non-distributed), on the host."""
    check_precision(plan)
    return FP32Adam(params, lr=lr) if plan.precision == "fp32" else MixedPrecisionAdam(params, lr=lr)


def check_precision(plan: ParallelPlan) -> None:
    """The trainer runs bf16 and fp32 training; fp16 needs Megatron's loss scaler, which it does not run."""
    if plan.precision not in ("bf16", "fp32"):
        raise SpecError("precision", plan.precision, "the CPU trainer runs bf16 mixed precision and fp32 training; "
                        "fp16 needs Megatron's dynamic loss scaling, which it does not run",
                        "set precision bf16 or fp32")


def _grad_reduce_in_fp32(plan: ParallelPlan) -> bool:
    """DDP's ``grad_reduce_in_fp32`` as megatron.training sets it (``accumulate_allreduce_grads_in_fp32``,
    true under --bf16 unless --grad-reduce-in-bf16): fp32 training's buffer is fp32 as its parameters are."""
    return plan.precision == "bf16" and not plan.grad_reduce_in_bf16


def _config_overrides() -> dict[str, Any]:
    """The CPU kernels (as :mod:`piper_megatron.measure` uses): no CUDA-only fusions; no aux loss."""
    return dict(masked_softmax_fusion=False, attention_softmax_in_fp32=False, apply_rope_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False, moe_aux_loss_coeff=0.0)


def _train(job: TrainJob, ranks_per_node: int, trace_dir: Path) -> dict[str, Any]:
    from piper_core.runtime.groups import released_groups

    # the probe trains many jobs in one process: no leaked gloo groups; a memory job runs whole
    # (model, DDP buffers and optimizer included) under the tensor ledger
    with released_groups(), (tensor_ledger() if job.memory else contextlib.nullcontext()) as tensors:
        return _train_job(job, ranks_per_node, trace_dir, tensors)


def _train_job(job: TrainJob, ranks_per_node: int, trace_dir: Path, tensors: Any = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from piper_core.runtime import NodeTopology
    from piper_megatron.build import gpt_model_chunks
    from piper_megatron.dispatcher import DispatchSettings, create_ep_comm, install_dispatcher
    from piper_megatron.trace import Tracer

    model, plan = job.model, job.plan
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
                                             virtual_pipeline_model_parallel_size=plan.vpp,
                                             expert_model_parallel_size=plan.ep,
                                             expert_tensor_parallel_size=plan.etp_size)
    patches, tracer, comm = None, None, None
    try:
        if model.is_moe and not job.stock:
            comm = create_ep_comm(NodeTopology.uniform(world_size=world, ranks_per_node=ranks_per_node))
            tracer = Tracer(trace_dir / f"trace.rank{rank}.jsonl", rank=rank)
            patches = install_dispatcher(comm, DispatchSettings.from_plan(plan.a2a, plan.a2a_chunks, tune=job.tune,
                                                                         defer_wgrad=plan.defer_wgrad,
                                                                         placement=job.placement,
                                                                         count_tokens=job.migrate_every is not None),
                                         tracer=tracer)
        tensor_parallel.model_parallel_cuda_manual_seed(job.seed)
        torch.manual_seed(job.seed)
        chunks = gpt_model_chunks(model, plan, device="cpu", **_config_overrides())  # one per virtual stage
        gpt = chunks[0]
        _uneven(job, chunks, comm)
        # overlap_grad_reduce as --piper sets it and the step-time model assumes (one bucket exposed);
        # without sync_grads neither the hooks nor finalize_model_grads reduce anything. Per model
        # chunk as megatron.training builds them (get_model: bucketing only in the first chunk; the
        # schedule's config is the first chunk's, with one no_sync / grad_sync function per chunk)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=_grad_reduce_in_fp32(plan),
                                                   overlap_grad_reduce=job.sync_grads,
                                                   use_distributed_optimizer=plan.distributed_optimizer)
        ddps = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        gpt.config.finalize_model_grads_func = finalize_model_grads if job.sync_grads else None
        no_sync = [d.no_sync for d in ddps]
        gpt.config.no_sync_func = no_sync if len(ddps) > 1 else no_sync[0]
        if len(ddps) > 1 and job.sync_grads:
            gpt.config.grad_sync_func = [d.start_grad_sync for d in ddps]
        optimizer = megatron_distributed_optimizer(ddps, plan, lr=job.lr) if plan.distributed_optimizer else \
            host_optimizer([p for d in ddps for p in d.parameters()], plan, lr=job.lr)
        s, mbs, m = model.seq_length, plan.micro_batch_size, plan.num_microbatches
        g = torch.Generator().manual_seed(job.seed + parallel_state.get_data_parallel_rank())
        batches = [torch.randint(0, model.vocab_size, (mbs, s + 1), generator=g) for _ in range(m)]
        positions = torch.arange(s).unsqueeze(0).expand(mbs, s)

        def data() -> Any:
            """The step's micro-batches: one iterator, or one per model chunk (the interleaved schedule)."""
            return iter(batches) if len(chunks) == 1 else [iter(batches) for _ in chunks]

        def forward_step(data: Any, module: Any) -> tuple[Any, Any]:
            batch = next(data)
            out = module(batch[:, :-1], positions, None, labels=batch[:, 1:])

            def loss_func(per_token: Any) -> tuple[Any, dict[str, Any]]:
                loss = per_token.float().mean()
                return loss, {"lm loss": loss.detach()}
            return out, loss_func

        # not activations: parameters, the inputs, and the cached tensors every forward reuses
        # (the causal mask of the CPU shim, RoPE's cos/sin table: both lru-cached, built once)
        from piper_megatron.cpu import _host_causal_mask

        cached = [_host_causal_mask(s)]
        rope = getattr(gpt, "rotary_pos_emb", None)
        if rope is not None:
            cached.append(rope(s))
        weights = [p for c in chunks for p in c.parameters()]
        excluded = {t.untyped_storage().data_ptr() for t in [*weights, positions, *batches, *cached]}
        steps, losses, peak = [], [], 0
        migration = _Migration.start(job, comm)
        for step in range(job.steps):
            ledger = ActivationPeak(excluded)
            dist.barrier()
            start = time.perf_counter()
            for d in ddps:
                d.zero_grad_buffer()
            with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack):
                out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data(),
                                                  model=ddps, num_microbatches=m, seq_length=s,
                                                  micro_batch_size=mbs, forward_only=False)
            optimizer.step()
            dist.barrier()
            steps.append(time.perf_counter() - start)
            peak = max(peak, ledger.peak)
            if out:
                losses.append(sum(r["lm loss"].item() for r in out))  # the schedule reports loss / micro-batches
            if tracer is not None and step == job.warmup - 1:
                tracer.flush()
                (trace_dir / f"trace.rank{rank}.jsonl").write_text("")  # phases of the timed steps only
            if migration is not None and (step + 1) % job.migrate_every == 0 and step + 1 < job.steps:
                migration.decide(ddps, optimizer, step + 1)  # between two steps, untimed in steps[]
        state = tensors.now if tensors is not None else None  # after the last step: no activations left
        if tracer is not None:
            tracer.close()
        phases = _phases(trace_dir / f"trace.rank{rank}.jsonl")
        expert_tokens = _expert_tokens(trace_dir / f"trace.rank{rank}.jsonl")
        forward = []
        for _ in range(job.forward_steps):
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data(), model=ddps,
                                            num_microbatches=m, seq_length=s, micro_batch_size=mbs, forward_only=True)
            dist.barrier()
            forward.append(time.perf_counter() - start)
        timed = job.steps - job.warmup
        per_step = {k: v / timed for k, v in phases.items()}
        params = sum(p.numel() for p in weights)
        return {"rank": rank, "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "ep_rank": parallel_state.get_expert_model_parallel_rank(),
                "step_s": steps, "step_median_s": median(steps[job.warmup:]), "losses": losses,
                "forward_s": forward,
                "params": params, "param_bytes": sum(p.numel() * p.element_size() for p in weights),
                "activation_peak_bytes": peak, "moe_phases_ms_per_step": per_step, "expert_tokens": expert_tokens,
                # Megatron's global memory buffer (unfused attention's baddbmm input): activations.workspace_bytes
                "optimizer": [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])],
                "workspace_bytes": sum(t.untyped_storage().nbytes()
                                       for t in parallel_state.get_global_memory_buffer().buffer.values()),
                **({} if migration is None else {"migrations": migration.records}),
                **({} if tensors is None else {"peak_tensor_bytes": tensors.peak, "state_tensor_bytes": state})}
    finally:
        if patches is not None:
            patches.restore()
        if job.migrate_every is not None:  # the probe trains many jobs in one process: no kept move buffers
            from piper_megatron.migrate import release_buffers

            release_buffers()
        parallel_state.destroy_model_parallel()


class _Migration:
    """``TrainJob.migrate_every``: the decisions :mod:`piper_megatron.live` makes between Megatron-LM's
    iterations, made here between the trainer's steps, and what each did on this rank."""

    def __init__(self, settings: Any, placements: dict[int, Any]) -> None:
        self.settings, self.placements, self.since = settings, placements, 0
        self.records: list[dict[str, Any]] = []

    @classmethod
    def start(cls, job: TrainJob, comm: Any) -> _Migration | None:
        if job.migrate_every is None:
            return None
        from piper_megatron.live import LiveSettings, job_placements

        settings = LiveSettings(every=job.migrate_every, horizon=job.migrate_horizon or job.migrate_every,
                                model=job.model, plan=job.plan, cluster=job.migrate_cluster, timeout=comm.timeout)
        return cls(settings, job_placements(job.model, job.plan.ep, job.placement))

    def decide(self, ddps: list[Any], optimizer: Any, iteration: int) -> None:
        import torch.distributed as dist

        from piper_megatron.live import decide

        dist.barrier()
        start = time.perf_counter()
        outcome = decide(self.settings, ddps, optimizer, self.placements, iteration=iteration, since=self.since)
        dist.barrier()
        seconds = time.perf_counter() - start
        self.placements, self.since = outcome.placements, iteration
        decision = None if outcome.choice is None else outcome.choice.chosen.decision
        moved = bool(decision is not None and decision.migrate)
        self.records.append({
            "after_step": iteration, "seconds": seconds, "moved": moved,
            "experts_moved": decision.cost.experts if moved else 0,
            "predicted_step_before_s": None if decision is None else decision.step_before_s,
            "predicted_step_after_s": None if decision is None else decision.step_after_s,
            "predicted_move_s": decision.cost.seconds if moved else 0.0,
            "move_s": None if outcome.report is None else outcome.report.seconds,
            "sent_bytes": 0 if outcome.report is None else outcome.report.sent_bytes,
            "placements": {str(n): list(p.ranks) for n, p in outcome.placements.items()},
            "line": outcome.line()})


def _uneven(job: TrainJob, chunks: list[Any], comm: Any) -> None:
    """The job's router bias and expert placement on the built model (:mod:`piper_megatron.experts`):
    the model is built with the default placement; each slot then gets its logical expert's weights."""
    from megatron.core import parallel_state

    from piper_megatron.experts import bias_routers, move_experts

    if job.router_bias:
        bias_routers(chunks, job.router_bias_map)
    if job.placement is not None and not job.placement.is_default:
        if comm is None:  # TrainJob refuses it; kept for callers that build jobs by hand
            raise SpecError("placement", job.placement.describe(), "needs Piper's dispatcher", "drop stock")
        move_experts(chunks, job.placement, group=comm.group, ep_rank=parallel_state.get_expert_model_parallel_rank(),
                     ranks=comm.layout.ranks, timeout=comm.timeout)


def rank_main(info: Any, job_json: dict[str, Any]) -> dict[str, Any]:
    """Target for the local / emulated launchers: train ``job_json`` on this rank, report."""
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    from piper_megatron.cpu import install_cpu_training_shims

    install_cpu_training_shims()
    import piper_core

    job = TrainJob.from_json(job_json)
    with tempfile.TemporaryDirectory(prefix="piper-train-") as tmp:
        trace_dir = Path(job.trace_dir) if job.trace_dir else Path(tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        return _train(job, info.ranks_per_node, trace_dir) | {"piper_core": piper_core.__file__}


def probe_setup(info: Any) -> Callable[[TrainJob, Path], dict[str, Any]]:
    """Rank side of the host-overhead probe (:mod:`piper_core.calibrate.probe`): many small jobs in
    this process, each in ``tmp`` for its traces."""
    from piper_megatron.cpu import install_cpu_training_shims

    install_cpu_training_shims()
    return lambda job, tmp: _train(job, info.ranks_per_node, tmp)


def check_job(job: TrainJob) -> None:
    """What the trainer refuses before any process starts: the interleaved schedule at pp = 2.

    The trainer runs the interleaved schedule with Megatron-Core's batched p2p and no p2p overlap
    (``batch_p2p_comm``, the config's defaults; Megatron-LM's ``--no-overlap-p2p-communication``),
    which Megatron-LM's ``validate_args`` allows only at pp > 2: at pp 2 a batch would hold two sends
    and two receives between the same two ranks. Its overlapped variant (Megatron-LM's default) posts
    them unbatched, and over gloo a receive then takes whichever send to it came first. Measured with
    weights seeded by their global names: pp 4 vpp 2 batched matches the one-rank losses to 1e-7
    (tests/megatron/test_train_vpp.py); overlapped it is off from the first step (5.721 against
    5.702), and pp 2 vpp 2 overlapped drifts (6.667 against 6.594 by the fifth step)."""
    plan = job.plan
    if plan.vpp and plan.pp < 3:
        raise SpecError("vpp", plan.vpp, f"the CPU trainer runs the interleaved schedule at pp >= 3 (pp is {plan.pp}): "
                        "with batched p2p Megatron refuses pp 2, and overlapped p2p over gloo pairs the two "
                        "ranks' forward and backward messages out of order", "use pp >= 3 with vpp, or no vpp at pp 2")


TRAINER = Trainer(name="megatron", rank_target="piper_megatron.train:rank_main", probe_setup=probe_setup,
                  check=check_job, requires=("megatron.core",))
"""Registered as the ``megatron`` trainer (entry-point group ``piper.trainers``, pyproject.toml);
``check``: :func:`check_job`."""


def run(job: TrainJob, *, nodes: int = 1, inter_node_mbit: float | None = None,
        timeout_s: float = TIMEOUT_S, realtime: bool = False) -> list[dict[str, Any]]:
    """Train ``job`` on ``job.plan.gpus`` ranks: local (``nodes == 1``) or on an emulated cluster of
    ``nodes`` nodes (root; links shaped to ``inter_node_mbit``). Every rank's report, in rank order.
    ``realtime``: ranks under SCHED_FIFO (see :func:`piper_core.emulate.launch.launch`)."""
    return TRAINER.run(job, nodes=nodes, inter_node_mbit=inter_node_mbit, timeout_s=timeout_s, realtime=realtime)


# ---- command line ---------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    from piper_core.cli.parse import parse_parallel
    from piper_core.presets import load_model

    p = argparse.ArgumentParser(prog="python -m piper_megatron.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-moe", help="model preset or ModelSpec YAML (default tiny-moe)")
    p.add_argument("--ranks", type=int, default=2, help="local CPU ranks (default 2)")
    p.add_argument("--parallel", default="", help='plan, e.g. "ep=2,mbs=2,gbs=4" (piper predict syntax)')
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stock", action="store_true", help="Megatron's own token dispatcher")
    p.add_argument("--json", action="store_true", help="print every rank's report as JSON")
    a = p.parse_args(argv)
    model = load_model(a.model)
    plan = parse_parallel(a.parallel, gpus=a.ranks)
    reports = run(TrainJob(model=model, plan=plan, steps=a.steps, stock=a.stock))
    if a.json:
        print(json.dumps(reports, indent=1))
    else:
        s = summary(reports)
        print(f"step times (s): {', '.join(f'{x:.3f}' for x in s['step_s'])}; losses: "
              f"{', '.join(f'{x:.3f}' for x in s['losses'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
