"""Piper's all-to-all inside DeepSpeed-MoE: :class:`PiperMOELayer`, a ``MOELayer`` subclass.

DeepSpeed's ``MOELayer.forward`` (``deepspeed/moe/sharded_moe.py``) encodes every rank's tokens
into a capacity-padded ``[experts, capacity, d]`` buffer, exchanges the whole buffer with one
synchronous ``all_to_all_single`` (``_AllToAll``), runs the experts, exchanges back and decodes.
:class:`PiperMOELayer` keeps DeepSpeed's gate (same routing, capacity, token dropping, ``l_aux``
and ``exp_counts``) and replaces what follows the gate with :mod:`piper_core.runtime`:

1. the routed tokens are sorted by global expert, one row per kept (token, route) pair, so empty
   capacity slots are neither sent nor computed (DeepSpeed pads every expert to the capacity);
2. per-expert counts are all-gathered (:func:`exchange_counts`), the dispatch is planned
   (:func:`plan_dispatch`: flat, hierarchical or aggregated stages, ``chunks`` pipeline chunks);
3. :func:`moe_alltoall` dispatches, runs the local experts chunk by chunk while the next chunk's
   exchange is in flight, and combines; each output row is weighted by its gate and summed per
   token, as DeepSpeed decodes. The experts' parameters are handed to ``moe_alltoall`` (``params``)
   so that each receives one accumulated gradient per backward, not one per chunk (ZeRO-2's
   per-parameter reduce hooks allow one: ``stage_1_and_2.reduce_ipg_grads``, "Gradient computed
   twice for this partition").

Expert placement (the block's ``placement``, :class:`~piper_core.runtime.placement.ExpertPlacement`):
the gate is DeepSpeed's and picks logical experts; before the routes are sorted, each kept route's
expert id becomes its physical slot (``slot_of``), so its token goes to the rank and local expert
holding that logical expert; ``exp_counts`` and ``l_aux`` stay the gate's (logical). With each
slot holding its logical expert's weights (``builder.init_experts(placement=...)``), outputs and
gradients equal the default placement's (tests/deepspeed/test_placement.py).

Outputs and gradients equal stock DeepSpeed's to fp32 rounding (tests/deepspeed/test_moe_layer.py):
the experts see the same rows, only without the padding rows, whose outputs DeepSpeed discards.
Requirements: DeepSpeed's ``Experts`` container (``deepspeed_experts``), experts that act on each
token independently (as DeepSpeed's FFN experts do), no tensor parallelism (no ``groups.mpu``
with tp > 1; Piper plans tp = 1 for DeepSpeed) and no Tutel.

Swapping: ``deepspeed/moe/layer.py`` imports ``MOELayer`` by name, so replacing
``sharded_moe.MOELayer`` changes nothing; :func:`swap_moe_layers` replaces each ``MoE`` module's
``deepspeed_moe`` instance instead, and the engine's ``isinstance(module, MOELayer)`` still finds
it. The process groups come afterwards (:func:`attach_comm`, collective), once DeepSpeed has
created its expert-parallel groups.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import MOELayer
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

from piper_core.errors import SpecError
from piper_core.runtime import A2AComm, Algorithm, AutoChunks, NodeTopology, ScheduleEvent, create_comm, exchange_counts
from piper_core.runtime import moe_alltoall, plan_dispatch
from piper_core.runtime.autochunks import ADAPTER_CANDIDATES, ADAPTER_TRIALS, ADAPTER_TUNING
from piper_core.runtime.placement import ExpertPlacement
from piper_core.specs.parallel import read_a2a

# Deadline of each wait of Piper's all-to-all (piper_core.runtime.timeouts). A training step can
# legitimately stall a peer for a while (checkpointing, a first-step compile), so the runtime's
# 60 s test default is too tight here.
A2A_TIMEOUT = timedelta(minutes=10)
PLAN_ALGORITHMS: tuple[str, ...] = ("flat", "hierarchical")  # ParallelPlan.a2a (aggregated: the runtime's only)


@dataclass(frozen=True, kw_only=True, slots=True)
class A2ASettings:
    """How a layer exchanges tokens: ``algorithm`` for each exchange, ``chunks`` pipeline chunks
    (1: the unpipelined path), with either algorithm (a hierarchical exchange in chunks runs its
    stages per chunk, advanced between the experts' chunks by :func:`moe_alltoall`). ``tune``: each
    layer measures its chunk count at run time (an :class:`AutoChunks` over :data:`ADAPTER_CANDIDATES`,
    made by :func:`attach_comm`); ``chunks`` is what the plan assumed. ``defer_wgrad``: the experts'
    weight gradients after each dispatch gradient is posted (``moe_alltoall(defer_wgrad=True)``)."""

    algorithm: Algorithm
    chunks: int
    tune: bool = False
    defer_wgrad: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise SpecError("chunks", self.chunks, "must be an int >= 1", "use 1 for the unpipelined all-to-all")

    @classmethod
    def from_plan(cls, a2a: str, chunks: int, *, tune: bool = False, defer_wgrad: bool = False) -> A2ASettings:
        """``ParallelPlan.a2a`` (flat|hierarchical) and ``a2a_chunks`` -> settings, as timing/layer.py
        times them. The old ``"pipelined"`` is read by :func:`read_a2a` (flat in ``chunks``, with a
        FutureWarning)."""
        a2a, _, _ = read_a2a(a2a, chunks, where="A2ASettings.from_plan")
        if a2a not in PLAN_ALGORITHMS:
            raise SpecError("a2a", a2a, f"a plan's exchange algorithm is one of {', '.join(PLAN_ALGORITHMS)}",
                            'use "flat" or "hierarchical", and "chunks" for pipelining')
        return cls(algorithm=Algorithm(a2a), chunks=chunks, tune=tune, defer_wgrad=defer_wgrad)

    def label(self) -> str:
        deferred = ", expert weight gradients deferred" if self.defer_wgrad else ""
        if self.tune:
            return (f"{self.algorithm.value}, chunk count measured per layer at run time "
                    f"({ADAPTER_TUNING}){deferred}")
        return self.algorithm.value + (f" in {self.chunks} pipelined chunks" if self.chunks > 1 else "") + deferred


class Tracer:
    """Appends one JSON line per schedule event of Piper's all-to-all (``piper.trace``): layer,
    direction, action, exchange, chunk and ``t_s`` (``time.perf_counter``). One file per rank."""

    def __init__(self, path: Path):
        self.path = path
        self._file: TextIO | None = None

    def event(self, layer: str, ev: ScheduleEvent) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)
        self._file.write(json.dumps({"layer": layer, "direction": ev.direction, "action": ev.action,
                                     "exchange": ev.exchange, "chunk": ev.chunk, "t_s": time.perf_counter()}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Routes:
    """Where each kept (route, token) pair of one forward goes, for ``k`` routes of ``S`` tokens.

    ``token_of_row[r]``: the token sent as row ``r`` (rows in DeepSpeed's slot order: by global expert,
    then capacity location); ``row_of_route[k * S]``: each route's row, ``rows`` for a dropped route
    (a zero row at decode); ``tokens_per_expert[E]``: rows per global expert.
    """

    token_of_row: torch.Tensor
    row_of_route: torch.Tensor
    tokens_per_expert: torch.Tensor
    rows: int

    @classmethod
    def from_gate(cls, indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int) -> Routes:
        """From the gate's sparse routes: ``indices``/``locations`` ``[k, S]`` (expert -1: dropped)."""
        k, s = indices.shape
        kept = indices >= 0
        slot = torch.where(kept, indices.long() * capacity + locations.long(), num_experts * capacity)
        order = torch.argsort(slot.reshape(-1), stable=True)  # kept routes by slot, then the dropped
        rows = int(kept.sum())
        taken = order[:rows]
        row_of_route = torch.full((k * s,), rows, dtype=torch.long, device=indices.device)
        row_of_route[taken] = torch.arange(rows, device=indices.device)
        per_expert = torch.bincount(indices[kept].long(), minlength=num_experts)
        return cls(token_of_row=taken % s, row_of_route=row_of_route, tokens_per_expert=per_expert, rows=rows)


class PiperMOELayer(MOELayer):
    """DeepSpeed's ``MOELayer`` with Piper's all-to-all (see the module doc). Build with
    :meth:`from_layer`; :func:`attach_comm` gives it its process groups before the first forward."""

    piper_a2a: A2ASettings | None = None
    piper_comm: A2AComm | None = None
    piper_tracer: Tracer | None = None
    piper_name: str = ""
    piper_auto: AutoChunks | None = None  # this layer's chunk-count tuner (settings.tune), made with the comm
    piper_placement: ExpertPlacement | None = None
    piper_slot_of: torch.Tensor | None = None  # [E] physical slot of each logical expert (None: the default)
    piper_count: bool = False  # sum the tokens the gate routes to each logical expert (take_routed_tokens)
    piper_routed: torch.Tensor | None = None

    def configure(self, settings: A2ASettings, *, comm: A2AComm | None = None, tracer: Tracer | None = None,
                  name: str = "") -> None:
        self.piper_a2a, self.piper_comm, self.piper_tracer, self.piper_name = settings, comm, tracer, name

    def place(self, placement: ExpertPlacement | None) -> None:
        """Route each logical expert's tokens to its slot in ``placement`` (None: the default);
        SpecError when it is for another expert count or ep size than this layer's."""
        slot_of = None
        if placement is not None:
            num_experts = self.num_local_experts * self.ep_size
            where = f"MoE layer {self.piper_name!r} placement" if self.piper_name else "placement"
            placement.check(num_experts=num_experts, ep=self.ep_size, key=where)
            slot_of = None if placement.is_default else torch.tensor(placement.slot_of, dtype=torch.long)
        self.piper_placement, self.piper_slot_of = placement, slot_of

    def take_routed_tokens(self) -> torch.Tensor:
        """Tokens the gate routed to each logical expert since the last call ([E], zeros if none; counting
        is on with ``piper_count``, :mod:`piper_deepspeed.live`), and restart the count."""
        routed = self.piper_routed
        self.piper_routed = None
        return routed if routed is not None else torch.zeros(self.num_local_experts * self.ep_size, dtype=torch.long)

    @classmethod
    def from_layer(cls, layer: MOELayer, settings: A2ASettings, *, name: str = "",
                   tracer: Tracer | None = None, placement: ExpertPlacement | None = None) -> PiperMOELayer:
        """A PiperMOELayer sharing ``layer``'s gate and experts (parameters, expert group name and
        size, ep group if already set). ``name`` names the layer in errors and traces; ``placement``:
        where each logical expert lives (:meth:`place`)."""
        _check_swappable(layer, name)
        new = cls(layer.gate, layer.experts, layer.ep_group_name, layer.ep_size, layer.num_local_experts,
                  use_tutel=False)
        new.ep_group = layer.ep_group
        new.wall_clock_breakdown = layer.wall_clock_breakdown
        new.configure(settings, tracer=tracer, name=name)
        new.place(placement)
        return new

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.ep_size == 1:  # no exchange to replace
            return super().forward(*input, **kwargs)
        if self.piper_comm is None or self.piper_a2a is None:
            raise RuntimeError(f"PiperMOELayer {self.piper_name!r} has no process groups yet: call "
                               "piper_deepspeed.initialize (or moe.attach_comm after DeepSpeed set the expert "
                               "groups) on every rank before the first forward")
        start = time.perf_counter()
        x = input[0]
        tokens = x.reshape(-1, x.shape[-1])
        used = input[1] if len(input) > 1 else None
        self.l_aux, capacity, num_experts, indices, locations, gates, self.exp_counts = self.gate(
            tokens, used, True, False)
        if self.piper_count:  # the gate's choices per logical expert, before the capacity drops them
            counts = self.exp_counts.detach().to(torch.long)
            self.piper_routed = counts if self.piper_routed is None else self.piper_routed + counts
        if self.piper_slot_of is not None:  # logical expert -> physical slot; dropped routes (-1) stay dropped
            slots = self.piper_slot_of.to(indices.device)[indices.long().clamp(min=0)].to(indices.dtype)
            indices = torch.where(indices >= 0, slots, indices)
        routes = Routes.from_gate(indices, locations, num_experts, int(capacity))
        counts = exchange_counts(routes.tokens_per_expert, comm=self.piper_comm)
        meta = plan_dispatch(counts, comm=self.piper_comm, algorithm=self.piper_a2a.algorithm,
                             chunks=self.piper_a2a.chunks if self.piper_auto is None else self.piper_auto,
                             device=tokens.device)
        on_event = None
        if self.piper_tracer is not None:
            tracer, name = self.piper_tracer, self.piper_name
            on_event = lambda ev: tracer.event(name, ev)  # noqa: E731
        rows = tokens.index_select(0, routes.token_of_row)
        params = [p for p in self.experts.deepspeed_experts.parameters() if p.requires_grad]
        run = lambda t, n, probs: self._run_experts(t, n)  # noqa: E731
        y = moe_alltoall(rows, meta, run, params=params, on_event=on_event, defer_wgrad=self.piper_a2a.defer_wgrad)
        out = _decode(y, routes, gates, tokens.shape[0])
        if self.wall_clock_breakdown:
            self.time_moe = 1000.0 * (time.perf_counter() - start)  # ms, as DeepSpeed's timers report
        return out.reshape(x.shape)

    def _run_experts(self, tokens: torch.Tensor, tokens_per_expert: tuple[int, ...]) -> torch.Tensor:
        """Local expert ``e`` on its ``tokens_per_expert[e]`` rows. Every expert runs, even on zero
        rows, so each expert parameter gets a gradient (zero) as it does in DeepSpeed's padded path."""
        outs = []
        parts = torch.split(tokens, list(tokens_per_expert))
        for part, expert in zip(parts, self.experts.deepspeed_experts):
            out = expert(part)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs)


