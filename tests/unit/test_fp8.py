"""FP8 plans (issue 16): Transformer Engine's FP8 GEMMs on a bf16 plan, as Megatron-Core runs them.

What moves: the linears' GEMMs run at the FP8 peak after quantizing their inputs; the FP8 weight
copies (and transposes) sit beside the bf16 parameters unless ``fp8_param``; the linears keep their
quantized inputs for backward. What does not: core attention, the router, the output layer,
element-wise kernels, gradients and optimizer state, the exchange's bytes, and MFU's denominator
(the dense bf16 peak, as Megatron-Bridge reports FP8 runs).
"""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.cli.parse import parse_parallel
from piper_core.errors import SpecError
from piper_core.export import deepspeed_compatible, parallel_flags, plan_label
from piper_core.presets import load_cluster, load_model
from piper_core.resource import activations
from piper_core.resource.params import stage_layer_params
from piper_core.resource.predict import predict
from piper_core.scheduler.search import search
from piper_core.scheduler.space import default_space
from piper_core.specs.parallel import ParallelPlan
from piper_core.timing.compute import (FP8_CAST_BYTES, attention_forward, gemm_time, linear_time, moe_forward,
                                       stream_time)
from piper_core.timing.layer import shape_of

H100 = load_cluster("dgx-h100")
QWEN = load_model("qwen3-30b-a3b")
BASE = "tp=1,pp=1,ep=8,mbs=1,gbs=256,dist_opt=1"


def _pair(extra: str = "", model=QWEN, cluster=H100, gpus: int = 64):
    bf16 = predict(model, cluster, parse_parallel(BASE + extra, gpus))
    fp8 = predict(model, cluster, parse_parallel(BASE + extra + ",fp8=hybrid", gpus))
    return bf16, fp8


@pytest.mark.parametrize("kwargs, message", [
    (dict(fp8="hybrid", precision="fp32"), r"fp8='hybrid': runs on a bf16 plan \(got precision fp32\).*set precision=bf16"),
    (dict(fp8="hybrid", fp8_param=True, distributed_optimizer=False), r"fp8_param=True: --fp8-param-gather needs the distributed optimizer"),
    (dict(fp8_recipe="tensorwise"), r"fp8_recipe='tensorwise': applies only to FP8 training; set fp8=hybrid"),
    (dict(fp8_param=True), r"fp8_param=True: applies only to FP8 training"),
    (dict(fp8="e5m2"), r"fp8='e5m2': must be one of \['e4m3', 'hybrid', None\]"),
])
def test_fp8_rules(kwargs, message):
    with pytest.raises(SpecError, match=message):
        ParallelPlan(gpus=8, global_batch_size=8, **kwargs)


def test_the_command_line_reads_fp8_and_none():
    plan = parse_parallel(BASE + ",fp8=e4m3,fp8_recipe=blockwise,fp8_param=1", 64)
    assert (plan.fp8, plan.fp8_recipe, plan.fp8_param) == ("e4m3", "blockwise", True)
    assert parse_parallel(BASE + ",fp8=none", 64).fp8 is None


def test_no_fp8_peak_no_fp8_plan():
    a100 = load_cluster("dgx-a100")
    assert a100.accelerator.peak_tflops_fp8 is None and H100.accelerator.peak_tflops_fp8 == 1979.0
    with pytest.raises(SpecError, match=r"accelerator.peak_tflops_fp8=None: A100-SXM4-80GB has no FP8 peak.*drop --fp8, or fp8=none"):
        predict(QWEN, a100, parse_parallel(BASE + ",fp8=hybrid", 64))


def test_the_linears_run_at_the_fp8_peak_and_the_rest_does_not_move():
    plan = parse_parallel(BASE + ",fp8=hybrid", 64)
    fp8, bf16 = shape_of(plan), dataclasses.replace(shape_of(plan), fp8=False)
    acc = H100.accelerator
    m = n = k = 8192  # compute-bound: the FP8 GEMM at the doubled peak, plus quantizing its input
    assert linear_time(acc, fp8, m, n, k) == pytest.approx(
        gemm_time(acc, "fp8", m, n, k) + stream_time(acc, FP8_CAST_BYTES * m * k), rel=1e-12)
    assert gemm_time(acc, "fp8", m, n, k) < 0.6 * linear_time(acc, bf16, m, n, k)
    proj8, core8 = attention_forward(QWEN, fp8, acc)
    proj16, core16 = attention_forward(QWEN, bf16, acc)
    assert core8 == core16 and proj8 < proj16  # core attention stays bf16
    rest8, experts8 = moe_forward(QWEN, fp8, acc)
    rest16, experts16 = moe_forward(QWEN, bf16, acc)
    assert experts8 < experts16 and rest8 == rest16  # router, permutation, norms stay as they were


