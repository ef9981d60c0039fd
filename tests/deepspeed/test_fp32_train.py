"""fp32 training through DeepSpeed (a config with neither ``bf16`` nor ``fp16`` enabled, DeepSpeed's
default) with Piper's block and MoE layer, on gloo CPU processes.

* Planning: :func:`piper_deepspeed.plan_for` prices an fp32 config's plans in fp32 (searched or pinned),
  a bf16 config's in bf16 (either spelling of DeepSpeed's key), and says so for fp32.
* The validation trainer's config (:func:`piper_deepspeed.measure.ds_config`): a ``bf16`` block for
  bf16 plans only; fp16 refused.
* Two ranks train the fp32 plan as the validation trainer does (ep 2, ZeRO 0, torch's Adam, Piper's
  MoE layer): fp32 parameters, the engine steps torch's Adam on the parameters themselves (no
  BF16/FP16 optimizer wrapper, no master copy: m and v are the whole state), the loss falls.
* The same plan under the tensor ledger: the peak is the model's fp32 peak within 5 %, and between
  steps the live state lacks exactly the gradients (freed after each step at ZeRO 0), not a master copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from piper_core.errors import SpecError
from tests.deepspeed import trainer_engine
from tests.gloo import run_ranks

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

LIMIT = 0.05
STEPS = 4
CONFIG = {"train_batch_size": 8, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
          "piper": {"cluster": "cpu-local", "model": "tiny-moe"}}


def _job(precision: str) -> Any:
    from piper_core.validate.cases import select
    from piper_core.validate.instrument import TrainJob

    (case,) = select(["ds-2r-ep2-mbs2"])
    return TrainJob(model=case.model, plan=dataclasses.replace(case.plan, precision=precision), steps=STEPS)


# ---- planning and the trainer's config ------------------------------------------------------------

def test_an_fp32_config_is_planned_in_fp32_and_a_bf16_one_in_bf16():
    from piper_deepspeed.initialize import node_topology, plan_for, report, rewrite_config

    def planned(config: dict[str, Any]) -> Any:
        return plan_for(config, 2)

    fp32 = planned(CONFIG)
    assert {p.plan.precision for p in fp32.top} == {"fp32"}
    assert {p.plan.precision for p in planned(CONFIG | {"bf16": {"enabled": True}}).top} == {"bf16"}
    assert planned(CONFIG | {"bfloat16": {"enabled": True}}).plan.precision == "bf16"  # DeepSpeed's old spelling
    assert planned(CONFIG | {"bf16": {"enabled": False}}).plan.precision == "fp32"
    pinned = CONFIG | {"piper": CONFIG["piper"] | {"plan": {"ep": 2, "mbs": 2}}}
    assert planned(pinned).plan.precision == "fp32"
    assert planned(pinned | {"bf16": {"enabled": True}}).plan.precision == "bf16"
    # priced as fp32 at ZeRO 0: 4-byte weights, Adam's m and v without a master copy
    stage = planned(pinned).prediction.stages[0]
    assert stage.weights == 4 * stage.params.total and stage.optimizer == pytest.approx(8 * stage.params.total, abs=1)

    def printed(config: dict[str, Any]) -> str:
        choice = planned(config)
        _, changes = rewrite_config(config, choice)
        return report(choice, changes, config, topology=node_topology(choice.prediction.cluster, 2))

    note = "piper: note: this config trains in fp32 (neither bf16 nor fp16 enabled): planned for fp32"
    assert note in printed(CONFIG)
    assert "fp32" not in printed(CONFIG | {"bf16": {"enabled": True}})


def test_the_trainer_config_has_a_bf16_block_for_bf16_only():
    from piper_deepspeed.measure import TRAINER, ds_config

    fp32 = ds_config(_job("fp32"))
    assert not {"bf16", "bfloat16", "fp16"} & set(fp32)
    assert ds_config(_job("bf16"))["bf16"] == {"enabled": True}
    with pytest.raises(SpecError, match="precision='fp16': the DeepSpeed trainer runs bf16 mixed precision and fp32"):
        ds_config(_job("fp16"))
    with pytest.raises(SpecError, match="precision='fp16'"):  # the launcher checks before any process starts
        TRAINER.run(_job("fp16"))
    sharded = dataclasses.replace(_job("fp32"), plan=dataclasses.replace(_job("fp32").plan, distributed_optimizer=True))
    with pytest.raises(SpecError, match="distributed_optimizer=True: the DeepSpeed trainer runs ZeRO stage 0"):
        ds_config(sharded)


# ---- training on two ranks ------------------------------------------------------------------------

def _train_fp32(rank: int, world: int, job_json: dict[str, Any]) -> dict[str, Any]:
    """The validation trainer's engine (piper_deepspeed.measure), inspected after STEPS steps."""
    import torch

    from piper_deepspeed.builder import lm_loss

    job, engine = trainer_engine(job_json)
    g = torch.Generator().manual_seed(job.seed + rank)
    plan, s = job.plan, job.model.seq_length
    batches = [torch.randint(0, job.model.vocab_size, (plan.micro_batch_size, s + 1), generator=g)
               for _ in range(plan.num_microbatches)]  # the same every step, as the trainer's
    losses = []
    for _ in range(job.steps):
        total = 0.0
        for batch in batches:
            loss = lm_loss(engine(batch[:, :-1]), batch[:, 1:], aux_loss_coeff=0.0)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / plan.num_microbatches)
    params = list(engine.module.parameters())
    inner = engine.optimizer
    held = [p for group in inner.param_groups for p in group["params"]]
    state = [t for p in held for t in inner.state[p].values() if torch.is_tensor(t) and t.dim() > 0]
    return {"losses": losses, "dtypes": sorted({str(p.dtype) for p in params}),
            "optimizer": type(inner).__module__ + "." + type(inner).__qualname__,
            # the same tensors (DeepSpeed-MoE groups expert and dense parameters apart, so not in order)
            "steps_the_parameters": len(held) == len(params) and {id(p) for p in held} == {id(p) for p in params},
            "state_bytes": sum(t.numel() * t.element_size() for t in state),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "moe": sorted({type(m).__name__ for m in engine.moe_layers}),
            "precision": (engine.bfloat16_enabled(), engine.fp16_enabled())}


