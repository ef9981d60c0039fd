"""The instrumented CPU trainer (piper_megatron.train) that `piper validate` and `make run` build on.

Two real gloo ranks train a small LayerNorm MoE model with Megatron-Core (GPTModel, DDP, the 1F1B
schedule) and Piper's dispatcher, expert, pipeline or tensor (with sequence) parallel, and pipeline
parallel with a multi-token-prediction layer on the last stage. Checked: the parameters each pipeline rank holds equal Piper's
count exactly; parameters plus the activation peak the saved-tensor hooks see are within 5 % of
the model's weights plus in-flight activations; the loss falls; the trace reports the MoE phases; bad plans are
refused with a message naming the key.
"""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.errors import SpecError
from piper_core.resource.memory import stage_memory
from piper_core.resource.params import stage_params
from piper_core.presets import load_cluster
from piper_core.specs.parallel import ParallelPlan
from piper_core.validate.cases import VAL_MODEL

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

MODEL = dataclasses.replace(VAL_MODEL, name="train-test", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                            moe_ffn_hidden_size=64, seq_length=64, vocab_size=256)
# one MTP layer (a MoE layer, as the last decoder layer is) with its embedding copy on the last stage
MTP_MODEL = dataclasses.replace(MODEL, name="train-test-mtp", mtp_num_layers=1)


@pytest.fixture(scope="module", params=["ep2", "pp2", "tp2", "pp2-mtp"])
def trained(request):
    from piper_megatron.train import TrainJob, run, summary

    fields = {"ep2": dict(ep=2, micro_batch_size=2), "pp2": dict(pp=2, micro_batch_size=1),
              "tp2": dict(tp=2, sequence_parallel=True, micro_batch_size=2),
              "pp2-mtp": dict(pp=2, micro_batch_size=1)}[request.param]
    model = MTP_MODEL if request.param.endswith("mtp") else MODEL
    plan = ParallelPlan(gpus=2, global_batch_size=8, distributed_optimizer=False, attention_backend="unfused", **fields)
    reports = run(TrainJob(model=model, plan=plan, steps=4, warmup=1), timeout_s=300)
    return model, plan, reports, summary(reports)


def test_parameters_per_stage_equal_pipers_count(trained):
    model, plan, reports, _ = trained
    want = stage_params(model, plan)
    for r in reports:
        assert r["params"] == want[r["pp_rank"]].total


def test_parameter_plus_activation_memory_is_within_5_percent_of_the_model(trained):
    """The issue's memory check. Activations alone within 10 %: with ep the routed rows follow the
    (untrained, skewed) router of this small model, which the model prices by its skew assumption."""
    model, plan, _, s = trained
    predicted = stage_memory(model, plan, load_cluster("cpu-local"))
    for stage, measured in zip(predicted, s["stages"]):
        got = measured["activation_peak_bytes"]
        assert got == pytest.approx(stage.activations, rel=0.10), (stage.stage, got, stage.activations)
        both = got + measured["param_bytes"]
        assert both == pytest.approx(stage.activations + stage.weights, rel=0.05), (stage.stage, both)


def test_the_model_learns_and_the_moe_phases_are_traced(trained):
    _, plan, reports, s = trained
    assert len(s["losses"]) == 4 and s["losses"][-1] < s["losses"][0]
    assert all(len(r["step_s"]) == 4 and min(r["step_s"]) > 0 for r in reports)
    phases = reports[0]["moe_phases_ms_per_step"]
    layers_here = 2 // plan.pp
    assert phases["calls"] == layers_here * plan.num_microbatches  # one record per MoE layer forward
    assert phases["expert"] > 0


def test_plans_the_cpu_trainer_cannot_run_are_refused():
    from piper_megatron.train import TrainJob

    plan = ParallelPlan(gpus=2, global_batch_size=8, ep=2, distributed_optimizer=True, optimizer_offload_fraction=0.5)
    with pytest.raises(SpecError, match="optimizer_offload_fraction=0.5: the CPU trainers run no optimizer offload"):
        TrainJob(model=MODEL, plan=plan)
    with pytest.raises(SpecError, match="steps"):
        TrainJob(model=MODEL, plan=dataclasses.replace(plan, optimizer_offload_fraction=0.0), steps=1, warmup=1)


def test_experts_split_over_tp_or_whole_train_the_same_losses():
    """tp 2 with sequence parallelism on 4 ranks, experts split over the tp ranks (etp 2, Megatron's
    default) or whole on each (etp 1): the same model (Megatron initialises each master weight whole,
    then splits it) on the same data, so the same losses; the ranks hold what
    Piper counts for each (the trainer passes etp to Megatron's parallel state)."""
    from piper_megatron.train import TrainJob, run, summary

    losses = {}
    for etp in (2, 1):
        plan = ParallelPlan(gpus=4, tp=2, sequence_parallel=True, ep=2, etp=etp, micro_batch_size=2,
                            global_batch_size=8, distributed_optimizer=False, attention_backend="unfused")
        reports = run(TrainJob(model=MODEL, plan=plan, steps=3, warmup=1), timeout_s=300)
        assert {r["params"] for r in reports} == {stage_params(MODEL, plan)[0].total}
        losses[etp] = summary(reports)["losses"]
    assert stage_params(MODEL, dataclasses.replace(plan, etp=2))[0].total < stage_params(MODEL, plan)[0].total
    # 5e-4: the split expert GEMMs sum in another order, and a router score that moves by rounding can
    # swap a token's expert at capacity (6.6e-5 measured on the first step's loss of 5.56 on an AMD
    # EPYC copy of the machine; 1.3e-4 on the third step's loss on an Intel Xeon copy, 2026-12-07, with
    # the code that passed 1e-4 on the AMD one)
    assert losses[2] == pytest.approx(losses[1], rel=5e-4) and losses[1][-1] < losses[1][0]