def test_fp8_memory_weight_cache_and_quantized_inputs():
    bf16, fp8 = _pair()
    layer_params = stage_layer_params(QWEN, fp8.plan)
    for s16, s8, n in zip(bf16.stages, fp8.stages, layer_params):
        assert s8.weights - s16.weights == 2 * n  # the FP8 copy and its transpose of every layer weight
        assert (s8.gradients, s8.optimizer) == (s16.gradients, s16.optimizer)
        assert s8.activations < s16.activations
    param = predict(QWEN, H100, parse_parallel(BASE + ",fp8=hybrid,fp8_param=1", 64))
    assert [s.weights for s in param.stages] == [s.weights for s in bf16.stages]  # FP8 weight + transpose = 2 B
    t16 = activations.layer_activation_terms(QWEN, bf16.plan, moe=True)
    t8 = activations.layer_activation_terms(QWEN, fp8.plan, moe=True)
    for key in ("linear_qkv.input", "linear_proj.input", "experts.input", "experts.fc2_input"):
        assert t8[key] * 2 == t16[key], key
    for key in ("mlp.input", "experts.fc1_output", "input_norm.input"):  # the router's input and the rest stay bf16
        assert t8[key] == t16[key], key


def test_mfu_stays_against_the_bf16_peak_and_fp8_is_faster():
    bf16, fp8 = _pair()
    assert fp8.time.step < bf16.time.step
    assert fp8.rate.mfu == pytest.approx(fp8.flops.model / (fp8.time.step * 64 * 989.5e12), rel=1e-9)
    assert fp8.flops.model == bf16.flops.model


def test_exports_and_labels():
    plan = parse_parallel(BASE + ",fp8=hybrid,fp8_param=1", 64)
    flags = parallel_flags(QWEN, plan)
    assert ("--fp8-format", "hybrid") in flags and ("--fp8-recipe", "delayed") in flags
    assert ("--fp8-param-gather", None) in flags and ("--bf16", None) in flags
    assert all(not f.startswith("--fp8") for f, _ in parallel_flags(QWEN, parse_parallel(BASE, 64)))
    assert plan_label(plan).endswith("fp8:hybrid/delayed+param flat")
    assert "DeepSpeed-MoE's layers run no FP8 GEMMs" in deepspeed_compatible(plan)


def test_the_search_prices_fp8_memory_as_predict_does():
    """Every plan the search keeps has the peak ``predict`` gives it (the search re-prices state for
    memory savers without pricing plans from scratch: it must count the FP8 weight copies too)."""
    space = dataclasses.replace(default_space(QWEN, H100, 64), fp8="hybrid")
    result = search(QWEN, H100, 64, 1024, space=space)
    assert result.scored and all(s.plan.fp8 == "hybrid" for s in result.scored)
    for s in result.best(20):
        assert s.peak_bytes == predict(QWEN, H100, s.plan).peak_stage.total


def test_piper_plan_fp8_searches_fp8_plans_and_refuses_what_cannot_run(capsys):
    import json

    from piper_core.cli.main import main

    assert main(["plan", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "64", "--gbs", "1024", "--top", "3",
                 "--fp8", "hybrid", "--fp8-recipe", "tensorwise", "--json", "--workers", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    plans = [row["plan"] for row in out["plans"]]
    assert len(plans) == 3 and all((p["fp8"], p["fp8_recipe"]) == ("hybrid", "tensorwise") for p in plans)
    assert main(["plan", "qwen3-30b-a3b", "--cluster", "dgx-a100", "--gpus", "64", "--fp8", "hybrid"]) == 2
    assert "A100-SXM4-80GB has no FP8 peak" in capsys.readouterr().err
    assert main(["plan", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "64", "--fp8-recipe", "blockwise"]) == 2
    assert "--fp8-recipe='blockwise': applies only to FP8 training; add --fp8 hybrid" in capsys.readouterr().err
