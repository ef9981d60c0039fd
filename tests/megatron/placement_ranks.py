"""Rank side of tests/megatron/test_placement.py: a Megatron-Core ``MoELayer`` with the default
placement (Megatron's own dispatcher) against the same layer with Piper's dispatcher and a
non-trivial :class:`~piper_core.runtime.placement.ExpertPlacement`, on ``ep == world`` gloo ranks.

Each case builds the stock layer, gathers every rank's local experts (logical expert ``l`` is the
default's slot ``l``), builds the Piper layer with the same router and, in each physical slot ``s``,
the weights of logical expert ``logical_at[s]``; runs one forward and backward on the same input on
each; and reports the largest differences of the output, the input gradient, the router gradient
and each logical expert's weight gradients (gathered from whichever rank holds it), plus the tokens
each physical slot received against the stock count of its logical expert. The control runs the
same placement with the default weights left in the slots: its output must differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from tests.megatron.piper_ranks import _comm, _forward_backward, _layer, _max_diff, _moe_config

EXPERTS = 8
# logical expert ids per expert-parallel rank: every rank gives experts away and reorders its own
PLACEMENTS = {2: ((5, 2, 7, 0), (3, 6, 1, 4)), 4: ((5, 2), (7, 0), (3, 6), (1, 4))}


@dataclasses.dataclass(frozen=True)
class PlacementCase:
    topk: int
    capacity: str  # a key of piper_ranks.CAPACITY
    algorithm: str
    chunks: int
    defer: bool = False

    @property
    def id(self) -> str:
        return f"top{self.topk}-{self.capacity}-{self.algorithm}-chunks{self.chunks}{'-dwg' if self.defer else ''}"


CASES = (PlacementCase(1, "dropless", "flat", 1), PlacementCase(2, "dropless", "flat", 1),
         PlacementCase(2, "dropless", "hierarchical", 2), PlacementCase(2, "cf1.0", "flat", 2),
         PlacementCase(1, "cf1.0-pad", "flat", 1), PlacementCase(2, "dropless", "flat", 2, defer=True))


def _local_experts(layer: Any) -> list[Any]:
    return list(layer.experts.local_experts)  # SequentialMLP (moe_grouped_gemm off)


def _init_experts(layer: Any, rank: int) -> None:
    """Expert weights as ``nn.Linear`` draws them (U(+-1/sqrt(fan_in))), one generator per global
    expert: outputs of order 1, so 1e-6 is a tight fp32 bound (Megatron's init, std 0.02, gives outputs
    near 1e-3, where any mapping would look close)."""
    local = _local_experts(layer)
    with torch.no_grad():
        for i, expert in enumerate(local):
            g = torch.Generator().manual_seed(17 + rank * len(local) + i)
            for p in expert.parameters():
                bound = 1.0 / p.shape[-1] ** 0.5
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))


def _gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` (the default group: its timeout is run_ranks')."""
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _expert_states(layer: Any, world: int) -> list[dict[str, torch.Tensor]]:
    """Each slot's expert weights, in slot order over the whole expert-parallel group."""
    mine = [{n: p.detach().clone() for n, p in e.named_parameters()} for e in _local_experts(layer)]
    return [state for rank in _gather(mine, world) for state in rank]


def _expert_grads(layer: Any, world: int) -> list[dict[str, torch.Tensor]]:
    """Each slot's expert weight gradients, in slot order over the expert-parallel group."""
    mine = [{n: p.grad.clone() for n, p in e.named_parameters()} for e in _local_experts(layer)]
    return [grads for rank in _gather(mine, world) for grads in rank]


def _place(layer: Any, states: list[dict[str, torch.Tensor]], logical_at: tuple[int, ...], rank: int) -> None:
    """Load logical expert ``logical_at[s]``'s weights into each of this rank's slots ``s``."""
    local = _local_experts(layer)
    with torch.no_grad():
        for i, expert in enumerate(local):
            state = states[logical_at[rank * len(local) + i]]
            for name, p in expert.named_parameters():
                p.copy_(state[name])


def _error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """max |ref - got|, relative to max |ref| where that exceeds 1 (fp32 rounding scales with it), as
    tests/deepspeed/test_moe_layer.py measures."""
    return _max_diff(ref, got) / max(1.0, ref.abs().max().item()) if ref.numel() else 0.0


