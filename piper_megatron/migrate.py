"""Incremental expert migration on Megatron-Core (issue 17, deliverable 3): between two steps, move the
experts whose physical slot changes to their new expert-parallel rank, then switch the dispatchers.

For each logical expert that changes slot (:func:`piper_core.scheduler.migration.plan_migration`, the
target aligned so that experts staying on a rank keep their slot), the holder of its old slot packs,
for every parameter of that local expert, in one fixed order:

* the weight (``param.data``: bf16 or fp32, in DDP's parameter buffer where it has one);
* the DDP gradient buffer's view ``param.main_grad``, so that it reads as the logical expert's after
  the move (DDP zeroes the buffer at the next step's start; moved anyway so that nothing observed
  between steps is stale);
* its optimizer state (:func:`optimizer_state`): Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``, and
  the fp32 master weight where the optimizer keeps one -- Piper's host ``FP32Adam`` and
  ``MixedPrecisionAdam`` (piper_megatron/train.py), Megatron-Core's ``FP32Optimizer``,
  ``Float16OptimizerWithFloat16Params`` and ``ChainedOptimizer``, a plain ``torch.optim`` optimizer,
  and Megatron-Core's ``DistributedOptimizer``. With an expert data-parallel size above 1 the
  distributed optimizer holds on each expert data-parallel rank a piece of an expert's state whose
  bounds depend on the expert's local slot, which a move may change: each rank first assembles the
  whole state of the experts it gives away (zeros but its piece, one all-reduce over the expert
  data-parallel group), the whole states move, and each rank writes its new piece back
  (:func:`_unshard`, :func:`_reshard`). Its precision-aware variant is refused, by name.

The plan, the point-to-point exchange of one byte buffer per peer and the buffers kept between
migrations are :mod:`piper_core.runtime.migrate`'s (shared with :mod:`piper_deepspeed.migrate`): what
is written lands in place (``copy_``: the parameters, views and state objects stay the same, so DDP's
buckets and the optimizer's references stay valid). Finally each MoE layer's
:class:`~piper_megatron.dispatcher.PiperTokenDispatcher` routes by the new placement
(:meth:`~piper_megatron.dispatcher.PiperTokenDispatcher.set_placement`).

Checkpoints hold physical slots under Megatron's expert names: ``write_placements`` keeps the
placement of every layer beside them (``piper_placement.json``, :mod:`piper_core.runtime.migrate`) and
:func:`apply_placements` sets it on a freshly built model before its state is loaded.

Experts must be ``SequentialMLP`` (``moe_grouped_gemm`` off, as on CPU ranks): the grouped variants
hold all local experts in shared tensors, which this does not split (refused, by name).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import migrate as move
from piper_core.runtime import timeouts
from piper_core.runtime.migrate import (  # noqa: F401 (re-exported: this module's API since issue 17)
    PLACEMENT_NAME,
    MigrationReport,
    placements_json,
    read_placements,
    write_placements,
)
from piper_core.runtime.placement import ExpertPlacement
from piper_megatron.experts import local_experts, moe_layers

Resolver = Callable[[torch.nn.Parameter], dict[str, torch.Tensor]]
BUFFERS = move.MoveBuffers()
"""This process's exchange buffers, kept between migrations (:class:`piper_core.runtime.migrate.MoveBuffers`)."""


# ---- the model's MoE layers ----------------------------------------------------------------------

def piper_dispatcher(layer: Any, number: int) -> Any:
    """MoE layer ``number``'s token dispatcher, which must be Piper's (SpecError otherwise)."""
    from piper_megatron.dispatcher import PiperTokenDispatcher

    d = layer.token_dispatcher
    if not isinstance(d, PiperTokenDispatcher):
        raise SpecError(f"layer {number} token dispatcher", type(d).__name__, "cannot route by a placement "
                        "(Megatron's dispatchers send logical expert l to slot l)",
                        "build the model with Piper's dispatcher (--piper, or install_dispatcher)")
    return d


