"""What Piper's DeepSpeed builder keeps for backward, in fp32 and bf16, against the activation model.

The validation trainer's engine (piper_deepspeed.measure: val-moe, ep 2, mbs 2, ZeRO 0, no bf16
block, Piper's MoE layer) on two gloo ranks runs one micro-batch forward under the trainer's ledger
(:class:`ActivationPeak`: unique storages, parameters and the batch excluded). Its live bytes at the
end of the forward are the model's embedding + layers + output terms, the experts' terms taken at the
rows each rank's experts really received (the model prices the capacity-padded rows, which Piper's
layer does not send). What the model leaves as it is: DeepSpeed's gate keeps fp32 [T, E] tensors
where the model prices Megatron's router ([T, k]), 12 KB a layer here (0.4 %).

In bf16 DeepSpeed's gate also keeps fp32 copies of its input and weight, and nothing keeps the bf16
norm output (:func:`piper_core.resource.activations._deepspeed_builder`). Megatron-Core's CPU path
(unfused attention) is priced as before in both precisions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

from piper_core.resource.activations import (  # noqa: E402
    HOST_KERNELS,
    embedding_activation_bytes,
    layer_activation_terms,
    output_activation_bytes,
    routed_rows,
)
from tests.deepspeed import trainer_engine  # noqa: E402
from tests.gloo import run_ranks  # noqa: E402

LIMIT = 0.01


def _job(precision: str) -> Any:
    from piper_core.validate.cases import select
    from piper_core.validate.instrument import TrainJob

    (case,) = select(["ds-2r-ep2-mbs2"])
    return TrainJob(model=case.model, plan=dataclasses.replace(case.plan, precision=precision), steps=2)


def _saved_bytes(rank: int, world: int, job_json: dict[str, Any]) -> dict[str, Any]:
    """Bytes held for backward after one micro-batch's forward, the rows each MoE layer's local experts
    received, and whether the parameters hold gradients after each engine.step of one global batch."""
    import torch

    from piper_core.validate.instrument import ActivationPeak
    from piper_deepspeed.builder import lm_loss
    from piper_deepspeed.moe import moe_modules

    job, engine = trainer_engine(job_json)
    rows: dict[str, int] = {}

    def count(name: str) -> Any:
        def hook(_module: Any, args: tuple[Any, ...]) -> None:
            rows[name] += len(args[0])
        return hook

    for name, moe in moe_modules(engine.module):
        rows[name] = 0
        for expert in moe.deepspeed_moe.experts.deepspeed_experts:
            expert.register_forward_pre_hook(count(name))
    g = torch.Generator().manual_seed(job.seed + rank)
    plan, s = job.plan, job.model.seq_length
    batches = [torch.randint(0, job.model.vocab_size, (plan.micro_batch_size, s + 1), generator=g)
               for _ in range(plan.num_microbatches)]
    excluded = {t.untyped_storage().data_ptr() for t in [*engine.module.parameters(), *batches]}
    held, first, grads = None, {}, []
    for batch in batches:
        ledger = ActivationPeak(excluded)
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack):
            loss = lm_loss(engine(batch[:, :-1]), batch[:, 1:], aux_loss_coeff=0.0)
            if held is None:  # the first micro-batch
                held, first = ledger.now, dict(rows)
            engine.backward(loss)
        engine.step()
        grads.append(any(p.grad is not None for p in engine.module.parameters()))
    return {"held": held, "rows": first, "grads_after_step": grads, "microbatches": plan.num_microbatches}


def _predicted(job: Any, rows: dict[str, int]) -> float:
    """The model's bytes for one micro-batch, each MoE layer's expert terms taken at its measured rows."""
    model, plan = job.model, job.plan
    terms = layer_activation_terms(model, plan, moe=True, kernels=HOST_KERNELS)
    experts = sum(v for k, v in terms.items() if k.startswith("experts."))
    per_row = experts / routed_rows(model, plan)
    layers = sum(sum(terms.values()) - experts + per_row * r for r in rows.values())
    assert len(rows) == model.num_layers
    return embedding_activation_bytes(model, plan, kernels=HOST_KERNELS) + layers + \
        output_activation_bytes(model, plan, kernels=HOST_KERNELS)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_bytes_are_the_model_s(precision):
    job = _job(precision)
    for r in run_ranks(2, _saved_bytes, job.to_json(), timeout_s=300):
        predicted = _predicted(job, r["rows"])
        assert abs(r["held"] / predicted - 1) <= LIMIT, (r["held"], predicted, r["rows"])
        if precision == "fp32":
            # DeepSpeedEngine._take_model_step at ZeRO 0 without bf16/fp16: self.zero_grad() (param.grad =
            # None) at the accumulation boundary only, so no gradients live between steps
            assert r["grads_after_step"] == [True] * (r["microbatches"] - 1) + [False]


def test_the_fp32_builder_terms_differ_from_megatron_s_only_where_the_builder_does():
    """Megatron's modules keep the weighted expert activation and the permuted probs, a full-width RoPE
    table; the builder's MLP is unweighted and Piper's combine keeps the gathered outputs."""
    job = _job("fp32")
    model, plan = job.model, job.plan
    ds = layer_activation_terms(model, plan, moe=True, kernels=HOST_KERNELS)
    megatron = layer_activation_terms(model, plan, moe=True, kernels=dataclasses.replace(HOST_KERNELS, host=False))
    assert set(megatron) - set(ds) == {"experts.activation_output", "experts.probs"}
    assert set(ds) - set(megatron) == {"dispatch.indices", "combine.indices", "combine.outputs", "combine.gates"}
    tokens = plan.micro_batch_size * model.seq_length
    assert ds["combine.outputs"] == model.moe_router_topk * tokens * model.hidden_size * 4
    assert 2 * ds["rope.cos_sin"] == megatron["rope.cos_sin"]
    assert {k: v for k, v in ds.items() if k in megatron and k != "rope.cos_sin"} == \
        {k: v for k, v in megatron.items() if k in ds and k != "rope.cos_sin"}


def test_in_bf16_the_gate_keeps_fp32_copies_and_nobody_the_norm_output():
    job = _job("bf16")
    model, plan = job.model, job.plan
    bf16 = layer_activation_terms(model, plan, moe=True, kernels=HOST_KERNELS)
    fp32 = layer_activation_terms(model, dataclasses.replace(plan, precision="fp32"), moe=True, kernels=HOST_KERNELS)
    assert set(bf16) - set(fp32) == {"gate.input_fp32", "gate.weight_fp32"}
    assert set(fp32) - set(bf16) == {"mlp.input"}  # in fp32 the gate's input.float() is the norm output
    assert bf16["gate.input_fp32"] == fp32["mlp.input"]
    assert bf16["gate.weight_fp32"] == model.hidden_size * model.num_experts * 4


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_megatron_s_cpu_prices_are_untouched(precision):
    """Megatron-Core's CPU trainers run unfused attention: host on or off, the same terms."""
    plan = dataclasses.replace(_job(precision).plan, attention_backend="unfused")
    model = _job(precision).model
    assert layer_activation_terms(model, plan, moe=True, kernels=HOST_KERNELS) == \
        layer_activation_terms(model, plan, moe=True, kernels=dataclasses.replace(HOST_KERNELS, host=False))
