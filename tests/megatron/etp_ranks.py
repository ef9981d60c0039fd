"""Rank side of ``test_dispatcher_etp.py``: Piper's dispatcher against Megatron's with expert tensor
parallelism and shared experts, on 4 gloo processes, one spawn for every case.

Each case builds a real Megatron-Core ``MoELayer`` (``SequentialMLP`` experts, fp32, 8 experts,
top-2; the helpers and sizes of :mod:`tests.megatron.piper_ranks`) with Megatron's
``MoEAlltoAllTokenDispatcher``, then with Piper's from the same weights, runs one forward and
backward of each on this rank's input and returns the largest differences (output, input gradient,
every parameter gradient: router, this rank's shard of the experts, shared expert).

Layouts (tp, etp) on 4 ranks, ep 2: (1, 2): attention tp 1 (every rank routes its own batch),
experts etp 2 x ep 2; (2, 2): attention tp 2 with sequence parallelism (every rank routes its own
sequence shard), experts etp 2 x ep 2 (in both the EP groups are (0, 2) and (1, 3), the expert-TP
groups (0, 1) and (2, 3); :data:`NODES` puts each EP group across two "nodes", so the hierarchical
exchange runs its inter-node stage); (2, 1): the shared expert under sequence parallelism with
whole experts (EP groups (0, 1) and (2, 3)).
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from datetime import timedelta
from typing import Any

from tests.megatron.piper_ranks import _compare, _forward_backward, _layer, _moe_config

WORLD, EP = 4, 2
LAYOUTS = ((1, 2), (2, 2), (2, 1))  # (attention tp, expert tp)
NODES = ((0, 1), (2, 3))
SHARED_SIZE = 20  # the shared expert's intermediate size (split over attention tp)
SHARED = {"none": (None, False), "shared": (SHARED_SIZE, False), "shared-overlap": (SHARED_SIZE, True)}
TUNED = (1, 2)  # the layout that also runs --piper-chunks tune
TUNE_CALLS = 13  # ADAPTER_CANDIDATES x ADAPTER_TRIALS measured calls, then the one that decides
TIMEOUT = timedelta(seconds=60)  # every process group and wait of the cases


@dataclasses.dataclass(frozen=True)
class EtpCase:
    tp: int
    etp: int
    capacity: str  # a key of tests.megatron.piper_ranks.CAPACITY
    shared: str  # a key of SHARED
    algorithm: str
    chunks: int

    @property
    def id(self) -> str:
        return f"tp{self.tp}-etp{self.etp}-ep{EP}-{self.capacity}-{self.shared}-{self.algorithm}-chunks{self.chunks}"


def etp_cases() -> list[EtpCase]:
    """etp 2: dropless by every plan algorithm in 1 and 2 chunks; token dropping and padding to
    capacity (factor 1.0); the shared expert, overlapped and not. etp 1: the overlapped shared expert."""
    cases = []
    for tp, etp in LAYOUTS:
        if etp == 1:
            cases += [EtpCase(tp, etp, "dropless", "shared-overlap", "flat", chunks) for chunks in (1, 2)]
            continue
        cases += [EtpCase(tp, etp, "dropless", "none", alg, chunks) for alg in ("flat", "hierarchical")
                  for chunks in (1, 2)]
        cases += [EtpCase(tp, etp, cap, "none", "flat", chunks) for cap in ("cf1.0", "cf1.0-pad") for chunks in (1, 2)]
        cases += [EtpCase(tp, etp, "dropless", "shared-overlap", alg, chunks)
                  for alg, chunks in (("flat", 1), ("hierarchical", 1), ("flat", 2))]
        cases.append(EtpCase(tp, etp, "dropless", "shared", "flat", 1))
    return cases


def _config(case: EtpCase) -> tuple[Any, Any]:
    """:func:`tests.megatron.piper_ranks._moe_config` (etp 1) with the case's etp and shared expert."""
    config, submodules = _moe_config(WORLD, EP, 2, case.capacity, case.tp)
    size, overlap = SHARED[case.shared]
    config = dataclasses.replace(config, expert_tensor_parallel_size=case.etp,
                                 moe_shared_expert_intermediate_size=size, moe_shared_expert_overlap=overlap)
    return config, submodules


