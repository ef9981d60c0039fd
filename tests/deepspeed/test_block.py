"""The ``"piper"`` block, planning and the drop-in's contract, in one process (no torch.distributed).

* every validation error of the block, matched: unknown keys (nearest and valid keys named), wrong
  types (strict: no "yes" for true), ranges, key combinations (``"chunks": 1`` with the old ``"pipelined"``),
  unresolvable presets, pinned plans DeepSpeed cannot run, a missing global batch, no plan that fits;
* ``a2a`` (the algorithm) and ``chunks`` are chosen independently; the old ``"a2a": "pipelined"``
  reads as flat in 2 chunks or more, with a note, and plans what the new spelling plans;
* an explicit all-to-all (``a2a`` not auto, ``chunks`` >= 2 or tune) is honoured where the search
  alone would pick ep = 1 (a model whose unrestricted best plan has ep = 1), or refused with the
  reason (one rank; a pinned ep = 1), never rewritten to flat;
* ``memory_headroom`` holds for a pinned plan as for the search: a pinned plan over the limit is
  refused with its predicted peak and the limit;
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
from piper_core.export import deepspeed_config, plan_label as describe  # noqa: E402
from piper_core.presets import load_cluster, load_model, model_names  # noqa: E402
from piper_core.resource.params import stage_params  # noqa: E402
from piper_core.resource.predict import predict  # noqa: E402
from piper_core.specs.parallel import ParallelPlan  # noqa: E402
from piper_core.specs.yamlio import to_dict  # noqa: E402
from piper_deepspeed.builder import build_model  # noqa: E402
from piper_deepspeed.config import PiperConfig  # noqa: E402
from piper_deepspeed.initialize import plan_for, rewrite_config  # noqa: E402
from piper_deepspeed.moe import A2ASettings  # noqa: E402

OK = {"cluster": "cpu-local", "model": "tiny-moe"}
CONFIG = {"train_batch_size": 8, "zero_optimization": {"stage": 0}}


@pytest.mark.parametrize("block, match", [
    (OK | {"chunk": 4}, r"piper\.chunk=4: is not a key of the piper block; did you mean 'chunks'\? valid keys: "
                        r"enabled, cluster, profile, a2a, chunks, defer_wgrad, placement, routing, migrate_every, migrate_horizon, "
                        r"memory_headroom, plan_only, "
                        r"trace, model, plan"),
    (OK | {"a2a": "ring"}, r"piper\.a2a='ring': must be one of auto, flat, hierarchical; write e\.g\. \"a2a\": "
                           r"\"hierarchical\" \(pipeline it with \"chunks\"\)$"),
    (OK | {"chunks": 0}, r"piper\.chunks=0: must be an int >= 1, \"auto\" or \"tune\""),
    (OK | {"chunks": "4"}, r"piper\.chunks='4': must be an int >= 1, \"auto\" or \"tune\""),
    (OK | {"chunks": 2.5}, r"piper\.chunks=2\.5: must be an int >= 1"),
    (OK | {"a2a": "pipelined", "chunks": 1},
     r"^piper\.chunks=1: a2a \"pipelined\" meant flat exchanges in 2 chunks or more, so one chunk contradicts it; "
     r"write \"a2a\": \"flat\", \"chunks\": 1 \(unpipelined\), or \"a2a\": \"flat\" with chunks 2, 4, 8 or \"auto\"$"),
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


# tiny-moe with 1,024-token sequences: on 2 cpu-local ranks the unrestricted search picks ep = 1 (the
# exchange outweighs what ep saves), so an explicit all-to-all must change the plan, not be dropped.
LONG = OK | {"model": to_dict(dataclasses.replace(load_model("tiny-moe"), name="tiny-moe-1k", seq_length=1024))}


ANY = {"flat", "hierarchical"}
ALL_CHUNKS = {1, 2, 4, 8}


@pytest.mark.parametrize("asked, a2a, chunks", [
    ({"a2a": "hierarchical", "chunks": 2}, {"hierarchical"}, {2}),
    ({"a2a": "flat", "chunks": 4}, {"flat"}, {4}),
    ({"a2a": "hierarchical"}, {"hierarchical"}, ALL_CHUNKS),
    ({"a2a": "flat"}, {"flat"}, ALL_CHUNKS),
    ({"chunks": 4}, ANY, {4}),  # a chunk count with a2a auto: either algorithm, in that many chunks
    ({"chunks": "tune"}, ANY, ALL_CHUNKS),
    ({"a2a": "hierarchical", "chunks": "tune"}, {"hierarchical"}, ALL_CHUNKS),
])
def test_explicit_all_to_all_is_honoured_where_the_search_would_pick_ep_1(asked, a2a, chunks) -> None:
    assert plan_for(CONFIG | {"piper": LONG}, 2).plan.ep == 1, "the case needs a search that picks ep = 1"
    choice = plan_for(CONFIG | {"piper": LONG | asked}, 2)
    plan = choice.plan
    assert plan.ep == 2 and plan.a2a in a2a and plan.a2a_chunks in chunks, plan
    assert {(s.plan.a2a, s.plan.a2a_chunks) for s in choice.search.scored if s.plan.ep > 1} == \
        {(a, c) for a in a2a for c in chunks}
    assert not any(s.plan.ep_comm_overlap or s.plan.shared_expert_overlap for s in choice.search.scored)
    assert all(p.plan.ep > 1 for p in choice.top)
    new, _ = rewrite_config(CONFIG | {"piper": LONG | asked}, choice)
    assert plan_for(new, 2).plan == plan, "the rewritten block pins the same plan"


@pytest.mark.parametrize("legacy, current", [
    ({"a2a": "pipelined", "chunks": 2}, {"a2a": "flat", "chunks": 2}),
    ({"a2a": "pipelined"}, {"a2a": "flat", "chunks": "{top}"}),
])
def test_legacy_pipelined_block_reads_as_flat_chunks_with_a_note(legacy, current) -> None:
    from piper_core.runtime import NodeTopology
    from piper_deepspeed.initialize import report

    config = CONFIG | {"piper": LONG | legacy}
    with pytest.warns(FutureWarning, match="the \"piper\" block: a2a 'pipelined' is read as a2a 'flat' with"):
        old = plan_for(config, 2)
    assert old.plan.ep == 2 and old.plan.a2a == "flat" and old.plan.a2a_chunks >= 2
    assert {(s.plan.a2a, s.plan.a2a_chunks >= 2) for s in old.search.scored if s.plan.ep > 1} == {("flat", True)}
    (note,) = old.notes
    new, _ = rewrite_config(config, old)
    assert (new["piper"]["a2a"], new["piper"]["chunks"]) == ("flat", old.plan.a2a_chunks)  # written the new way
    assert f"piper: note: {note}" in report(old, [], config, topology=NodeTopology(nodes=((0, 1),)))
    spelt = {k: v if v != "{top}" else old.plan.a2a_chunks for k, v in current.items()}
    now = plan_for(CONFIG | {"piper": LONG | spelt}, 2)
    assert now.plan == old.plan and now.notes == ()


def test_chunks_1_with_a2a_auto_means_unpipelined() -> None:
    choice = plan_for(CONFIG | {"piper": LONG | {"chunks": 1}}, 2)
    assert {(p.plan.a2a, p.plan.a2a_chunks) for p in choice.top} <= {("flat", 1), ("hierarchical", 1)}
    assert {s.plan.a2a_chunks for s in choice.search.scored} == {1}


@pytest.mark.parametrize("block, world, match", [
    (OK | {"a2a": "hierarchical", "chunks": 2}, 1,
     r"^piper\.a2a='hierarchical': asks for an expert all-to-all, which needs expert parallelism \(ep > 1\), and no "
     r"ep > 1 is possible on 1 rank; run on more ranks, or set \"a2a\" and \"chunks\" to \"auto\" \(or remove "
     r"them\) to plan without an expert all-to-all$"),
    (OK | {"chunks": 4}, 1, r"^piper\.chunks=4: asks for an expert all-to-all, .* no ep > 1 is possible on 1 rank"),
    (OK | {"a2a": "flat", "chunks": 2, "plan": {"ep": 1, "mbs": 1}}, 2,
     r"^piper\.chunks=2: asks for an expert all-to-all, which needs expert parallelism \(ep > 1\), and "
     r"piper\.plan pins ep=1; pin ep > 1 in piper\.plan, or set \"a2a\" to \"auto\" or \"flat\" and remove "
     r"\"chunks\"$"),
    pytest.param(OK | {"a2a": "pipelined", "plan": {"ep": 1, "mbs": 1}}, 2, r"^piper\.a2a='pipelined': .* pins ep=1",
                 marks=pytest.mark.filterwarnings("ignore::FutureWarning")),  # the old spelling: refused too
    (OK | {"a2a": "hierarchical", "plan": {"ep": 1, "mbs": 1}}, 2, r"^piper\.a2a='hierarchical': .* pins ep=1"),
    (OK | {"chunks": "tune", "plan": {"ep": 1, "mbs": 1}}, 2, r"^piper\.chunks='tune': .* pins ep=1"),
])
def test_explicit_all_to_all_without_ep_above_1_is_refused(block, world, match) -> None:
    with pytest.raises(SpecError, match=match):
        plan_for(CONFIG | {"piper": block}, world)


def test_explicit_all_to_all_that_fits_nowhere_says_the_search_was_restricted() -> None:
    with pytest.raises(Infeasible, match=r"no plan DeepSpeed can run fits switch-1t on 2 ranks of cpu-local at "
                                         r"global batch 8 \(searched \d+ plans, ep > 1 only as "
                                         r"piper\.a2a='hierarchical' asks; rejected: .*exceeds memory\); .*, or set \"a2a\" and \"chunks\" to "
                                         r"\"auto\"$"):
        plan_for(CONFIG | {"piper": OK | {"model": "switch-1t", "a2a": "hierarchical"}}, 2)


def test_pinned_ep_1_with_a2a_flat_loads_as_exported() -> None:
    exported = deepspeed_config(predict(load_model("tiny-moe"), load_cluster("cpu-local"),
                                        ParallelPlan(gpus=2, ep=1, micro_batch_size=1, global_batch_size=8)))
    exported["piper"]["model"] = "tiny-moe"
    assert (exported["piper"]["a2a"], exported["piper"]["chunks"]) == ("flat", 1)
    plan = plan_for(exported, 2).plan
    assert (plan.ep, plan.a2a, plan.a2a_chunks) == (1, "flat", 1)


PIN = {"plan": {"ep": 2, "mbs": 1}}
PIN_TEXT = r"\{'tp': 1, 'pp': 1, 'ep': 2, 'etp': 1, 'cp': 1, 'vpp': 1, 'mbs': 1, 'recompute': 'none'\}"


def test_memory_headroom_holds_for_a_pinned_plan() -> None:
    fits = plan_for(CONFIG | {"piper": OK | PIN | {"memory_headroom": 0.5}}, 2).prediction
    peak_gib, usable_gib = fits.peak_stage.total / 2**30, load_cluster("cpu-local").capacity_gib
    headroom = 0.98
    assert peak_gib > usable_gib * (1 - headroom), "the case needs a plan over the 0.98 limit"
    limit_gib = usable_gib * (1 - headroom)
    with pytest.raises(SpecError, match=rf"^piper\.plan={PIN_TEXT}: is predicted to need {peak_gib:.2f} GiB per "
                                        rf"GPU at its peak, over the {limit_gib:.2f} GiB limit the search applies "
                                        rf"\(cpu-local's usable {usable_gib:.2f} GiB less memory_headroom 0\.98\); "
                                        r"pin a plan that fits \(a larger ep or a smaller mbs\), lower "
                                        r"piper\.memory_headroom, or remove piper\.plan to let Piper search$"):
        plan_for(CONFIG | {"piper": OK | PIN | {"memory_headroom": headroom}}, 2)
    with pytest.raises(Infeasible, match=r"rejected: \d+ exceeds memory\)"):  # the search: the same limit
        plan_for(CONFIG | {"piper": OK | {"memory_headroom": headroom}}, 2)


def test_pinned_plan_over_capacity_is_refused() -> None:
    with pytest.raises(SpecError, match=rf"^piper\.plan={PIN_TEXT}: is predicted to need [0-9.]+ GiB per GPU at its "
                                        r"peak, over the 10\.80 GiB limit the search applies \(cpu-local's usable "
                                        r"10\.80 GiB\); pin a plan that fits"):
        plan_for(CONFIG | {"piper": OK | PIN | {"model": "switch-1t"}}, 2)


def test_settings_follow_the_plans_algorithm_and_chunks() -> None:
    from piper_core.runtime import Algorithm

    assert A2ASettings.from_plan("hierarchical", 2) == A2ASettings(algorithm=Algorithm.HIERARCHICAL, chunks=2)
    assert A2ASettings.from_plan("flat", 1) == A2ASettings(algorithm=Algorithm.FLAT, chunks=1)
    assert A2ASettings.from_plan("hierarchical", 1, tune=True).tune
    with pytest.warns(FutureWarning, match="A2ASettings.from_plan: a2a 'pipelined' is read as a2a 'flat' with 4"):
        assert A2ASettings.from_plan("pipelined", 4) == A2ASettings(algorithm=Algorithm.FLAT, chunks=4)
    with pytest.raises(SpecError, match=r"^a2a='aggregated': a plan's exchange algorithm is one of flat, hierarchical"):
        A2ASettings.from_plan("aggregated", 1)


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
    plan = ParallelPlan(gpus=4, ep=4, micro_batch_size=2, global_batch_size=16, a2a="hierarchical", a2a_chunks=4)
    exported = json.loads(json.dumps(deepspeed_config(predict(spec, cluster, plan))))
    exported["piper"]["model"] = "tiny-moe"
    block = PiperConfig.from_block(exported["piper"])
    assert (block.a2a, block.chunks, block.plan.ep, block.plan.mbs) == ("hierarchical", 4, 4, 2)
    choice = plan_for(exported, 4)
    assert choice.search is None
    got = choice.plan
    assert (got.ep, got.pp, got.micro_batch_size, got.global_batch_size, got.a2a, got.a2a_chunks,
            got.distributed_optimizer) == (4, 1, 2, 16, "hierarchical", 4, True)


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


def test_defer_wgrad_reaches_the_plan_the_export_and_is_said_where_it_cannot_apply() -> None:
    """``"defer_wgrad": true`` puts the deferral in the searched and the pinned plan (ep > 1; priced),
    the export writes it back, and a plan with ep = 1 (no exchange) says it was dropped."""
    searched = plan_for(CONFIG | {"piper": OK | {"chunks": 2, "defer_wgrad": True}}, 2)
    assert searched.plan.ep == 2 and searched.plan.defer_wgrad
    plain = plan_for(CONFIG | {"piper": OK | {"chunks": 2}}, 2)
    assert not plain.plan.defer_wgrad and searched.prediction.time.step <= plain.prediction.time.step
    pinned = plan_for(CONFIG | {"piper": OK | PIN | {"defer_wgrad": True}}, 2)
    assert pinned.plan.defer_wgrad and describe(pinned.plan).endswith("+dwg")
    exported = deepspeed_config(pinned.prediction)
    exported["piper"]["model"] = "tiny-moe"
    assert exported["piper"]["defer_wgrad"] is True and plan_for(exported, 2).plan == pinned.plan
    config = CONFIG | {"piper": OK | {"plan": {"ep": 1, "mbs": 1}, "defer_wgrad": True}}
    alone = plan_for(config, 2)
    assert alone.plan.ep == 1 and not alone.plan.defer_wgrad
    rewritten, changes = rewrite_config(config, alone)
    assert ("piper.defer_wgrad (needs ep > 1)", True, False) in changes and rewritten["piper"]["defer_wgrad"] is False