def _tokens(run: dict[str, Any]) -> list[int]:
    """Tokens per local expert over every chunk of the forward."""
    return [sum(c) for c in zip(*run["calls"])]


def _case(rank: int, world: int, comm: Any, case: PlacementCase) -> dict[str, Any]:
    from piper_core.runtime import Algorithm
    from piper_core.runtime.placement import ExpertPlacement
    from piper_megatron.dispatcher import DispatchSettings, install_dispatcher

    config, submodules = _moe_config(world, world, case.topk, case.capacity)
    stock_layer = _layer(config, submodules)
    _init_experts(stock_layer, rank)
    stock = _forward_backward(stock_layer, rank)
    states = _expert_states(stock_layer, world)
    stock_tokens = [t for r in _gather(_tokens(stock), world) for t in r]  # by logical expert (= default slot)
    stock_grads = _expert_grads(stock_layer, world)
    placement = ExpertPlacement(num_experts=EXPERTS, ep=world, ranks=PLACEMENTS[world])
    settings = DispatchSettings(algorithm=Algorithm(case.algorithm), chunks=case.chunks, defer_wgrad=case.defer,
                                placement=placement)
    patches = install_dispatcher(comm, settings)
    try:
        placed = _layer(config, submodules, source=stock_layer)
        _place(placed, states, placement.logical_at, rank)
        got = _forward_backward(placed, rank)
        control = _layer(config, submodules, source=stock_layer)  # the placement, default weights in the slots
        unplaced = _forward_backward(control, rank)
    finally:
        patches.restore()
    grads = _expert_grads(placed, world)
    per = EXPERTS // world
    expert_diff = max(_error(stock_grads[logical][name], grads[slot][name])
                      for slot, logical in enumerate(placement.logical_at) for name in stock_grads[logical])
    return {"dispatcher": type(placed.token_dispatcher).__name__,
            "output": _error(stock["y"], got["y"]), "input_grad": _error(stock["x_grad"], got["x_grad"]),
            "router_grad": max(_error(g, got["grads"][n]) for n, g in stock["grads"].items() if "router" in n),
            "expert_grads": expert_diff,
            "expert_grad_scale": max(g.abs().max().item() for grads in stock_grads for g in grads.values()),
            "tokens": _tokens(got), "want_tokens": [stock_tokens[placement.logical_at[rank * per + i]]
                                                   for i in range(per)],
            "output_scale": stock["y"].abs().max().item(), "control_output": _max_diff(stock["y"], unplaced["y"])}


def _refused(world: int, comm: Any) -> dict[str, str]:
    """Building a layer with a placement for another ep or expert count: the dispatcher's message."""
    from piper_core.errors import SpecError
    from piper_core.runtime import Algorithm
    from piper_core.runtime.placement import ExpertPlacement
    from piper_megatron.dispatcher import DispatchSettings, install_dispatcher

    config, submodules = _moe_config(world, world, 2, "dropless")
    wrong = {"ep": ExpertPlacement.from_slots(tuple(reversed(range(EXPERTS))), 2 * world),
             "experts": ExpertPlacement.from_slots(tuple(reversed(range(2 * EXPERTS))), world)}
    messages = {}
    for what, placement in wrong.items():
        patches = install_dispatcher(comm, DispatchSettings(algorithm=Algorithm.FLAT, placement=placement))
        try:
            _layer(config, submodules)
            messages[what] = "built"
        except SpecError as exc:
            messages[what] = str(exc)
        finally:
            patches.restore()
    return messages


