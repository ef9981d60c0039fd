"""Memory per GPU for each pipeline stage: weights, gradients, optimizer state, activations,
communication buffers and the fixed overhead, against the cluster's capacity.

Sources:
* Bytes per parameter: Megatron-Core distributed-optimizer guide (docs ``dist_optimizer.md``):
  2-byte params, 4-byte gradients with bf16 (Megatron sets fp32 gradient accumulation for bf16 in
  ``validate_args`` unless ``--grad-reduce-in-bf16``, 2 bytes) and 2-byte ones with fp16, Adam's
  fp32 main params, m and v (12/d). Every parameter is 2 bytes, the router's included
  (``Router.reset_parameters`` casts it to ``params_dtype``).
* fp32 gradient copy: where the gradient buffer is not fp32 (fp16, or bf16 with
  ``--grad-reduce-in-bf16``) the optimizer copies its gradient shard to fp32 at the step
  (``main_grad.float()`` in ``DistributedOptimizer._copy_model_grads_to_main_grads``,
  megatron/core/optimizer/distrib_optimizer.py; ``Float16OptimizerWithFloat16Params`` likewise for all
  parameters without it). The copy lives from ``optimizer.step()`` to the next ``optimizer.zero_grad()``
  at the top of ``train_step`` (megatron/training/training.py), when the activations are freed:
  the stage's peak is the larger of the step and the forward/backward. With ``--optimizer-cpu-offload``
  the GPU share keeps its copy for good (``HybridDeviceOptimizer._set_sub_optimizer_grads``
  sets ``fp32_param.grad = grad.to(fp32)`` and nothing frees it) and the host keeps 16 bytes per
  offloaded parameter (fp32 master, m, v and a pinned fp32 gradient copy).
* fp32 training (neither ``--bf16`` nor ``--fp16``): 4-byte params and gradients, and Adam's m and v
  only (8/d): the optimizer steps the parameters themselves (``FP32Optimizer``; the distributed
  optimizer's main params of an fp32 parameter are views of it, ``shard_fp32_groups`` in
  ``DistributedOptimizer._build_model_and_main_param_groups``), so no master copy and no
  gradient copy.
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
from piper_core.resource.params import ParamCount, stage_layer_params, stage_params
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import mtp_layers, stage_blocks
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
    step_gradients: int = 0  # fp32 gradient copy live only during the optimizer step
    workspace: int = 0  # framework buffers kept from the first forward on (activations.workspace_bytes)
    unsaved: int = 0  # of ``activations``: kept outside autograd's saved tensors (activations.UNSAVED)
    host: int = 0  # offloaded optimizer state on the host (not part of ``total``)
    fp8_weights: int = 0  # of ``params``, the weights an FP8 plan runs in FP8 (0 in other plans)

    @property
    def total(self) -> int:
        return peak_bytes(self.weights + self.gradients + self.optimizer, self.overhead + self.workspace,
                          self.activations + self.buffers, self.step_gradients)


def peak_bytes(state: int, overhead: int, forward_backward: int, step_gradients: int) -> int:
    """A stage's peak: its state and overhead, plus the larger of what the forward/backward holds
    (activations and buffers) and the fp32 gradient copy of the optimizer step (see the module
    docstring: the copy is made after the last backward and freed before the next forward)."""
    return state + overhead + max(forward_backward, step_gradients)


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytes:
    """Bytes of one GPU's model state (see :func:`_state_bytes`)."""

    weights: int
    gradients: int
    optimizer: int  # on the GPU for the whole step
    step_gradients: int  # fp32 gradient copy, live only during the optimizer step
    host: int  # offloaded optimizer state on the host

    @property
    def persistent(self) -> int:
        return self.weights + self.gradients + self.optimizer


FP8_WEIGHT_CACHE_BYTES = 2
"""Bytes per FP8 linear weight Transformer Engine keeps besides the bf16 parameter in an FP8 plan
without ``fp8_param``: the weight quantized once per step and reused by every micro-batch, and its
transpose for the backward GEMMs (Hopper's FP8 GEMMs take only the TN layout). With ``fp8_param``
(``--fp8-param-gather``) the parameter itself is that FP8 weight (1 byte) and its transpose (1),
the 2 bytes of a bf16 parameter: no cache on top."""


def fp8_weights(model: ModelSpec, plan: ParallelPlan) -> tuple[int, ...]:
    """Per pipeline rank: the weights ``plan`` runs in FP8 (its layers' parameters; 0 without FP8)."""
    return stage_layer_params(model, plan) if plan.fp8 is not None else (0,) * plan.pp


