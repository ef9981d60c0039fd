"""Peak memory per rank, measured (every tensor from creation to free, piper_core/validate/peak.py)
against the model's predicted peak, through the real Megatron-Core trainer: expert, data and
pipeline parallel plans of the validation model, full recompute (which runs on CPU ranks through
piper_megatron.cpu._patch_checkpoint_rng), and two families out of the probe's (RMSNorm with SwiGLU
experts, priced with the host kernels; fine-grained dropless experts), tp 2 with sequence
parallelism, and Piper's pipelined exchange
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
                                  "2r-fine-dropless-ep2-pipelined2", "2r-tp2-sp"])
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


@pytest.mark.parametrize("suite,name", [("full-fp32", "2r-ep2-mbs4"), ("full", "2r-pp2-mbs2")])
def test_global_memory_buffer_is_the_predicted_workspace(suite, name):
    """Megatron's global memory buffer, read from ``parallel_state`` after real training steps, is the
    workspace the model prices for the local spec (unfused attention: [b np, s, s] in the activation
    dtype; held through the step, so part of the measured after-step state), on every stage; and
    Transformer Engine's spec (the GPU presets) prices none."""
    import dataclasses

    from piper_core import trainers
    from piper_core.presets import load_cluster
    from piper_core.resource.predict import predict
    from piper_core.validate.cases import select
    from piper_core.validate.instrument import TrainJob, summary
    from piper_core.validate.suite import load_suite

    (case,) = select([name], suite=load_suite(suite))
    job = TrainJob(model=case.model, plan=case.plan, steps=2, warmup=1)
    stages = summary(trainers.get("megatron").run(job, timeout_s=300))["stages"]
    pred = predict(case.model, load_cluster("cpu-local"), case.plan)
    b, s = case.plan.micro_batch_size, case.model.seq_length
    expected = b * case.model.num_attention_heads * s * s * (4 if case.plan.precision == "fp32" else 2)
    assert [st["workspace_bytes"] for st in stages] == [st.workspace for st in pred.stages] == [expected] * case.plan.pp
    gpu = predict(case.model, load_cluster("dgx-h100"), dataclasses.replace(case.plan, attention_backend="flash"))
    assert all(st.workspace == 0 for st in gpu.stages)
