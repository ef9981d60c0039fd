"""The GEMM check's pure half (piper_core/validate/gemms.py): shapes read from the profiler's rows, summed
by shape, and priced; the run itself is in tests/megatron/test_validate_gemms.py."""

from __future__ import annotations

import pytest

from piper_core.presets import load_cluster
from piper_core.validate import gemms


def test_shapes_are_read_from_each_products_inputs():
    assert gemms.shape_of("aten::mm", [[128, 64], [64, 256]]) == (1, 128, 64, 256)
    assert gemms.shape_of("aten::addmm", [[256], [128, 64], [64, 256], [], []]) == (1, 128, 64, 256)
    assert gemms.shape_of("aten::bmm", [[8, 128, 32], [8, 32, 128]]) == (8, 128, 32, 128)
    assert gemms.shape_of("aten::baddbmm", [[8, 128, 128], [8, 128, 32], [8, 32, 128], [], []]) == (8, 128, 32, 128)


def test_rows_of_one_shape_are_summed_and_other_ops_ignored():
    rows = [("aten::mm", "[[128, 64], [64, 256]]", 10, 0.002), ("aten::addmm", "[[256], [128, 64], [64, 256], [], []]", 10,
                                                                 0.004),
            ("aten::bmm", "[[8, 128, 32], [8, 32, 128]]", 4, 0.001), ("aten::add", "[[3], [3]]", 99, 1.0),
            ("aten::mm", "[[1, 1], [1, 1]]", 0, 0.0)]
    out = gemms.group(rows, steps=2)
    assert [(r["batch"], r["m"], r["k"], r["n"]) for r in out] == [(1, 128, 64, 256), (8, 128, 32, 128)]
    first = out[0]
    assert first["calls"] == 20 and first["calls_per_step"] == 10
    assert first["measured_us"] == pytest.approx(300.0) and first["flop"] == 2 * 128 * 64 * 256
    assert out[1]["measured_us"] == pytest.approx(250.0)


def test_the_price_is_the_models_gemm_time():
    from piper_core.timing.compute import core_attention_gemm_time, gemm_time

    cluster = load_cluster("cpu-local")
    acc = cluster.accelerator
    assert gemms.priced_us(cluster, "fp32", 1, 128, 64, 256) == pytest.approx(1e6 * gemm_time(acc, "fp32", 128, 256, 64))
    assert gemms.priced_us(cluster, "fp32", 8, 128, 32, 128) == \
        pytest.approx(1e6 * core_attention_gemm_time(acc, "fp32", 128, 128, 32, batch=8))


@pytest.mark.parametrize("argv, match", [
    (["no-such-case", "--profile", "cpu-local"], "case='no-such-case': is not a case of suite full-fp32"),
    (["2r-ep2-mbs2", "--profile", "cpu-local", "--steps", "1"], "--steps=1: must be at least 2"),
    (["emu2x1-ep2", "--profile", "cpu-local"], "case='emu2x1-ep2': runs on emulated nodes"),
    (["2r-ep2-mbs2"], "case and --profile='2r-ep2-mbs2': are required to measure"),
    (["--report", "/nonexistent.json"], "--report /nonexistent.json: not a result this tool wrote"),
])
def test_bad_arguments_exit_2_naming_them(argv, match, capsys):
    assert gemms.main(argv) == 2
    assert match in capsys.readouterr().err
