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
    """bf16: 2 + 4 + 12/d per parameter, the router's included (Router.reset_parameters casts its
    fp32-created weight to params_dtype), experts sharded over edp; no copy at the step (the fp32
    gradient buffer is the main gradient)."""
    plan = ParallelPlan(gpus=64, pp=4, ep=8, global_batch_size=64)  # dp 16, edp 2
    for params, mem in zip(stage_params(MIXTRAL, plan), stage_memory(MIXTRAL, plan, H100)):
        assert mem.weights == 2 * params.total
        assert mem.gradients == 4 * params.total
        assert mem.optimizer == pytest.approx(12 * params.dense / plan.dp + 12 * params.expert / plan.edp, abs=1)
        assert mem.step_gradients == 0


def test_router_weight_is_two_bytes():
    """The router adds E x h parameters per MoE layer and 2 + 4 + 12/d bytes for each, as any
    other parameter (it was priced 4 + 4 + 8/d, as if Megatron kept it in fp32)."""
    plan = ParallelPlan(gpus=8, ep=8, global_batch_size=8)
    wider = dataclasses.replace(MIXTRAL, num_experts=16)  # 8 more router rows per layer, experts / ep
    narrow, wide = stage_params(MIXTRAL, plan)[0], stage_params(wider, plan)[0]
    router_rows = 8 * MIXTRAL.hidden_size * MIXTRAL.num_layers
    assert wide.dense - narrow.dense == router_rows
    a, b = stage_memory(MIXTRAL, plan, H100)[0], stage_memory(wider, plan, H100)[0]
    expert_weights = 2 * (wide.expert - narrow.expert)
    assert b.weights - a.weights - expert_weights == 2 * router_rows


def test_fp16_and_no_distributed_optimizer():
    """fp16 gradients are 2 bytes; the optimizer's fp32 copy of them (4 bytes per parameter, all of
    them without the distributed optimizer) is made at the step (Float16OptimizerWithFloat16Params.
    _copy_model_grads_to_main_grads), beside 12 bytes of fp32 main params, m and v."""
    plan = ParallelPlan(gpus=8, ep=8, global_batch_size=8, precision="fp16", distributed_optimizer=False)
    params, mem = stage_params(MIXTRAL, plan)[0], stage_memory(MIXTRAL, plan, H100)[0]
    assert mem.gradients == 2 * params.total
    assert mem.optimizer == 12 * params.total
    assert mem.step_gradients == 4 * params.total


def test_bf16_gradients_get_an_fp32_shard_at_the_optimizer_step():
    """--grad-reduce-in-bf16 with the distributed optimizer: DistributedOptimizer.
    _copy_model_grads_to_main_grads makes ``main_grad.float()`` of the rank's shard (4 bytes per
    sharded parameter), live from the step to the next zero_grad, when the activations are free:
    the peak is the state plus the larger of the two. With offload the GPU share keeps it."""
    base = dict(gpus=64, pp=4, ep=8, global_batch_size=64)
    plan = ParallelPlan(**base, grad_reduce_in_bf16=True)
    for params, mem in zip(stage_params(MIXTRAL, plan), stage_memory(MIXTRAL, plan, H100)):
        shard = params.dense / plan.dp + params.expert / plan.edp
        assert mem.gradients == 2 * params.total
        assert mem.step_gradients == pytest.approx(4 * shard, abs=1)
        assert mem.optimizer == pytest.approx(12 * shard, abs=1)
        state = mem.weights + mem.gradients + mem.optimizer + mem.overhead
        assert mem.total == state + max(mem.activations + mem.buffers, mem.step_gradients)
    half = ParallelPlan(**base, grad_reduce_in_bf16=True, optimizer_offload_fraction=0.5)
    params, mem = stage_params(MIXTRAL, half)[0], stage_memory(MIXTRAL, half, H100)[0]
    shard = params.dense / half.dp + params.expert / half.edp
    assert mem.step_gradients == 0  # HybridDeviceOptimizer: fp32_param.grad = grad.to(fp32), kept
    assert mem.optimizer == pytest.approx(16 * shard * 0.5, abs=1)


def test_the_step_copy_sets_the_peak_when_it_outweighs_the_activations():
    """Short sequences, no distributed optimizer: the fp32 copy of every gradient (4 bytes per
    parameter) is larger than what the forward/backward holds, so it is the peak's transient term."""
    short = dataclasses.replace(MIXTRAL, num_layers=2, seq_length=128)
    plan = ParallelPlan(gpus=8, ep=8, global_batch_size=8, distributed_optimizer=False, grad_reduce_in_bf16=True)
    params, mem = stage_params(short, plan)[0], stage_memory(short, plan, H100)[0]
    assert mem.step_gradients == 4 * params.total > mem.activations + mem.buffers
    assert mem.total == mem.weights + mem.gradients + mem.optimizer + mem.overhead + 4 * params.total


def _logits(model, plan) -> int:
    """bf16 logits [s/cp, b, V/tp]."""
    return model.seq_length // plan.cp * plan.micro_batch_size * model.padded_vocab(plan.tp) // plan.tp * 2


