"""Peak memory per rank, measured (every tensor from creation to free, piper_core/validate/peak.py)
against the model's predicted peak, through the real Megatron-Core trainer: expert, data and
pipeline parallel plans of the validation model, full recompute (which runs on CPU ranks through
piper_megatron.cpu._patch_checkpoint_rng), and two families out of the probe's (RMSNorm with SwiGLU
experts, priced with the host kernels; fine-grained dropless experts), and Piper's pipelined exchange
(whose moe_alltoall keeps each chunk's expert output until backward: the model's
``pipelined.expert_output``; without it 2r-fine-dropless-ep2-pipelined2 was -8.4 % in the fp32 suite),
within the 5 % acceptance limit (issue 15)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

LIMIT = 0.05


@pytest.mark.parametrize("name", ["2r-ep2-mbs2", "2r-ep1-mbs2", "2r-pp2-mbs2", "2r-ep2-rc-full",
                                  "2r-rms-swiglu-ep2", "2r-fine-dropless-ep2", "2r-ep2-pipelined2",
                                  "2r-fine-dropless-ep2-pipelined2"])
def test_measured_peak_is_the_predicted_peak(name):
    from piper_core.presets import load_cluster
    from piper_core.resource.predict import predict
    from piper_core.validate.cases import select
    from piper_core.validate.peak import measure_peak

    (case,) = select([name])
    row = measure_peak(case, predict(case.model, load_cluster("cpu-local"), case.plan), timeout_s=300)
    assert len(row.measured) == case.plan.pp
    # the model state after a step (weights, fp32 gradient buffers, Adam's master copy and moments)
    assert abs(row.state_error) <= LIMIT, row
    # the peak: state plus the largest of the activations in flight and the step's temporaries
    assert abs(row.error) <= LIMIT, row
    assert all(p > s for p, s in zip(row.measured, row.measured_state))
