"""fp32 training as a plan precision: what Megatron runs with neither --bf16 nor --fp16 (and what a
CPU without bf16 instructions trains in), priced, searched, exported, calibrated and validated."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.calibrate.api import parse_topology, split_framework, split_precision
from piper_core.calibrate.assemble import fit_accelerator
from piper_core.calibrate.steps import Topology, gemm_shapes, plan_steps
from piper_core.errors import SpecError
from piper_core.export import deepspeed_config, parallel_flags
from piper_core.presets import load_cluster, load_model
from piper_core.resource.activations import HOST_KERNELS, embedding_activation_bytes, layer_activation_terms
from piper_core.resource.memory import stage_memory
from piper_core.resource.params import stage_params
from piper_core.resource.predict import predict
from piper_core.scheduler.search import search
from piper_core.scheduler.space import SearchSpace
from piper_core.specs import ParallelPlan
from piper_core.timing.compute import gemm_time
from piper_core.timing.layer import layer_cost, shape_of
from piper_core.timing.step import step_time
from piper_core.validate.suite import load_suite

MIXTRAL = load_model("mixtral-8x7b")
H100 = load_cluster("dgx-h100")
CPU = load_cluster("cpu-local")


def _plan(precision: str, **kw) -> ParallelPlan:
    return ParallelPlan(gpus=64, pp=4, ep=8, global_batch_size=64, precision=precision, **kw)


@pytest.mark.parametrize("dist_opt", [True, False])
def test_state_is_four_byte_weights_and_gradients_and_adam_moments_only(dist_opt):
    """FP32Optimizer / the distributed optimizer's views of fp32 params: no master copy (8 bytes of
    m and v per sharded parameter, not 12), no gradient copy at the step."""
    plan = _plan("fp32", distributed_optimizer=dist_opt)
    for params, mem in zip(stage_params(MIXTRAL, plan), stage_memory(MIXTRAL, plan, H100)):
        shard = params.dense / plan.dp + params.expert / plan.edp if dist_opt else params.total
        assert mem.weights == 4 * params.total
        assert mem.gradients == 4 * params.total
        assert mem.optimizer == pytest.approx(8 * shard, abs=1)
        assert mem.step_gradients == 0


def test_activations_double_where_they_are_in_the_activation_dtype():
    """Every term in the activation dtype doubles; fp32 terms (softmaxes, lse) and int64 ids stay;
    the host kernels' dropout masks and norm statistics (kept in the activation dtype) double too."""
    small = dataclasses.replace(MIXTRAL, num_layers=4, hidden_dropout=0.1)
    bf16, fp32 = (ParallelPlan(gpus=8, ep=8, global_batch_size=8, precision=p, attention_backend="unfused")
                  for p in ("bf16", "fp32"))  # Megatron-Core's CPU path
    a = layer_activation_terms(small, bf16, moe=True, kernels=HOST_KERNELS)
    b = layer_activation_terms(small, fp32, moe=True, kernels=HOST_KERNELS)
    assert b["mlp.input"] == 2 * a["mlp.input"]
    assert b["attn_bda.dropout_mask"] == 2 * a["attn_bda.dropout_mask"]
    assert b["input_norm.stats"] == 2 * a["input_norm.stats"]
    assert b["router.softmax"] == a["router.softmax"]  # fp32 either way
    assert b["core_attn.softmax"] == 2 * a["core_attn.softmax"]
    gpu_a = embedding_activation_bytes(small, bf16)
    gpu_b = embedding_activation_bytes(small, fp32)
    assert gpu_a == gpu_b  # CUDA keeps a bool dropout mask and int64 ids in either precision


def test_exchanges_collectives_and_gemms_move_four_byte_elements():
    plan_b, plan_f = _plan("bf16"), _plan("fp32")
    cb = layer_cost(MIXTRAL, shape_of(plan_b), H100, True)
    cf = layer_cost(MIXTRAL, shape_of(plan_f), H100, True)
    assert 1.8 * cb.a2a_raw < cf.a2a_raw < 2 * cb.a2a_raw  # twice the bytes, the same latency terms
    # a memory-bound GEMM takes twice as long; a compute-bound one runs at the fp32 peak
    acc = H100.accelerator
    assert gemm_time(acc, "fp32", 8, 8, 65536) - acc.kernel_latency_us * 1e-6 == pytest.approx(
        2 * (gemm_time(acc, "bf16", 8, 8, 65536) - acc.kernel_latency_us * 1e-6), rel=1e-6)
    tb, tf = step_time(MIXTRAL, plan_b, H100), step_time(MIXTRAL, plan_f, H100)
    assert tf.step > 3 * tb.step  # fp32 peak is 67 TFLOPS on an H100 SXM, bf16 989 (dense)
    assert tf.data_parallel >= tb.data_parallel  # 4-byte gradients either way, 4-byte weight gathers


