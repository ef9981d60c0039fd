"""fp32 training (Megatron's default: neither --bf16 nor --fp16) through the CPU trainer
(piper_megatron.train) and the activation measurement (piper_megatron.measure).

* The trainer's fp32 optimizer against Megatron's own ``FP32Optimizer`` (its CUDA loss-scale tensor
  put on the host, as piper_megatron.cpu_training does for pretrain_gpt.py): the same parameters
  after three steps, Adam on the parameters themselves with only m and v as state.
* Two real gloo ranks train the validation model's fp32 plans (ep 2, and pp 2 through the 1F1B
  schedule) under the tensor ledger: fp32 parameters, as many as Piper counts; the loss falls; the
  state after a step is the model's fp32 state (4-byte weights and gradients, Adam's m and v: no
  master copy, which would add a quarter) and the peak the model's peak, within the 5 % acceptance
  limit of the bf16 peak test.
* One layer's activations in fp32 (no ``Float16Module`` cast) equal the formula's fp32 terms.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from piper_core.errors import SpecError
from piper_core.specs.parallel import ParallelPlan
from tests.gloo import run_ranks

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

LIMIT = 0.05  # the peak test's acceptance limit (tests/megatron/test_peak_memory.py)
STEPS = 4


# ---- the optimizer --------------------------------------------------------------------------------

def test_fp32_adam_steps_the_parameters_as_megatrons_fp32_optimizer(monkeypatch):
    import torch
    import megatron.core.optimizer.optimizer as megatron_optimizer
    from megatron.core.optimizer import OptimizerConfig

    from piper_megatron.cpu import _host_training_torch
    from piper_megatron.train import FP32Adam, MixedPrecisionAdam, host_optimizer

    monkeypatch.setattr(megatron_optimizer, "torch", _host_training_torch())  # FP32Optimizer's _scale on 'cuda'
    torch.manual_seed(0)
    shapes = [(8, 4), (4,), (3, 5)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    plan = ParallelPlan(gpus=1, global_batch_size=1, distributed_optimizer=False, precision="fp32")
    optimizer = host_optimizer(ours, plan, lr=1e-2)
    reference = megatron_optimizer.FP32Optimizer(torch.optim.Adam(theirs, lr=1e-2),
                                                 OptimizerConfig(lr=1e-2, clip_grad=0.0), lambda _: None)
    assert isinstance(optimizer, FP32Adam)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.main_grad = torch.randn(p.shape)  # DDP's gradient buffer
            q.main_grad = p.main_grad.clone()
        reference.zero_grad()  # as Megatron's train_step does before each backward
        optimizer.step()
        assert reference.step()[0]
        assert all(p.grad is None for p in ours), "a grad left aliasing DDP's buffer takes the next backward twice"
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    held = [p for group in optimizer.adam.param_groups for p in group["params"]]
    assert all(a is b for a, b in zip(held, ours, strict=True)), "Adam must step the parameters themselves"
    state = [t for p in ours for t in optimizer.adam.state[p].values() if t.dim() > 0]
    assert sum(t.numel() * t.element_size() for t in state) == 8 * sum(p.numel() for p in ours)  # m and v
    # bf16 keeps the fp32 master copies (and fp16, whose loss scaling the trainer does not run, is refused)
    bf16 = [torch.nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in shapes]
    assert isinstance(host_optimizer(bf16, dataclasses.replace(plan, precision="bf16"), lr=1e-2), MixedPrecisionAdam)
    with pytest.raises(SpecError, match="precision='fp16': the CPU trainer runs bf16 mixed precision and fp32"):
        host_optimizer(bf16, dataclasses.replace(plan, precision="fp16"), lr=1e-2)


# ---- training on two ranks ------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["2r-ep2-mbs2", "2r-pp2-mbs2"])
def trained(request):
    """(the case in fp32, the model's prediction, every rank's report, the summary, the peak row)."""
    from piper_core.presets import load_cluster
    from piper_core.resource.predict import predict
    from piper_core.validate.cases import select
    from piper_core.validate.instrument import TrainJob, summary
    from piper_core.validate.peak import peak_row
    from piper_megatron.train import run

    (case,) = select([request.param])
    case = dataclasses.replace(case, plan=dataclasses.replace(case.plan, precision="fp32"))
    pred = predict(case.model, load_cluster("cpu-local"), case.plan)
    reports = run(TrainJob(model=case.model, plan=case.plan, steps=STEPS, warmup=1, memory=True), timeout_s=300)
    s = summary(reports)
    return case, pred, reports, s, peak_row(case, pred, s)


def test_parameters_are_fp32_and_as_many_as_piper_counts(trained):
    from piper_core.resource.params import stage_params

    case, _, reports, _, _ = trained
    want = stage_params(case.model, case.plan)
    for r in reports:
        assert r["params"] == want[r["pp_rank"]].total
        assert r["param_bytes"] == 4 * r["params"], "fp32 training keeps fp32 parameters"


def test_the_loss_is_finite_and_falls(trained):
    _, _, _, s, _ = trained
    losses = s["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses


def test_state_and_peak_are_the_fp32_model_without_a_master_copy(trained):
    """The model's fp32 state has no master copy; one would add 4 bytes per parameter, a quarter of
    the 16 that weights, gradients and Adam's m and v take, far outside the limit."""
    _, pred, reports, _, row = trained
    for stage, measured in zip(pred.stages, row.measured_state):
        assert stage.optimizer == pytest.approx(8 * stage.params.total, abs=1) and stage.step_gradients == 0
        assert 4 * stage.params.total > 2 * LIMIT * measured  # a master copy would break the limit
    assert abs(row.state_error) <= LIMIT, row
    assert abs(row.error) <= LIMIT, row


