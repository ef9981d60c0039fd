"""Megatron-Core's own distributed optimizer through the CPU trainer (piper_megatron.train): its
``get_megatron_optimizer`` with ``use_distributed_optimizer`` on gloo ranks, the optimizer state and
fp32 main parameters sharded over the data-parallel ranks (experts' over the expert data-parallel
ranks), gradients reduce-scattered and parameters all-gathered after the step.

* The same losses as the trainer's unsharded Adam, on the same model and data (fp32 and bf16, data
  and expert parallel): sharding moves where each parameter is stepped, not its update.
* The measured peak and model state per rank (every tensor from creation to free,
  piper_core/validate/peak.py) are the model's, within the 5 % acceptance limit, and smaller than
  without sharding by what the model says.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

LIMIT = 0.05


@pytest.mark.parametrize("parallel", [{"ep": 1, "precision": "fp32"}, {"ep": 2, "precision": "bf16"}])
def test_sharded_steps_train_the_same_losses_as_the_unsharded_adam(parallel):
    from piper_core.validate.cases import select
    from piper_megatron.train import TrainJob, run, summary

    (case,) = select(["2r-ep2-mbs2"])
    losses, classes = {}, {}
    for dopt in (False, True):
        plan = dataclasses.replace(case.plan, distributed_optimizer=dopt, **parallel)
        reports = run(TrainJob(model=case.model, plan=plan, steps=4, warmup=1), timeout_s=300)
        losses[dopt] = summary(reports)["losses"]
        classes[dopt] = set(reports[0]["optimizer"])
    assert classes == {False: {"FP32Adam" if parallel["precision"] == "fp32" else "MixedPrecisionAdam"},
                       True: {"DistributedOptimizer"}}
    assert losses[True] == pytest.approx(losses[False], rel=1e-6) and losses[True][-1] < losses[True][0]


@pytest.mark.parametrize("name", ["2r-ep1-dopt", "4r-ep2-dopt"])
def test_the_sharded_state_and_peak_are_the_models(name):
    from piper_core.presets import load_cluster
    from piper_core.resource.predict import predict
    from piper_core.validate.cases import select
    from piper_core.validate.peak import measure_peak

    (case,) = select([name])
    assert case.plan.distributed_optimizer and case.plan.dp > 1
    cluster = load_cluster("cpu-local")
    rows = {}
    for dopt in (True, False):
        c = dataclasses.replace(case, plan=dataclasses.replace(case.plan, distributed_optimizer=dopt))
        rows[dopt] = measure_peak(c, predict(c.model, cluster, c.plan), timeout_s=300)
        assert abs(rows[dopt].state_error) <= LIMIT and abs(rows[dopt].error) <= LIMIT, rows[dopt]
    # what sharding saves (the optimizer state and main parameters of the other data-parallel ranks)
    measured = rows[False].measured_state[0] - rows[True].measured_state[0]
    predicted = rows[False].predicted_state[0] - rows[True].predicted_state[0]
    assert predicted > 0 and measured == pytest.approx(predicted, rel=LIMIT)
