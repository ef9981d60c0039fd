"""The ``"piper"`` block, planning and the drop-in's contract, in one process (no torch.distributed).

* every validation error of the block, matched: unknown keys (nearest and valid keys named), wrong
  types (strict: no "yes" for true), ranges, key combinations, unresolvable presets, pinned plans
  DeepSpeed cannot run, a missing global batch, no plan that fits;
* ZeRO-3 with MoE fails with Piper's message before any DeepSpeed call (``deepspeed.initialize``
  and ``init_distributed`` are replaced by functions that fail the test if called);
* no block / ``"enabled": false``: ``deepspeed.initialize`` receives the very same objects and its
  result is returned unchanged; the signature equals ``deepspeed.initialize``'s;
* the block ``piper plan --export-deepspeed`` writes loads, and pins the exported plan;
* the config rewrite leaves its input untouched and keeps the batch triple consistent;
* the DeepSpeed builder's per-rank parameter counts equal Piper's model (``stage_params``) for
  every preset it can build (MLA excepted), on the meta device.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json

import pytest
import torch

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

import deepspeed  # noqa: E402

import piper_deepspeed  # noqa: E402
from piper_core.errors import Infeasible, SpecError  # noqa: E402
from piper_core.export import deepspeed_config  # noqa: E402
from piper_core.presets import load_cluster, load_model, model_names  # noqa: E402
from piper_core.resource.params import stage_params  # noqa: E402
from piper_core.resource.predict import predict  # noqa: E402
from piper_core.specs.parallel import ParallelPlan  # noqa: E402
from piper_deepspeed.builder import build_model  # noqa: E402
from piper_deepspeed.config import PiperConfig  # noqa: E402
from piper_deepspeed.initialize import plan_for, rewrite_config  # noqa: E402

OK = {"cluster": "cpu-local", "model": "tiny-moe"}
CONFIG = {"train_batch_size": 8, "zero_optimization": {"stage": 0}}


@pytest.mark.parametrize("block, match", [
    (OK | {"chunk": 4}, r"piper\.chunk=4: is not a key of the piper block; did you mean 'chunks'\? valid keys: "
                        r"enabled, cluster, profile, a2a, chunks, memory_headroom, plan_only, trace, model, plan"),
    (OK | {"a2a": "ring"}, r"piper\.a2a='ring': must be one of auto, flat, hierarchical, pipelined"),
    (OK | {"chunks": 0}, r"piper\.chunks=0: must be an int >= 1, \"auto\" or \"tune\""),
    (OK | {"chunks": "4"}, r"piper\.chunks='4': must be an int >= 1, \"auto\" or \"tune\""),
    (OK | {"a2a": "hierarchical", "chunks": "tune"}, r"piper\.chunks='tune': tuning measures the pipelined all-to-all's "
                                                    r"chunk count, and a2a \"hierarchical\" is unpipelined"),
    (OK | {"chunks": 2.5}, r"piper\.chunks=2\.5: must be an int >= 1"),
    (OK | {"a2a": "flat", "chunks": 4}, r"piper\.chunks=4: pipeline chunks apply only to a2a \"pipelined\""),
    (OK | {"a2a": "pipelined", "chunks": 1}, r"piper\.chunks=1: a2a \"pipelined\" needs chunks >= 2"),
    (OK | {"memory_headroom": 1.0}, r"piper\.memory_headroom=1\.0: must be a number in \[0, 1\)"),
    (OK | {"memory_headroom": -0.1}, r"piper\.memory_headroom=-0\.1: must be a number in \[0, 1\)"),
    (OK | {"memory_headroom": True}, r"piper\.memory_headroom=True: must be a number"),
    (OK | {"enabled": "yes"}, r"piper\.enabled='yes': must be true or false"),
    (OK | {"plan_only": 1}, r"piper\.plan_only=1: must be true or false"),
    (OK | {"trace": 3}, r"piper\.trace=3: must be a directory path or null"),
    (OK | {"model": 7}, r"piper\.model=7: must be a model preset name, a ModelSpec YAML path or a ModelSpec mapping"),
    (OK | {"profile": "cal.yaml"}, r"piper\.profile='cal\.yaml': and piper\.cluster \('cpu-local'\) are exclusive"),
    (OK | {"predicted": {"mfu": "high"}}, r"piper\.predicted=.*must be a mapping of numbers"),
    ({"model": "tiny-moe"}, r"piper\.cluster=None: is required.*set it to a preset \(cpu-local, "),
    (OK | {"cluster": 8}, r"piper\.cluster=8: must be a cluster preset name or a ClusterSpec YAML path"),
    (OK | {"plan": {"ep": 2}}, r"piper\.plan\.mbs=None: is required and must be an int >= 1"),
    (OK | {"plan": {"ep": 2, "mbs": 1, "dp": 4}}, r"piper\.plan\.dp=4: is not a key of piper\.plan; .*valid keys: "
                                                    r"tp, pp, ep, etp, cp, vpp, mbs, recompute"),
    (OK | {"plan": {"ep": 0, "mbs": 1}}, r"piper\.plan\.ep=0: must be an int >= 1"),
    (OK | {"plan": {"ep": 2, "mbs": 1, "recompute": "some"}}, r"piper\.plan\.recompute='some': must be one of none"),
    (OK | {"plan": [2, 1]}, r"piper\.plan=\[2, 1\]: must be a mapping"),
    ("on", r"piper='on': must be a mapping \(a JSON object\)"),
])
def test_block_validation_errors(block, match) -> None:
    with pytest.raises(SpecError, match=match):
        PiperConfig.from_block(block)


@pytest.mark.parametrize("block, config, match", [
    (OK | {"cluster": "dgx-h10"}, CONFIG, r"piper\.cluster='dgx-h10': is neither a cluster preset nor a YAML file; "
                                          r"did you mean 'dgx-h100'\?"),
    (OK | {"model": "tiny-mo"}, CONFIG, r"piper\.model='tiny-mo': .*did you mean 'tiny-moe'\?"),
    ({"cluster": "cpu-local", "model": {"name": "m", "hiden_size": 8}}, CONFIG,
     r"piper\.model\.hiden_size=8: is not a key of ModelSpec; did you mean 'piper\.model\.hidden_size'\?"),
    ({"cluster": "cpu-local"}, CONFIG, r"piper\.model=None: the block needs the model's shape"),
    (OK | {"plan": {"tp": 2, "ep": 2, "mbs": 1}}, CONFIG, r"piper\.plan=.*cannot be expressed in DeepSpeed "
                                                          r"\(tp=2: the DeepSpeed export has no tensor parallelism"),
    (OK | {"plan": {"ep": 2, "mbs": 1, "recompute": "full"}}, CONFIG,
     r"piper\.plan\.recompute='full': Piper cannot make a DeepSpeed model recompute"),
    (OK | {"plan": {"pp": 2, "ep": 2, "mbs": 1}}, CONFIG, r"piper\.plan\.pp=2: pipeline stages need a PipelineModule"),
    (OK | {"plan": {"ep": 4, "mbs": 1}}, CONFIG, r"^piper\.plan on 2 ranks: ep=4: etp\*ep = 1\*4 = 4 must divide"),
    (OK, {"zero_optimization": {"stage": 1}}, r"train_batch_size=None: Piper plans for a fixed global batch"),
    (OK, CONFIG | {"zero_optimization": {"stage": "1"}}, r"zero_optimization\.stage='1': must be 0, 1, 2 or 3"),
    (OK, CONFIG | {"zero_optimization": {"stage": 3}},
     r"zero_optimization\.stage=3: DeepSpeed-MoE does not run under ZeRO-3 .*4 MoE layers \(tiny-moe\)"),
])
def test_plan_for_errors(block, config, match) -> None:
    with pytest.raises(SpecError, match=match):
        plan_for(config | {"piper": block}, 2)


def test_pipeline_with_zero2_and_no_fitting_plan() -> None:
    with pytest.raises(SpecError, match=r"zero_optimization\.stage=2: DeepSpeed's pipeline engine runs ZeRO 0 or 1"):
        plan_for({"train_batch_size": 8, "zero_optimization": {"stage": 2}, "piper": OK}, 2, pipeline=True)
    with pytest.raises(Infeasible, match=r"no plan DeepSpeed can run fits switch-1t on 2 ranks of cpu-local .*"
                                         r"rejected: .*exceeds memory"):
        plan_for({"train_batch_size": 8, "piper": OK | {"model": "switch-1t"}}, 2)


def _forbidden(*args, **kwargs):
    raise AssertionError("DeepSpeed must not be called")


def test_zero3_with_moe_fails_with_piper_message_before_deepspeed(monkeypatch) -> None:
    monkeypatch.setattr(deepspeed, "initialize", _forbidden)
    monkeypatch.setattr(deepspeed.comm, "init_distributed", _forbidden)
    spec = load_model("tiny-moe")
    model = build_model(spec, ParallelPlan(gpus=1, global_batch_size=1))
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3}, "piper": OK}
    with pytest.raises(SpecError, match=r"^zero_optimization\.stage=3: DeepSpeed-MoE does not run under ZeRO-3 "
                                        r"\(the engine refuses native MoE layers with stage 3; this model has 4 MoE "
                                        r"layers: 'layers\.0\.moe', 'layers\.1\.moe', 'layers\.2\.moe', \.\.\.\); "
                                        r"Piper plans MoE models with ZeRO 0-2; set zero_optimization\.stage to 1 or 2"):
        piper_deepspeed.initialize(model=model, config=config)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.result = (object(), object(), object(), object())

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return self.result


@pytest.mark.parametrize("how", ["no block", "enabled false", "path", "args.deepspeed_config"])
def test_without_block_deepspeed_runs_untouched(how, monkeypatch, tmp_path) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(deepspeed, "initialize", recorder)
    monkeypatch.setattr(deepspeed.comm, "init_distributed", _forbidden)
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    if how != "no block":
        config["piper"] = {"enabled": False, "cluster": "cpu-local"}
    snapshot = copy.deepcopy(config)
    args, passed = argparse.Namespace(local_rank=0), config
    if how in ("path", "args.deepspeed_config"):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        passed = str(path)
    if how == "args.deepspeed_config":
        args.deepspeed_config, passed = str(path), None
    args_before = dict(vars(args))
    objects = dict(args=args, model=torch.nn.Linear(2, 2), optimizer=object(), model_parameters=object(),
                   training_data=object(), lr_scheduler=object(), distributed_port=12345, mpu=object(),
                   dist_init_required=False, collate_fn=object(), config=passed, mesh_param=object(),
                   config_params=None)
    result = piper_deepspeed.initialize(**objects)
    assert result is recorder.result
    [call] = recorder.calls
    assert call.keys() == objects.keys()
    for key, value in objects.items():
        assert call[key] is value, key
    assert config == snapshot and vars(args) == args_before


def test_signature_is_deepspeeds() -> None:
    ours = inspect.signature(piper_deepspeed.initialize).parameters.values()
    theirs = inspect.signature(deepspeed.initialize).parameters.values()
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


def test_exported_block_loads_and_pins_its_plan() -> None:
    spec, cluster = load_model("tiny-moe"), load_cluster("cpu-local")
    plan = ParallelPlan(gpus=4, ep=4, micro_batch_size=2, global_batch_size=16, a2a="pipelined", a2a_chunks=4)
    exported = json.loads(json.dumps(deepspeed_config(predict(spec, cluster, plan))))
    exported["piper"]["model"] = "tiny-moe"
    block = PiperConfig.from_block(exported["piper"])
    assert (block.a2a, block.chunks, block.plan.ep, block.plan.mbs) == ("pipelined", 4, 4, 2)
    choice = plan_for(exported, 4)
    assert choice.search is None
    got = choice.plan
    assert (got.ep, got.pp, got.micro_batch_size, got.global_batch_size, got.a2a, got.a2a_chunks,
            got.distributed_optimizer) == (4, 1, 2, 16, "pipelined", 4, True)


def test_profile_plans_on_the_calibrated_cluster(tmp_path) -> None:
    from piper_core.calibrate.profile import write_profile

    path = tmp_path / "me.yaml"
    write_profile(path, dataclasses.replace(load_cluster("cpu-local"), name="calibrated-here"),
                  {"machine": {}, "date": "2025-01-01", "ranks": 2, "nodes": 1, "command": "piper calibrate",
                   "benchmarks": {}, "fits": {}})
    choice = plan_for(CONFIG | {"piper": {"profile": str(path), "model": "tiny-moe"}}, 2)
    assert choice.prediction.cluster.name == "calibrated-here"


def test_rewrite_is_a_copy_and_keeps_the_batch_consistent() -> None:
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
              "zero_optimization": {"stage": 0, "overlap_comm": True}, "piper": OK | {"a2a": "auto"}}
    snapshot = copy.deepcopy(config)
    choice = plan_for(config, 4)
    new, changes = rewrite_config(config, choice)
    assert config == snapshot
    plan = choice.plan
    assert new["train_batch_size"] == 16 == new["train_micro_batch_size_per_gpu"] * new["gradient_accumulation_steps"] * 4
    assert new["train_micro_batch_size_per_gpu"] == plan.micro_batch_size
    assert new["zero_optimization"] == {"stage": 1 if plan.distributed_optimizer else 0, "overlap_comm": True}
    assert new["piper"]["plan"]["ep"] == plan.ep and new["piper"]["a2a"] == plan.a2a
    assert {k for k, _, _ in changes} <= {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                          "zero_optimization.stage"}
    assert plan_for(new, 4).plan == plan, "the rewritten config pins the same plan"
    again = plan_for(config, 4)
    assert again.plan == plan, "planning is deterministic (every rank computes the same plan)"


@pytest.mark.parametrize("name", [n for n in model_names() if load_model(n).mla is None])
def test_builder_parameters_equal_piper_model(name) -> None:
    spec = load_model(name)
    for ep in sorted({1, spec.num_experts}) if spec.num_experts <= 8 else (spec.num_experts,):
        plan = ParallelPlan(gpus=ep, ep=ep, global_batch_size=ep)
        with torch.device("meta"):
            model = build_model(spec, plan)
        expert = sum(p.numel() for n, p in model.named_parameters() if ".deepspeed_experts." in n)
        dense = sum(p.numel() for n, p in model.named_parameters() if ".deepspeed_experts." not in n)
        predicted = stage_params(spec, plan)[0]
        assert (dense, expert) == (predicted.dense, predicted.expert), f"{name} ep={ep}"


def test_builder_refuses_what_it_cannot_build() -> None:
    with pytest.raises(SpecError, match=r"mla=.*the DeepSpeed training model has no multi-latent attention"):
        build_model(load_model("deepseek-v3"), ParallelPlan(gpus=1, global_batch_size=1))
    spec = dataclasses.replace(load_model("tiny-moe"), num_layers=3)
    with pytest.raises(SpecError, match=r"pp=2: must divide num_layers \(3\)"):
        build_model(spec, ParallelPlan(gpus=2, pp=2, global_batch_size=1))