def _host_shared_expert_streams() -> None:
    """``SharedExpertMLP`` makes a ``torch.cuda.Stream`` for ``moe_shared_expert_overlap``: give its
    module the host ``torch`` that :func:`piper_megatron.cpu.install_cpu_shims` gave the dispatcher's."""
    shared = importlib.import_module("megatron.core.transformer.moe.shared_experts")
    shared.torch = importlib.import_module("megatron.core.transformer.moe.token_dispatcher").torch


def _gloo_uneven_collectives() -> None:
    """The expert-TP all-gather and reduce-scatter with per-rank split sizes (the stock
    ``dispatch_postprocess``/``combine_preprocess``, and Piper's etp path, which calls the same
    mappings) pass uneven tensor lists to ``all_gather``/``reduce_scatter``, which NCCL takes and
    gloo refuses ("invalid tensor size"). On gloo groups: the gather pads every part to the largest
    and trims, the reduce-scatter all-reduces and keeps this rank's rows (the same sum of etp parts).
    Both dispatchers run through them alike; even splits keep Megatron's own code."""
    import torch
    import torch.distributed as dist

    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "_etp_gloo", False):
        return

    def gloo(group: Any, sizes: Any) -> bool:
        return sizes is not None and group.size() > 1 and str(dist.get_backend(group)) == "gloo"

    def gather_along_first_dim(input_: Any, group: Any, output_split_sizes: Any = None,
                               use_global_buffer: bool = False):
        if not gloo(group, output_split_sizes):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        padded = torch.cat([input_, input_.new_zeros(rows - input_.shape[0], *input_.shape[1:])])
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)])

    def reduce_scatter_along_first_dim(input_: Any, group: Any, input_split_sizes: Any = None,
                                       use_global_buffer: bool = False):
        if not gloo(group, input_split_sizes):
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[:group.rank()])
        return total[start:start + input_split_sizes[group.rank()]].clone()

    gather_along_first_dim._etp_gloo = True  # type: ignore[attr-defined]
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _settings(algorithm: str, chunks: int, *, tune: bool = False) -> Any:
    from piper_core.runtime import Algorithm
    from piper_megatron.dispatcher import DispatchSettings

    return DispatchSettings(algorithm=Algorithm(algorithm), chunks=chunks, tune=tune)


class _Watched:
    """A posted exchange whose wait is logged."""

    def __init__(self, pending: Any, log: list[str]) -> None:
        self._pending, self._log = pending, log

    def wait(self) -> Any:
        self._log.append("wait")
        return self._pending.wait()


