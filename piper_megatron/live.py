"""Expert migration while Megatron-LM trains: ``--piper-migrate-every N`` (issue 17).

Every ``N`` iterations, between two of them (after the optimizer step; :mod:`piper_megatron.install`
wraps ``megatron.training.training.train_step``), every rank of the job:

1. takes from each of its MoE layers' :class:`~piper_megatron.dispatcher.PiperTokenDispatcher` the
   tokens its router sent each **logical** expert since the last decision (counted before the
   dispatcher reorders the router's columns into physical slots, so whatever the placement);
2. sums them over the job (:func:`routed_tokens`: one all-reduce, bounded by the job's timeout, whose
   failure names the operation and the ranks), so every rank holds the same histogram per layer;
3. prices moving from the placements the job runs now to the placement optimizer's and to swap
   descent's (:func:`piper_core.scheduler.migration.choose`: the predicted step under the histogram
   before and after, the predicted move on the plan's cluster, the gain over ``H`` iterations against
   the move), the same on every rank, so all ranks decide alike;
4. only when the gain exceeds the move: gathers the distributed optimizer's overlapped parameter
   all-gather first (so the weights that move are the step's), then
   :func:`piper_megatron.migrate.migrate` moves the experts (weights, gradient buffers, optimizer
   state) and switches the dispatchers.

The placements of the whole job (every MoE layer, every pipeline stage) are kept on every rank, from
the same start (``--piper-placement``, else Megatron's default; a loaded checkpoint's
``piper_placement.json``) and the same decisions; before each decision they are checked against
what this rank's dispatchers route by. Pure bookkeeping besides the one all-reduce and ``migrate``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from piper_core.runtime import timeouts
from piper_core.runtime.placement import ExpertPlacement, Placements
from piper_core.scheduler.migration import Choice, choose, layer_range, move_rows
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.routing import Routing, moe_layer_numbers
from piper_megatron.experts import moe_layers
from piper_megatron.migrate import (
    PLACEMENT_NAME,
    MigrationReport,
    current_placements,
    migrate,
    piper_dispatcher,
    read_placements,
)

MAX_MOVES_SHOWN = 4  # per layer, in the decision line


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveSettings:
    """What the decisions price with: every ``every`` iterations, the gain over ``horizon`` iterations,
    the job's ``model``, ``plan`` and ``cluster`` (``--piper``'s), and each collective's ``timeout``."""

    every: int
    horizon: int
    model: ModelSpec
    plan: ParallelPlan
    cluster: ClusterSpec
    timeout: timedelta


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """One decision after ``iteration``: over the tokens routed since ``since``, the candidates priced
    (``choice``; None when no tokens were counted), this rank's move (``report``; None when nothing
    moved here) and the placements of every MoE layer now in force."""

    iteration: int
    since: int
    choice: Choice | None
    report: MigrationReport | None
    placements: dict[int, ExpertPlacement]

    def line(self) -> str:
        """What rank 0 prints."""
        head = f"piper: migration decision after iteration {self.iteration} (tokens of iterations " \
               f"{self.since + 1}-{self.iteration})"
        if self.choice is None:
            return f"{head}: none: no tokens were routed to the experts"
        decision = self.choice.chosen.decision
        step = f"predicted step {decision.step_before_s:.4g} s -> {decision.step_after_s:.4g} s"
        if not decision.migrate:
            return f"{head}: no move: {decision.reason()} ({step})"
        rows = move_rows(self.choice.chosen.migration, max_shown=MAX_MOVES_SHOWN)
        moved = "; ".join(f"layer {layer_range(layers)}: {text}" for layers, text in rows)
        line = f"{head}: moved {decision.cost.experts} experts ({moved}): {decision.reason()} ({step})"
        if self.report is not None:
            line += (f"; this rank's move took {self.report.seconds:.3g} s and sent "
                     f"{self.report.sent_bytes / 2**20:.3g} MiB")
        return line


def job_placements(model: ModelSpec, ep: int, given: Placements | None) -> dict[int, ExpertPlacement]:
    """layer_number -> placement of every MoE layer of ``model``: ``given``'s (``--piper-placement``:
    one for every layer, or per layer), else Megatron's default."""
    default = ExpertPlacement.default(model.num_experts, ep)
    return {n: (given.for_layer(n) if given is not None else None) or default for n in moe_layer_numbers(model)}