def test_two_ranks_train_fp32_with_adam_on_the_parameters():
    results = run_ranks(2, _train_fp32, _job("fp32").to_json(), timeout_s=300)
    for r in results:
        assert r["precision"] == (False, False)
        assert r["dtypes"] == ["torch.float32"]
        assert r["moe"] == ["PiperMOELayer"]
        # torch's Adam(W) itself ("torch_adam"; DeepSpeed's Adam is AdamW unless adam_w_mode is false), not
        # DeepSpeed's BF16_Optimizer/FP16_Optimizer wrapper with its fp32 master copies
        assert r["optimizer"] in ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW"), r["optimizer"]
        assert r["steps_the_parameters"], "Adam must step the engine's own fp32 parameters (no master copy)"
        assert r["state_bytes"] == 2 * r["param_bytes"]  # Adam's m and v, fp32
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][-1] < r["losses"][0], r["losses"]


def test_measured_fp32_peak_is_the_predicted_peak_without_a_master_copy():
    from piper_core.presets import load_cluster
    from piper_core.resource.predict import predict
    from piper_core.validate.cases import select
    from piper_core.validate.peak import measure_peak

    (case,) = select(["ds-2r-ep2-mbs2"])
    case = dataclasses.replace(case, plan=dataclasses.replace(case.plan, precision="fp32"))
    pred = predict(case.model, load_cluster("cpu-local"), case.plan)
    row = measure_peak(case, pred, timeout_s=300)
    assert abs(row.error) <= LIMIT, row
    # At ZeRO 0 DeepSpeed frees the fp32 gradients after each step, so the live state between steps is
    # the weights and Adam's m and v, which the comparison prices (gradients_after_step=False); a master
    # copy would add as many bytes as the weights (+33 %).
    assert abs(row.state_error) <= 0.01, row
    assert pred.stages[0].weights / row.measured_state[0] > 0.3  # what a master copy would add

