"""Rank side of ``test_ddp_grads.py``: Piper's pipelined dispatcher under Megatron-Core's DDP with
overlapped gradient reduction, the setting ``--piper`` turns on.

Megatron-Core's ``DistributedDataParallel`` with ``overlap_grad_reduce`` counts, per parameter, how
often its grad-ready hook fires in the first step and launches a bucket's reduction when the counts
match again in later steps (``_ParamAndGradBucketGroup.register_grad_ready``). A dispatcher whose
backward accumulates an expert's gradient once per chunk breaks that count as soon as the chunk
count changes between steps, as it does while ``--piper-chunks tune`` measures 1/2/4/8 chunks.

Each rank trains a tiny GPT-MoE (tiny-moe, 4 layers, 8 experts, top-2; fp32; ep 2, every other rank
dimension data parallel) for :data:`STEPS` steps of 2 micro-batches with Megatron-Core's schedule,
its DDP and ``torch.optim.Adam`` on the reduced ``main_grad``, once per variant from the same
weights and data, and returns every parameter's reduced gradient of every step:

* ``stock``: Megatron's alltoall dispatcher;
* ``tune``: Piper's pipelined dispatcher choosing its chunk count at run time (12 calls measuring
  1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8 chunks, then its choice), so the count changes from step 2 on;
* ``chunks2``: Piper's pipelined dispatcher with a fixed 2 chunks;
* ``legacy-tune``: ``tune`` with the gradient accounting this fixes injected back (the experts'
  parameters withheld from ``moe_alltoall``, so each chunk accumulates into ``.grad`` and fires the
  hooks once per chunk). It must come out wrong: an error from Megatron's DDP or gradients off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tests.megatron.piper_ranks import MBS, MICRO_BATCHES, SEQ, _batches, _forward_step  # same data and loss

STEPS, EP = 8, 2
VARIANTS = ("stock", "tune", "chunks2", "legacy-tune")
# DDP settings --piper turns on: overlapped reduction, alone and with the distributed optimizer's
# reduce-scatter (the gradient each rank keeps is its shard; the rest of its buffer is its local sum)
DDP = {"overlap": {"overlap_grad_reduce": True},
       "overlap-distopt": {"overlap_grad_reduce": True, "use_distributed_optimizer": True}}


def _settings(variant: str) -> Any:
    from piper_core.runtime import Algorithm
    from piper_megatron.dispatcher import DispatchSettings

    if variant == "stock":
        return None
    if variant == "chunks2":
        return DispatchSettings(algorithm=Algorithm.FLAT, chunks=2)
    return DispatchSettings(algorithm=Algorithm.FLAT, chunks=2, tune=True)


def _withhold_params(patches: Any) -> None:
    """Inject the old accounting: the dispatcher's ``moe_alltoall`` called without ``params``."""
    from piper_megatron import dispatcher

    original = dispatcher.moe_alltoall

    def moe_alltoall(*args: Any, params: Any = (), **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    patches.set(dispatcher, "moe_alltoall", moe_alltoall)


def _train(world: int, comm: Any, variant: str, ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Reduced gradients per step (name -> tensor), losses per step, or the error that stopped it."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from piper_core.presets import load_model
    from piper_core.specs.parallel import ParallelPlan
    from piper_megatron.build import gpt_model
    from piper_megatron.dispatcher import install_dispatcher

    plan = ParallelPlan(gpus=world, ep=EP, global_batch_size=world * MBS * MICRO_BATCHES)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    settings = _settings(variant)
    patches = None if settings is None else install_dispatcher(comm, settings)
    if variant == "legacy-tune":
        _withhold_params(patches)
    grads: list[dict[str, torch.Tensor]] = []
    losses: list[list[float]] = []
    try:
        model = gpt_model(dataclasses.replace(load_model("tiny-moe"), seq_length=SEQ), plan, device="cpu",
                          params_dtype=torch.float32, bf16=False, pipeline_dtype=torch.float32,
                          moe_aux_loss_coeff=0.0)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(**ddp_kwargs), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = ddp.no_sync
        optimizer = torch.optim.Adam(ddp.parameters(), lr=3e-3)
        batches = _batches(parallel_state.get_data_parallel_rank())
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            out = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(batches),
                                              model=[ddp], num_microbatches=MICRO_BATCHES, seq_length=SEQ,
                                              micro_batch_size=MBS, forward_only=False)
            grads.append({n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()})
            for p in ddp.parameters():
                p.grad = p.main_grad
            optimizer.step()
            losses.append([r["lm loss"].item() for r in out])
        return {"grads": grads, "losses": losses, "error": None}
    except Exception as exc:  # the injected accounting may make Megatron's DDP assert: that is a result
        return {"grads": grads, "losses": losses, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if patches is not None:
            patches.restore()


def _compare(stock: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Largest gradient difference relative to the largest stock gradient, per step."""
    steps = []
    for want, got in zip(stock["grads"], run["grads"]):
        scale = max(g.abs().max().item() for g in want.values())
        diff = max((want[n] - got[n]).abs().max().item() for n in want)
        steps.append(diff / scale)
    return {"relative_diff": steps, "steps": len(run["grads"]), "error": run["error"],
            "losses": run["losses"]}


def run_rank(rank: int, world: int) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    from megatron.core import parallel_state

    from piper_core.runtime import NodeTopology
    from piper_megatron.cpu import install_cpu_training_shims
    from piper_megatron.dispatcher import create_ep_comm

    install_cpu_training_shims()
    out: dict[str, Any] = {}
    for name, ddp_kwargs in DDP.items():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
        comm = create_ep_comm(NodeTopology.uniform(world_size=world, ranks_per_node=world))
        runs = {v: _train(world, comm, v, ddp_kwargs) for v in VARIANTS}
        if runs["stock"]["error"]:
            raise RuntimeError(f"stock training failed under DDP {ddp_kwargs}: {runs['stock']['error']}")
        out[name] = {v: _compare(runs["stock"], r) for v, r in runs.items() if v != "stock"}
        out[name]["stock_losses"] = runs["stock"]["losses"]
        parallel_state.destroy_model_parallel()
    return out
