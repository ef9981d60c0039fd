"""Incremental expert migration on DeepSpeed-MoE (issue 17, deliverable 3): between two steps, move the
experts whose physical slot changes to their new expert-parallel rank, then route by the new placement.

The DeepSpeed counterpart of :mod:`piper_megatron.migrate`, on the same plan and exchange
(:mod:`piper_core.runtime.migrate`). MoE layers are the model's DeepSpeed ``MoE`` modules whose layer
is Piper's (:class:`~piper_deepspeed.moe.PiperMOELayer`: ep > 1 under ``piper_deepspeed.initialize``),
numbered in module order by ``numbers`` where given (:mod:`piper_deepspeed.live` passes the model
spec's MoE layer numbers, Megatron's 1-based ``layer_number``, which Piper's builder follows), else
1, 2, ... For every parameter of a local expert that moves, in one fixed order:

* the weight (``param.data``);
* its gradient (``param.grad``) where it has one: DeepSpeed clears gradients after each step, so
  between steps there is usually none, and a gradient accumulated between steps moves with its weight;
* its optimizer state: Adam's ``exp_avg``, ``exp_avg_sq`` and ``step`` of a torch optimizer, which is
  what the engine steps under ZeRO stage 0 without bf16 or fp16 (``engine.optimizer``).

Refused, by name, before anything moves: DeepSpeed's ``BF16_Optimizer``, ``FP16_Optimizer`` and the
ZeRO optimizers (stages 1-3). They keep the fp32 master weights and Adam's state in flat buffers
partitioned over the data-parallel ranks, whose per-expert slices this module does not cut; migrate
an fp32 ZeRO-0 job, or train those without migration.

Checkpoints: DeepSpeed saves each expert slot under its global expert id. After migrations the slots
hold other logical experts, so :func:`save_placements` writes the placement beside the checkpoint
(``piper_placement.json``) and :func:`apply_placements` routes a freshly built model by it (before or
after ``engine.load_checkpoint``: it moves nothing). tests/deepspeed/test_migrate.py checks both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import migrate as move
from piper_core.runtime.migrate import MigrationReport, read_placements, write_placements
from piper_core.runtime.placement import ExpertPlacement
from piper_deepspeed.moe import PiperMOELayer, moe_modules

BUFFERS = move.MoveBuffers()
"""This process's exchange buffers, kept between migrations (:class:`piper_core.runtime.migrate.MoveBuffers`)."""
Resolver = Callable[[torch.nn.Parameter], list[torch.Tensor]]


def _module(model: Any) -> torch.nn.Module:
    """The model of an engine (``engine.module``) or the model itself."""
    return getattr(model, "module", model)


def moe_layers(model: Any, numbers: Sequence[int] | None = None) -> dict[int, PiperMOELayer]:
    """MoE layer number (``numbers[i]`` for the i-th MoE module, default i + 1) -> its Piper layer.
    SpecError for a MoE module whose layer is DeepSpeed's own (it sends logical expert ``l`` to slot
    ``l`` and cannot follow a move), and for ``numbers`` of another length than the MoE modules."""
    modules = moe_modules(_module(model))
    numbers = tuple(numbers) if numbers is not None else tuple(range(1, len(modules) + 1))
    if len(numbers) != len(modules):
        raise SpecError("MoE layer numbers", list(numbers), f"name {len(numbers)} MoE layers, the model has "
                        f"{len(modules)} DeepSpeed MoE modules", "build the model from the same spec as piper.model")
    out = {}
    for number, (name, module) in zip(numbers, modules):
        layer = module.deepspeed_moe
        if not isinstance(layer, PiperMOELayer):
            raise SpecError(f"MoE layer {name!r}", type(layer).__name__, "cannot route by a placement (DeepSpeed's "
                            "MOELayer sends logical expert l to slot l)", "initialise with piper_deepspeed.initialize "
                            "and ep > 1, so that every MoE layer is Piper's")
        out[number] = layer
    return out


def current_placements(model: Any, numbers: Sequence[int] | None = None) -> dict[int, ExpertPlacement]:
    """MoE layer number -> the placement it routes by (the default where none)."""
    return {n: layer.piper_placement or ExpertPlacement.default(layer.num_local_experts * layer.ep_size, layer.ep_size)
            for n, layer in moe_layers(model, numbers).items()}


