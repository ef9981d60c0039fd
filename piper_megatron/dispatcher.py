"""Piper's token dispatcher for Megatron-Core MoE layers: the runtime all-to-all of
:mod:`piper_core.runtime` (flat, hierarchical, aggregated; pipelined in chunks) in place of
Megatron's ``all_to_all_single``.

Megatron has no dispatcher registry: ``MoELayer.__init__`` instantiates the module-level name
``moe_layer.MoEAlltoAllTokenDispatcher`` when ``moe_token_dispatcher_type == 'alltoall'``, so
:func:`install_dispatcher` rebinds that name to a subclass bound to one :class:`A2AComm` (before the
model is built), and returns a :class:`Patches` handle that undoes it.

What the subclass changes (phases of ``MoEAlltoAllTokenDispatcher``, 0.16-0.19):

* ``preprocess``: one all-gather of every EP member's tokens per expert (``exchange_counts``; the
  stock dispatcher all-gathers the same counts over the tp x ep group) gives the ``[W, E]`` count
  matrix; Megatron's split and sort metadata follow from it, and ``plan_dispatch`` plans the step.
* ``token_dispatch`` / ``token_combine`` (unpipelined: one chunk): the planned exchanges, autograd-
  aware; Megatron's own ``dispatch_postprocess``/``combine_preprocess`` still sort by local expert,
  so the phases stay separate and Megatron's schedules that call them one by one keep working.
* Pipelined (chunks > 1): dispatch, experts and combine are fused into one
  :func:`piper_core.runtime.moe_alltoall` call, which posts chunk ``k + 1``'s exchange before chunk
  ``k``'s experts run, in forward and backward. Megatron calls the experts from
  ``MoELayer.routed_experts_compute``, so that method is rebound too (for layers whose dispatcher
  is Piper's; others run the original): ``token_dispatch`` and ``token_combine`` pass tokens
  through, and ``routed_experts_compute`` runs the fused exchange with the layer's experts.
  ``MoELayer.dispatch`` is rebound to open that fused call (Megatron's forward, its recompute and
  its EP-overlap schedule all reach ``token_dispatch`` through it). A caller that drives the
  dispatcher's phases itself (``token_dispatch`` with no fused call open: Megatron's own dispatcher
  tests) gets them unpipelined for that step (one chunk, the plan's algorithm, the tuner left
  alone), with one :class:`PhaseDrivenWarning` per dispatcher. So the step is planned when its
  first exchange runs, not in ``preprocess``: by then the path is known.

Supported: expert tensor parallel size 1 (experts whole on each EP rank), no shared-expert overlap
(0.19 runs it inside the stock ``token_dispatch``); pipelined also needs Megatron's own a2a-overlap
and delayed-wgrad features off. Each is checked when a layer is built (SpecError).
State between phases (the frozen ``DispatchMeta``) lives on the dispatcher, as Megatron's own
split sizes do: Megatron calls the phases as methods with no other place to keep it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_layer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from piper_core.errors import SpecError
from piper_core.runtime import (
    A2AComm,
    Algorithm,
    AutoChunks,
    DispatchMeta,
    NodeTopology,
    ScheduleEvent,
    create_comm,
    exchange,
    exchange_counts,
    moe_alltoall,
    plan_dispatch,
)
from piper_core.runtime.autochunks import ADAPTER_CANDIDATES, ADAPTER_TRIALS
from piper_megatron.trace import LayerRecord, Tracer


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchSettings:
    """How the MoE all-to-all runs: ``algorithm`` per exchange, in ``chunks`` (> 1: pipelined).

    ``tune``: each MoE layer measures its chunk count at run time (an :class:`AutoChunks` over
    :data:`ADAPTER_CANDIDATES`, :data:`ADAPTER_TRIALS` steps each); ``chunks`` is then only the
    count the plan assumed. Every layer runs the fused path, one chunk included."""

    algorithm: Algorithm = Algorithm.FLAT
    chunks: int = 1
    tune: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise SpecError("chunks", self.chunks, "must be an int >= 1", "use 1 for the unpipelined exchange")

    @classmethod
    def from_plan(cls, a2a: str, chunks: int, *, tune: bool = False) -> DispatchSettings:
        """A ParallelPlan's ``a2a``/``a2a_chunks``: pipelined chunks run flat exchanges, as the
        step-time model prices them (piper_core/timing/layer.py ``_a2a_one_way``)."""
        if a2a == "pipelined":
            return cls(algorithm=Algorithm.FLAT, chunks=chunks, tune=tune)
        if tune:
            raise SpecError("chunks", "tune", f"tuning measures pipelined chunk counts; the plan's all-to-all is "
                            f"{a2a}", "plan with the pipelined all-to-all, or give a chunk count")
        return cls(algorithm=Algorithm(a2a), chunks=1)

    @property
    def pipelined(self) -> bool:
        """True where dispatch, experts and combine run fused in ``moe_alltoall``."""
        return self.tune or self.chunks > 1

    def describe(self) -> str:
        if self.tune:
            return (f"Piper pipelined all-to-all: chunk count measured per MoE layer at run time "
                    f"({'/'.join(map(str, ADAPTER_CANDIDATES))} chunks of {self.algorithm.value} exchanges, "
                    f"{ADAPTER_TRIALS} steps each, then the fastest; the plan assumed {self.chunks})")
        if self.pipelined:
            return (f"Piper pipelined all-to-all: {self.chunks} chunks of {self.algorithm.value} exchanges, chunk "
                    "k+1's exchange overlapping chunk k's experts")
        return f"Piper {self.algorithm.value} all-to-all"


def expert_parallel_groups() -> list[tuple[int, ...]]:
    """Global ranks of every expert-parallel group of the job (collective over the job)."""
    mine = tuple(dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted(set(everyone))


def create_ep_comm(topology: NodeTopology, *, timeout: timedelta = timedelta(seconds=60),
                   host_timeout: bool = True) -> A2AComm:
    """The runtime's groups for this rank's expert-parallel group, after
    ``parallel_state.initialize_model_parallel`` (collective: every rank of the job calls it)."""
    return create_comm(topology, parents=expert_parallel_groups(), timeout=timeout, host_timeout=host_timeout)


class PhaseDrivenWarning(UserWarning):
    """A pipelined dispatcher's phases were called one by one: that step ran unpipelined."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Binding:
    comm: A2AComm
    settings: DispatchSettings
    tracer: Tracer | None


class PiperTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """``MoEAlltoAllTokenDispatcher`` whose exchanges are Piper's (see the module docstring).

    Used through the subclass :func:`install_dispatcher` makes, which carries the comm, the
    settings and the tracer (``MoELayer`` constructs dispatchers with fixed arguments).
    """

    binding: ClassVar[_Binding]

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: Any,
                 pg_collection: Any = None) -> None:
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        binding = getattr(type(self), "binding", None)
        if binding is None:
            raise SpecError("PiperTokenDispatcher", "unbound", "needs a comm and settings",
                            "build layers after piper_megatron.dispatcher.install_dispatcher(comm, settings)")
        self._check(binding, config)
        self._meta: DispatchMeta | None = None
        self._counts: torch.Tensor | None = None  # this step's [W, E] counts, kept until it is planned
        self._device = torch.device("cpu")  # where this step's index tensors go
        self._fused = False  # MoELayer.dispatch opened a fused call for this step
        self._warned = False  # the phase-driven fallback has been reported (once per dispatcher)
        self.layer_number: int | None = None  # the MoE layer's, once Megatron sets it
        self._record: LayerRecord | None = None
        self.auto_chunks = AutoChunks(binding.comm, candidates=ADAPTER_CANDIDATES, trials=ADAPTER_TRIALS) \
            if binding.settings.tune else None  # this layer's own tuner, kept across steps

    def _check(self, binding: _Binding, config: Any) -> None:
        ranks = tuple(dist.get_process_group_ranks(self.ep_group))
        if ranks != binding.comm.layout.ranks:
            raise SpecError("expert-parallel group", ranks, f"differs from the Piper comm's group "
                            f"{binding.comm.layout.ranks}", "create the comm after initialize_model_parallel, "
                            "from the same expert-parallel groups (create_ep_comm)")
        if self.tp_size != 1:
            raise SpecError("expert_tensor_parallel_size", self.tp_size, "Piper's dispatcher keeps each expert "
                            "whole on its expert-parallel rank", "set --expert-tensor-parallel-size 1")
        if config.moe_shared_expert_overlap:
            raise SpecError("moe_shared_expert_overlap", True, "Megatron overlaps the shared expert inside the "
                            "stock token_dispatch/token_combine, which Piper's dispatcher replaces",
                            "turn moe_shared_expert_overlap off")
        if binding.settings.pipelined:
            for key in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
                        "overlap_dispatch_backward_with_experts_wgrad"):
                if getattr(config, key, False):
                    raise SpecError(key, True, "the pipelined all-to-all fuses dispatch, experts and combine, "
                                    "which Megatron's own a2a/wgrad overlap splits into schedule nodes",
                                    f"turn {key} off, or use an unpipelined all-to-all (chunks 1)")

    # ---- metadata ----------------------------------------------------------------------------
    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Megatron's per-step metadata and the counts Piper plans from, from one all-gather. A new
        step: the plan waits for its first exchange (:meth:`_current_meta`)."""
        comm = self.binding.comm
        if self.drop_and_pad:  # every (source, expert) run is padded to capacity: no exchange needed
            tokens_per_expert = super().preprocess(routing_map)
            counts = torch.full((comm.size, self.num_experts), self.capacity, dtype=torch.long)
        else:
            counts = exchange_counts(routing_map.sum(dim=0).long(), comm=comm)
            tokens_per_expert = self._megatron_metadata(counts, routing_map)
        self._meta, self._counts, self._device, self._fused = None, counts, routing_map.device, False
        return tokens_per_expert

    def _megatron_metadata(self, counts: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """What the stock ``preprocess`` derives from its gathered counts (expert tp size 1), from
        ``counts`` [W, E] on the host: splits, tokens per local expert, the output size."""
        me, per = self.binding.comm.me, self.num_local_experts
        mine = counts[:, me * per:(me + 1) * per]  # [W, local experts]: tokens each member sends here
        dynamic = self.config.moe_expert_capacity_factor is not None or self.config.moe_router_padding_for_quantization
        self.num_out_tokens = int(counts[me].sum()) if dynamic else routing_map.size(0) * self.config.moe_router_topk
        self.input_splits = counts[me].reshape(-1, per).sum(dim=1).numpy()
        self.output_splits = mine.sum(dim=1).numpy()
        self.output_splits_tp = mine.sum().reshape(1).numpy()
        if per > 1:
            self.num_global_tokens_per_local_expert = mine.to(self.permute_idx_device)
        return mine.sum(dim=0)

    # ---- exchanges -----------------------------------------------------------------------------
    def open_fused_call(self) -> None:
        """``MoELayer.dispatch`` is running: this step's dispatch, experts and combine go through
        ``MoELayer.routed_experts_compute`` (pipelined: fused in ``moe_alltoall``)."""
        self._fused = True

    @property
    def in_fused_call(self) -> bool:
        """True from ``MoELayer.dispatch`` to the step's ``token_combine``."""
        return self._fused

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, *args: Any, **kwargs: Any):
        fused = self.binding.settings.pipelined and self._fused
        if self.binding.settings.pipelined and not fused:
            self._warn_phase_driven()
        meta = self._current_meta()
        tracer = self.binding.tracer
        if tracer is not None:
            self._record = tracer.begin(algorithm=self.binding.settings.algorithm.value, chunks=meta.chunks,
                                        meta=meta, first_expert=self.local_expert_indices[0])
            self._record.layer = self.layer_number  # phase-driven steps never reach routed_experts_compute
            self._record.mark("dispatch")
        if fused:
            return hidden_states, probs  # exchanged chunk by chunk in routed_experts_compute
        chunk = meta.chunk[0]
        return exchange(hidden_states, chunk.dispatch), exchange(probs, chunk.dispatch)

    def token_combine(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        record = self._record
        if record is not None:
            record.mark("combine")
        fused = self.binding.settings.pipelined and self._fused
        out = hidden_states if fused else exchange(hidden_states, self._current_meta().chunk[0].combine)
        self._fused = False
        if record is not None:
            record.finish()
            self._record = None
        return out

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.binding.settings.pipelined and self._fused:  # Piper's fused path never calls it
            raise RuntimeError("PiperTokenDispatcher (pipelined): MoELayer.routed_experts_compute is Megatron's, "
                               "not Piper's; keep install_dispatcher's patches in place while the model runs")
        return super().dispatch_postprocess(hidden_states, probs)

    def _current_meta(self) -> DispatchMeta:
        """This step's plan, made on first use: ``chunks`` (or the tuner's count) for a fused call,
        one chunk when the phases are driven one by one (no tuner call spent on it)."""
        if self._meta is None:
            if self._counts is None:
                raise RuntimeError("PiperTokenDispatcher: an exchange was called before preprocess "
                                   "(dispatch_preprocess)")
            settings = self.binding.settings
            chunks: int | AutoChunks = 1
            if self._fused:
                chunks = settings.chunks if self.auto_chunks is None else self.auto_chunks
            self._meta = plan_dispatch(self._counts, comm=self.binding.comm, algorithm=settings.algorithm,
                                       chunks=chunks, device=self._device)
        return self._meta

    def _warn_phase_driven(self) -> None:
        if self._warned:
            return
        self._warned = True
        settings = self.binding.settings
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1]
        layer = "" if self.layer_number is None else f"layer {self.layer_number}, "
        chunks = "a tuned chunk count" if settings.tune else f"{settings.chunks} chunks"
        warnings.warn(f"PiperTokenDispatcher ({layer}experts {first}-{last}): the pipelined all-to-all "
                      f"({chunks}) needs MoELayer's forward, but token_dispatch was called with no fused call "
                      f"open (a caller driving the phases one by one); such steps run unpipelined, one chunk "
                      f"of {settings.algorithm.value} exchanges (said once per dispatcher)",
                      PhaseDrivenWarning, stacklevel=3)

    # ---- experts -------------------------------------------------------------------------------
    def routed_experts_compute(self, layer: Any, original: Callable[..., Any], hidden_states: torch.Tensor,
                               probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``MoELayer.routed_experts_compute`` for this dispatcher's layer: the original between the
        two exchanges, or (pipelined) dispatch -> experts -> combine fused over the chunks."""
        record = self._record
        if record is not None:
            record.layer = layer.layer_number
        if not self.binding.settings.pipelined:
            if record is not None:
                record.mark("expert")
            return original(layer, hidden_states, probs)

        def experts(tokens: torch.Tensor, tokens_per_expert: tuple[int, ...], chunk_probs: torch.Tensor | None):
            out, bias = layer.experts(tokens, torch.tensor(tokens_per_expert, dtype=torch.long), chunk_probs)
            if bias is not None:
                raise SpecError("experts bias", "returned", "the fused path combines expert outputs only",
                                "build experts without a separate output bias (add_bias_linear false)")
            return out

        on_event = None if record is None else _marker(record)
        # the experts' parameters go through moe_alltoall's own autograd node: one gradient accumulation
        # each per backward, so DDP's per-parameter grad-ready hooks fire once whatever the chunk count
        params = [p for p in layer.experts.parameters() if p.requires_grad]
        return moe_alltoall(hidden_states, self._current_meta(), experts, probs=probs, params=params,
                            on_event=on_event), None


def _marker(record: LayerRecord) -> Callable[[ScheduleEvent], None]:
    """Forward schedule events as trace marks: time until the next event goes to this phase."""
    def on_event(event: ScheduleEvent) -> None:
        if event.direction == "forward":
            record.mark("expert" if event.action == "experts" else event.exchange)
    return on_event


class Patches:
    """Attributes rebound by :func:`install_dispatcher`; :meth:`restore` puts the originals back."""

    _INHERITED = object()  # the name was not the owner's own (a method of a base class): delete it again

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        getattr(owner, name)  # AttributeError now, not a silently added attribute
        self._saved.append((owner, name, vars(owner).get(name, self._INHERITED)))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            if value is self._INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _routed_experts_compute(original: Callable[..., Any]) -> Callable[..., Any]:
    def routed_experts_compute(self: Any, hidden_states: torch.Tensor, probs: torch.Tensor):
        dispatcher = self.token_dispatcher
        # outside a fused call, token_dispatch has exchanged the tokens already: Megatron's own steps
        if isinstance(dispatcher, PiperTokenDispatcher) and dispatcher.in_fused_call:
            return dispatcher.routed_experts_compute(self, original, hidden_states, probs)
        return original(self, hidden_states, probs)

    routed_experts_compute.__wrapped__ = original  # type: ignore[attr-defined]
    return routed_experts_compute


def _dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    """``MoELayer.dispatch`` (Megatron's forward calls it before ``routed_experts_compute``) opens
    the fused call of a Piper dispatcher."""
    def dispatch(self: Any, *args: Any, **kwargs: Any):
        if isinstance(self.token_dispatcher, PiperTokenDispatcher):
            self.token_dispatcher.open_fused_call()
        return original(self, *args, **kwargs)

    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch


def _set_layer_number(original: Callable[..., Any]) -> Callable[..., Any]:
    """``MoELayer.set_layer_number`` also tells a Piper dispatcher (for its messages)."""
    def set_layer_number(self: Any, layer_number: int) -> None:
        original(self, layer_number)
        if isinstance(self.token_dispatcher, PiperTokenDispatcher):
            self.token_dispatcher.layer_number = layer_number

    set_layer_number.__wrapped__ = original  # type: ignore[attr-defined]
    return set_layer_number


def install_dispatcher(comm: A2AComm, settings: DispatchSettings, *, tracer: Tracer | None = None) -> Patches:
    """Make MoE layers built from now on use Piper's dispatcher on ``comm``; returns the patches
    (``.restore()`` brings Megatron's dispatcher back for layers built after it)."""
    bound = type("PiperTokenDispatcher", (PiperTokenDispatcher,),
                 {"binding": _Binding(comm=comm, settings=settings, tracer=tracer), "__module__": __name__})
    patches = Patches()
    patches.set(moe_layer, "MoEAlltoAllTokenDispatcher", bound)
    layer = moe_layer.MoELayer
    patches.set(layer, "routed_experts_compute", _routed_experts_compute(layer.routed_experts_compute))
    patches.set(layer, "dispatch", _dispatch(layer.dispatch))
    patches.set(layer, "set_layer_number", _set_layer_number(layer.set_layer_number))
    return patches