def _state_bytes(params: ParamCount, plan: ParallelPlan, fp8_count: int = 0) -> StateBytes:
    """Weights, gradients, optimizer state (GPU and host) and the step's fp32 gradient copy for ``params``.

    An offloaded share keeps fp32 master weights, Adam m and v (12 bytes) and a pinned fp32
    gradient copy (4 bytes) per parameter on the host (Megatron ``HybridDeviceOptimizer``).
    ``fp8_count``: of ``params``, the weights an FP8 plan runs in FP8 (:data:`FP8_WEIGHT_CACHE_BYTES`).
    """
    grad_bytes = plan.grad_bytes
    fp32_grads = grad_bytes == 4
    fp32_weights = plan.precision == "fp32"  # the parameters are the optimizer's main params
    if plan.distributed_optimizer:
        shard = params.dense / (plan.dp * plan.cp) + params.expert / plan.edp
    else:
        shard = params.total
    offload = plan.optimizer_offload_fraction
    # fp32 copy of the shard's gradients (module docstring): none when the buffer already is fp32
    # (``.float()`` returns it), transient without offload, kept for good by the GPU share with it
    grad_copy = 0 if fp32_grads else 4 * shard
    optimizer = ((8 if fp32_weights else 12) * shard + (grad_copy if offload else 0)) * (1 - offload)
    cache = FP8_WEIGHT_CACHE_BYTES * fp8_count if plan.fp8 is not None and not plan.fp8_param else 0
    return StateBytes(weights=(4 if fp32_weights else 2) * params.total + cache, gradients=grad_bytes * params.total,
                      optimizer=math.ceil(optimizer),
                      step_gradients=0 if offload else math.ceil(grad_copy), host=math.ceil(16 * shard * offload))


def in_flight_chunks(plan: ParallelPlan, rank: int) -> int:
    """Model-chunk forwards whose activations rank ``rank`` holds at its peak."""
    m = plan.num_microbatches
    if plan.vpp is None:
        return min(plan.pp - rank, m)
    warmup = 2 * (plan.pp - rank - 1) + (plan.vpp - 1) * plan.pp
    return min(warmup + 1, m * plan.vpp)


@functools.lru_cache(maxsize=65536)
def _layer_bytes(model: ModelSpec, plan: ParallelPlan, moe: bool, kernels: activations.Kernels,
                 saved_only: bool = False) -> int:
    return activations.layer_activation_bytes(model, plan, moe=moe, kernels=kernels, saved_only=saved_only)


def _stage_activations(model: ModelSpec, plan: ParallelPlan, rank: int, chunks: tuple[tuple[bool, ...], ...],
                       kernels: activations.Kernels = activations.GPU_DEFAULTS) -> tuple[int, int]:
    """Activation bytes rank ``rank`` keeps at its peak (all in-flight micro-batches): all of them, and
    those autograd saves (without what is kept outside its saved tensors, :data:`activations.UNSAVED`).

    ``chunks`` holds, per model chunk of the rank, whether each layer (MTP layers' transformer layers
    included, :func:`stage_blocks`) is a MoE layer; ``kernels``
    what the accelerator's kernels keep (:func:`activations.kernels_for`).
    """
    per_chunk = _chunk_activations(model, plan, chunks, kernels)
    in_flight = in_flight_chunks(plan, rank)
    embedding = activations.embedding_activation_bytes(model, plan, kernels=kernels) if rank == 0 else 0
    output = activations.output_activation_bytes(model, plan, kernels=kernels) if rank == plan.pp - 1 else 0
    mtp = mtp_layers(model, plan)[rank]
    if mtp:  # the MTP layers' own embedding lookup, projection and loss, per micro-batch like the output's
        output += mtp * activations.mtp_activation_bytes(model, plan, kernels=kernels)
    out = []
    for per_mb, transient in per_chunk:
        held = in_flight * per_mb / len(chunks)
        if rank == 0:
            held += in_flight / len(chunks) * embedding
        if rank == plan.pp - 1:
            if plan.vpp is None:
                # without interleaving the last stage runs a micro-batch's backward right after its
                # forward, and the loss and output layer's backward free what they kept before the
                # last checkpointed group is rebuilt: the two are never held together
                out.append(math.ceil(held + max(output, transient)))
                continue
            held += output
        out.append(math.ceil(held + transient))
    return out[0], out[1]