def current_placements(chunks: Iterable[torch.nn.Module]) -> dict[int, ExpertPlacement]:
    """layer_number -> the placement each MoE layer's dispatcher routes by (default where none)."""
    out = {}
    for number, layer in moe_layers(chunks).items():
        d = piper_dispatcher(layer, number)
        out[number] = d.placement or ExpertPlacement.default(d.num_experts, d.ep_size)
    return out


# ---- optimizer state -----------------------------------------------------------------------------

def optimizer_state(optimizer: Any, params: list[torch.nn.Parameter]) -> Resolver:
    """A function from a model parameter to the optimizer tensors that belong to it (the fp32 master
    weight as ``main_param`` where one is kept apart from the parameter; Adam's state by its names).
    SpecError for an optimizer this does not know, and for the distributed optimizer over more than
    one expert data-parallel rank (module docstring)."""
    owners = {id(p): _owner(optimizer, p) for p in params}

    def resolve(p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        owner = owners.get(id(p))
        if owner is None:
            return {}
        tensors = owner(p)
        return {k: v for k, v in sorted(tensors.items()) if torch.is_tensor(v)}
    return resolve


def _owner(optimizer: Any, p: torch.nn.Parameter) -> Callable[[Any], dict[str, torch.Tensor]] | None:
    """The function giving ``p``'s state in ``optimizer`` (None: it does not hold ``p``)."""
    from piper_megatron.train import FP32Adam, MixedPrecisionAdam

    name = type(optimizer).__name__
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for inner in chained:
            found = _owner(inner, p)
            if found is not None:
                return found
        return None
    if isinstance(optimizer, FP32Adam):
        return (lambda q: dict(optimizer.adam.state.get(q, {}))) if any(q is p for q in optimizer.params) else None
    if isinstance(optimizer, MixedPrecisionAdam):
        for q, master in zip(optimizer.params, optimizer.masters):
            if q is p:
                return lambda _q, m=master: {"main_param": m, **optimizer.adam.state.get(m, {})}
        return None
    if name == "DistributedOptimizer":
        return _distributed(optimizer, p)
    if hasattr(optimizer, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        for group, masters in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            for q, master in zip(group, masters):
                if q is p:
                    return lambda _q, m=master: {"main_param": m, **optimizer.optimizer.state.get(m, {})}
        held = any(q is p for group in optimizer.fp32_from_fp32_groups for q in group)
        return (lambda q: dict(optimizer.optimizer.state.get(q, {}))) if held else None
    inner = getattr(optimizer, "optimizer", None)  # FP32Optimizer wraps a torch optimizer
    if name == "FP32Optimizer" and isinstance(inner, torch.optim.Optimizer):
        return _owner(inner, p)
    if isinstance(optimizer, torch.optim.Optimizer):
        held = any(q is p for g in optimizer.param_groups for q in g["params"])
        return (lambda q: dict(optimizer.state.get(q, {}))) if held else None
    raise SpecError("optimizer", name, "is not one whose per-parameter state migration knows (Piper's FP32Adam / "
                    "MixedPrecisionAdam, Megatron's FP32Optimizer, Float16OptimizerWithFloat16Params, "
                    "DistributedOptimizer, ChainedOptimizer, or a torch.optim optimizer)",
                    "use one of those, or migrate with move_optimizer=False only if the optimizer keeps no state")


def _distributed(optimizer: Any, p: torch.nn.Parameter) -> Callable[[Any], dict[str, torch.Tensor]] | None:
    """Megatron's DistributedOptimizer: ``p``'s main parameter and Adam state (its whole state: one
    expert data-parallel rank; else SpecError)."""
    if p not in optimizer.model_param_gbuf_map:
        return None
    group = getattr(optimizer, "data_parallel_group", None)
    size = dist.get_world_size(group) if group is not None else 1
    if getattr(p, "allreduce", True) is False and size > 1:
        raise SpecError("DistributedOptimizer", f"expert data-parallel size {size}", "holds a piece of each "
                        "expert's state per expert data-parallel rank; optimizer_state returns whole states only",
                        "call migrate(), which assembles the pieces over the expert data-parallel group first")
    if p not in optimizer.model_param_group_index_map:
        return None

    def state(q: Any) -> dict[str, torch.Tensor]:
        tensors = dict(optimizer._get_main_param_and_optimizer_states(q))
        main = tensors.pop("param")
        if main.untyped_storage().data_ptr() != q.untyped_storage().data_ptr():  # fp32: a view of the weight
            tensors["main_param"] = main
        return tensors
    return state


# ---- the distributed optimizer over several expert data-parallel ranks -------------------------------

def _sharded(optimizer: Any) -> list[Any]:
    """Megatron's DistributedOptimizers (chained or not) that shard expert parameters over more than
    one expert data-parallel rank: each rank holds a piece of an expert's state whose bounds depend on
    the expert's local slot, so a move to another slot needs the whole state (:func:`_unshard`)."""
    out = []
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        group = getattr(o, "data_parallel_group", None)
        if type(o).__name__ == "DistributedOptimizer" and group is not None and dist.get_world_size(group) > 1 and \
                any(getattr(p, "allreduce", True) is False for p in o.model_param_gbuf_map):
            if getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
                raise SpecError("use_precision_aware_optimizer", True, "keeps the distributed optimizer's state "
                                "scaled in lower precision, which migration does not unscale",
                                "migrate without --use-precision-aware-optimizer")
            out.append(o)
    return out


def _shard_keys(p: torch.nn.Parameter) -> tuple[str, ...]:
    """Adam's m and v, and the fp32 main parameter where it is not a view of an fp32 weight."""
    return ("exp_avg", "exp_avg_sq") + (("param",) if p.dtype != torch.float32 else ())


def _unshard(optimizers: list[Any], params: list[torch.nn.Parameter],
             timeout: timedelta) -> dict[int, dict[str, torch.Tensor]]:
    """``id(p)`` -> whole fp32 state tensors of ``p`` (``main_param`` for the main parameter): every
    expert data-parallel rank writes the piece it holds into zeros, then one all-reduce (sum) over the
    expert data-parallel group (each element is held by exactly one rank; a rank that holds no piece
    of ``p`` has it in no map, so every rank sizes the buffer from ``params`` alone)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    flat = torch.zeros(sum(p.numel() * len(_shard_keys(p)) for p in params), dtype=torch.float32)
    offset = 0
    for p in params:
        holder = next((o for o in optimizers if p in o.model_param_group_index_map), None)
        state = holder._get_main_param_and_optimizer_states(p) if holder is not None else {}
        piece = holder._get_model_param_range_map(p)["param"] if holder is not None else None
        views = {}
        for key in _shard_keys(p):
            full = flat[offset:offset + p.numel()]
            if piece is not None and key in state:
                full[piece.start:piece.end].copy_(state[key].detach().view(-1))
            views["main_param" if key == "param" else key] = full.view(p.shape)
            offset += p.numel()
        out[id(p)] = views
    group = optimizers[0].data_parallel_group
    members = tuple(dist.get_process_group_ranks(group))
    what = timeouts.OpName(op=f"expert migration all-reduce (the moved experts' distributed optimizer state, "
                           f"{flat.numel() * 4:,} bytes)", stage="expert data-parallel group", ranks=members,
                           rank=dist.get_rank())
    timeouts.wait(timeouts.launch(what, lambda: dist.all_reduce(flat, group=group, async_op=True)), what, timeout)
    return out


@torch.no_grad()
def _reshard(optimizers: list[Any], full: dict[int, dict[str, torch.Tensor]],
             params: list[torch.nn.Parameter]) -> None:
    """Write each rank's piece of the (received) whole states back into its optimizer shards."""
    for o in optimizers:
        for p in params:
            if p not in o.model_param_group_index_map:  # this rank holds no piece of p
                continue
            state = o._get_main_param_and_optimizer_states(p)
            piece = o._get_model_param_range_map(p)["param"]
            for key in _shard_keys(p):
                if key in state:
                    state[key].view(-1).copy_(full[id(p)]["main_param" if key == "param" else key]
                                              .view(-1)[piece.start:piece.end])


# ---- packing -------------------------------------------------------------------------------------

def _tensors(expert: Any, resolve: Resolver | None) -> list[torch.Tensor]:
    """What moves with one local expert, in a fixed order (module docstring)."""
    out = []
    for p in expert.parameters():
        out.append(p.data)
        grad = getattr(p, "main_grad", None)
        if grad is not None:
            out.append(grad)
        if resolve is not None:
            out.extend(resolve(p).values())
    return out


def release_buffers() -> int:
    """Free the exchange buffers kept between migrations; the bytes they held."""
    return BUFFERS.release()


# ---- the move ------------------------------------------------------------------------------------

def migrate(chunks: list[torch.nn.Module], optimizer: Any, target: ExpertPlacement | Mapping[int, ExpertPlacement],
            *, timeout: timedelta = timedelta(seconds=60), move_optimizer: bool = True) -> MigrationReport:
    """Move this rank's experts to ``target`` (one placement for every MoE layer, or layer_number ->
    placement; layers not given keep theirs) and switch the dispatchers (module docstring). Call it
    on every rank of the job between two steps (after ``optimizer.step()``). ``move_optimizer=False``
    leaves the optimizer state in the slots (wrong for Adam: the tests' control)."""
    layers = moe_layers(chunks)
    plan, placements = move.plan_moves(current_placements(chunks), target)
    number0 = next(iter(layers))
    group = piper_dispatcher(layers[number0], number0).ep_group
    ranks = tuple(dist.get_process_group_ranks(group))
    me = dist.get_rank(group)
    resolve, sharded, full = None, [], {}
    if move_optimizer:
        sharded = _sharded(optimizer)
        if not sharded:
            params = [p for layer in layers.values() for e in local_experts(layer, layer.layer_number)
                      for p in e.parameters()]
            resolve = optimizer_state(optimizer, params)
    move.barrier(group, ranks, me, timeout, "before")
    start = time.perf_counter()
    if sharded:  # the distributed optimizer over several expert data-parallel ranks: whole states first
        involved = [p for m in plan.moves if m.src_rank == me
                    for p in local_experts(layers[m.layer], m.layer)[m.src_local].parameters()]
        full = _unshard(sharded, involved, timeout)
        resolve = lambda p: {k: t for k, t in sorted(full.get(id(p), {}).items())}  # noqa: E731
    sent, received, phases = move.exchange(
        plan, lambda layer, local: _tensors(local_experts(layers[layer], layer)[local], resolve),
        group, ranks, me, timeout, BUFFERS)
    if sharded:
        _reshard(sharded, full, involved)
    move.barrier(group, ranks, me, timeout, "after")
    seconds = time.perf_counter() - start
    for n, p in placements.items():
        piper_dispatcher(layers[n], n).set_placement(None if p.is_default else p)
    return MigrationReport(plan=plan, sent_bytes=sent, received_bytes=received, seconds=seconds,
                           placements=placements, phases=phases)


# ---- checkpoints ---------------------------------------------------------------------------------

def apply_placements(chunks: list[torch.nn.Module], placements: Mapping[int, ExpertPlacement]) -> None:
    """Route each MoE layer by its placement without moving anything: for a model whose slots already
    hold those experts (a checkpoint saved after a migration, loaded next). Every MoE layer of this
    rank must be listed."""
    layers = moe_layers(chunks)
    missing = sorted(set(layers) - set(placements))
    if missing:
        raise SpecError("placement", sorted(placements), f"lists no placement for MoE layers {missing} of this rank",
                        "pass the piper_placement.json saved with the checkpoint")
    for n, layer in layers.items():
        p = placements[n]
        piper_dispatcher(layer, n).set_placement(None if p.is_default else p)