def _watch(layer: Any, log: list[str]) -> Any:
    """Log, in order, the exchanges Piper's dispatcher posts and waits beside work
    (``start_exchange`` in :mod:`piper_megatron.dispatcher`) and the shared expert's fc1 and fc2;
    returns the undo."""
    from piper_megatron import dispatcher

    original = dispatcher.start_exchange

    def start_exchange(*args: Any, **kwargs: Any) -> _Watched:
        log.append("post")
        return _Watched(original(*args, **kwargs), log)

    def logged(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            log.append(name)
            return fn(*args, **kwargs)
        return run

    shared = layer.shared_experts
    shared.linear_fc1_forward_and_act = logged("fc1", shared.linear_fc1_forward_and_act)
    shared.linear_fc2_forward = logged("fc2", shared.linear_fc2_forward)
    dispatcher.start_exchange = start_exchange

    def undo() -> None:
        dispatcher.start_exchange = original
    return undo


def _piper_run(comm: Any, settings: Any, config: Any, submodules: Any, source: Any, rank: int, *,
               calls: int = 1, log: list[str] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """Piper's layer from ``source``'s weights, run ``calls`` times (gradients zeroed before each);
    ``log``: the schedule of the exchanges beside the shared expert (:func:`_watch`)."""
    from piper_megatron.dispatcher import install_dispatcher

    patches = install_dispatcher(comm, settings)
    undo = None
    try:
        layer = _layer(config, submodules, source=source)
        undo = None if log is None else _watch(layer, log)
        runs = []
        for _ in range(calls):
            layer.zero_grad(set_to_none=True)
            runs.append(_forward_backward(layer, rank))
        return layer, runs
    finally:
        if undo is not None:
            undo()
        patches.restore()


def _groups() -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    return {"ep": dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()),
            "etp": dist.get_process_group_ranks(parallel_state.get_expert_tensor_parallel_group())}


def _layout(rank: int, tp: int, etp: int) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel

    from piper_core.runtime import NodeTopology
    from piper_megatron.dispatcher import create_ep_comm

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=EP,
                                             expert_tensor_parallel_size=etp, distributed_timeout_minutes=1)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        comm = create_ep_comm(NodeTopology(nodes=NODES), timeout=TIMEOUT)
        results: dict[str, Any] = {"groups": _groups()}
        stock: dict[tuple[str, str], Any] = {}  # (capacity, shared) -> (layer, run): one stock run each
        for case in (c for c in etp_cases() if (c.tp, c.etp) == (tp, etp)):
            config, submodules = _config(case)
            if (case.capacity, case.shared) not in stock:
                layer = _layer(config, submodules)
                stock[case.capacity, case.shared] = layer, _forward_backward(layer, rank)
            source, want = stock[case.capacity, case.shared]
            log = [] if case.shared == "shared-overlap" else None
            layer, (got,) = _piper_run(comm, _settings(case.algorithm, case.chunks), config, submodules, source, rank,
                                       log=log)
            meta = layer.token_dispatcher._meta  # the step's plan: stages of each chunk's dispatch
            results[case.id] = _compare(want, got) | {"dispatcher": type(layer.token_dispatcher).__name__,
                                                       "stages": [len(c.dispatch.forward.stages) for c in meta.chunk],
                                                       "schedule": log}
        if (tp, etp) == TUNED:
            results["tune"] = _tune_case(comm, rank, tp, etp, stock["dropless", "none"])
        return results
    finally:
        parallel_state.destroy_model_parallel()


def _tune_case(comm: Any, rank: int, tp: int, etp: int, stock: tuple[Any, dict[str, Any]]) -> dict[str, Any]:
    """``--piper-chunks tune``: every rank measures 1/2/4/8 chunks, then decides; the tp x ep group
    must see the same times (each expert-TP pair gathers every chunk together, so both run one
    count). The call after the decision against stock."""
    source, want = stock
    config, submodules = _config(EtpCase(tp, etp, "dropless", "none", "flat", 2))
    layer, runs = _piper_run(comm, _settings("flat", 2, tune=True), config, submodules, source, rank,
                             calls=TUNE_CALLS + 1)
    tuner = layer.token_dispatcher.auto_chunks
    return _compare(want, runs[-1]) | {"chosen": tuner.chosen, "medians_s": tuner.medians_s}


def run_rank(rank: int, world: int) -> dict[str, Any]:
    """Every case of every layout on this rank; picklable results only."""
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    from piper_megatron.cpu import install_cpu_shims

    if world != WORLD:
        raise ValueError(f"the etp cases need {WORLD} ranks, got {world}")
    install_cpu_shims()
    _host_shared_expert_streams()
    _gloo_uneven_collectives()
    start = time.perf_counter()
    layouts = {f"tp{tp}-etp{etp}": _layout(rank, tp, etp) for tp, etp in LAYOUTS}
    return {"layouts": layouts, "seconds": time.perf_counter() - start}