def optimizer_state(optimizer: Any) -> Resolver:
    """A function from a model parameter to the optimizer tensors that move with it (module docstring:
    the fp32 master where one is kept, then Adam's state by name); SpecError for an optimizer whose
    state is flat and partitioned."""
    name = type(optimizer).__name__
    if name == "FP16_UnfusedOptimizer":
        masters = {id(p): m for half, full in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                   for p, m in zip(half, full)}
        inner = optimizer.optimizer

        def resolve(p: torch.nn.Parameter) -> list[torch.Tensor]:
            master = masters.get(id(p))
            return [] if master is None else [master, *_adam(inner, master)]
        return resolve
    if isinstance(optimizer, torch.optim.Optimizer):
        return lambda p: _adam(optimizer, p)
    raise SpecError("optimizer", name, "keeps expert state this migration does not move (DeepSpeed's BF16_Optimizer, "
                    "fused FP16_Optimizer and ZeRO optimizers hold fp32 masters and Adam state in flat, partitioned "
                    "buffers)", "migrate a job at ZeRO stage 0 (a torch optimizer, or FP16_UnfusedOptimizer in bf16 "
                    "or fp16), or train without migration")


def _adam(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> list[torch.Tensor]:
    return [v for _, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v)]


def _tensors(expert: torch.nn.Module, resolve: Resolver | None) -> list[torch.Tensor]:
    """What moves with one local expert, in a fixed order (module docstring)."""
    out = []
    for p in expert.parameters():
        out.append(p.data)
        if p.grad is not None:
            out.append(p.grad)
        if resolve is not None:
            out.extend(resolve(p))
    return out


def migrate(model: Any, optimizer: Any, target: ExpertPlacement | Mapping[int, ExpertPlacement], *,
            timeout: timedelta = timedelta(seconds=60), move_optimizer: bool = True,
            numbers: Sequence[int] | None = None) -> MigrationReport:
    """Move this rank's experts to ``target`` (one placement for every MoE layer, or layer number ->
    placement; layers not given keep theirs) and route by it. ``model``: the engine or its module;
    ``optimizer``: ``engine.optimizer``. Every rank of the job calls it between two steps (after
    ``engine.step()``). ``move_optimizer=False`` leaves the optimizer state in the slots (wrong for
    Adam: the tests' control); ``numbers``: the layers' numbers (module docstring)."""
    layers = moe_layers(model, numbers)
    plan, placements = move.plan_moves(current_placements(model, numbers), target)
    resolve = optimizer_state(optimizer) if move_optimizer else None
    group = next(iter(layers.values())).ep_group
    ranks = tuple(dist.get_process_group_ranks(group))
    me = dist.get_rank(group)
    move.barrier(group, ranks, me, timeout, "before")
    start = time.perf_counter()
    sent, received, phases = move.exchange(
        plan, lambda layer, local: _tensors(layers[layer].experts.deepspeed_experts[local], resolve),
        group, ranks, me, timeout, BUFFERS)
    move.barrier(group, ranks, me, timeout, "after")
    seconds = time.perf_counter() - start
    for n, p in placements.items():  # every layer of ``layers``, by construction: route by it
        layers[n].place(None if p.is_default else p)
    return MigrationReport(plan=plan, sent_bytes=sent, received_bytes=received, seconds=seconds,
                           placements=placements, phases=phases)


def apply_placements(model: Any, placements: Mapping[int, ExpertPlacement],
                     numbers: Sequence[int] | None = None) -> None:
    """Route each MoE layer by its placement without moving anything: for a model whose slots already
    hold those experts (a checkpoint saved after a migration). Every MoE layer must be listed."""
    layers = moe_layers(model, numbers)
    missing = sorted(set(layers) - set(placements))
    extra = sorted(set(placements) - set(layers))
    if missing or extra:
        raise SpecError("placement layers", sorted(placements), f"do not match this model's MoE layers "
                        f"{sorted(layers)}" + (f" (missing {missing})" if missing else "")
                        + (f" (not MoE layers: {extra})" if extra else ""),
                        "pass the piper_placement.json saved with this model's checkpoint")
    for n, layer in layers.items():
        p = placements[n]
        layer.place(None if p.is_default else p)


def save_placements(directory: Path | str, model: Any, numbers: Sequence[int] | None = None) -> Path | None:
    """Write the placements ``model`` routes by into ``directory/piper_placement.json`` on global rank
    0 (its path; None on the other ranks). Call it with ``engine.save_checkpoint``'s directory."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return write_placements(directory, current_placements(model, numbers))


def load_placements(directory: Path | str, model: Any, numbers: Sequence[int] | None = None) -> dict[int, ExpertPlacement]:
    """Route ``model`` by the placements saved in ``directory`` (:func:`save_placements`); returns them."""
    placements = read_placements(directory)
    apply_placements(model, placements, numbers)
    return placements


def release_buffers() -> int:
    """Free the exchange buffers kept between migrations; the bytes they held."""
    return BUFFERS.release()