# ---- one layer's activations ----------------------------------------------------------------------

ACT = {"dense-none": (False, "none"), "moe-none": (True, "none"), "dense-selective": (False, "selective"),
       "moe-full": (True, "full")}


def _act_model() -> Any:
    from piper_core.specs.model import ModelSpec

    return ModelSpec(name="act-fp32", num_layers=1, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512,
                     num_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2, vocab_size=1024, seq_length=128,
                     normalization="LayerNorm")


def _act_plan(recompute: str) -> ParallelPlan:
    return ParallelPlan(gpus=1, micro_batch_size=2, global_batch_size=2, recompute=recompute,
                        recompute_num_layers=1 if recompute == "full" else None, attention_backend="unfused",
                        precision="fp32")


def _measure_fp32(rank: int, world: int) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    from megatron.core import parallel_state, tensor_parallel

    from piper_megatron.cpu import install_cpu_shims
    from piper_megatron.measure import measure_layer_activations

    install_cpu_shims()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        out = {}
        for name, (moe, recompute) in ACT.items():
            m = measure_layer_activations(_act_model(), _act_plan(recompute), moe=moe)
            dtypes = {s.dtype for s in m.storages if s.kind == "activation"}
            out[name] = {"bytes": m.activation_bytes, "dtypes": sorted(dtypes), "table": m.table()}
        return out
    finally:
        parallel_state.destroy_model_parallel()


def test_fp32_layer_activations_are_the_formulas():
    from piper_core.resource.activations import layer_activation_terms
    from piper_megatron.measure import CPU_KERNELS

    measured = run_ranks(1, _measure_fp32, timeout_s=240)[0]
    for name, (moe, recompute) in ACT.items():
        got = measured[name]
        assert "float32" in got["dtypes"] and "bfloat16" not in got["dtypes"], (name, got["dtypes"])  # no cast
        want = sum(layer_activation_terms(_act_model(), _act_plan(recompute), moe=moe, kernels=CPU_KERNELS).values())
        assert want == pytest.approx(got["bytes"], rel=LIMIT), f"{name}: predicted {want}, measured\n{got['table']}"
