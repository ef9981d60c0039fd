"""`make run`'s twin: the precision it trains in, and the plan --piper makes for it."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")

from piper_megatron import twin  # noqa: E402


def test_native_bf16_reads_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu sse avx2 fma\n")
    assert not twin.native_bf16(info)
    info.write_text("flags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert twin.native_bf16(info)
    assert not twin.native_bf16(tmp_path / "missing")


def test_auto_says_why_it_trains_fp32(monkeypatch):
    monkeypatch.setattr(twin, "native_bf16", lambda: False)
    precision, why = twin.twin_precision("auto")
    assert precision == "fp32" and "no bf16 instructions" in why and "--precision bf16" in why
    monkeypatch.setattr(twin, "native_bf16", lambda: True)
    assert twin.twin_precision("auto") == ("bf16", None)
    assert twin.twin_precision("fp32") == ("fp32", None)  # asked for: no note


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_twin_is_planned_in_the_precision_it_trains_in(precision):
    """--piper plans an fp32 job (no --bf16) as fp32 training, a bf16 one as bf16."""
    from piper_megatron.args import parse_megatron_args, parse_piper_options
    from piper_megatron.install import plan_job

    flags = [*twin.twin_args(precision), "--piper", "--piper-cluster", "cpu-local"]
    assert ("--bf16" in flags) == (precision == "bf16")
    planned = plan_job(parse_megatron_args(flags), flags, parse_piper_options(flags), world_size=2,
                       limit=twin.cpu_trainer_space)
    assert planned.top.plan.precision == precision
