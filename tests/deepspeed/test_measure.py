"""``piper_deepspeed.measure``, the DeepSpeed side of ``piper validate``: the config it hands DeepSpeed
pins the plan (so Piper's initialize rewrites nothing) and it refuses plans it cannot run, before any
process starts. The run itself is exercised by ``piper validate --quick`` (tests/megatron)."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

from piper_core.errors import SpecError  # noqa: E402
from piper_core.specs.parallel import ParallelPlan  # noqa: E402
from piper_core.validate.cases import VAL_MODEL  # noqa: E402
from piper_core.validate.instrument import TrainJob  # noqa: E402
from piper_deepspeed.config import PiperConfig  # noqa: E402
from piper_deepspeed.measure import ds_config, run  # noqa: E402


def _job(**plan) -> TrainJob:
    fields = {"gpus": 2, "global_batch_size": 8, "ep": 2, "micro_batch_size": 2, "distributed_optimizer": False,
              "attention_backend": "flash"} | plan
    return TrainJob(model=VAL_MODEL, plan=ParallelPlan(**fields), steps=3, warmup=1)


def test_config_pins_the_plan_in_bf16_at_zero_0() -> None:
    cfg = ds_config(_job(a2a="hierarchical", a2a_chunks=2))
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (8, 2, 2)
    assert cfg["bf16"] == {"enabled": True} and cfg["zero_optimization"] == {"stage": 0}
    block = PiperConfig.from_block(cfg["piper"])
    assert (block.a2a, block.chunks, block.plan.ep, block.plan.mbs) == ("hierarchical", 2, 2, 2)


def test_stock_runs_deepspeeds_layer_and_tune_asks_the_block_to_tune() -> None:
    """``stock``: no block (DeepSpeed's own MoE layer, the bench-e2e baseline); ``tune``: the block's
    chunks are measured per layer at run time."""
    import dataclasses

    job = _job(a2a="flat", a2a_chunks=2)
    stock = ds_config(dataclasses.replace(job, stock=True))
    assert "piper" not in stock and {k: v for k, v in ds_config(job).items() if k != "piper"} == stock
    assert PiperConfig.from_block(ds_config(dataclasses.replace(job, tune=True))["piper"]).chunks == "tune"


@pytest.mark.parametrize(("plan", "message"), [
    ({"pp": 2, "ep": 1}, "measures pp = cp = etp = 1 plans"),
    ({"attention_backend": "unfused"}, "scaled_dot_product_attention.*set attention_backend=flash"),
])
def test_refuses_what_it_cannot_measure_before_launching(plan, message) -> None:
    with pytest.raises(SpecError, match=message):
        run(_job(**plan), timeout_s=1)
