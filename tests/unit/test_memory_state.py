"""Weights, gradients and optimizer state per GPU: exact byte counts, savers, offload."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.resource.memory import stage_memory
from piper_core.resource.params import stage_params
from piper_core.resource.predict import predict
from piper_core.scheduler.search import search
from piper_core.scheduler.space import SearchSpace
from piper_core.specs import ParallelPlan

MIXTRAL = load_model("mixtral-8x7b")
H100 = load_cluster("dgx-h100")


def test_state_bytes_follow_megatrons_table():
    """bf16: 2 + 4 + 12/d per parameter (router fp32: 4 + 4 + 8/d), experts sharded over edp."""
    plan = ParallelPlan(gpus=64, pp=4, ep=8, global_batch_size=64)  # dp 16, edp 2
    for params, mem in zip(stage_params(MIXTRAL, plan), stage_memory(MIXTRAL, plan, H100)):
        half_dense = params.dense - params.fp32
        assert mem.weights == 2 * (half_dense + params.expert) + 4 * params.fp32
        assert mem.gradients == 4 * (half_dense + params.expert) + 4 * params.fp32
        expected = 12 * half_dense / plan.dp + 8 * params.fp32 / plan.dp + 12 * params.expert / plan.edp
        assert mem.optimizer == pytest.approx(expected, abs=1)


def test_fp16_and_no_distributed_optimizer():
    plan = ParallelPlan(gpus=8, ep=8, global_batch_size=8, precision="fp16", distributed_optimizer=False)
    params, mem = stage_params(MIXTRAL, plan)[0], stage_memory(MIXTRAL, plan, H100)[0]
    half = params.total - params.fp32
    assert mem.gradients == 2 * half + 4 * params.fp32
    assert mem.optimizer == 16 * half + 8 * params.fp32


def test_bf16_grads_and_offload_move_bytes_not_lose_them():
    base = dict(gpus=64, pp=4, ep=8, global_batch_size=64)
    plain = stage_memory(MIXTRAL, ParallelPlan(**base), H100)[0]
    bf16 = stage_memory(MIXTRAL, ParallelPlan(**base, grad_reduce_in_bf16=True), H100)[0]
    off = stage_memory(MIXTRAL, ParallelPlan(**base, grad_reduce_in_bf16=True, optimizer_offload_fraction=1.0), H100)[0]
    assert bf16.gradients < plain.gradients and bf16.optimizer == plain.optimizer
    assert off.optimizer == 0 and off.host > 0 and off.total < bf16.total
    # the host holds 16 bytes per offloaded parameter (12 optimizer + 4 gradient copy)
    assert off.host == pytest.approx(plain.optimizer * 16 / 12, rel=1e-3)


def test_offload_costs_time():
    base = dict(gpus=64, pp=4, ep=8, global_batch_size=64)
    on_gpu = predict(MIXTRAL, H100, ParallelPlan(**base))
    offloaded = predict(MIXTRAL, H100, ParallelPlan(**base, optimizer_offload_fraction=1.0))
    assert offloaded.time.optimizer > on_gpu.time.optimizer


def test_offload_rules():
    with pytest.raises(SpecError, match=r"optimizer_offload_fraction=1.0: Megatron's CPU optimizer offload runs inside"):
        ParallelPlan(gpus=8, global_batch_size=8, distributed_optimizer=False, optimizer_offload_fraction=1.0)
    with pytest.raises(SpecError, match=r"grad_reduce_in_bf16=True: needs precision bf16"):
        ParallelPlan(gpus=8, global_batch_size=8, precision="fp16", grad_reduce_in_bf16=True)
    with pytest.raises(SpecError, match=r"optimizer_offload_fraction=1.5: must be in \[0, 1\]"):
        ParallelPlan(gpus=8, global_batch_size=8, optimizer_offload_fraction=1.5)


SMALL = SearchSpace(tp=(1,), pp=(1,), vpp=(1,), cp=(1,), ep=(8,), mbs=(1,), recompute=("none",),
                    distributed_optimizer=(True,), a2a=(("flat", 1, False),))
SHORT = dataclasses.replace(MIXTRAL, num_layers=8)


def _peaks(cluster, **kw):
    return predict(SHORT, cluster, ParallelPlan(gpus=8, ep=8, global_batch_size=8, **kw)).peak_stage.total


def _cluster_fitting_only_offload(**extra):
    """A cluster whose usable memory lies between the offloaded and the bf16-gradient peaks."""
    bf16 = _peaks(H100, grad_reduce_in_bf16=True)
    off = _peaks(H100, grad_reduce_in_bf16=True, optimizer_offload_fraction=1.0)
    fraction = (bf16 + off) / 2 / (H100.accelerator.hbm_gib * 2**30)
    return dataclasses.replace(H100, usable_memory_fraction=fraction, **extra)


def test_savers_are_used_only_when_needed():
    roomy = search(SHORT, H100, 64, 64, space=SMALL)
    assert roomy.scored and all(not s.plan.grad_reduce_in_bf16 for s in roomy.scored)
    tight = search(SHORT, _cluster_fitting_only_offload(), 8, 8, space=SMALL)
    assert [s.plan.optimizer_offload_fraction for s in tight.scored] == [1.0]
    assert tight.scored[0].plan.grad_reduce_in_bf16


def test_host_memory_limits_offload():
    result = search(SHORT, _cluster_fitting_only_offload(host_memory_gib_per_node=16.0), 8, 8, space=SMALL)
    assert not result.scored
    assert result.rejected["offloaded optimizer exceeds host memory"] == 1


def test_full_recompute_uniform_and_block_layouts():
    """uniform n=2 over 4 layers: 2 group inputs + one rebuilt group of 2; block n=2: 2 single-layer
    checkpoints + 2 layers kept whole + one rebuilt layer (TransformerBlock._checkpointed_forward)."""
    from piper_core.resource import activations
    from piper_core.resource.memory import stage_memory as mem

    tiny = load_model("tiny-moe")  # 4 MoE layers
    base = dict(gpus=1, global_batch_size=1, recompute="full", recompute_num_layers=2)
    none = ParallelPlan(gpus=1, global_batch_size=1)
    layer = activations.layer_activation_bytes(tiny, none, moe=True)
    ckpt = activations.layer_activation_bytes(tiny, ParallelPlan(**base), moe=True, recomputed=True)
    edges = activations.embedding_activation_bytes(tiny, none) + activations.output_activation_bytes(tiny, none)
    cpu = load_cluster("cpu-local")
    uniform = mem(tiny, ParallelPlan(**base, recompute_method="uniform"), cpu)[0].activations
    block = mem(tiny, ParallelPlan(**base, recompute_method="block"), cpu)[0].activations
    assert uniform == 2 * ckpt + 2 * layer + edges
    assert block == 2 * ckpt + 2 * layer + layer + edges
