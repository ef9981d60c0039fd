"""Piper's runtime all-to-all: flat, hierarchical and aggregated exchanges, and the pipelined
dispatch -> experts -> combine of a MoE layer. The only part of ``piper_core`` that imports torch.

Works on any ``torch.distributed`` backend (gloo on CPU, NCCL on GPU): every stage is an
``all_to_all_single`` on a sub-group or a set of ``isend``/``irecv``, posted with ``async_op=True``.
Nothing is read from the environment and nothing is kept in module state (migration's kept buffers
are an object the adapter owns).

API (stable; the benchmarks and the adapters build on it)::

    # topology and groups (collective set-up, once)
    NodeTopology(nodes=((0, 1, 2, 3), (4, 5, 6, 7)))          # global ranks per node
    NodeTopology.uniform(world_size=8, ranks_per_node=4)
    Algorithm.FLAT | Algorithm.HIERARCHICAL | Algorithm.AGGREGATED
    create_comm(topology, *, parents=None, timeout=timedelta(seconds=60), host_timeout=True) -> A2AComm
        # EVERY rank of the job calls it with identical arguments (it creates process groups,
        # then one barrier per parent group); parents: global ranks of each parent group
        # (default: the whole job), e.g. the expert-parallel groups; returns this rank's comm.

    # one exchange (all_to_all_single semantics on dim 0; bit-identical for every algorithm)
    all_to_all_flat(x, *, input_splits, output_splits, comm, label="all-to-all") -> Tensor
    all_to_all(x, counts, *, comm, algorithm, label="all-to-all") -> Tensor     # counts: [W, W]
    plan_exchange(counts, *, comm, algorithm, label="all-to-all", device=None) -> ExchangePlan
    flat_plan(input_splits, output_splits, *, comm, label="all-to-all") -> ExchangePlan
    exchange(x, plan) -> Tensor                                  # autograd; backward = counts.T
    start_exchange(x, plan, *, backward=False) -> PendingExchange  # async: .advance(), .wait()

    # MoE dispatch (Megatron's layout: x sorted by global expert; E/W experts per member)
    exchange_counts(tokens_per_expert, *, comm) -> Tensor [W, E]     # one all-gather
    plan_dispatch(counts, *, comm, algorithm, chunks=1, device=None) -> DispatchMeta (frozen)
        # chunks: an int, or an AutoChunks (below) that picks it by measurement
    dispatch(x, meta, *, probs=None) -> (tokens grouped by local expert, probs)   # chunks == 1
    combine(y, meta) -> Tensor                                                     # chunks == 1
    moe_alltoall(x, meta, experts, *, probs=None, params=(), on_event=None) -> Tensor  # pipelined, any chunks
        # experts(tokens [T, ...], tokens_per_expert: tuple[int, ...], probs [T, ...] | None) -> [T, ...]
        # params: the experts' parameters; each gets ONE gradient accumulation per backward whatever
        # the chunk count (per-parameter hooks such as DDP's grad-ready counting fire once)

    # the chunk count chosen at run time (Tutel's adaptive pipelining degree; see .autochunks)
    AutoChunks(comm, *, candidates=(1, 2, 4), trials=3, margin=0.05, device=None)
        # plan_dispatch(..., chunks=auto): each candidate for `trials` steps (moe_alltoall times
        # them), then one all-reduce (MAX) and the fewest chunks within `margin` of the fastest;
        # .chosen (None while measuring), .medians_s, .reset()

    CollectiveError   # a stage failed or timed out; names the exchange, the stage, the ranks

    # moving experts between ranks between two steps (submodules; the adapters say what moves)
    .migrate: plan_moves(current, target), exchange(plan, tensors_of, group, ranks, me, timeout, buffers),
              MoveBuffers (the adapter's, kept between moves), write_placements / read_placements
    .live:    the migration decision every N steps (LiveSettings, routed_tokens, price, Outcome)

Shapes: ``x`` is ``[rows, ...]`` (any trailing dims and dtype); ``counts[s][d]`` are rows (tokens),
not bytes, indexed by member (rank in the parent group = position in its sorted global ranks).
Plans are pure computation (no communication) and hold index tensors on ``device``, which must be
where ``x`` lives. Timeouts: each wait lasts at most ``comm.timeout`` (see :mod:`.timeouts`).
"""

from piper_core.runtime.alltoall import (
    ExchangePlan,
    PendingExchange,
    all_to_all,
    all_to_all_flat,
    exchange,
    flat_plan,
    plan_exchange,
    start_exchange,
)
from piper_core.runtime.autochunks import AutoChunks
from piper_core.runtime.dispatch import ChunkPlan, DispatchMeta, combine, dispatch, exchange_counts, plan_dispatch
from piper_core.runtime.groups import A2AComm, create_comm
from piper_core.runtime.pipelined import ExpertFn, ScheduleEvent, moe_alltoall
from piper_core.runtime.timeouts import CollectiveError
from piper_core.runtime.topology import Algorithm, NodeTopology, RankLayout, layout_for

__all__ = [
    "A2AComm", "Algorithm", "AutoChunks", "ChunkPlan", "CollectiveError", "DispatchMeta", "ExchangePlan", "ExpertFn",
    "NodeTopology", "PendingExchange", "RankLayout", "ScheduleEvent", "all_to_all", "all_to_all_flat",
    "combine", "create_comm", "dispatch", "exchange", "exchange_counts", "flat_plan", "layout_for",
    "moe_alltoall", "plan_dispatch", "plan_exchange", "start_exchange",
]