@pytest.mark.parametrize("kw", [dict(gpus=2, pp=2, global_batch_size=8, micro_batch_size=2),
                                dict(gpus=16, tp=2, sequence_parallel=True, cp=2, pp=2, ep=2,
                                     global_batch_size=8)])
def test_last_stage_holds_the_logits_beside_the_loss(kw):
    """The output layer's bf16 logits stay alive while the cross entropy's fp32 copy is made (and
    their bf16 gradient while that copy, turned gradient, is cast back): one [s/cp, b, V/tp] 2-byte
    tensor on top of the saved activations, on the last stage only (GPTModel._postprocess,
    tensor_parallel/cross_entropy.py). A large vocabulary makes it the largest transient."""
    tiny = dataclasses.replace(load_model("tiny-moe"), vocab_size=65536)
    plan = ParallelPlan(**kw)
    first, last = stage_memory(tiny, plan, H100)
    assert last.buffers == _logits(tiny, plan) > first.buffers
    assert first.buffers == stage_memory(dataclasses.replace(tiny, vocab_size=256), plan, H100)[0].buffers


def test_bf16_grads_and_offload_move_bytes_not_lose_them():
    base = dict(gpus=64, pp=4, ep=8, global_batch_size=64)
    plain = stage_memory(MIXTRAL, ParallelPlan(**base), H100)[0]
    bf16 = stage_memory(MIXTRAL, ParallelPlan(**base, grad_reduce_in_bf16=True), H100)[0]
    off = stage_memory(MIXTRAL, ParallelPlan(**base, grad_reduce_in_bf16=True, optimizer_offload_fraction=1.0), H100)[0]
    assert bf16.gradients < plain.gradients and bf16.optimizer == plain.optimizer and bf16.step_gradients > 0
    assert off.optimizer == 0 and off.host > 0 and off.total < bf16.total
    # the host holds 16 bytes per offloaded parameter (12 optimizer + 4 gradient copy), none stays
    assert off.host == pytest.approx(plain.optimizer * 16 / 12, abs=1) and off.step_gradients == 0


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


def test_search_prices_the_step_copy_as_predict_does():
    """The search's shared memory pricing (_Memory) gives each plan predict's peak, also where the
    step's fp32 gradient copy is the peak's transient term."""
    short = dataclasses.replace(MIXTRAL, num_layers=2, seq_length=128)
    space = dataclasses.replace(SMALL, distributed_optimizer=(False,), memory_savers=((True, 0.0),))
    result = search(short, H100, 8, 8, space=space)
    assert result.scored
    for scored in result.scored:
        p = predict(short, H100, scored.plan)
        assert scored.plan.grad_reduce_in_bf16
        assert scored.peak_bytes == p.peak_stage.total
        assert p.peak_stage.step_gradients > p.peak_stage.activations + p.peak_stage.buffers


def test_full_recompute_uniform_and_block_layouts():
    """uniform n=2 over 4 layers: 2 group inputs + one rebuilt group of 2; block n=2: 2 single-layer
    checkpoints + 2 layers kept whole + one rebuilt layer (TransformerBlock._checkpointed_forward).
    On the last stage (pp 1 here) the rebuilt group and what the loss and output layer keep are never
    held together: their backward frees the latter before the last group is rebuilt (measured:
    docs/validation.md, 2r-ep2-rc-full, +13.5 % while both were counted)."""
    from piper_core.resource import activations
    from piper_core.resource.memory import stage_memory as mem

    tiny = load_model("tiny-moe")  # 4 MoE layers
    base = dict(gpus=1, global_batch_size=1, recompute="full", recompute_num_layers=2)
    none = ParallelPlan(gpus=1, global_batch_size=1)
    cpu = load_cluster("cpu-local")
    k = activations.kernels_for(cpu.accelerator)  # the host kernels (RMSNorm keeps fp32 copies)
    layer = activations.layer_activation_bytes(tiny, none, moe=True, kernels=k)
    ckpt = activations.layer_activation_bytes(tiny, ParallelPlan(**base), moe=True, recomputed=True, kernels=k)
    embedding = activations.embedding_activation_bytes(tiny, none, kernels=k)
    output = activations.output_activation_bytes(tiny, none, kernels=k)
    uniform = mem(tiny, ParallelPlan(**base, recompute_method="uniform"), cpu)[0].activations
    block = mem(tiny, ParallelPlan(**base, recompute_method="block"), cpu)[0].activations
    assert output < layer  # the rebuilt group is the larger of the two
    assert uniform == 2 * ckpt + embedding + 2 * layer
    assert block == 2 * ckpt + 2 * layer + embedding + layer
    # a vocabulary large enough that the loss keeps more than a rebuilt group: the loss's bytes count
    wide = dataclasses.replace(tiny, vocab_size=tiny.vocab_size * 32)
    out_wide = activations.output_activation_bytes(wide, none, kernels=k)
    assert out_wide > 2 * layer
    assert mem(wide, ParallelPlan(**base, recompute_method="uniform"), cpu)[0].activations == \
        2 * ckpt + activations.embedding_activation_bytes(wide, none, kernels=k) + out_wide