@functools.lru_cache(maxsize=65536)
def _chunk_activations(model: ModelSpec, plan: ParallelPlan, chunks: tuple[tuple[bool, ...], ...],
                       kernels: activations.Kernels) -> tuple[tuple[int, int], tuple[int, int]]:
    """Bytes one micro-batch keeps on a rank with ``chunks`` (summed over its chunks), and under full
    recompute the one checkpointed group rebuilt in backward: for all activations and for autograd's
    saved ones. Ranks with the same chunks share it (the search prices every stage of many plans)."""
    plain = dataclasses.replace(plan, recompute="none", recompute_num_layers=None) if plan.recompute == "full" else plan
    kinds = {moe for chunk in chunks for moe in chunk}
    n = plan.recompute_num_layers or 1
    checkpoint = 0
    if plan.recompute == "full":
        # a checkpointed group keeps only its input (the activation model's full-recompute term)
        checkpoint = activations.layer_activation_bytes(model, plan, moe=False, recomputed=True, kernels=kernels)
    out = []
    for saved_only in (False, True):
        full = {moe: _layer_bytes(model, plain, moe, kernels, saved_only) for moe in kinds}
        per_mb = 0
        transient = 0
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
                per_mb += math.ceil(len(redo) / group) * checkpoint
                transient = max(transient, sum(full[moe] for moe in redo[:group]))
        out.append((per_mb, transient))
    return out[0], out[1]


def _buffers(model: ModelSpec, plan: ParallelPlan, k: activations.Kernels) -> tuple[int, int]:
    """Transient buffers outside the saved activations, the largest one live at a time, on every
    stage but the last and on the last.

    The all-to-all receive buffer of one MoE layer (permuted tokens x hidden, before the sort by
    expert); with sequence parallelism, the all-gathered [s, b, h] input of a column-parallel
    linear (SP saves the shard and re-gathers in backward; the local spec gathers into its
    persistent workspace instead, :func:`activations.workspace_bytes`); and on the last stage the
    logits, or their gradient, beside the loss's fp32 copy (:func:`activations.logits_transient_bytes`).
    """
    tokens = model.seq_length // plan.cp * plan.micro_batch_size
    act = 4 if plan.precision == "fp32" else 2  # bytes per activation element
    gathered = tokens * model.hidden_size * act if plan.sequence_parallel and not activations.local_spec(plan, k) else 0
    a2a = 0
    if model.is_moe:
        a2a = activations.routed_rows(model, plan) * model.hidden_size * act
    inner = max(gathered, a2a)
    return inner, max(inner, activations.logits_transient_bytes(model, plan))


def with_state_of(stages: tuple[StageMemory, ...], plan: ParallelPlan) -> tuple[StageMemory, ...]:
    """``stages`` with weights, gradients and optimizer state recomputed for ``plan``.

    For plans that differ only in how state is kept (bf16 gradients, optimizer offload): the
    activations and buffers do not change, so the search re-prices only the state.
    """
    return tuple(_with_state(s, _state_bytes(s.params, plan, s.fp8_weights)) for s in stages)


def _with_state(s: StageMemory, state: StateBytes) -> StageMemory:
    return dataclasses.replace(s, weights=state.weights, gradients=state.gradients, optimizer=state.optimizer,
                               step_gradients=state.step_gradients, host=state.host)


def stage_memory(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> tuple[StageMemory, ...]:
    """Per pipeline rank: every memory term in bytes for one GPU."""
    out = []
    params = stage_params(model, plan)
    kernels = activations.kernels_for(cluster.accelerator)
    buffers, last_buffers = _buffers(model, plan, kernels)
    workspace = activations.workspace_bytes(model, plan, kernels)
    fp8 = fp8_weights(model, plan)
    for rank, chunks in enumerate(stage_blocks(model, plan)):
        state = _state_bytes(params[rank], plan, fp8[rank])
        acts, saved = _stage_activations(model, plan, rank, chunks, kernels)
        out.append(StageMemory(
            stage=rank, layers=sum(len(c) for c in chunks), params=params[rank], weights=state.weights,
            gradients=state.gradients, optimizer=state.optimizer, step_gradients=state.step_gradients,
            activations=acts, unsaved=acts - saved,
            buffers=last_buffers if rank == plan.pp - 1 else buffers,
            overhead=round(cluster.memory_overhead_gib * GIB), workspace=workspace, host=state.host,
            fp8_weights=fp8[rank],
        ))
    return tuple(out)
