"""The migration decision made while a job trains, the part every framework shares (issue 17): Megatron's
``--piper-migrate-every N`` (:mod:`piper_megatron.live`) and the DeepSpeed block's ``"migrate_every"``
(:mod:`piper_deepspeed.live`).

Every ``N`` steps, between two of them, every rank of the job:

1. takes from each of its MoE layers the tokens its router sent each **logical** expert since the last
   decision (the adapter counts them before its dispatcher maps logical experts to physical slots, so
   whatever the placement);
2. sums them over the job (:func:`routed_tokens`: one all-reduce, bounded by the job's timeout, whose
   failure names the operation and the ranks), so every rank holds the same histogram per layer;
3. prices moving from the placements the job runs now to the placement optimizer's and to swap
   descent's (:func:`price`, :func:`piper_core.scheduler.migration.choose`: the predicted step under
   the histogram before and after, the predicted move on the plan's cluster, the gain over ``H``
   steps against the move), the same on every rank, so all ranks decide alike;
4. only when the gain exceeds the move: the adapter moves the experts and switches its dispatchers.

The placements of the whole job are kept on every rank, from the same start and the same decisions
(:class:`Outcome`), and checked against what the rank's layers route by before each decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from piper_core.runtime import timeouts
from piper_core.runtime.migrate import PLACEMENT_NAME, MigrationReport, read_placements
from piper_core.runtime.placement import ExpertPlacement, Placements
from piper_core.scheduler.migration import Choice, choose, layer_range, move_rows
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.routing import Routing, moe_layer_numbers

MAX_MOVES_SHOWN = 4  # per layer, in the decision line


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveSettings:
    """What the decisions price with: every ``every`` steps, the gain over ``horizon`` steps, the job's
    ``model``, ``plan`` and ``cluster`` (the adapter's plan), and each collective's ``timeout``."""

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

    @property
    def moved(self) -> bool:
        return self.choice is not None and self.choice.chosen.decision.migrate

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
    """layer_number -> placement of every MoE layer of ``model``: ``given``'s (one for every layer, or
    per layer), else the default (Megatron's contiguous blocks, DeepSpeed's too)."""
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


def routed_tokens(mine: Mapping[int, torch.Tensor], layers: tuple[int, ...], num_experts: int,
                  timeout: timedelta, device: torch.device) -> dict[int, tuple[int, ...]]:
    """layer_number -> tokens per logical expert that every rank's router sent since the last decision,
    summed over the job: this rank's counts (``mine``, by the layers it holds) in their rows, one
    all-reduce over every rank (rows of layers a rank does not hold stay 0 there)."""
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


def collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def price(settings: LiveSettings, counts: Mapping[int, tuple[int, ...]], placements: Mapping[int, ExpertPlacement],
          *, iteration: int, since: int) -> tuple[Choice | None, dict[int, ExpertPlacement] | None]:
    """The candidates priced over ``counts`` (None when a layer counted no token) and the target of
    every MoE layer when the chosen move pays (else None). Pure: the same on every rank."""
    model, plan = settings.model, settings.plan
    if any(sum(c) == 0 for c in counts.values()):
        return None, None
    routing = Routing(num_experts=model.num_experts, source=f"tokens routed in iterations {since + 1}-{iteration}",
                      layers=tuple((n, tuple(map(float, c))) for n, c in counts.items()))
    choice = choose(model, settings.cluster, plan, routing, {n: p.ranks for n, p in placements.items()},
                    horizon=settings.horizon)
    if not choice.chosen.decision.migrate:
        return choice, None
    return choice, {n: ExpertPlacement(num_experts=model.num_experts, ep=plan.ep, ranks=ranks)
                    for n, ranks in choice.chosen.migration.target}


def check_in_force(current: Mapping[int, ExpertPlacement], placements: Mapping[int, ExpertPlacement],
                   what: str) -> None:
    """RuntimeError when this rank's layers route by other placements than the job's record (``what``:
    the adapter's switch, named in the message)."""
    for n, p in current.items():
        if placements.get(n) != p:
            raise RuntimeError(f"piper: MoE layer {n} routes by {p.ranks}, while the job's migration record says "
                               f"{None if placements.get(n) is None else placements[n].ranks}: something else changed "
                               f"the placement outside {what}")