def test_offload_and_bf16_reduction_are_refused_and_left_out_of_the_search():
    with pytest.raises(SpecError, match="optimizer_offload_fraction.*fp32"):
        _plan("fp32", optimizer_offload_fraction=1.0)
    with pytest.raises(SpecError, match="grad_reduce_in_bf16"):
        _plan("fp32", grad_reduce_in_bf16=True)
    small = dataclasses.replace(MIXTRAL, num_layers=8)
    space = SearchSpace(tp=(1, 2), pp=(1, 2), vpp=(1,), cp=(1,), ep=(1, 8), mbs=(1,), precision="fp32")
    result = search(small, H100, 64, 256, space=space)
    assert result.scored and all(s.plan.precision == "fp32" for s in result.scored)
    assert not any(s.plan.grad_reduce_in_bf16 or s.plan.optimizer_offload_fraction for s in result.scored)


def test_exports_say_fp32_as_the_frameworks_do():
    """Megatron trains in fp32 without --bf16/--fp16 (there is no --fp32 flag); DeepSpeed without a
    bf16/fp16 block."""
    small = dataclasses.replace(MIXTRAL, num_layers=8)
    plan = ParallelPlan(gpus=8, ep=8, global_batch_size=8, precision="fp32")
    p = predict(small, H100, plan)
    flags = {f for f, _ in parallel_flags(small, plan)}
    assert not flags & {"--bf16", "--fp16", "--fp32"}
    assert "--bf16" in {f for f, _ in parallel_flags(small, dataclasses.replace(plan, precision="bf16"))}
    config = deepspeed_config(p)
    assert "bf16" not in config and "fp16" not in config and "fp32" not in config
    assert "bf16" in deepspeed_config(predict(small, H100, dataclasses.replace(plan, precision="bf16")))


def test_calibration_in_fp32_fits_the_curve_and_probes_in_fp32():
    shapes = gemm_shapes(quick=True, precision="fp32")
    assert len(shapes["fp32"]) > len(shapes["bf16"]) == 2  # the curve in fp32, a few bf16 points
    acc = dataclasses.replace(CPU.accelerator, peak_tflops_bf16=0.01, peak_tflops_fp32=0.2, gemm_efficiency=0.8,
                              hbm_gb_per_s=20.0, hbm_efficiency=0.9, kernel_latency_us=15.0, gemm_half_size=0.0)
    bench = {"gemm": {d: [{"m": m, "n": n, "k": k, "seconds": gemm_time(acc, d, m, n, k)} for m, n, k in rows]
                      for d, rows in shapes.items()}}
    fitted, report = fit_accelerator(bench, CPU.accelerator, "fp32")
    assert fitted.peak_flops("fp32") * fitted.gemm_efficiency == pytest.approx(0.2e12 * 0.8, rel=1e-3)
    assert fitted.peak_flops("bf16") * fitted.gemm_efficiency == pytest.approx(0.01e12 * 0.8, rel=1e-2)
    assert "curve" in report["gemm"]["fp32"] and "curve" not in report["gemm"]["bf16"]
    steps = plan_steps(Topology(nodes=1, ranks_per_node=2), quick=True, timeout_s=60, overhead_probe=True,
                       precision="fp32")
    by = {s.name: s for s in steps}
    assert by["memory"].args[1]["dtype"] == "fp32" and by["overheads"].args[0]["precision"] == "fp32"
    bf16 = {s.name: s for s in plan_steps(Topology(nodes=1, ranks_per_node=2), quick=True, timeout_s=60,
                                          overhead_probe=True)}
    assert "dtype" not in bf16["memory"].args[1] and "precision" not in bf16["overheads"].args[0]


def test_topology_names_carry_the_precision():
    assert split_precision("local-2-deepspeed-fp32") == ("local-2-deepspeed", "fp32")
    assert split_framework("local-2-deepspeed-fp32") == ("local-2", "deepspeed")
    assert split_precision("emu-2x1-200mbit") == ("emu-2x1-200mbit", "bf16")
    assert parse_topology("emu-2x2-200mbit-fp32").world_size == 4


def test_the_fp32_suite_is_the_full_suite_in_fp32(tmp_path):
    full, fp32 = load_suite("full"), load_suite("full-fp32")
    assert [c.name for c in fp32.cases] == [c.name for c in full.cases] and len(fp32.cases) >= 28
    for a, b in zip(full.cases, fp32.cases):
        assert b.plan == dataclasses.replace(a.plan, precision="fp32")
        assert b.topology == a.topology + "-fp32"
    assert fp32.subsets == full.subsets
    bad = tmp_path / "bad.yaml"
    bad.write_text("suite: bad\nmodels_from: full\ncases_from: full\nplan_overrides: {precison: fp32}\n")
    with pytest.raises(SpecError, match="precison"):
        load_suite(bad)
    bad.write_text("suite: bad\nmodels_from: full\nplan_overrides: {precision: fp32}\n"
                   "cases: [{name: a, group: g, model: val-moe, gpus: 2, plan: {global_batch_size: 2}}]\n")
    with pytest.raises(SpecError, match="cases_from"):
        load_suite(bad)