def _decode(y: torch.Tensor, routes: Routes, gates: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Token ``s`` = sum over its routes of gate x expert output (fp32 gates, dropped routes zero),
    the combine of GShard Algorithm 2 (arXiv 2006.16668) as DeepSpeed computes it."""
    padded = torch.cat([y, y.new_zeros(1, y.shape[-1])])
    routed = padded.index_select(0, routes.row_of_route).view(gates.shape[0], num_tokens, y.shape[-1])
    return (routed * gates.unsqueeze(-1)).sum(0).to(y.dtype)


def _check_swappable(layer: MOELayer, name: str) -> None:
    where = f"MoE layer {name!r}" if name else "MoE layer"
    if isinstance(layer, PiperMOELayer):
        raise SpecError(where, type(layer).__name__, "is already a PiperMOELayer",
                        "swap each DeepSpeed MoE layer once (piper_deepspeed.initialize does it)")
    if getattr(layer, "use_tutel", False):
        raise SpecError(f"{where}.use_tutel", True, "Tutel's dispatch kernels and Piper's all-to-all both replace "
                        "DeepSpeed's dispatch", "build the MoE layer with use_tutel=False")
    if not hasattr(layer.experts, "deepspeed_experts"):
        raise SpecError(f"{where}.experts", type(layer.experts).__name__, "must be DeepSpeed's Experts container "
                        "(Piper runs each local expert on its own rows)", "build the layer with deepspeed.moe.layer.MoE")
    if "sparse_routes" not in inspect.signature(type(layer.gate).forward).parameters:
        raise SpecError(f"{where}.gate", type(layer.gate).__name__, "has no sparse_routes argument (DeepSpeed 0.19's "
                        "TopKGate returns per-route experts, slots and gates, which Piper dispatches)",
                        "upgrade DeepSpeed or disable the piper block")
    tp = 1 if groups.mpu is None else bwc_tensor_model_parallel_world_size(groups.mpu)
    if tp > 1:
        raise SpecError("tensor parallel size", tp, "Piper's DeepSpeed MoE layer runs without tensor parallelism "
                        "(its plans for DeepSpeed have tp=1)", "drop the mpu's tensor parallelism")


def moe_modules(model: torch.nn.Module) -> list[tuple[str, MoE]]:
    """DeepSpeed ``MoE`` modules of ``model`` with their qualified names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def swap_moe_layers(model: torch.nn.Module, settings: A2ASettings, *, tracer: Tracer | None = None,
                    placement: ExpertPlacement | None = None) -> list[str]:
    """Replace the ``deepspeed_moe`` of every ``MoE`` module with ep_size > 1 by a PiperMOELayer
    (each with ``placement``: where each logical expert lives, None for the default); returns the
    names of the swapped MoE modules. Call before ``deepspeed.initialize``."""
    swapped = []
    for name, module in moe_modules(model):
        if module.ep_size > 1:
            module.deepspeed_moe = PiperMOELayer.from_layer(module.deepspeed_moe, settings, name=name, tracer=tracer,
                                                            placement=placement)
            swapped.append(name)
    return swapped


def attach_comm(model: torch.nn.Module, topology: NodeTopology, *, timeout: timedelta = A2A_TIMEOUT) -> A2AComm | None:
    """Create Piper's all-to-all groups over DeepSpeed's expert-parallel groups and hand them to
    every PiperMOELayer of ``model``. Collective: every rank calls it once its layers have their
    ``ep_group`` (set by the DeepSpeed engine, or by ``MoE.set_deepspeed_parallelism``)."""
    layers = [m for m in model.modules() if isinstance(m, PiperMOELayer) and m.ep_size > 1]
    mine = _ep_ranks(layers)
    gathered: list[Sequence[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if not any(g is not None for g in gathered):
        return None
    missing = [r for r, g in enumerate(gathered) if g is None]
    if missing:
        raise SpecError("ranks", missing, "hold no expert-parallel MoE layer, while other ranks do (Piper's "
                        "all-to-all groups span the whole job)", "give every pipeline stage a MoE layer")
    # on NCCL the process group's watchdog enforces the deadline; a host-side deadline would make the
    # host wait on every exchange (as the Megatron adapter, piper_megatron.install)
    comm = create_comm(topology, parents=sorted({tuple(g) for g in gathered}), timeout=timeout,
                       host_timeout=dist.get_backend() != "nccl")
    for layer in layers:
        layer.piper_comm = comm
        tune = layer.piper_a2a is not None and layer.piper_a2a.tune
        layer.piper_auto = AutoChunks(comm, candidates=ADAPTER_CANDIDATES, trials=ADAPTER_TRIALS) if tune else None
    return comm


def _ep_ranks(layers: list[PiperMOELayer]) -> tuple[int, ...] | None:
    """Global ranks of this rank's expert-parallel group (one group for all its layers)."""
    found = set()
    for layer in layers:
        if layer.ep_group is None:
            raise RuntimeError(f"PiperMOELayer {layer.piper_name!r} has no ep_group: DeepSpeed sets it in "
                               "deepspeed.initialize (MoE.set_deepspeed_parallelism); attach after that")
        found.add(tuple(sorted(dist.get_process_group_ranks(layer.ep_group))))
    if len(found) > 1:
        raise SpecError("ep_size", sorted(len(g) for g in found), "all MoE layers of a rank must share one "
                        "expert-parallel group", "build every MoE layer with the plan's ep_size")
    return found.pop() if found else None
