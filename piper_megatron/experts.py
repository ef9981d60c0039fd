"""Skewed routing and expert placement for the CPU trainer (issue 17, the measured deliverable).

Two things a benchmark of expert placement needs from a training run:

* :func:`bias_routers` -- a **fixed additive bias on the router logits** of chosen logical experts,
  so that dropless training is uneven by a known, repeatable amount. Megatron's router runs
  unchanged (``TopKRouter.forward``: input jitter, ``gating``, ``routing`` with its score function,
  top-k, capacity and aux losses); only the logits that ``gating`` returns get the constant added.
  Megatron's own ``expert_bias`` was not used: it needs the sigmoid score function
  (``TransformerConfig.__post_init__``), acts only on the top-k choice, and
  ``finalize_model_grads`` moves it towards balance every step (``_update_router_expert_bias``).
* :func:`move_experts` -- the **same logical model under any placement**: the model is built with
  Megatron's default placement (slot ``s`` holds logical expert ``s``, drawn by Megatron's expert RNG),
  then every MoE layer all-gathers its experts' weights over the expert-parallel group and each
  rank loads logical expert ``logical_at[s]`` into its slot ``s``. Runs with different placements
  then start from the same logical weights, and Piper's dispatcher sends each logical expert's
  tokens to its slot (:mod:`piper_megatron.dispatcher`), so they train the same model.

Only Megatron-Core's per-expert ``SequentialMLP`` (``moe_grouped_gemm`` off, what the CPU trainer
builds) is moved; a grouped layer is refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from piper_core.errors import SpecError
from piper_core.runtime import timeouts
from piper_core.runtime.placement import Placements


def moe_layers(chunks: Iterable[torch.nn.Module]) -> dict[int, Any]:
    """layer_number -> Megatron ``MoELayer`` of this rank's model chunks (DDP-wrapped or not), in module
    order (the same on every rank of an expert-parallel group: its members hold the same pipeline stage)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    out: dict[int, Any] = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                number = getattr(module, "layer_number", None)
                if number is None:
                    raise SpecError("MoELayer.layer_number", None, "is unset, so the layer cannot be named in a "
                                    "placement", "build the layer inside a TransformerBlock (or call set_layer_number)")
                out[number] = module
    return out


def local_experts(layer: Any, number: int) -> list[Any]:
    """MoE layer ``number``'s local experts, one module each (Megatron's ``SequentialMLP``): what placing
    and migrating experts move."""
    local = getattr(layer.experts, "local_experts", None)
    if local is None:
        raise SpecError(f"layer {number} experts", type(layer.experts).__name__, "hold every local expert in shared "
                        "tensors; placing and migrating experts move SequentialMLP experts (one module each)",
                        "turn moe_grouped_gemm off (--moe-grouped-gemm unset; the CPU trainer does)")
    return list(local)


def _biased_gating(gating: Any, bias: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    logits = gating(input)
    return logits + bias.to(dtype=logits.dtype)


def bias_routers(chunks: Iterable[torch.nn.Module], bias: Mapping[int, float]) -> int:
    """Add ``bias[e]`` to logical expert ``e``'s router logit in every MoE layer (a constant, not a
    parameter: it never trains). Returns the number of routers biased."""
    layers = moe_layers(chunks)
    for layer in layers.values():
        router = layer.router
        experts = router.config.num_moe_experts
        vector = torch.zeros(experts, dtype=torch.float32)
        for e, b in bias.items():
            if not 0 <= e < experts:
                raise SpecError("router_bias", e, f"is not a logical expert of this model (0 .. {experts - 1})",
                                "bias experts of the model")
            vector[e] = float(b)
        # an instance attribute in front of Router.gating: TopKRouter.forward calls self.gating(input)
        router.gating = functools.partial(_biased_gating, router.gating, vector)
    return len(layers)


def _flat(expert: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in expert.parameters()])  # bf16 -> fp32 is exact


def move_experts(chunks: Iterable[torch.nn.Module], placement: Placements, *, group: dist.ProcessGroup,
                 ep_rank: int, ranks: tuple[int, ...], timeout: timedelta) -> int:
    """Load logical expert ``placement.logical_at[s]``'s weights into each of this rank's slots ``s``,
    from a model built with the default placement (module docstring); with a placement per layer,
    each MoE layer by its own (an unlisted layer stays). ``group``: the expert-parallel
    group (``ranks``, its global ranks; this rank is ``ep_rank`` of it), each all-gather waited on for
    at most ``timeout``. Collective over the group; returns the MoE layers moved (0 for the default
    placement, which moves nothing)."""
    if placement.is_default:
        return 0
    layers = {n: layer for n, layer in moe_layers(chunks).items()
              if placement.for_layer(n) is not None and not placement.for_layer(n).is_default}
    for n, (number, layer) in enumerate(layers.items()):
        local = local_experts(layer, number)
        per = len(local)
        placement.check(num_experts=per * placement.ep, ep=placement.ep, key="placement")
        logical_at = placement.for_layer(number).logical_at
        mine = torch.stack([_flat(e) for e in local])  # [per, numel]: experts of one layer share their shapes
        gathered = [torch.empty_like(mine) for _ in ranks]
        what = timeouts.OpName(op=f"expert placement: all-gather of MoE layer {number}'s experts "
                                  f"({n + 1}/{len(layers)} here)",
                               stage="stage 1/1", ranks=ranks, rank=dist.get_rank())
        work = timeouts.launch(what, lambda: dist.all_gather(gathered, mine, group=group, async_op=True))
        timeouts.wait(work, what, timeout)
        logical = torch.cat(gathered)  # [E, numel]: built with the default placement, slot = logical id
        with torch.no_grad():
            for i, expert in enumerate(local):
                row, offset = logical[logical_at[ep_rank * per + i]], 0
                for p in expert.parameters():
                    p.copy_(row[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
    return len(layers)


__all__ = ["bias_routers", "local_experts", "moe_layers", "move_experts"]
