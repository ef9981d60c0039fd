"""Memory per GPU for each pipeline stage: weights, gradients, optimizer state, activations,
communication buffers and the fixed overhead, against the cluster's capacity.

Sources:
* Bytes per parameter: Megatron-Core distributed-optimizer guide (docs ``dist_optimizer.md``):
  bf16 params with fp32 gradients 2 + 4 + 12/d; fp16 params and gradients 2 + 2 + 16/d (fp32 main
  params and gradients, Adam m and v). Megatron sets fp32 gradient accumulation for bf16
  (``validate_args``) unless ``--grad-reduce-in-bf16`` (2 bytes). The router weight is fp32
  (TopKRouter): 4 + 4 + 8/d. ``--optimizer-cpu-offload`` moves a fraction of the optimizer
  state to the host (16 bytes per parameter there: fp32 master, m, v and a gradient copy).
* Sharding: dense state over dp*cp, expert state over expert-dp (``DistributedOptimizer`` with the
  expert-data-parallel group).
* In-flight micro-batches: 1F1B keeps ``pp - rank`` micro-batches on rank ``rank``; the interleaved
  schedule keeps ``2(pp - rank - 1) + (vpp - 1) pp + 1`` model-chunk forwards
  (``get_num_warmup_microbatches`` in pipeline_parallel/schedules.py), both capped by the
  micro-batches of the step.
* Activations per layer: :mod:`piper_core.resource.activations`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from piper_core.resource import activations
from piper_core.resource.params import ParamCount, stage_params
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import stage_kinds
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

GIB = 1024**3


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """Bytes on one GPU of pipeline rank ``stage`` (the largest of its tp/ep ranks)."""

    stage: int
    layers: int
    params: ParamCount
    weights: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    overhead: int
    host: int = 0  # offloaded optimizer state on the host (not part of ``total``)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers + self.overhead


def _state_bytes(params: ParamCount, plan: ParallelPlan) -> tuple[int, int, int, int]:
    """(weights, gradients, optimizer on the GPU, optimizer on the host) bytes for ``params``.

    An offloaded share keeps fp32 master weights, Adam m and v (12 bytes) and a pinned fp32
    gradient copy (4 bytes) per parameter on the host (Megatron ``HybridDeviceOptimizer``).
    """
    half = params.total - params.fp32
    grad_bytes, opt_bytes = (4, 12) if plan.precision == "bf16" else (2, 16)
    if plan.grad_reduce_in_bf16:
        grad_bytes = 2
    weights = 2 * half + 4 * params.fp32
    grads = grad_bytes * half + 4 * params.fp32
    dense_half, expert = params.dense - params.fp32, params.expert
    if plan.distributed_optimizer:
        dense_shards, expert_shards = plan.dp * plan.cp, plan.edp
    else:
        dense_shards = expert_shards = 1
    shard = dense_half / dense_shards + expert / expert_shards
    optimizer = opt_bytes * shard + 8 * params.fp32 / dense_shards
    offload = plan.optimizer_offload_fraction
    host = 16 * shard * offload
    return weights, grads, math.ceil(optimizer * (1 - offload)), math.ceil(host)


def in_flight_chunks(plan: ParallelPlan, rank: int) -> int:
    """Model-chunk forwards whose activations rank ``rank`` holds at its peak."""
    m = plan.num_microbatches
    if plan.vpp is None:
        return min(plan.pp - rank, m)
    warmup = 2 * (plan.pp - rank - 1) + (plan.vpp - 1) * plan.pp
    return min(warmup + 1, m * plan.vpp)


@functools.lru_cache(maxsize=65536)
def _layer_bytes(model: ModelSpec, plan: ParallelPlan, moe: bool) -> int:
    return activations.layer_activation_bytes(model, plan, moe=moe)


def _stage_activations(model: ModelSpec, plan: ParallelPlan, rank: int, chunks: tuple[tuple[bool, ...], ...]) -> int:
    """Activation bytes rank ``rank`` keeps at its peak (all in-flight micro-batches).

    ``chunks`` holds, per model chunk of the rank, whether each layer is a MoE layer.
    """
    plain = dataclasses.replace(plan, recompute="none", recompute_num_layers=None) if plan.recompute == "full" else plan
    kinds = {moe for chunk in chunks for moe in chunk}
    full = {moe: _layer_bytes(model, plain, moe) for moe in kinds}
    n = plan.recompute_num_layers or 1
    per_mb = 0       # bytes one micro-batch keeps on this rank, summed over its chunks
    transient = 0    # full recompute: one checkpointed group rebuilt in backward
    for chunk in chunks:
        if plan.recompute != "full":
            per_mb += sum(full[moe] for moe in chunk)
            continue
        # uniform: every layer, checkpointed in groups of n; block: each of the first n layers of the
        # chunk checkpointed on its own (TransformerBlock._checkpointed_forward)
        uniform = plan.recompute_method == "uniform"
        redo, kept = (chunk, ()) if uniform else (chunk[:n], chunk[n:])
        group = n if uniform else 1
        per_mb += sum(full[moe] for moe in kept)
        if redo:
            # a checkpointed group keeps only its input (the activation model's full-recompute term)
            checkpoint = activations.layer_activation_bytes(model, plan, moe=False, recomputed=True)
            per_mb += math.ceil(len(redo) / group) * checkpoint
            transient = max(transient, sum(full[moe] for moe in redo[:group]))
    held = in_flight_chunks(plan, rank) * per_mb / len(chunks)
    if rank == 0:
        held += in_flight_chunks(plan, rank) / len(chunks) * activations.embedding_activation_bytes(model, plan)
    if rank == plan.pp - 1:
        held += activations.output_activation_bytes(model, plan)
    return math.ceil(held + transient)


def _buffers(model: ModelSpec, plan: ParallelPlan) -> int:
    """Transient buffers outside the saved activations, the largest one live at a time.

    The all-to-all receive buffer of one MoE layer (permuted tokens x hidden, before the sort by
    expert) and, with sequence parallelism, the all-gathered [s, b, h] input of a column-parallel
    linear (SP saves the shard and re-gathers in backward).
    """
    tokens = model.seq_length // plan.cp * plan.micro_batch_size
    gathered = tokens * model.hidden_size * 2 if plan.sequence_parallel else 0
    a2a = 0
    if model.is_moe:
        a2a = activations.routed_rows(model, plan) * model.hidden_size * 2
    return max(gathered, a2a)


def with_state_of(stages: tuple[StageMemory, ...], plan: ParallelPlan) -> tuple[StageMemory, ...]:
    """``stages`` with weights, gradients and optimizer state recomputed for ``plan``.

    For plans that differ only in how state is kept (bf16 gradients, optimizer offload): the
    activations and buffers do not change, so the search re-prices only the state.
    """
    out = []
    for s in stages:
        weights, grads, optimizer, host = _state_bytes(s.params, plan)
        out.append(dataclasses.replace(s, weights=weights, gradients=grads, optimizer=optimizer, host=host))
    return tuple(out)


def stage_memory(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> tuple[StageMemory, ...]:
    """Per pipeline rank: every memory term in bytes for one GPU."""
    out = []
    params = stage_params(model, plan)
    buffers = _buffers(model, plan)
    for rank, chunks in enumerate(stage_kinds(model, plan)):
        weights, grads, optimizer, host = _state_bytes(params[rank], plan)
        out.append(StageMemory(
            stage=rank, layers=sum(len(c) for c in chunks), params=params[rank], weights=weights,
            gradients=grads, optimizer=optimizer,
            activations=_stage_activations(model, plan, rank, chunks), buffers=buffers,
            overhead=round(cluster.memory_overhead_gib * GIB), host=host,
        ))
    return tuple(out)
