"""Rank side of ``test_faults.py``: a ``--piper`` training job in which one rank is killed or hangs.

Every rank joins a gloo job, takes the path ``--piper`` takes at run time (the
``initialize_model_parallel`` hook of :class:`piper_megatron.install.Installation` creates Piper's
groups with Megatron's ``--distributed-timeout-minutes`` and installs the dispatcher), builds a tiny
GPT-MoE (tiny-moe, 4 layers, 8 experts, top-2, fp32) with Megatron-Core, wraps it in Megatron-Core's
``DistributedDataParallel`` with ``overlap_grad_reduce`` (as ``--piper`` turns on) and trains with
Megatron's ``get_forward_backward_func`` schedule and ``torch.optim.Adam``.

The victim rank arms a trigger and, in step :data:`KILL_STEP` at the point :class:`Fault` names,
SIGKILLs itself (no Python clean-up, like the OOM killer or a lost node's processes) or SIGSTOPs
itself (a hung rank: alive, its connections open, never answering):

* an exchange of Piper's (``op``, matched in ``PendingExchange``'s operation name, e.g.
  ``"dispatch chunk 1/2 (forward)"``): the victim dies just before posting it, after the step's
  count all-gather, so the survivors post it and wait for a peer that is gone;
* ``"grad reduce"``: just before Megatron's DDP posts the step's data-parallel gradient all-reduce
  (``_ParamAndGradBucketGroup.start_grad_sync`` of a group of more than one rank), after every
  exchange of the step, so the survivors wait in ``finish_grad_sync``.

Every rank writes ``<out>/rank<R>.json`` with what ended it; the victim writes ``<out>/fault``
(its wall-clock time) just before the signal. The launcher in ``test_faults.py`` reads them.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

MBS, SEQ, MICRO_BATCHES, STEPS, KILL_STEP = 2, 32, 2, 3, 1
EP = 2
# Megatron-LM's default --distributed-timeout-minutes, for the job's and Piper's groups alike: a
# killed peer must be noticed long before any timeout could end the wait
TIMEOUT_MINUTES = 10


@dataclasses.dataclass(frozen=True)
class Fault:
    """Which rank gets ``signal``, where, in a job of ``world`` ranks (pp = world // 2, ep 2) whose
    MoE layers run Piper's ``a2a`` ("flat" or "pipelined") in ``chunks``."""

    world: int
    a2a: str
    chunks: int
    victim: int
    op: str  # a substring of a Piper exchange's name, or "grad reduce"
    signal: str = "SIGKILL"  # or "SIGSTOP"
    # Piper's groups (DispatchRequest.timeout_minutes, from --distributed-timeout-minutes); Megatron's
    # keep TIMEOUT_MINUTES
    piper_timeout_minutes: float = TIMEOUT_MINUTES

    @property
    def id(self) -> str:
        where = self.op.replace(" ", "-").replace("/", "of").replace("(", "").replace(")", "")
        return f"w{self.world}-{self.a2a}{self.chunks}-{self.signal}{self.victim}-{where}"


class _Trigger:
    """The victim's switch: fires at the fault's point in step ``KILL_STEP``."""

    def __init__(self, fault: Fault, out: Path):
        self.fault, self.out, self.step = fault, out, 0

    def at(self, point: str) -> None:
        if self.step == KILL_STEP and self.fault.op in point:
            tmp = self.out / "fault.tmp"
            tmp.write_text(json.dumps({"t": time.time(), "at": point}))
            tmp.rename(self.out / "fault")  # whole when the launcher sees it
            os.kill(os.getpid(), getattr(signal, self.fault.signal))

    def arm(self) -> None:
        """Wrap the two points in this process (the victim's own; it never restores them)."""
        from megatron.core.distributed import param_and_grad_buffer

        from piper_core.runtime import alltoall

        post = alltoall.PendingExchange._post

        def _post(exchange: Any, buf: torch.Tensor) -> None:
            self.at(exchange._op)
            post(exchange, buf)

        bucket_group = param_and_grad_buffer._ParamAndGradBucketGroup
        start = bucket_group.start_grad_sync

        def start_grad_sync(group: Any, *args: Any, **kwargs: Any) -> None:
            if group.data_parallel_group.size() > 1:
                self.at("grad reduce")
            start(group, *args, **kwargs)

        alltoall.PendingExchange._post = _post
        bucket_group.start_grad_sync = start_grad_sync


def _forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    output = model(batch[:, :-1], positions, None, labels=batch[:, 1:])

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _train(fault: Fault, trigger: _Trigger | None) -> int:
    """Steps completed (a survivor never gets to return)."""
    import io

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from piper_core.presets import load_model
    from piper_core.specs.parallel import ParallelPlan
    from piper_megatron.build import gpt_model
    from piper_megatron.install import DispatchRequest, Installation
    from piper_megatron.versions import installed_release

    pp = fault.world // EP
    installation = Installation(installed_release(), [], io.StringIO())
    installation.hook_model_parallel(DispatchRequest(a2a=fault.a2a, chunks=fault.chunks, ranks_per_node=fault.world,
                                                     timeout_minutes=fault.piper_timeout_minutes))
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, expert_model_parallel_size=EP,
                                             distributed_timeout_minutes=TIMEOUT_MINUTES)
    plan = ParallelPlan(gpus=fault.world, pp=pp, ep=EP, global_batch_size=EP * MBS * MICRO_BATCHES)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    model = gpt_model(dataclasses.replace(load_model("tiny-moe"), seq_length=SEQ), plan, device="cpu",
                      params_dtype=torch.float32, bf16=False, pipeline_dtype=torch.float32, moe_aux_loss_coeff=0.0)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(overlap_grad_reduce=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    optimizer = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(7 + parallel_state.get_data_parallel_rank())
    batches = [torch.randint(0, 256, (MBS, SEQ + 1), generator=g) for _ in range(MICRO_BATCHES)]
    if trigger is not None:
        trigger.arm()
    for step in range(STEPS):
        if trigger is not None:
            trigger.step = step
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(batches), model=[ddp],
                                    num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MBS,
                                    forward_only=False)
        for p in ddp.parameters():
            p.grad = p.main_grad
        optimizer.step()
    return STEPS


def rank_main(rank: int, fault: Fault, port: int, out_dir: str) -> None:
    """Process target: train until something ends this rank; write what ended it."""
    out = Path(out_dir)
    torch.set_num_threads(1)
    stacks = open(out / f"stack{rank}.txt", "w")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the launcher asks before killing
    report: dict[str, Any] = {"rank": rank, "error": None}
    try:
        import warnings

        warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
        import torch.distributed as dist

        from piper_megatron.cpu import install_cpu_training_shims

        install_cpu_training_shims()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=fault.world,
                                timeout=timedelta(minutes=TIMEOUT_MINUTES))
        report["steps"] = _train(fault, _Trigger(fault, out) if rank == fault.victim else None)
    except Exception as exc:  # noqa: BLE001 - what ended the rank is the result
        report |= {"t_error": time.time(), "type": type(exc).__name__, "error": str(exc),
                   "cause": None if exc.__cause__ is None else f"{type(exc.__cause__).__name__}: {exc.__cause__}",
                   "traceback": traceback.format_exc()}
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(out / f"rank{rank}.json")
