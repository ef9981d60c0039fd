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
    ({"pp": 2, "ep": 1}, "measures pp = cp = tp = etp = 1 plans"),
    ({"tp": 2, "sequence_parallel": True, "ep": 1}, "measures pp = cp = tp = etp = 1 plans"),
    ({"attention_backend": "unfused"}, "scaled_dot_product_attention.*set attention_backend=flash"),
])
def test_refuses_what_it_cannot_measure_before_launching(plan, message) -> None:
    with pytest.raises(SpecError, match=message):
        run(_job(**plan), timeout_s=1)


def _jobs_in_one_process(rank: int, world: int) -> dict:
    """Three DeepSpeed jobs in turn in one process, as the host-overhead probe trains them."""
    import dataclasses

    from torch.distributed.distributed_c10d import _world

    from piper_deepspeed.measure import _train
    from tests.deepspeed import deepspeed_comm

    deepspeed_comm()
    job = dataclasses.replace(_job(a2a="flat", a2a_chunks=2), steps=1, warmup=0, forward_steps=0, sync_grads=False)
    before = len(_world.pg_map)
    counts, losses = [], []
    for j in (job, dataclasses.replace(job, stock=True), job):
        losses.append(_train(j)["losses"][0])
        counts.append(len(_world.pg_map))
    return {"before": before, "counts": counts, "losses": losses}


def test_each_job_destroys_its_groups_and_the_next_builds_its_own() -> None:
    """The probe's DeepSpeed jobs leaked Piper's three all-to-all groups per job; destroying them with
    torch's call alone would leave DeepSpeed's cached expert groups dead for the next job. Every job
    ends with the groups it started with, and the second Piper job still trains (same first loss)."""
    from tests.gloo import run_ranks

    for r in run_ranks(2, _jobs_in_one_process):
        assert r["counts"] == [r["before"]] * 3, r
        assert abs(r["losses"][0] - r["losses"][2]) < 1e-6 and abs(r["losses"][0] - r["losses"][1]) < 1e-2, r
