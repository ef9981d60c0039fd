"""The interleaved pipeline schedule (vpp) in Piper's CPU trainer: the same model (weights seeded by
their global names, tests/megatron/seeded_ranks.py) trained on one rank and at pp 4 x vpp 2 gives
the same losses; each rank holds the parameters Piper counts for its two chunks, and its peak tensor
memory is the predicted one; pp 2 with vpp is refused before any process starts (gloo pairs the two
ranks' forward and backward messages out of order there)."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.errors import SpecError
from piper_core.specs.parallel import ParallelPlan
from piper_core.validate.cases import VAL_MODEL

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

MODEL = dataclasses.replace(VAL_MODEL, name="vpp-test", num_layers=8, hidden_size=64, num_attention_heads=4,
                            ffn_hidden_size=128, moe_ffn_hidden_size=64, seq_length=64, vocab_size=256)


def _plan(**fields) -> ParallelPlan:
    return ParallelPlan(global_batch_size=8, micro_batch_size=1, distributed_optimizer=False,
                        attention_backend="unfused", precision="fp32", **fields)


def _train(plan: ParallelPlan, **job):
    from piper_core.validate.instrument import TrainJob, launch, summary

    reports = launch("tests.megatron.seeded_ranks:rank_main", TrainJob(model=MODEL, plan=plan, **job),
                     nodes=1, inter_node_mbit=None, timeout_s=300, realtime=False)
    return reports, summary(reports)


def test_interleaved_pipeline_trains_the_one_rank_losses():
    from piper_core.resource.params import stage_params

    _, one = _train(_plan(gpus=1), steps=4, warmup=1)
    plan = _plan(gpus=4, pp=4, vpp=2)
    reports, vpp = _train(plan, steps=4, warmup=1)
    assert vpp["losses"] == pytest.approx(one["losses"], rel=1e-6) and one["losses"][-1] < one["losses"][0]
    want = stage_params(MODEL, plan)
    assert [r["params"] for r in sorted(reports, key=lambda r: r["pp_rank"])] == [p.total for p in want]


def test_interleaved_pipeline_peak_is_the_predicted_peak():
    from piper_core.presets import load_cluster
    from piper_core.resource.predict import predict
    from piper_core.validate.peak import peak_row
    from piper_core.validate.suite import Case

    plan = _plan(gpus=4, pp=4, vpp=2)
    _, s = _train(plan, steps=2, warmup=1, memory=True)
    case = Case(name="vpp", group="vpp", model=MODEL, plan=plan)
    row = peak_row(case, predict(MODEL, load_cluster("cpu-local"), plan), s)
    assert abs(row.error) <= 0.05, row


def test_pp2_with_vpp_is_refused():
    from piper_megatron.train import TrainJob, run

    with pytest.raises(SpecError, match="vpp.*pp >= 3"):
        run(TrainJob(model=MODEL, plan=_plan(gpus=2, pp=2, vpp=2)), timeout_s=1)