def saved_placements(directory: Path | str, model: ModelSpec, ep: int) -> dict[int, ExpertPlacement] | None:
    """Every MoE layer's placement from a checkpoint directory's ``piper_placement.json`` (a layer it
    does not list: the default), None when the directory has none (its slots hold the default)."""
    path = Path(directory) / PLACEMENT_NAME
    if not path.is_file():
        return None
    read = read_placements(path)
    for n, p in read.items():
        p.check(num_experts=model.num_experts, ep=ep, key=f"{path}: layer {n}")
    default = ExpertPlacement.default(model.num_experts, ep)
    return {n: read.get(n, default) for n in moe_layer_numbers(model)}


def routed_tokens(chunks: Iterable[torch.nn.Module], layers: tuple[int, ...], num_experts: int,
                  timeout: timedelta) -> dict[int, tuple[int, ...]]:
    """layer_number -> tokens per logical expert that every rank's router sent since the last call,
    summed over the job: each rank's dispatchers' counts (:meth:`~piper_megatron.dispatcher.
    PiperTokenDispatcher.take_routed_tokens`, which restarts them) in its MoE layers' rows, one
    all-reduce over every rank (rows of layers a rank does not hold stay 0 there)."""
    mine = {n: piper_dispatcher(layer, n).take_routed_tokens() for n, layer in moe_layers(chunks).items()}
    device = next(iter(mine.values())).device if mine else _collective_device()
    counts = torch.zeros(len(layers), num_experts, dtype=torch.long, device=device)
    for row, n in enumerate(layers):
        if n in mine:
            counts[row] += mine[n].to(device)
    world = dist.get_world_size()
    what = timeouts.OpName(op=f"expert migration decision: all-reduce of the tokens routed to each expert "
                           f"({len(layers)} MoE layers x {num_experts} experts)", stage="whole job",
                           ranks=tuple(range(world)), rank=dist.get_rank())
    timeouts.wait(timeouts.launch(what, lambda: dist.all_reduce(counts, async_op=True)), what, timeout)
    return {n: tuple(int(c) for c in row) for n, row in zip(layers, counts.cpu().tolist())}


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def decide(settings: LiveSettings, chunks: list[torch.nn.Module], optimizer: Any,
           placements: Mapping[int, ExpertPlacement], *, iteration: int, since: int) -> Outcome:
    """The decision after ``iteration`` over the tokens routed since iteration ``since`` (module
    docstring), and the move when it pays. Collective over the job: every rank calls it."""
    model, plan = settings.model, settings.plan
    _check_in_force(chunks, placements)
    counts = routed_tokens(chunks, tuple(placements), model.num_experts, settings.timeout)
    placements = dict(placements)
    if any(sum(c) == 0 for c in counts.values()):
        return Outcome(iteration=iteration, since=since, choice=None, report=None, placements=placements)
    routing = Routing(num_experts=model.num_experts, source=f"tokens routed in iterations {since + 1}-{iteration}",
                      layers=tuple((n, tuple(map(float, c))) for n, c in counts.items()))
    choice = choose(model, settings.cluster, plan, routing, {n: p.ranks for n, p in placements.items()},
                    horizon=settings.horizon)
    chosen = choice.chosen
    if not chosen.decision.migrate:
        return Outcome(iteration=iteration, since=since, choice=choice, report=None, placements=placements)
    target = {n: ExpertPlacement(num_experts=model.num_experts, ep=plan.ep, ranks=ranks)
              for n, ranks in chosen.migration.target}
    mine = moe_layers(chunks)
    report = None
    if mine:  # a pipeline stage without MoE layers moves nothing
        sync_params(chunks)
        report = migrate(chunks, optimizer, {n: p for n, p in target.items() if n in mine}, timeout=settings.timeout)
    return Outcome(iteration=iteration, since=since, choice=choice, report=report, placements=placements | target)


def _check_in_force(chunks: list[torch.nn.Module], placements: Mapping[int, ExpertPlacement]) -> None:
    """RuntimeError when this rank's dispatchers route by other placements than the job's record."""
    for n, p in current_placements(chunks).items():
        if placements.get(n) != p:
            raise RuntimeError(f"piper: MoE layer {n} routes by {p.ranks}, while the job's migration record says "
                               f"{None if placements.get(n) is None else placements[n].ranks}: something else changed "
                               "the placement (set_placement) outside --piper-migrate-every")


def sync_params(chunks: Iterable[torch.nn.Module]) -> None:
    """With the distributed optimizer's overlapped parameter all-gather, the step's new weights reach
    ``param.data`` only at the next forward: gather them now, synchronously (as Megatron does before it
    saves a checkpoint), so that the weights that move are the step's."""
    for chunk in chunks:
        config = getattr(chunk, "ddp_config", None)
        if config is not None and config.use_distributed_optimizer and config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


__all__ = ["LiveSettings", "Outcome", "decide", "job_placements", "routed_tokens", "saved_placements", "sync_params"]
