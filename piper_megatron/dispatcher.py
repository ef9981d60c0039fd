"""Piper's token dispatcher for Megatron-Core MoE layers: the runtime all-to-all of
:mod:`piper_core.runtime` (flat, hierarchical, aggregated; pipelined in chunks) in place of
Megatron's ``all_to_all_single``.

Megatron has no dispatcher registry: ``MoELayer.__init__`` instantiates the module-level name
``moe_layer.MoEAlltoAllTokenDispatcher`` when ``moe_token_dispatcher_type == 'alltoall'``, so
:func:`install_dispatcher` rebinds that name to a subclass bound to one :class:`A2AComm` (before the
model is built), and returns a :class:`Patches` handle that undoes it.

What the subclass changes (phases of ``MoEAlltoAllTokenDispatcher``, 0.16-0.19):

* ``preprocess``: one all-gather of every member's tokens per expert gives the count matrix:
  ``[W, E]`` over the EP group (``exchange_counts``) with expert tensor parallel size (etp) 1, and
  ``[etp, W, E]`` over the expert tp x ep group otherwise, as the stock ``preprocess`` gathers it
  (each etp rank routes its own tokens and exchanges them over its own EP group). Megatron's split
  and sort metadata follow from it, and ``plan_dispatch`` plans this rank's EP exchange from its row.
* etp > 1: after Piper's EP exchange, the tokens are all-gathered over the expert-TP group and the
  expert outputs reduce-scattered back, with Megatron's own mappings and splits, as the stock
  ``dispatch_postprocess``/``combine_preprocess`` do (unpipelined: those very methods run; pipelined:
  :meth:`PiperTokenDispatcher._etp_experts` does it per chunk inside the experts of each chunk).
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

Shared experts: without ``moe_shared_expert_overlap`` ``MoELayer`` runs them itself, untouched. With
it, Megatron hands the shared expert to the dispatcher (``set_shared_experts``), whose stock phases
run its pieces beside the stock all-to-alls. Piper's dispatcher keeps it to itself and runs the
same pieces around its own exchanges: the sequence-parallel gather in ``dispatch_preprocess``;
unpipelined, fc1 while the dispatch exchange is in flight (posted with ``start_exchange``, waited
after) and fc2 while the combine exchange is. Only the forward overlaps: each exchange's backward is
one autograd node the engine runs when its gradient is ready, apart from the shared expert's own
nodes. Pipelined, fc1 runs before the fused call and fc2 after it, beside no exchange:
``moe_alltoall`` posts its exchanges inside an autograd Function's forward, where the shared
expert's graph would not be recorded (grad mode is off there); the chunks there already overlap the
exchanges with the routed experts.

Expert placement (``placement``, ``--piper-placement``: :class:`~piper_core.runtime.placement.
ExpertPlacement`): Megatron's router is untouched and picks logical experts; ``dispatch_preprocess``
reorders the columns of its ``routing_map`` and ``probs`` from logical to physical (column ``s`` is
logical expert ``logical_at[s]``) before anything else reads them, so every later phase (counts,
permutation, exchanges, the sort by local expert, the unpermute) works in physical slots and the
tokens of logical expert ``l`` reach slot ``slot_of[l]`` on its rank. The probs' reorder is an
index (autograd scatters the gradient back to the router's columns), so outputs and gradients equal
the default placement's when each slot holds its logical expert's weights (tests/megatron/
test_placement.py).

Deferred expert weight gradients (``defer_wgrad``, ``--piper-defer-wgrad``) run the fused path too,
one chunk included: ``moe_alltoall(defer_wgrad=True)`` splits each chunk's expert backward into
input and weight gradients (``piper_core/runtime/wgrad.py``). Megatron-Core's expert linears
(``ColumnParallelLinear``/``RowParallelLinear``) compute both in one autograd Function
(``LinearWithGradAccumulationAndAsyncCommunication``), which cannot be split, so for the experts'
forward of such a call each expert linear's ``_forward_impl`` is, on that instance, what that
Function's forward computes (``matmul(input, weight.t())`` plus the bias) in torch operations, whose
backward autograd can split. Only where the Function would do nothing else: an expert linear that
would fuse gradient accumulation, all-reduce its input gradient, gather a sequence-parallel input
or buffer its output gradient is refused (SpecError naming it). Transformer Engine's expert layers
(no ``_forward_impl``) reach ``split_backward``, which refuses them by name.

The fused path needs Megatron's own a2a-overlap and delayed-wgrad features off (checked when a layer
is built: SpecError).
State between phases (the frozen ``DispatchMeta``) lives on the dispatcher, as Megatron's own
split sizes do: Megatron calls the phases as methods with no other place to keep it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe import moe_layer
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from piper_core.errors import SpecError
from piper_core.runtime import (
    A2AComm,
    Algorithm,
    AutoChunks,
    DispatchMeta,
    ExchangePlan,
    NodeTopology,
    PendingExchange,
    ScheduleEvent,
    create_comm,
    exchange,
    exchange_counts,
    moe_alltoall,
    plan_dispatch,
    start_exchange,
)
from piper_core.runtime import timeouts
from piper_core.runtime.autochunks import ADAPTER_CANDIDATES, ADAPTER_TRIALS, choose
from piper_core.runtime.placement import ExpertPlacement, LayerPlacements, Placements
from piper_megatron.pins import PIPER_ALGORITHMS
from piper_megatron.trace import LayerRecord, Tracer


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchSettings:
    """How the MoE all-to-all runs: ``algorithm`` per exchange, in ``chunks`` (> 1: pipelined).

    ``tune``: each MoE layer measures its chunk count at run time (an :class:`AutoChunks` over
    :data:`ADAPTER_CANDIDATES`, :data:`ADAPTER_TRIALS` steps each); ``chunks`` is then only the
    count the plan assumed. Every layer runs the fused path, one chunk included. ``placement``: where
    each logical expert lives (None: logical expert ``l`` in slot ``l``), one placement for every MoE
    layer or one per layer (:class:`~piper_core.runtime.placement.LayerPlacements`, applied when
    Megatron gives the layer its ``layer_number``). ``count_tokens``: each layer sums the tokens its
    router sends each logical expert, for :meth:`PiperTokenDispatcher.take_routed_tokens`
    (``--piper-migrate-every``, :mod:`piper_megatron.live`)."""

    # ParallelPlan.a2a values (the aggregated exchange is the runtime's, no plan's)
    PLAN_ALGORITHMS: ClassVar[tuple[str, ...]] = PIPER_ALGORITHMS
    algorithm: Algorithm = Algorithm.FLAT
    chunks: int = 1
    tune: bool = False
    defer_wgrad: bool = False
    placement: Placements | None = None
    count_tokens: bool = False  # each layer sums the tokens its router sends each logical expert (take_routed_tokens)

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise SpecError("chunks", self.chunks, "must be an int >= 1", "use 1 for the unpipelined exchange")

    @classmethod
    def from_plan(cls, a2a: str, chunks: int, *, tune: bool = False, defer_wgrad: bool = False,
                  placement: Placements | None = None, count_tokens: bool = False) -> DispatchSettings:
        """A ParallelPlan's ``a2a`` (flat|hierarchical: the exchange of every chunk) and
        ``a2a_chunks`` (> 1: pipelined), as the step-time model prices them (piper_core/timing/
        layer.py); ``tune`` measures the chunk count of either algorithm at run time. A setting
        written before the two were independent (``"pipelined"``) is read by
        :func:`piper_core.specs.parallel.read_a2a`: flat exchanges in ``chunks``, with a FutureWarning."""
        from piper_core.specs.parallel import read_a2a

        a2a, _, _ = read_a2a(a2a, chunks, where="DispatchSettings.from_plan")
        if a2a not in cls.PLAN_ALGORITHMS:
            raise SpecError("a2a", a2a, f"a plan's exchange algorithm is one of {', '.join(cls.PLAN_ALGORITHMS)}",
                            "use flat or hierarchical, and the chunk count for pipelining")
        return cls(algorithm=Algorithm(a2a), chunks=chunks, tune=tune, defer_wgrad=defer_wgrad, placement=placement,
                   count_tokens=count_tokens)

    @property
    def pipelined(self) -> bool:
        """True where dispatch, experts and combine run fused in ``moe_alltoall`` (pipelined, tuned,
        or with the experts' weight gradients deferred, which needs the fused call)."""
        return self.tune or self.chunks > 1 or self.defer_wgrad

    def describe(self) -> str:
        deferred = "; expert weight gradients computed while each dispatch gradient is in flight" \
            if self.defer_wgrad else ""
        placed = "" if self.placement is None else f"; expert placement: {self.placement.describe()}"
        return self._describe() + deferred + placed

    def _describe(self) -> str:
        if self.tune:
            return (f"Piper pipelined all-to-all: chunk count measured per MoE layer at run time "
                    f"({'/'.join(map(str, ADAPTER_CANDIDATES))} chunks of {self.algorithm.value} exchanges, "
                    f"{ADAPTER_TRIALS} steps each, then the fastest; the plan assumed {self.chunks})")
        if self.chunks > 1:
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
        self.placement: ExpertPlacement | None = None  # where this layer's logical experts live (None: default)
        placement = binding.settings.placement  # a per-layer one waits for the layer_number (_set_layer_number)
        self.set_placement(placement if isinstance(placement, ExpertPlacement) else None)
        self._meta: DispatchMeta | None = None
        self._counts: torch.Tensor | None = None  # this step's [etp, W, E] counts, kept until it is planned
        self._shared: Any = None  # the shared expert when Megatron overlaps it (set_shared_experts)
        self._device = torch.device("cpu")  # where this step's index tensors go
        self._fused = False  # MoELayer.dispatch opened a fused call for this step
        self._warned = False  # the phase-driven fallback has been reported (once per dispatcher)
        self.layer_number: int | None = None  # the MoE layer's, once Megatron sets it
        self._routed: torch.Tensor | None = None  # tokens per logical expert since take_routed_tokens (count_tokens)
        self._record: LayerRecord | None = None
        self.auto_chunks = _ExpertGroupAutoChunks(binding.comm, self.tp_group, candidates=ADAPTER_CANDIDATES,
                                                  trials=ADAPTER_TRIALS) \
            if binding.settings.tune else None  # this layer's own tuner, kept across steps

    def _check(self, binding: _Binding, config: Any) -> None:
        ranks = tuple(dist.get_process_group_ranks(self.ep_group))
        if ranks != binding.comm.layout.ranks:
            raise SpecError("expert-parallel group", ranks, f"differs from the Piper comm's group "
                            f"{binding.comm.layout.ranks}", "create the comm after initialize_model_parallel, "
                            "from the same expert-parallel groups (create_ep_comm)")
        if binding.settings.pipelined:
            for key in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
                        "overlap_dispatch_backward_with_experts_wgrad"):
                if getattr(config, key, False):
                    raise SpecError(key, True, "the pipelined all-to-all fuses dispatch, experts and combine, "
                                    "which Megatron's own a2a/wgrad overlap splits into schedule nodes",
                                    f"turn {key} off, or use an unpipelined all-to-all (chunks 1)")

    def set_placement(self, placement: ExpertPlacement | None) -> None:
        """Route this layer's tokens by ``placement`` from the next step on (SpecError when it is for
        another expert count or ep). The slots must then hold their logical experts' weights:
        :func:`piper_megatron.migrate.migrate` moves them and calls this."""
        self._logical_at = _logical_at(placement, num_experts=self.num_experts, ep=self.ep_size)
        self.placement = placement

    def take_routed_tokens(self) -> torch.Tensor:
        """The tokens this rank's router sent each logical expert of this layer since the last call (int64
        ``[E]``, on the router's device; counted with ``DispatchSettings.count_tokens``, once per forward
        of the layer, recomputed forwards included), and start counting again."""
        routed = self._routed if self._routed is not None else torch.zeros(self.num_experts, dtype=torch.long)
        self._routed = None
        return routed

    # ---- metadata ----------------------------------------------------------------------------
    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Megatron's per-step metadata and the counts Piper plans from, from one all-gather. A new
        step: the plan waits for its first exchange (:meth:`_current_meta`)."""
        comm = self.binding.comm
        if self.drop_and_pad:  # every (source, expert) run is padded to capacity: no exchange needed
            tokens_per_expert = super().preprocess(routing_map)
            counts = torch.full((self.tp_size, comm.size, self.num_experts), self.capacity, dtype=torch.long)
        else:
            counts = self._gather_counts(routing_map.sum(dim=0).long())
            tokens_per_expert = self._megatron_metadata(counts, routing_map)
        self._meta, self._counts, self._device, self._fused = None, counts, routing_map.device, False
        return tokens_per_expert

    def _gather_counts(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Every member's tokens per expert, int64 ``[etp, W, E]`` on the host: ``[t, s, g]`` = tokens
        that expert-TP rank ``t`` of EP rank ``s`` sends expert ``g``. etp 1: one all-gather over the EP
        group; else one over the expert tp x ep group, whose ranks run EP-major (the layout the stock
        ``preprocess`` reads its gather with)."""
        comm = self.binding.comm
        if self.tp_size == 1:
            return exchange_counts(tokens_per_expert, comm=comm).unsqueeze(0)
        local = tokens_per_expert.reshape(-1).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp_size * self.ep_size)]
        what = timeouts.OpName(op="counts all-gather (tokens per expert, expert tp x ep group)", stage="stage 1/1",
                               ranks=tuple(dist.get_process_group_ranks(self.tp_ep_group)), rank=dist.get_rank())
        work = timeouts.launch(what, lambda: dist.all_gather(parts, local, group=self.tp_ep_group, async_op=True))
        timeouts.wait(work, what, comm.timeout if comm.host_timeout else None)
        return torch.stack(parts).cpu().reshape(self.ep_size, self.tp_size, -1).transpose(0, 1).contiguous()

    def _megatron_metadata(self, counts: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """What the stock ``preprocess`` derives from its gathered counts, from ``counts``
        ``[etp, W, E]`` on the host: splits, tokens per local expert, the output size."""
        me, per, t = self.binding.comm.me, self.num_local_experts, self.tp_rank
        mine = counts[:, :, me * per:(me + 1) * per]  # [etp, W, local experts]: tokens each member sends here
        from_rank = mine.sum(dim=2)  # [etp, W]
        dynamic = self.config.moe_expert_capacity_factor is not None or self.config.moe_router_padding_for_quantization
        self.num_out_tokens = int(counts[t, me].sum()) if dynamic else routing_map.size(0) * self.config.moe_router_topk
        self.input_splits = counts[t, me].reshape(-1, per).sum(dim=1).numpy()
        self.output_splits = from_rank[t].numpy()
        self.output_splits_tp = from_rank.sum(dim=1).numpy()
        if per > 1:
            self.num_global_tokens_per_local_expert = mine.reshape(-1, per).to(self.permute_idx_device)
        return mine.sum(dim=(0, 1))

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
            logical = None
            if self._logical_at is not None:  # the physical slots' logical experts (trace.py)
                logical = self._logical_at[list(self.local_expert_indices)].tolist()
            self._record = tracer.begin(algorithm=self.binding.settings.algorithm.value, chunks=meta.chunks,
                                        meta=meta, first_expert=self.local_expert_indices[0], logical_experts=logical)
            self._record.layer = self.layer_number  # phase-driven steps never reach routed_experts_compute
            self._record.mark("dispatch")
        fc1 = None if self._shared is None else self._shared.linear_fc1_forward_and_act
        if fused:  # exchanged chunk by chunk in routed_experts_compute; the shared expert beside none
            if fc1 is not None:
                fc1()
            return hidden_states, probs
        tokens, weights = _exchange_beside((hidden_states, probs), meta.chunk[0].dispatch, fc1)
        return tokens, weights

    def token_combine(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        record = self._record
        if record is not None:
            record.mark("combine")
        fused = self.binding.settings.pipelined and self._fused
        fc2 = None if self._shared is None else self._shared_fc2
        if fused:
            out = hidden_states
            if fc2 is not None:
                fc2()
        else:
            (out,) = _exchange_beside((hidden_states,), self._current_meta().chunk[0].combine, fc2)
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

    # ---- shared expert (moe_shared_expert_overlap) ----------------------------------------------
    def set_shared_experts(self, shared_experts: Any) -> None:
        """Keep the shared expert from the stock phases (they would run it beside the stock
        all-to-alls); Piper's phases run the same pieces beside its own exchanges (module doc)."""
        super().set_shared_experts(shared_experts)
        self._shared, self.shared_experts = shared_experts, None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        if self.binding.settings.count_tokens:  # in logical experts: before the reorder
            routed = routing_map.sum(dim=0, dtype=torch.long)
            self._routed = routed if self._routed is None else self._routed + routed
        if self._logical_at is not None:  # router columns (logical experts) -> physical slots (module doc)
            index = self._logical_at.to(routing_map.device)
            routing_map, probs = routing_map.index_select(1, index), probs.index_select(1, index)
        out = super().dispatch_preprocess(hidden_states, routing_map, probs)
        if self._shared is not None:  # its sequence-parallel gather, as the stock phase runs it
            self._shared.pre_forward_comm(hidden_states)
        return out

    def _shared_fc2(self) -> None:
        self._shared.linear_fc2_forward()
        self._shared.post_forward_comm()

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = super().combine_postprocess(hidden_states)
        if self._shared is not None:  # added after the unpermute, as the stock phase adds it
            output = output + self._shared.get_output()
        return output

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
            self._meta = plan_dispatch(self._counts[self.tp_rank], comm=self.binding.comm, algorithm=settings.algorithm,
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
        deferred = ", weight gradients deferred" if settings.defer_wgrad else ""
        dropped = " and the weight gradients not deferred" if settings.defer_wgrad else ""
        warnings.warn(f"PiperTokenDispatcher ({layer}experts {first}-{last}): the fused all-to-all "
                      f"({chunks}{deferred}) needs MoELayer's forward, but token_dispatch was called with no fused "
                      f"call open (a caller driving the phases one by one); such steps run unpipelined, one chunk "
                      f"of {settings.algorithm.value} exchanges{dropped} (said once per dispatcher)",
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

        defer = self.binding.settings.defer_wgrad

        def experts(tokens: torch.Tensor, tokens_per_expert: tuple[int, ...], chunk_probs: torch.Tensor | None):
            with splittable_linears(layer.experts) if defer else contextlib.nullcontext():
                out, bias = layer.experts(tokens, torch.tensor(tokens_per_expert, dtype=torch.long), chunk_probs)
            if bias is not None:
                raise SpecError("experts bias", "returned", "the fused path combines expert outputs only",
                                "build experts without a separate output bias (add_bias_linear false)")
            return out

        meta = self._current_meta()
        chunk_numbers = iter(range(meta.chunks))  # moe_alltoall runs the experts once per chunk, in order

        def sharded(tokens: torch.Tensor, tokens_per_expert: tuple[int, ...], chunk_probs: torch.Tensor | None):
            return self._etp_experts(experts, tokens, chunk_probs, self._etp_sizes(meta, next(chunk_numbers)))

        on_event = None if record is None else _marker(record)
        # the experts' parameters go through moe_alltoall's own autograd node: one gradient accumulation
        # each per backward, so DDP's per-parameter grad-ready hooks fire once whatever the chunk count
        params = [p for p in layer.experts.parameters() if p.requires_grad]
        return moe_alltoall(hidden_states, meta, experts if self.tp_size == 1 else sharded, probs=probs,
                            params=params, on_event=on_event, defer_wgrad=defer), None

    def _etp_sizes(self, meta: DispatchMeta, k: int) -> torch.Tensor:
        """``[etp, local experts]``: tokens each expert-TP rank's chunk ``k`` brings each local
        expert, cut from the counts as ``plan_dispatch`` cuts them (piece ``k`` of every (source,
        expert) run: piper_core.runtime.dispatch)."""
        counts, n = self._counts, meta.chunks
        part = (counts * (k + 1)) // n - (counts * k) // n  # [etp, W, E]
        me, per = self.binding.comm.me, self.num_local_experts
        sizes = part[:, :, me * per:(me + 1) * per].sum(dim=1)
        if tuple(sizes[self.tp_rank].tolist()) != meta.chunk[k].tokens_per_expert:
            raise RuntimeError(f"PiperTokenDispatcher: chunk {k + 1}/{n} brings {meta.chunk[k].tokens_per_expert} "
                               f"tokens per local expert, its expert-TP split says {sizes[self.tp_rank].tolist()}")
        return sizes

    def _etp_experts(self, experts: Callable[..., torch.Tensor], tokens: torch.Tensor, probs: torch.Tensor | None,
                     sizes: torch.Tensor) -> torch.Tensor:
        """One chunk through this rank's shard of the experts (etp > 1), as the stock
        ``dispatch_postprocess``/``combine_preprocess`` run all of a step's tokens: all-gather every
        expert-TP rank's chunk, sort (rank, expert) runs by expert, experts, sort back, reduce-scatter.
        ``sizes`` [etp, local experts] from :meth:`_etp_sizes`. Megatron's mappings are autograd
        Functions whose backward is the reverse collective, so ``moe_alltoall`` runs each chunk's
        gather/scatter backward in its fixed chunk order, the same on every expert-TP rank."""
        per_rank = sizes.sum(dim=1).tolist()
        tokens = gather_from_sequence_parallel_region(tokens, group=self.tp_group, output_split_sizes=per_rank)
        if probs is not None:
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_group, output_split_sizes=per_rank)
        runs = torch.arange(sizes.numel())
        tokens, probs = sort_chunks_by_idxs(tokens, sizes.ravel(), runs.reshape(sizes.shape).T.ravel(), probs=probs)
        out = experts(tokens, tuple(sizes.sum(dim=0).tolist()), probs)
        out, _ = sort_chunks_by_idxs(out, sizes.T.ravel(), runs.reshape(sizes.shape[1], -1).T.ravel())
        # the stock combine_preprocess reduces in the probs' dtype
        return reduce_scatter_to_sequence_parallel_region(out.to(self.probs.dtype), group=self.tp_group,
                                                          input_split_sizes=per_rank).to(out.dtype)


def _logical_at(placement: ExpertPlacement | None, *, num_experts: int, ep: int) -> torch.Tensor | None:
    """The router column each physical slot reads (None for no placement or the default one);
    SpecError when ``placement`` is for another expert count or expert-parallel size."""
    if placement is None:
        return None
    placement.check(num_experts=num_experts, ep=ep, key="placement")
    return None if placement.is_default else torch.tensor(placement.logical_at, dtype=torch.long)


class _ExpertGroupAutoChunks(AutoChunks):
    """An :class:`AutoChunks` whose choice the expert-TP group shares: with etp > 1 each expert-TP
    rank of an EP rank runs its own EP group's exchanges, yet all of them gather and scatter every
    chunk together, so they must run the same chunk count. The base decides over the EP group (MAX of
    each candidate's median); one more all-reduce (MAX) over the expert-TP group of those, and the
    same rule (``choose``) on the result, gives every rank of the tp x ep group the same count."""

    def __init__(self, comm: A2AComm, tp_group: dist.ProcessGroup, **kwargs: Any) -> None:
        super().__init__(comm, **kwargs)
        self.tp_group = tp_group

    def _decide(self) -> None:
        super()._decide()
        ranks = tuple(dist.get_process_group_ranks(self.tp_group))
        if len(ranks) == 1 or self.medians_s is None:
            return
        t = torch.tensor([self.medians_s[c] for c in self.candidates], dtype=torch.float64, device=self.device)
        what = timeouts.OpName(op="AutoChunks decision over the expert-TP group (all-reduce of measured layer times)",
                               stage="stage 1/1", ranks=ranks, rank=dist.get_rank())
        work = timeouts.launch(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp_group,
                                                             async_op=True))
        timeouts.wait(work, what, self.comm.timeout if self.comm.host_timeout else None)
        self.medians_s = dict(zip(self.candidates, t.cpu().tolist()))
        self.chosen = choose(self.medians_s, self.margin)


class _Posted(torch.autograd.Function):
    """The end of an exchange posted earlier (``start_exchange``): forward waits for it; backward
    runs the reverse exchange (as :func:`piper_core.runtime.exchange`'s backward does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pending: PendingExchange,  # type: ignore[override]
                plan: ExchangePlan) -> torch.Tensor:
        ctx.plan = plan
        return pending.wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return start_exchange(grad.contiguous(), ctx.plan, backward=True).wait(), None, None


def _exchange_beside(tensors: tuple[torch.Tensor, ...], plan: ExchangePlan,
                     work: Callable[[], None] | None) -> list[torch.Tensor]:
    """Each of ``tensors`` exchanged by ``plan`` (differentiable); ``work()`` runs while they are all
    in flight (posted in order, waited in order: the same on every rank). None: one after another."""
    if work is None:
        return [exchange(t, plan) for t in tensors]
    pending = [start_exchange(t.detach(), plan) for t in tensors]
    work()
    return [_Posted.apply(t, p, plan) for t, p in zip(tensors, pending)]


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
    """``MoELayer.set_layer_number`` also tells a Piper dispatcher: for its messages, and to route by
    that layer's placement when the settings hold one per layer."""
    def set_layer_number(self: Any, layer_number: int) -> None:
        original(self, layer_number)
        dispatcher = self.token_dispatcher
        if isinstance(dispatcher, PiperTokenDispatcher):
            dispatcher.layer_number = layer_number
            placement = type(dispatcher).binding.settings.placement
            if isinstance(placement, LayerPlacements):
                dispatcher.set_placement(placement.for_layer(layer_number))

    set_layer_number.__wrapped__ = original  # type: ignore[attr-defined]
    return set_layer_number


@contextlib.contextmanager
def splittable_linears(experts: torch.nn.Module) -> Iterator[None]:
    """For the experts' forward inside it: each Megatron expert linear computes its output with torch
    operations instead of ``LinearWithGradAccumulationAndAsyncCommunication`` (see the module doc),
    so that ``split_backward`` can defer its weight gradient."""
    linears = [(name, m) for name, m in experts.named_modules() if hasattr(type(m), "_forward_impl")]
    for name, m in linears:
        m._forward_impl = functools.partial(_torch_linear, name)
    try:
        yield
    finally:
        for _, m in linears:
            m.__dict__.pop("_forward_impl", None)


def _torch_linear(name: str, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  gradient_accumulation_fusion: bool = False, allreduce_dgrad: bool = False,
                  sequence_parallel: bool = False, grad_output_buffer: Any = None, **_: Any) -> torch.Tensor:
    """What ``LinearWithGradAccumulationAndAsyncCommunication.forward`` computes for an expert linear
    that communicates nothing and accumulates nothing itself, as torch operations."""
    for on, what, fix in ((gradient_accumulation_fusion, "gradient accumulation fusion (into main_grad)",
                           "--no-gradient-accumulation-fusion"),
                          (allreduce_dgrad, "an all-reduce of its input gradient", "expert linears without it"),
                          (sequence_parallel, "a sequence-parallel gather of its input", "expert linears without it"),
                          (grad_output_buffer is not None, "a buffered output gradient", "expert linears without it")):
        if on:
            raise SpecError("defer_wgrad", True, f"expert linear {name!r} runs {what} inside the autograd Function "
                            "that also computes its weight gradient, which cannot be deferred",
                            f"use {fix}, or drop --piper-defer-wgrad")
    out = torch.matmul(input, weight.t())
    return out + bias if bias is not None else out


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
