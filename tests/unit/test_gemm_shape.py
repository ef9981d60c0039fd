"""GEMM efficiency by shape (issue 15, Deliver 9): small and fine-grained expert GEMMs run below the
large-GEMM efficiency where the accelerator sets ``gemm_half_size``, unset it is the flat roofline
of before, calibration fits the knee where the data show one (and says why not where they do not),
and a bad value is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from piper_core.calibrate.assemble import fit_accelerator
from piper_core.calibrate.fit import GemmPoint, fit_roofline
from piper_core.calibrate.steps import gemm_shapes
from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.specs.cluster import AcceleratorSpec, ClusterSpec
from piper_core.specs.yamlio import dump_yaml, load_yaml
from piper_core.timing.compute import BYTES, LayerShape, attention_forward, gemm_time, mlp_forward
from piper_core.timing.gemm import gemm_efficiency, shape_size

H100 = load_cluster("dgx-h100")
FLAT_H100 = dataclasses.replace(H100.accelerator, gemm_half_size=0.0)
CPU = load_cluster("cpu-local")
# a CPU-like accelerator with a knee, to generate calibration data from
KNEED = dataclasses.replace(CPU.accelerator, peak_tflops_bf16=1.2, peak_tflops_fp32=0.2, peak_tflops_fp16=0.15,
                            gemm_efficiency=0.8, gemm_half_size=120.0, hbm_gb_per_s=20.0, hbm_efficiency=0.9,
                            kernel_latency_us=15.0)
FLAT = dataclasses.replace(KNEED, gemm_half_size=0.0)


def _busy_efficiency(acc: AcceleratorSpec, m: int, n: int, k: int) -> float:
    """Achieved share of the bf16 peak, launch latency left out."""
    busy = gemm_time(acc, "bf16", m, n, k) - acc.kernel_latency_us * 1e-6
    return 2.0 * m * n * k / busy / acc.peak_flops("bf16")


# ---- the model -----------------------------------------------------------------------------------

def test_dgx_h100_prices_a_fine_grained_expert_gemm_below_a_large_one():
    acc = H100.accelerator
    assert acc.gemm_half_size == 500.0
    small = _busy_efficiency(acc, 1024, 1408, 2048)  # tokens per expert x expert ffn x hidden
    large = _busy_efficiency(acc, 16384, 8192, 28672)
    # both compute-bound, so the flat roofline ran them at the same 70 %
    assert _busy_efficiency(FLAT_H100, 1024, 1408, 2048) == pytest.approx(0.7)
    assert _busy_efficiency(FLAT_H100, 16384, 8192, 28672) == pytest.approx(0.7)
    assert small < 0.8 * large
    s = shape_size(1024, 1408, 2048)
    assert small == pytest.approx(0.7 * s / (s + 500.0))


def test_the_knee_slows_fine_grained_experts_more_than_coarse_ones():
    model = load_model("qwen3-30b-a3b")  # 128 experts of ffn 768 at hidden 2048
    shape = LayerShape(tp=1, cp=1, ep=8, etp=1, sp=False, mbs=1, recompute="none", attention_backend="flash",
                       precision="bf16", a2a="flat", chunks=1)
    coarse = dataclasses.replace(model, moe_ffn_hidden_size=768 * 16, num_experts=8)
    ratios = {}
    for name, m in (("fine", model), ("coarse", coarse)):
        args = (m, shape)
        kw = dict(tokens=512, ffn=m.moe_ffn_hidden_size, split=1, count=m.num_experts // 8, grouped=True)
        ratios[name] = mlp_forward(*args, H100.accelerator, **kw) / mlp_forward(*args, FLAT_H100, **kw)
    assert ratios["fine"] > ratios["coarse"] > 1.0


def test_unset_knee_is_the_flat_roofline_of_before():
    """gemm_half_size 0 reproduces the old formula bit for bit, for every precision and shape."""
    rng = np.random.default_rng(0)
    for acc in (FLAT_H100, CPU.accelerator, load_cluster("dgx-a100").accelerator):
        assert acc.gemm_half_size == 0.0
        for precision in ("bf16", "fp16", "fp32"):
            for m, n, k in rng.integers(1, 20000, size=(50, 3)):
                flops = 2.0 * m * n * k
                moved = BYTES * (m * k + k * n + m * n)
                old = max(flops / (acc.peak_flops(precision) * acc.gemm_efficiency),
                          moved / (acc.hbm_gb_per_s * 1e9 * acc.hbm_efficiency)) + acc.kernel_latency_us * 1e-6
                assert gemm_time(acc, precision, m, n, k) == old


def test_a_cluster_yaml_without_the_key_loads_flat(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(dump_yaml(CPU).replace("  gemm_half_size: 0.0\n", ""))
    assert "gemm_half_size" not in path.read_text()
    assert load_yaml(ClusterSpec, path) == CPU


def test_the_knee_scales_with_the_precisions_peak():
    """fp32 (the router) pays the same knee time per byte as bf16: its knee is h x peak ratio."""
    acc = H100.accelerator
    m, n, k = 4096, 8, 4096
    s = shape_size(m, n, k)
    knee = 500.0 * acc.peak_flops("fp32") / acc.peak_flops("bf16")
    assert gemm_efficiency(acc, "fp32", m, n, k) == pytest.approx(0.7 * s / (s + knee))
    extra = [2.0 * m * n * k / acc.peak_flops(p) * (1 / gemm_efficiency(acc, p, m, n, k) - 1 / 0.7)
             for p in ("bf16", "fp32")]
    assert extra[0] == pytest.approx(extra[1])


def test_core_attention_keeps_the_flat_efficiency():
    model = load_model("mixtral-8x7b")
    shape = LayerShape(tp=1, cp=1, ep=1, etp=1, sp=False, mbs=1, recompute="none", attention_backend="flash",
                       precision="bf16", a2a="flat", chunks=1)
    proj_knee, core_knee = attention_forward(model, shape, H100.accelerator)
    proj_flat, core_flat = attention_forward(model, shape, FLAT_H100)
    assert core_knee == core_flat
    assert proj_knee > proj_flat


@pytest.mark.parametrize("value, match", [
    (-5, r"accelerator\.gemm_half_size=-5\.0: must be a finite number >= 0"),
    (".nan", r"accelerator\.gemm_half_size=nan: must be a finite number >= 0"),
    ("'big'", r"accelerator\.gemm_half_size='big': must be a number"),
])
def test_a_bad_knee_is_refused_by_name(tmp_path, value, match):
    path = tmp_path / "bad.yaml"
    path.write_text(dump_yaml(CPU).replace("  gemm_half_size: 0.0\n", f"  gemm_half_size: {value}\n"))
    with pytest.raises(SpecError, match=match) as err:
        load_yaml(ClusterSpec, path)
    assert "bad.yaml" in str(err.value)
    if value == -5:
        assert "set it to 0 for a flat efficiency" in str(err.value)


# ---- the fit -------------------------------------------------------------------------------------

def _bench(acc: AcceleratorSpec, quick: bool, noise: float = 0.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"gemm": {dtype: [{"m": m, "n": n, "k": k, "seconds": gemm_time(acc, dtype, m, n, k)
                              * (1 + noise * rng.standard_normal())} for m, n, k in rows]
                     for dtype, rows in gemm_shapes(quick).items()}}


@pytest.mark.parametrize("quick", [False, True])
def test_fit_recovers_the_knee_from_data_the_model_generates(quick):
    acc, report = fit_accelerator(_bench(KNEED, quick), CPU.accelerator)
    assert report["gemm"]["knee"] == "fitted"
    assert acc.gemm_half_size == pytest.approx(120.0, rel=1e-3)
    assert acc.peak_flops("bf16") * acc.gemm_efficiency == pytest.approx(1.2e12 * 0.8, rel=1e-3)
    assert acc.peak_flops("fp32") * acc.gemm_efficiency == pytest.approx(0.2e12 * 0.8, rel=1e-3)
    assert acc.kernel_latency_us == pytest.approx(15.0, rel=1e-3)
    for dtype in ("bf16", "fp32", "fp16"):
        assert report["gemm"][dtype]["max_rel_residual"] < 1e-3


def test_fit_finds_the_knee_through_noise():
    acc, report = fit_accelerator(_bench(KNEED, quick=False, noise=0.03, seed=3), CPU.accelerator)
    assert report["gemm"]["knee"] == "fitted"
    assert acc.gemm_half_size == pytest.approx(120.0, rel=0.3)


@pytest.mark.parametrize("noise", [0.0, 0.04])
def test_fit_leaves_data_without_a_knee_flat_and_says_why(noise):
    acc, report = fit_accelerator(_bench(FLAT, quick=False, noise=noise, seed=1), CPU.accelerator)
    assert acc.gemm_half_size == 0.0
    assert report["gemm"]["knee"].startswith("flat: ")
    assert acc.peak_flops("bf16") * acc.gemm_efficiency == pytest.approx(1.2e12 * 0.8, rel=0.1 if noise else 1e-4)


def test_a_knee_beyond_every_measured_shape_is_not_extrapolated():
    """Efficiency still rising at the largest shape: the large-GEMM rate is unknown, so flat."""
    steep = dataclasses.replace(KNEED, gemm_half_size=1e5)
    points = [GemmPoint(m=m, n=n, k=k, seconds=gemm_time(steep, "bf16", m, n, k))
              for m, n, k in gemm_shapes(quick=False)["bf16"]]
    fit = fit_roofline(points)
    assert fit.half_size == 0.0 and fit.knee.startswith("flat: ")
    assert fit.compute_flops_per_s <= 1.01 * fit.best_rate


def test_fit_without_knee_is_the_flat_roofline():
    points = [GemmPoint(m=m, n=n, k=k, seconds=gemm_time(KNEED, "bf16", m, n, k))
              for m, n, k in gemm_shapes(quick=False)["bf16"]]
    flat, kneed = fit_roofline(points, knee=False), fit_roofline(points)
    assert flat.half_size == 0.0 and flat.knee == "not fitted (knee=False)"
    assert kneed.fit.max_rel_residual < 1e-6 < flat.fit.max_rel_residual
