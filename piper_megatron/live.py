"""Expert migration while Megatron-LM trains: ``--piper-migrate-every N`` (issue 17).

Every ``N`` iterations, between two of them (after the optimizer step; :mod:`piper_megatron.install`
wraps ``megatron.training.training.train_step``), every rank of the job runs :func:`decide`, the
decision of :mod:`piper_core.runtime.live` on Megatron-Core's model:

1. the tokens each MoE layer's :class:`~piper_megatron.dispatcher.PiperTokenDispatcher` counted per
   **logical** expert since the last decision (before it reorders the router's columns into physical
   slots), summed over the job (one all-reduce);
2. the candidates priced, the same on every rank;
3. only when the gain exceeds the move: the distributed optimizer's overlapped parameter all-gather
   first (so the weights that move are the step's), then :func:`piper_megatron.migrate.migrate` moves
   the experts (weights, gradient buffers, optimizer state) and switches the dispatchers.

The placements of the whole job (every MoE layer, every pipeline stage) are kept on every rank, from
the same start (``--piper-placement``, else Megatron's default; a loaded checkpoint's
``piper_placement.json``) and the same decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from piper_core.runtime.live import (  # noqa: F401 (re-exported: this module's API since issue 17)
    LiveSettings,
    Outcome,
    check_in_force,
    collective_device,
    job_placements,
    price,
    saved_placements,
)
from piper_core.runtime.live import routed_tokens as sum_routed
from piper_core.runtime.placement import ExpertPlacement
from piper_megatron.experts import moe_layers
from piper_megatron.migrate import current_placements, migrate, piper_dispatcher


def routed_tokens(chunks: Iterable[torch.nn.Module], layers: tuple[int, ...], num_experts: int,
                  timeout: Any) -> dict[int, tuple[int, ...]]:
    """layer_number -> tokens per logical expert that every rank's router sent since the last call,
    summed over the job: each rank's dispatchers' counts (:meth:`~piper_megatron.dispatcher.
    PiperTokenDispatcher.take_routed_tokens`, which restarts them), one all-reduce over every rank."""
    mine = {n: piper_dispatcher(layer, n).take_routed_tokens() for n, layer in moe_layers(chunks).items()}
    device = next(iter(mine.values())).device if mine else collective_device()
    return sum_routed(mine, layers, num_experts, timeout, device)


def decide(settings: LiveSettings, chunks: list[torch.nn.Module], optimizer: Any,
           placements: Mapping[int, ExpertPlacement], *, iteration: int, since: int) -> Outcome:
    """The decision after ``iteration`` over the tokens routed since iteration ``since`` (module
    docstring), and the move when it pays. Collective over the job: every rank calls it."""
    check_in_force(current_placements(chunks), placements, "--piper-migrate-every (set_placement)")
    counts = routed_tokens(chunks, tuple(placements), settings.model.num_experts, settings.timeout)
    placements = dict(placements)
    choice, target = price(settings, counts, placements, iteration=iteration, since=since)
    if target is None:
        return Outcome(iteration=iteration, since=since, choice=choice, report=None, placements=placements)
    mine = moe_layers(chunks)
    report = None
    if mine:  # a pipeline stage without MoE layers moves nothing
        sync_params(chunks)
        report = migrate(chunks, optimizer, {n: p for n, p in target.items() if n in mine}, timeout=settings.timeout)
    return Outcome(iteration=iteration, since=since, choice=choice, report=report, placements=placements | target)


def sync_params(chunks: Iterable[torch.nn.Module]) -> None:
    """With the distributed optimizer's overlapped parameter all-gather, the step's new weights reach
    ``param.data`` only at the next forward: gather them now, synchronously (as Megatron does before it
    saves a checkpoint), so that the weights that move are the step's."""
    for chunk in chunks:
        config = getattr(chunk, "ddp_config", None)
        if config is not None and config.use_distributed_optimizer and config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


__all__ = ["LiveSettings", "Outcome", "decide", "job_placements", "routed_tokens", "saved_placements", "sync_params"]