def _per_layer_case(rank: int, world: int, comm: Any) -> dict[str, Any]:
    """A placement per MoE layer (``--piper-placement`` with a ``layers`` file): each layer routes by
    its own once Megatron gives it its ``layer_number``; a layer the file does not list keeps the
    default. Layer 2's placement (another permutation than layer 1's), with its slots holding those
    experts, gives the stock layer's output; so does layer 3 (unlisted) with the default weights."""
    from piper_core.runtime import Algorithm
    from piper_core.runtime.placement import ExpertPlacement, LayerPlacements
    from piper_megatron.dispatcher import DispatchSettings, install_dispatcher

    first = ExpertPlacement(num_experts=EXPERTS, ep=world, ranks=PLACEMENTS[world])
    second = ExpertPlacement.from_slots(tuple(reversed(range(EXPERTS))), world)
    placements = LayerPlacements(num_experts=EXPERTS, ep=world, layers={1: first, 2: second})
    config, submodules = _moe_config(world, world, 2, "dropless")
    stock_layer = _layer(config, submodules)
    _init_experts(stock_layer, rank)
    stock = _forward_backward(stock_layer, rank)
    states = _expert_states(stock_layer, world)
    patches = install_dispatcher(comm, DispatchSettings(algorithm=Algorithm.FLAT, placement=placements))
    try:
        layers = {}
        for n in (1, 2, 3):
            layer = _layer(config, submodules, source=stock_layer)  # numbered 1 when built
            layer.set_layer_number(n)
            layers[n] = layer
        routed = {n: (None if layer.token_dispatcher.placement is None else layer.token_dispatcher.placement.ranks)
                  for n, layer in layers.items()}
        _place(layers[2], states, second.logical_at, rank)
        got, unlisted = _forward_backward(layers[2], rank), _forward_backward(layers[3], rank)
        blind = _forward_backward(layers[1], rank)  # layer 1's placement, default weights in its slots
    finally:
        patches.restore()
    return {"routed": routed, "want": {1: first.ranks, 2: second.ranks, 3: None},
            "output": _error(stock["y"], got["y"]), "input_grad": _error(stock["x_grad"], got["x_grad"]),
            "unlisted_output": _error(stock["y"], unlisted["y"]), "control_output": _max_diff(stock["y"], blind["y"]),
            "output_scale": stock["y"].abs().max().item()}


def _hook_case(rank: int, world: int) -> dict[str, Any]:
    """The run-time path of ``--piper-placement``: the placement in the ``DispatchRequest`` that
    ``Installation.prepare`` makes, installed by the hooked ``initialize_model_parallel``; the layer
    built under it, given the stock layer's router and its logical experts' weights, against the
    stock layer built after ``restore()``."""
    import io

    from megatron.core import parallel_state, tensor_parallel

    from piper_core.runtime.placement import ExpertPlacement
    from piper_megatron.install import DispatchRequest, Installation
    from piper_megatron.versions import installed_release

    placement = ExpertPlacement(num_experts=EXPERTS, ep=world, ranks=PLACEMENTS[world])
    installation = Installation(installed_release(), [], io.StringIO())
    installation.hook_model_parallel(DispatchRequest(a2a="flat", chunks=1, ranks_per_node=1, timeout_minutes=1,
                                                     placement=placement))
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world, expert_tensor_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        config, submodules = _moe_config(world, world, 2, "dropless")
        placed = _layer(config, submodules)
        installation.restore()
        stock_layer = _layer(config, submodules)
        _init_experts(stock_layer, rank)
        placed.load_state_dict(stock_layer.state_dict())
        _place(placed, _expert_states(stock_layer, world), placement.logical_at, rank)
        stock, got = _forward_backward(stock_layer, rank), _forward_backward(placed, rank)
        settings = type(placed.token_dispatcher).binding.settings
    finally:
        installation.restore()
        parallel_state.destroy_model_parallel()
    return {"dispatcher": type(placed.token_dispatcher).__name__, "placement": settings.placement == placement,
            "stock": type(stock_layer.token_dispatcher).__name__, "output": _error(stock["y"], got["y"]),
            "input_grad": _error(stock["x_grad"], got["x_grad"])}


def run_rank(rank: int, world: int) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    import piper_core
    from megatron.core import parallel_state, tensor_parallel

    from piper_megatron.cpu import install_cpu_training_shims

    install_cpu_training_shims()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world, expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        comm = _comm(world, 1, world)
        results = {case.id: _case(rank, world, comm, case) for case in CASES}
        refused = _refused(world, comm)
        per_layer = _per_layer_case(rank, world, comm)
    finally:
        parallel_state.destroy_model_parallel()
    hook = _hook_case(rank, world)
    return {"cases": results, "refused": refused, "per_layer": per_layer, "hook": hook,
            "piper_core": piper_core.__file__}
