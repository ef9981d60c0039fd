"""``--piper``: Megatron arguments -> model spec, pinned sizes, the plan, the rewrite, and the hooks
on both ways Megatron-LM scripts reach argument validation (:mod:`piper_megatron.versions`).

How each is exercised:

* 0.18-0.19 (``parse_and_validate_args`` calls ``arguments.validate_args``): against the REAL
  ``megatron.training`` of megatron-core 0.19.2, downloaded once by tests/megatron/megatron_wheel.py
  (skipped, with the reason, when the download fails) and run in a subprocess
  (tests/megatron/args_driver.py) with that tree first on the path. A stand-in ``pretrain_gpt.py``
  whose ``__main__`` calls ``parse_and_validate_args`` as the real one does is run through the
  launcher and through ``install()``; what Megatron's real ``validate_args`` accepted is compared
  with the plan Piper computes here from the same command line, and the vocabulary its real
  tokenizer padded with the one Piper planned.
* 0.16-0.17 (``initialize_megatron`` calls the ``validate_args`` that ``megatron.training.initialize``
  bound at import): their ``megatron.training`` cannot sit beside the 0.19.2 tree (the 0.16.1 wheel
  ships only ``megatron/core``; 0.17 needs Python 3.12), so the same subprocess first installs
  tests/megatron/megatron016.py, a stand-in that binds the real 0.19.2 ``parse_args``/``validate_args``
  by name at import, as ``initialize.py`` does at core_v0.16.1 and core_v0.17.1, and reports version
  0.16.1 or 0.17.1; the script calls ``pretrain(..., args_defaults=..., extra_args_provider=...)``. A
  hook on ``arguments.validate_args`` alone would miss that binding; the test checks the rewrite
  arrives. (The real 0.16.1 ``megatron.training``: tests/megatron/test_versions.py and
  test_pretrain_gpt.py.)
* Installed megatron-core 0.16.1 (no ``megatron.training``): ``install()`` fails with a clear error.

The rest needs no Megatron: the spec read off every preset's Megatron flags equals the preset;
pins, the rewrite, errors; and ``python -m piper_megatron ... --piper-plan-only`` for switch-1t on
64 dgx-h100 GPUs, in a subprocess that must import neither Megatron nor torch.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from piper_core.cli.plan import describe
from piper_core.errors import Infeasible, SpecError
from piper_core.export import model_flags
from piper_core.presets import load_cluster, load_model, model_names
from piper_core.resource.predict import predict
from piper_megatron.args import (
    apply_settings,
    eval_layer_pattern,
    megatron_settings,
    model_spec_from_args,
    moe_layout,
    parse_megatron_args,
    parse_piper_options,
)
from piper_megatron.pins import explicit_flags, pins_from
from piper_megatron.install import dispatcher_description, plan_job, report

REPO = Path(__file__).resolve().parents[2]
PIPER = ["--piper", "--piper-cluster", "dgx-h100"]
# A 0.5 B-parameter MoE on 8 GPUs: small enough to plan in a blink, big enough to need choices.
BASE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--ffn-hidden-size", "4096",
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--num-experts", "16",
        "--moe-ffn-hidden-size", "1024", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--global-batch-size", "64", "--bf16",
        "--lr", "1e-4", "--train-iters", "10"]
PINNED = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1", "--piper-a2a", "hierarchical",
          "--piper-chunks", "2"]
WORLD = 8


def flags_of(model) -> list[str]:
    argv: list[str] = []
    for flag, value in model_flags(model):
        argv += [flag] if value is None else [flag, str(value)]
    return argv + ["--vocab-size", str(model.vocab_size)]


SWITCH = flags_of(load_model("switch-1t")) + ["--global-batch-size", "2048", "--bf16"]


def planned(argv: list[str], world: int = WORLD):
    return plan_job(parse_megatron_args(argv), argv, parse_piper_options(argv), world_size=world)


# ---- Megatron arguments -> ModelSpec ----------------------------------------------------------------

@pytest.mark.parametrize("name", model_names())
def test_spec_from_each_presets_megatron_flags_is_the_preset(name):
    """export.model_flags (spec -> flags, checked against Megatron's parser) and back."""
    preset = load_model(name)
    got = model_spec_from_args(parse_megatron_args(flags_of(preset)))
    assert got == dataclasses.replace(preset, name=got.name, moe_expert_load_skew=1.0)


def test_megatron_defaults_fill_what_validate_args_would():
    ns = parse_megatron_args(["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4",
                              "--seq-length", "128", "--num-experts", "4", "--vocab-size", "100",
                              "--num-query-groups", "2"])
    spec = model_spec_from_args(ns)
    assert spec.ffn_hidden_size == 4 * 96 and spec.moe_ffn_hidden_size == 4 * 96  # validate_args' rules
    assert spec.num_query_groups is None  # --num-query-groups counts only with --group-query-attention
    assert (spec.moe_router_topk, spec.normalization, spec.position_embedding) == (2, "LayerNorm", "learned_absolute")
    assert (spec.tie_embeddings, spec.add_bias_linear, spec.attention_dropout) == (True, True, 0.1)
    swiglu = model_spec_from_args(parse_megatron_args(["--swiglu", "--num-layers", "2", "--hidden-size", "96",
                                                        "--num-attention-heads", "4", "--seq-length", "128",
                                                        "--vocab-size", "100"]))
    assert swiglu.ffn_hidden_size == int((4 * 96 * 2 / 3) / 64) * 64


def test_moe_layer_freq_forms():
    assert moe_layout(2, 8) == (0, 2)
    assert moe_layout("([0]*3+[1]*5)", 8) == (3, 1)
    assert moe_layout([1, 0] * 4, 8) == (0, 2)
    with pytest.raises(SpecError, match="not of that form"):
        moe_layout("([1]*3+[0]*1)*2", 8)
    with pytest.raises(SpecError, match="lists 4 layers, the model has 8"):
        moe_layout("[1]*4", 8)
    with pytest.raises(SpecError, match="list expression of 0/1"):
        eval_layer_pattern("__import__('os').getcwd()")


def test_vocabulary_rules():
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
    gpt2 = parse_megatron_args(base + ["--tokenizer-type", "GPT2BPETokenizer"])
    assert model_spec_from_args(gpt2).vocab_size == 50257
    assert model_spec_from_args(parse_megatron_args(base), {"tokenizer_type": "GPT2BPETokenizer"}).vocab_size == 50257
    with pytest.raises(SpecError, match="cannot read it from --tokenizer-type HuggingFaceTokenizer.*add --vocab-size"):
        model_spec_from_args(parse_megatron_args(base + ["--tokenizer-type", "HuggingFaceTokenizer"]))
    with pytest.raises(SpecError, match="--seq-length=None: is required with --piper"):
        model_spec_from_args(parse_megatron_args(base[:-2] + ["--vocab-size", "10"]))


# ---- Piper's flags, pins, the rewrite -----------------------------------------------------------------

def test_piper_flag_errors():
    with pytest.raises(SpecError, match="--piper-cluster=.*only together with --piper"):
        parse_piper_options(["--piper-cluster", "dgx-h100"])
    with pytest.raises(SpecError, match=r"^--piper-chunks=1: --piper-a2a pipelined meant flat exchanges in 2 "
                                        r"chunks or more, so one chunk contradicts it; write --piper-a2a flat "
                                        r"--piper-chunks 1"):
        parse_piper_options(["--piper", "--piper-a2a", "pipelined", "--piper-chunks", "1"])
    with pytest.raises(SpecError, match="--piper-world-size=.*add --piper-plan-only"):
        parse_piper_options(["--piper", "--piper-world-size", "64"])
    options = parse_piper_options(["--piper", "--piper-chunks", "auto", "--piper-trace", "t.jsonl"])
    assert (options.enabled, options.chunks, str(options.trace)) == (True, None, "t.jsonl")


def test_explicit_flags_are_what_the_command_line_wrote():
    assert explicit_flags(BASE) == {}
    got = explicit_flags(["--tensor-model-parallel-size=2", "--sequence-parallel", "--micro-batch-size", "1"])
    assert got == {"tensor_model_parallel_size": 2, "sequence_parallel": True, "micro_batch_size": 1}


@pytest.mark.parametrize(("argv", "message"), [
    (["--expert-tensor-parallel-size", "2", "--tensor-model-parallel-size", "4"],
     "expert tensor parallel size 1 or equal to --tensor-model-parallel-size"),
    (["--moe-token-dispatcher-type", "flex"], "replaces Megatron's alltoall token dispatcher"),
    (["--decoder-first-pipeline-num-layers", "1"], "splits layers evenly or shortens the last stage"),
])
def test_pins_the_search_cannot_honour_are_refused(argv, message):
    with pytest.raises(SpecError, match=message):
        pins_from(argv, parse_piper_options(["--piper"]))


def test_expert_tensor_parallelism_and_shared_overlap_pins_are_honoured():
    """Piper's dispatcher runs etp > 1 and Megatron's shared-expert overlap (tests/megatron/
    test_dispatcher_etp.py): a pinned etp 2 plans tp 2 with it, and the overlap flag is kept."""
    pins = pins_from(["--expert-tensor-parallel-size", "2", "--moe-shared-expert-overlap"],
                     parse_piper_options(["--piper"]))
    assert dict(pins.given) == {"expert_tensor_parallel_size": 2, "moe_shared_expert_overlap": True}
    job = planned(BASE + PIPER + ["--expert-tensor-parallel-size", "2"])
    assert job.result.scored and all(s.plan.tp == 2 and s.plan.etp_size == 2 for s in job.result.scored)


def test_pinned_sizes_are_honoured_and_reported():
    argv = BASE + PIPER + PINNED
    job = planned(argv)
    assert job.result.scored and all(s.plan.tp == 2 and s.plan.micro_batch_size == 1 and s.plan.a2a == "hierarchical"
                                     and s.plan.a2a_chunks == 2 for s in job.result.scored)
    settings = megatron_settings(job.model, job.top.plan, job.pins)
    assert not {"tensor_model_parallel_size", "micro_batch_size"} & set(settings)  # pinned: never rewritten
    assert job.pins.describe() == ("--micro-batch-size 1, --tensor-model-parallel-size 2, --piper-a2a hierarchical, "
                                   "--piper-chunks 2")
    assert dispatcher_description(job) == ("Piper pipelined all-to-all, 2 chunks of hierarchical exchanges "
                                           "(intra-node, then inter-node; chunk k+1's exchange overlaps chunk k's "
                                           f"experts) over expert-parallel groups of {job.top.plan.ep}")
    text = report(job, [], dispatcher_description(job))
    assert f"pinned by the command line: {job.pins.describe()}" in text
    assert f"best: {describe(job.top.plan)}" in text


def test_tune_measures_the_chunks_of_either_algorithm_and_says_so():
    with pytest.raises(SpecError, match="--piper-chunks='tune': full recompute runs each MoE layer's forward twice"):
        pins_from(["--recompute-granularity", "full"], parse_piper_options(["--piper", "--piper-chunks", "tune"]))
    argv = BASE + PIPER + ["--piper-chunks", "tune"]
    options = parse_piper_options(argv)
    assert (options.tune, options.chunks) == (True, None)
    job = planned(argv)
    assert job.result.scored and all(s.plan.ep > 1 and s.plan.recompute != "full" for s in job.result.scored)
    assert {s.plan.a2a for s in job.result.scored} == {"flat", "hierarchical"}
    assert job.pins.describe() == "--piper-chunks tune"
    text = dispatcher_description(job)
    assert "chunk count measured per MoE layer at run time (1/2/4/8 chunks, 3 steps each, then the fastest; " \
           f"planned with {job.top.plan.a2a_chunks})" in text
    hierarchical = planned(BASE + PIPER + ["--piper-a2a", "hierarchical", "--piper-chunks", "tune"])
    assert hierarchical.pins.tune and {s.plan.a2a for s in hierarchical.result.scored} == {"hierarchical"}
    assert dispatcher_description(hierarchical).startswith("Piper pipelined all-to-all of hierarchical exchanges "
                                                           "(intra-node, then inter-node), chunk count measured")


@pytest.mark.parametrize(("flags", "variants"), [
    (["--piper-a2a", "hierarchical", "--piper-chunks", "4"], {("hierarchical", 4)}),
    (["--piper-a2a", "flat", "--piper-chunks", "8"], {("flat", 8)}),
    (["--piper-a2a", "hierarchical"], {("hierarchical", c) for c in (1, 2, 4, 8)}),
    (["--piper-chunks", "2"], {("flat", 2), ("hierarchical", 2)}),
    (["--piper-a2a", "hierarchical", "--piper-chunks", "1"], {("hierarchical", 1)}),  # unpipelined
])
def test_algorithm_and_chunks_are_chosen_independently(flags, variants):
    job = planned(BASE + PIPER + flags)
    assert job.result.scored and all(s.plan.ep > 1 for s in job.result.scored)
    assert {(s.plan.a2a, s.plan.a2a_chunks) for s in job.result.scored} == variants


def test_piper_plans_never_use_megatrons_ep_overlap():
    """Megatron's --overlap-moe-expert-parallel-comm runs in its own dispatcher, which --piper
    replaces: the searched variants leave it out, and every plan is one --piper can run."""
    from piper_core.runners import megatron_piper

    job = planned(BASE + PIPER)
    assert job.result.scored and not any(s.plan.ep_comm_overlap for s in job.result.scored)
    assert all(megatron_piper(s.plan) is None for s in job.result.scored)
    assert "overlap_moe_expert_parallel_comm" not in megatron_settings(job.model, job.top.plan, job.pins)


def test_shared_expert_overlap_follows_what_pipers_dispatcher_runs():
    """The search overlaps a shared expert with the exchange (Megatron's --moe-shared-expert-overlap);
    Piper's dispatcher does not run that overlap (pins.SHARED_EXPERT_OVERLAP), so --piper plans,
    times and exports none, and says so."""
    from piper_megatron.install import SHARED_NOTE
    from piper_megatron.pins import SHARED_EXPERT_OVERLAP

    job = planned(BASE + PIPER + ["--moe-shared-expert-intermediate-size", "1024"])
    settings = megatron_settings(job.model, job.top.plan, job.pins)
    if SHARED_EXPERT_OVERLAP:  # the dispatcher runs it: the plan's overlap reaches Megatron's arguments
        assert job.top.plan.shared_expert_overlap and settings["moe_shared_expert_overlap"] is True
        return
    assert job.result.scored and not any(s.plan.shared_expert_overlap for s in job.result.scored)
    assert "moe_shared_expert_overlap" not in settings and SHARED_NOTE in job.notes
    assert f"piper: note: {SHARED_NOTE}" in report(job, [], dispatcher_description(job))


@pytest.mark.parametrize(("legacy", "current"), [
    (["--piper-a2a", "pipelined", "--piper-chunks", "2"], ["--piper-a2a", "flat", "--piper-chunks", "2"]),
    (["--piper-a2a", "pipelined"], ["--piper-a2a", "flat", "--piper-chunks", "{top}"]),
])
def test_legacy_pipelined_flag_reads_as_flat_chunks_with_a_note(legacy, current):
    with pytest.warns(FutureWarning, match="--piper-a2a: a2a 'pipelined' is read as a2a 'flat' with"):
        old = planned(BASE + PIPER + legacy)
    assert old.result.scored and all(s.plan.a2a == "flat" and s.plan.a2a_chunks >= 2 for s in old.result.scored)
    note = next(n for n in old.notes if "'pipelined' is read as a2a 'flat'" in n)
    assert f"piper: note: {note}" in report(old, [], dispatcher_description(old))
    new = planned(BASE + PIPER + [f.format(top=old.top.plan.a2a_chunks) for f in current])
    assert old.top.plan == new.top.plan and not any("pipelined" in n for n in new.notes)


def test_rewrite_sets_the_plan_and_resets_what_it_does_not_use():
    job = planned(BASE + PIPER)
    ns = parse_megatron_args(BASE + ["--recompute-method", "block"])
    ns.num_layers_per_virtual_pipeline_stage = 1  # as if left over from elsewhere, not pinned
    changes = apply_settings(ns, megatron_settings(job.model, job.top.plan, job.pins))
    plan = job.top.plan
    assert (ns.tensor_model_parallel_size, ns.expert_model_parallel_size, ns.micro_batch_size) == \
        (plan.tp, plan.ep, plan.micro_batch_size)
    assert ns.moe_token_dispatcher_type == "alltoall" and ns.num_layers_per_virtual_pipeline_stage is None
    assert {c.dest for c in changes} >= {"expert_model_parallel_size", "moe_token_dispatcher_type"}


def test_planning_needs_what_it_cannot_guess(tmp_path):
    no_gbs = [a for a in BASE if a not in ("--global-batch-size", "64")]
    with pytest.raises(SpecError, match="--global-batch-size=None: is required with --piper"):
        planned(no_gbs + PIPER)
    with pytest.raises(SpecError, match="precision='fp16': Piper's search plans bf16 mixed precision and fp32 "
                                        "training.*drop --fp16 to train in fp32"):
        planned([a if a != "--bf16" else "--fp16" for a in BASE] + PIPER)
    with pytest.raises(SpecError, match="--piper-cluster=None: is required"):
        planned(BASE + ["--piper"])


def test_fp32_is_planned_for_fp32_with_a_note_and_without_bf16_only_savers():
    """fp32 (neither --bf16 nor --fp16, Megatron's default): every plan searched trains in fp32 and is
    priced so (4-byte weights and gradients, Adam on the weights themselves: no master copy), with a
    note; bf16 gradient reduction and optimizer offload (which validate_args reads only under --bf16 /
    runs as the precision-aware optimizer) are never chosen, even where the bf16 job of the same model
    needs them to fit."""
    fp32 = [a for a in BASE if a != "--bf16"]
    job, bf16 = planned(fp32 + PIPER), planned(BASE + PIPER)
    assert {p.plan.precision for p in job.best} == {"fp32"} and {p.plan.precision for p in bf16.best} == {"bf16"}
    assert any("trains in fp32" in note and "planned for fp32" in note for note in job.notes)
    assert "piper: note: this job trains in fp32 (no --bf16): planned for fp32" in report(job, [], None)
    assert not any("fp32" in note for note in bf16.notes)
    top = job.top.stages[0]  # fp32 weights, fp32 gradients, Adam's m and v over the same shard
    as_bf16 = predict(job.model, job.cluster, dataclasses.replace(job.top.plan, precision="bf16")).stages[0]
    assert (top.weights, top.gradients) == (2 * as_bf16.weights, as_bf16.gradients)
    assert top.optimizer == pytest.approx(as_bf16.optimizer * 8 / 12, abs=1)
    assert planned(SWITCH + PIPER, world=64).top.plan.grad_reduce_in_bf16  # the bf16 job fits only with savers
    with pytest.raises(Infeasible, match="fits 64 GPUs"):
        planned([a for a in SWITCH if a != "--bf16"] + PIPER, world=64)
    with pytest.raises(SpecError, match="--grad-reduce-in-bf16=True: acts only in bf16.*add --bf16, or drop"):
        planned(fp32 + PIPER + ["--grad-reduce-in-bf16"])
    with pytest.raises(SpecError, match="--optimizer-cpu-offload=True: acts only in bf16"):
        planned(fp32 + PIPER + ["--optimizer-cpu-offload"])


def test_profile_is_loaded_as_the_calibrated_cluster(tmp_path):
    from piper_core.calibrate.profile import write_profile
    from piper_core.presets import _HERE, load_cluster

    profile = tmp_path / "h100-profile.yaml"
    write_profile(profile, load_cluster("dgx-h100"), {"machine": {}, "date": "2025-01-01", "ranks": 8, "nodes": 1,
                                                       "command": "piper calibrate", "benchmarks": {}, "fits": {}})
    job = planned(BASE + ["--piper", "--piper-profile", str(profile)])
    assert job.top.plan == planned(BASE + PIPER).top.plan
    assert any("calibrated cluster dgx-h100" in note for note in job.notes)
    bare = tmp_path / "bare.yaml"
    bare.write_text((_HERE / "clusters" / "dgx-h100.yaml").read_text())
    with pytest.raises(SpecError, match="is a ClusterSpec YAML, not a calibration profile"):
        planned(BASE + ["--piper", "--piper-profile", str(bare)])
    with pytest.raises(SpecError, match="--piper-profile=.*must be a YAML file"):
        parse_piper_options(["--piper", "--piper-profile", "profile.json"])


def test_infeasible_request_fails_with_the_reason():
    with pytest.raises(Infeasible, match="no plan for gpt-24L-4096H-512E-top1 fits 8 GPUs of dgx-h100 .*needs at "
                                         "least .* GPUs"):
        planned(SWITCH + PIPER)


# ---- the launcher, without Megatron -----------------------------------------------------------------

def _launch(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``python -m piper_megatron ARGV`` in-process in a fresh interpreter, then the loaded modules."""
    code = ("import json, sys\nfrom piper_megatron.__main__ import main\nrc = main(sys.argv[1:])\n"
            "print('MODULES ' + json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'torch'})))\n"
            "sys.exit(rc)\n")
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)


def test_plan_only_prints_switch_1t_on_64_gpus_without_megatron_or_a_gpu(tmp_path):
    argv = ["pretrain_gpt.py", *SWITCH, *PIPER, "--piper-plan-only", "--piper-world-size", "64"]
    proc = _launch(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    expected = planned(SWITCH + PIPER, world=64).top.plan
    assert f"best: {describe(expected)}" in proc.stdout
    assert expected.grad_reduce_in_bf16 and expected.optimizer_offload_fraction == 1.0  # 1.03 T on 64 GPUs
    assert "pretrain_gpt.py (not found here; plan-only does not need it) was not run" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "MODULES []", "plan-only imported Megatron or torch"


def test_plan_only_never_runs_the_script(tmp_path):
    script = REPO / "tests" / "megatron" / "scripts" / "pretrain_gpt_019.py"  # would import Megatron if run
    proc = _launch([str(script), *BASE, *PIPER, "--piper-plan-only", "--piper-world-size", "8"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"{script} was not run and no model was built" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "MODULES []"


def test_infeasible_plan_only_exits_1_with_the_reason(tmp_path):
    proc = _launch(["pretrain_gpt.py", *SWITCH, *PIPER, "--piper-plan-only", "--piper-world-size", "8"], tmp_path)
    assert proc.returncode == 1
    assert "piper_megatron: infeasible: no plan for gpt-24L-4096H-512E-top1 fits 8 GPUs" in proc.stderr


def test_without_piper_the_script_runs_untouched(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import json, sys\nprint('SCRIPT ' + json.dumps({'argv': sys.argv, 'path0': sys.path[0], "
                      "'megatron': sorted(m for m in sys.modules if m.startswith('megatron'))}))\n")
    proc = _launch([str(script), "--num-layers", "2", "--tensor-model-parallel-size", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SCRIPT "))[7:])
    assert seen == {"argv": [str(script), "--num-layers", "2", "--tensor-model-parallel-size", "2"],
                    "path0": str(tmp_path), "megatron": []}


def test_piper_flags_without_piper_are_refused(tmp_path):
    proc = _launch(["train.py", "--piper-cluster", "dgx-h100"], tmp_path)
    assert proc.returncode == 2 and "only together with --piper" in proc.stderr


def test_install_needs_megatron_training():
    pytest.importorskip("megatron.core")
    from importlib.util import find_spec

    from piper_megatron.install import install

    if find_spec("megatron.training") is not None:
        pytest.skip("megatron.training is importable here")
    assert install(BASE) is None  # no --piper: returns before touching Megatron
    with pytest.raises(SpecError, match="megatron.training=.*the megatron-core 0.16 wheel ships only megatron/core"):
        install(BASE + PIPER)


# ---- the real argument APIs (subprocess with megatron-core 0.19.2's tree) ---------------------------

SCENARIOS = {
    "untouched": {"via": "launcher", "argv": BASE + ["--micro-batch-size", "1"]},
    "piper": {"via": "install", "argv": BASE + PIPER},
    "pinned": {"via": "install", "argv": BASE + PIPER + PINNED},
    "pipeline": {"via": "install", "argv": BASE + PIPER + ["--pipeline-model-parallel-size", "2"]},
    "vpp_pinned": {"via": "install", "argv": BASE + PIPER + ["--pipeline-model-parallel-size", "4",
                                                             "--num-layers-per-virtual-pipeline-stage", "1"]},
    "recompute_pinned": {"via": "install", "argv": BASE + PIPER + ["--recompute-granularity", "full",
                                                                   "--recompute-method", "block",
                                                                   "--recompute-num-layers", "2"]},
    "infeasible": {"via": "install", "argv": SWITCH + ["--lr", "1e-4", "--train-iters", "10"] + PIPER},
    "plan_only": {"via": "install", "argv": BASE + PIPER + ["--piper-plan-only"]},
    "off": {"via": "install", "argv": BASE + PIPER + ["--piper-off", "use-distributed-optimizer,overlap-grad-reduce",
                                                      "--piper-off", "recompute-granularity"]},
    "unfused": {"via": "install", "argv": BASE + PIPER + ["--attention-backend", "unfused"]},
    "typo": {"via": "install", "argv": BASE + PIPER + ["--piper-chunk", "2"]},
    "typo_launcher": {"via": "launcher", "argv": BASE + PIPER + ["--piper-chunk", "2"]},
    "save": {"via": "install", "argv": BASE + PIPER + ["--save", "{work}/saved", "--save-interval", "5"]},  # {work}:
    # the run's directory
    "resume": {"via": "install", "argv": BASE + PIPER + ["--load", "{work}/resume"]},  # saved with PINNED's plan
    "launcher": {"via": "launcher", "argv": BASE + PIPER + ["--expert-model-parallel-size", "4"]},  # last: keeps hooks
}
ENV = {"WORLD_SIZE": str(WORLD), "RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@pytest.fixture(scope="module")
def megatron_019():
    from tests.megatron.megatron_wheel import megatron_tree

    tree, why = megatron_tree()
    if tree is None:
        pytest.skip(f"megatron-core 0.19.2 (the real megatron.training) is not available: {why}")
    return tree


@pytest.fixture(scope="module")
def api_run(megatron_019, tmp_path_factory):
    from tests.megatron.megatron_wheel import tree_env

    cache = {}

    def get(version: str) -> dict:
        if version not in cache:
            work = tmp_path_factory.mktemp(f"version-{version}")
            _saved_checkpoint(work / "resume", planned(BASE + PIPER + PINNED))
            scenarios = {name: s | {"env": ENV, "argv": [a.replace("{work}", str(work)) for a in s["argv"]]}
                         for name, s in SCENARIOS.items()}
            (work / "scenarios.json").write_text(json.dumps(scenarios))
            cmd = [sys.executable, "-m", "tests.megatron.args_driver", version, str(work / "scenarios.json"),
                   str(work / "out.json")]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                                  env=tree_env(megatron_019, REPO))
            assert proc.returncode == 0, proc.stderr[-4000:]
            cache[version] = json.loads((work / "out.json").read_text()) | {"work": str(work)}
        return cache[version]

    return get


def _saved_checkpoint(directory: Path, job) -> None:
    """What a --piper run with --save leaves in ``directory`` once Megatron has saved a checkpoint."""
    from piper_megatron.resume import TRACKER_NAME, make_record, write_record

    write_record(directory, make_record(model=job.model, cluster=job.cluster.name, plan=job.top.plan,
                                        label=describe(job.top.plan)))
    (directory / TRACKER_NAME).write_text("10\n")


def expected_args(plan, off: tuple[str, ...] = ()) -> dict:
    """What Megatron's validated arguments hold under ``plan`` with the switches ``off`` kept off."""
    return {"overlap_grad_reduce": "overlap-grad-reduce" not in off,
            "overlap_param_gather": plan.distributed_optimizer and "overlap-param-gather" not in off,
            "tensor_model_parallel_size": plan.tp, "pipeline_model_parallel_size": plan.pp,
            "virtual_pipeline_model_parallel_size": plan.vpp if plan.virtual_stages > 1 else None,
            "context_parallel_size": plan.cp, "expert_model_parallel_size": plan.ep,
            "expert_tensor_parallel_size": plan.etp_size, "sequence_parallel": plan.sequence_parallel,
            "micro_batch_size": plan.micro_batch_size, "global_batch_size": plan.global_batch_size,
            "recompute_granularity": None if plan.recompute == "none" else plan.recompute,
            "use_distributed_optimizer": plan.distributed_optimizer, "moe_token_dispatcher_type": "alltoall",
            "grad_reduce_in_bf16": plan.grad_reduce_in_bf16,
            "optimizer_cpu_offload": plan.optimizer_offload_fraction > 0,
            "decoder_last_pipeline_num_layers": plan.num_layers_in_last_pipeline_stage, "data_parallel_size": plan.dp}


def _subset(args: dict, keys) -> dict:
    return {k: args[k] for k in keys}


# megatron-core version the subprocess reports -> how its scripts reach validate_args
VERSIONS = {"0.19.2": "parse_and_validate_args", "0.16.1": "pretrain", "0.17.1": "pretrain"}


@pytest.mark.parametrize("version", VERSIONS)
def test_version_is_detected_and_its_apis_are_what_piper_relies_on(api_run, version):
    run = api_run(version)
    assert run["detected"] == {"series": version.rsplit(".", 1)[0], "entry": VERSIONS[version]}
    assert run["drift"] == []  # the 0.19.2 tree's dispatcher APIs (the stand-ins change only megatron.training)


@pytest.mark.parametrize("version", VERSIONS)
def test_plan_only_parser_has_megatrons_defaults(api_run, version):
    real = api_run(version)["parser_defaults"]
    mine = vars(parse_megatron_args([]))
    assert {k: real[k] for k in mine} == {k: (v if not isinstance(v, list) else str(v)) for k, v in mine.items()}


@pytest.mark.parametrize("version", VERSIONS)
def test_without_piper_nothing_of_megatron_is_touched(api_run, version):
    got = api_run(version)["scenarios"]["untouched"]
    assert got["rc"] == 0 and got["piper_lines"] == []
    assert got["changed_after"] == [], "module attributes differ from the originals"
    assert not any(got["hooks"].values())
    assert (got["args"]["tensor_model_parallel_size"], got["args"]["moe_token_dispatcher_type"]) == (1, "allgather")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("scenario", ["piper", "pinned", "pipeline", "vpp_pinned", "recompute_pinned", "off", "unfused",
                                      "launcher"])
def test_megatron_validates_the_plan(api_run, version, scenario):
    got = api_run(version)["scenarios"][scenario]
    assert "error" not in got and got.get("exit") is None, got
    job = planned(SCENARIOS[scenario]["argv"])
    want = expected_args(job.top.plan, job.pins.off_all)
    assert _subset(got["args"], want) == want
    assert f"piper: pinned by the command line: {job.pins.describe()}" in got["piper_lines"]
    assert f"piper: token dispatcher: {dispatcher_description(job)}" in got["piper_lines"]
    assert got["hooks"]["arguments.validate_args"] and got["hooks"]["parallel_state.initialize_model_parallel"]
    assert got["hooks"]["initialize.validate_args"] == (VERSIONS[version] == "pretrain")  # bound at import there
    if scenario != "launcher":
        assert got["install_again_is_same"], "a second install() hooked Megatron twice"
        assert got["changed_after"] == [], "restore() left hooks behind"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_vocabulary_is_read_as_the_release_reads_it(api_run, version):
    """NullTokenizer --vocab-size 32000: 0.18-0.19's is 32000 tokens, and the real 0.19.2 tokenizer
    pads the vocabulary Piper planned; 0.16-0.17's appends an end-of-document token (32001), which
    the plan reads and notes (the stand-ins run 0.19.2's tokenizer, so only the note is checked)."""
    got = api_run(version)["scenarios"]["piper"]
    note = ("piper: note: megatron-core 0.1{}'s NullTokenizer appends an end-of-document token: vocabulary 32001 "
            "(--vocab-size 32000 + 1), padded as Megatron pads it")
    if VERSIONS[version] == "pretrain":
        assert note.format(version[3]) in got["piper_lines"]
        return
    assert not any("NullTokenizer" in line for line in got["piper_lines"])
    job = planned(SCENARIOS["piper"]["argv"])
    assert got["args"]["padded_vocab_size"] == job.model.padded_vocab(got["args"]["tensor_model_parallel_size"])


@pytest.mark.parametrize("version", VERSIONS)
def test_pinned_sizes_survive_megatrons_validation(api_run, version):
    scenarios = api_run(version)["scenarios"]
    args = scenarios["pinned"]["args"]
    assert (args["tensor_model_parallel_size"], args["micro_batch_size"]) == (2, 1)
    args = scenarios["vpp_pinned"]["args"]
    assert (args["pipeline_model_parallel_size"], args["virtual_pipeline_model_parallel_size"]) == (4, 2)
    args = scenarios["recompute_pinned"]["args"]
    recompute = (args["recompute_granularity"], args["recompute_method"], args["recompute_num_layers"])
    assert recompute == ("full", "block", 2)


@pytest.mark.parametrize("version", VERSIONS)
def test_infeasible_request_fails_before_megatron_accepts_arguments(api_run, version):
    got = api_run(version)["scenarios"]["infeasible"]
    assert got["error"].startswith("Infeasible: no plan for gpt-24L-4096H-512E-top1 fits 8 GPUs of dgx-h100")
    assert got["args"] is None, "Megatron set its global arguments: the run would have gone on to build the model"


@pytest.mark.parametrize("version", VERSIONS)
def test_plan_only_exits_inside_validation(api_run, version):
    got = api_run(version)["scenarios"]["plan_only"]
    assert got["exit"] == 0 and got["args"] is None
    assert f"best: {describe(planned(BASE + PIPER).top.plan)}" in got["stdout"].splitlines()


@pytest.mark.parametrize("version", VERSIONS)
def test_switches_kept_off_stay_off_through_megatrons_validation(api_run, version):
    args = api_run(version)["scenarios"]["off"]["args"]
    assert (args["use_distributed_optimizer"], args["overlap_grad_reduce"], args["overlap_param_gather"],
            args["recompute_granularity"]) == (False, False, False, None)
    piper = api_run(version)["scenarios"]["piper"]["args"]
    assert (piper["use_distributed_optimizer"], piper["overlap_grad_reduce"]) == (True, True)  # on without --piper-off


@pytest.mark.parametrize("version", VERSIONS)
def test_a_misspelt_piper_flag_stops_before_megatron_parses(api_run, version):
    scenarios = api_run(version)["scenarios"]
    got = scenarios["typo"]
    assert got["error"].startswith("SpecError: flag='--piper-chunk': is not one of Piper's flags")
    assert got["args"] is None and not any(got["hooks"].values())
    assert scenarios["typo_launcher"]["rc"] == 2 and scenarios["typo_launcher"]["args"] is None


@pytest.mark.parametrize("version", VERSIONS)
def test_save_and_resume_through_megatrons_arguments(api_run, version):
    from piper_megatron.resume import RECORD_NAME, layout_of, read_record

    run = api_run(version)
    got = run["scenarios"]["save"]
    assert "error" not in got and got.get("exit") is None, got
    record = read_record(Path(run["work"]) / "saved" / RECORD_NAME)
    assert record.fields == dict(layout_of(planned(BASE + PIPER).top.plan))
    assert {k: dict(record.megatron)[k] for k in ("tensor_model_parallel_size", "expert_model_parallel_size",
                                                   "micro_batch_size")} == \
        {k: got["args"][k] for k in ("tensor_model_parallel_size", "expert_model_parallel_size", "micro_batch_size")}
    resumed = run["scenarios"]["resume"]
    assert "error" not in resumed, resumed
    recorded = planned(BASE + PIPER + PINNED).top.plan
    want = expected_args(recorded)
    assert _subset(resumed["args"], want) == want
    assert any("resuming with the plan its checkpoint was saved with" in line for line in resumed["piper_lines"])


def test_defer_wgrad_flag_plans_deferred_exchanges_and_exports_the_flag():
    """``--piper-defer-wgrad``: the whole search runs (Megatron's EP-overlap variants included, which
    keep their own delay), the pick defers and says so, and the export passes the flag on."""
    from piper_core.export import piper_flags

    job = planned(SWITCH + PIPER + ["--piper-defer-wgrad"], world=1024)
    plan = job.top.plan
    assert plan.ep > 1 and plan.defer_wgrad and describe(plan).endswith("+dwg")
    assert all(s.plan.defer_wgrad == (s.plan.ep > 1 and not s.plan.ep_comm_overlap) for s in job.result.scored)
    assert dispatcher_description(job).endswith("the experts' weight gradients computed while each dispatch "
                                                "gradient is in flight")
    assert ("--piper-defer-wgrad", None) in piper_flags(plan)
    plain = planned(SWITCH + PIPER, world=1024).top
    assert job.top.time.step <= plain.time.step


def test_the_experts_are_priced_as_the_command_line_runs_them():
    """Megatron's --moe-grouped-gemm is off by default: without it the plan prices one GEMM per local
    expert even on a preset whose GPUs usually group them; with it, grouped GEMMs; with
    --piper-defer-wgrad it is refused by name (the split backward needs the expert linears as torch ops)."""
    plain = planned(SWITCH + PIPER, world=1024)
    grouped = planned(SWITCH + PIPER + ["--moe-grouped-gemm"], world=1024)
    assert load_cluster("dgx-h100").accelerator.grouped_gemm  # the preset's habit
    assert not plain.top.plan.grouped_gemm_on(plain.cluster.accelerator)
    assert grouped.top.plan.grouped_gemm_on(grouped.cluster.accelerator)
    with pytest.raises(SpecError, match=r"--moe-grouped-gemm=True: --piper-defer-wgrad splits .* drop --moe-grouped-gemm"):
        planned(SWITCH + PIPER + ["--moe-grouped-gemm", "--piper-defer-wgrad"], world=1024)


# ---- --piper-routing ------------------------------------------------------------------------------

def test_piper_routing_prices_the_measured_load(tmp_path):
    """A measured routing that sends 4x the mean to four experts (one rank's under Megatron's
    contiguous placement): the plan's predicted step grows, the plan says why, and the same routing
    with a placement that spreads those experts is predicted faster."""
    import yaml

    hot = [400] * 4 + [100] * 12
    path = tmp_path / "routing.yaml"
    path.write_text(yaml.safe_dump({"num_experts": 16, "default": hot}))
    pinned = PIPER + BASE + ["--expert-model-parallel-size", "4"]
    even = planned(pinned)
    skewed = planned(pinned + ["--piper-routing", str(path)])
    assert skewed.best[0].time.step > 1.2 * even.best[0].time.step
    assert any(n.startswith(f"--piper-routing {path}") for n in skewed.notes)
    spread = tmp_path / "placement.json"
    spread.write_text(json.dumps({"num_experts": 16, "ep": 4, "ranks": [[0, 4, 5, 6], [1, 7, 8, 9], [2, 10, 11, 12],
                                                                        [3, 13, 14, 15]]}))
    placed = planned(pinned + ["--piper-routing", str(path), "--piper-placement", str(spread)])
    assert placed.best[0].time.step < skewed.best[0].time.step
    assert placed.best[0].time.step == pytest.approx(even.best[0].time.step, rel=0.02)


def test_piper_routing_errors_name_the_flag(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("num_experts: 8\ndefault: [1, 1, 1, 1, 1, 1, 1, 1]\n")
    with pytest.raises(SpecError, match="num_experts"):
        planned(PIPER + BASE + ["--piper-routing", str(path)])
    with pytest.raises(SpecError, match="--piper-routing.*only together with --piper"):
        parse_piper_options(BASE + ["--piper-routing", str(path)])


# ---- --piper-migrate-every -------------------------------------------------------------------------

def test_piper_migrate_every_reads_its_iterations_and_the_horizon_defaults_to_them():
    options = parse_piper_options(PIPER + BASE + ["--piper-migrate-every", "50"])
    assert (options.migrate_every, options.migrate_horizon) == (50, 50)
    options = parse_piper_options(PIPER + BASE + ["--piper-migrate-every=10", "--piper-migrate-horizon", "400"])
    assert (options.migrate_every, options.migrate_horizon) == (10, 400)
    assert parse_piper_options(PIPER + BASE).migrate_every is None
    job = planned(PIPER + BASE + ["--piper-migrate-every", "10"])  # plans as without the flag
    assert job.top.plan == planned(PIPER + BASE).top.plan


@pytest.mark.parametrize("flags, message", [
    (["--piper-migrate-every", "0"], r"--piper-migrate-every='0': must be a whole number of iterations >= 1 "
                                     r"\(decides every that many iterations\); write e.g. --piper-migrate-every 100"),
    (["--piper-migrate-every", "2.5"], r"--piper-migrate-every='2.5': must be a whole number of iterations >= 1"),
    (["--piper-migrate-every", "often"], r"--piper-migrate-every='often': must be a whole number"),
    (["--piper-migrate-every", "5", "--piper-migrate-horizon", "-3"],
     r"--piper-migrate-horizon='-3': must be a whole number of iterations >= 1 \(counts the gain over that many "
     r"iterations\); write e.g. --piper-migrate-horizon 100"),
    (["--piper-migrate-horizon", "100"], r"--piper-migrate-horizon=100: counts a migration's gain over that many "
                                         r"iterations, and no migration is decided without --piper-migrate-every; "
                                         r"add --piper-migrate-every N, or drop --piper-migrate-horizon"),
])
def test_bad_piper_migrate_values_are_refused_by_name(flags, message):
    with pytest.raises(SpecError, match=message):
        parse_piper_options(PIPER + BASE + flags)


def test_piper_migrate_every_needs_piper_and_a_job_whose_experts_can_move():
    with pytest.raises(SpecError, match=r"--piper-migrate-every='given': Piper's flags act only together with "
                                        r"--piper .*add --piper, or drop --piper-migrate-every"):
        parse_piper_options(BASE + ["--piper-migrate-every", "10"])
    moe = {"--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk"}
    dense = [a for i, a in enumerate(BASE) if a not in moe and (i == 0 or BASE[i - 1] not in moe)]
    with pytest.raises(SpecError, match=r"--piper-migrate-every=10: moves experts between expert-parallel ranks, "
                                        r"and this model has none; drop --piper-migrate-every, or add --num-experts"):
        planned(PIPER + dense + ["--piper-migrate-every", "10"])
    with pytest.raises(SpecError, match=r"--piper-migrate-every=10: moves experts one module each .*--moe-grouped-gemm "
                                        r"keeps .*; drop --moe-grouped-gemm or --piper-migrate-every"):
        planned(PIPER + BASE + ["--piper-migrate-every", "10", "--moe-grouped-gemm"])
    with pytest.raises(SpecError, match=r"--piper-migrate-every=10: moves the distributed optimizer's state as fp32"):
        planned(PIPER + BASE + ["--piper-migrate-every", "10", "--use-precision-aware-optimizer"])


# ---- the dispatcher's exchange domain --------------------------------------------------------------

@pytest.mark.parametrize("cluster, local, domain", [("gb200-nvl72", "4", 64), ("dgx-h100", "8", 8), ("gb200-nvl72", "", 64)])
def test_the_dispatcher_exchanges_within_the_nvlink_domain(monkeypatch, cluster, local, domain):
    """On GB200 NVL72 torchrun starts 4 ranks per compute tray (LOCAL_WORLD_SIZE=4), yet 64 of them
    share one NVLink domain: the hierarchical exchange's fast stage spans the domain, as the plan
    priced it (ClusterSpec.exchange_domain_ranks); on DGX H100 the domain is the node."""
    from piper_megatron.install import dispatch_request

    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    argv = ["--piper", "--piper-cluster", cluster] + BASE + ["--expert-model-parallel-size", "16"]
    planned_job = planned(argv, world=128)
    request = dispatch_request(planned_job, parse_piper_options(argv), 7)
    assert request.ranks_per_node == domain and request.timeout_minutes == 7
    assert (request.a2a, request.chunks) == (planned_job.top.plan.a2a, planned_job.top.plan.a2a_chunks)


# ---- a pinned pipeline layout ----------------------------------------------------------------------



def test_a_pinned_layout_is_the_plans_and_megatrons(tmp_path):
    """--pipeline-model-parallel-layout on the command line: the plan runs that layout (its pp x vpp
    from the stage count), the rewrite leaves the flag as written, and the model's rules are checked
    before the search (a layout with the wrong layer count is refused by name)."""
    layout = "Ettt|tt|t|ttL"  # 8 layers over 4 stages, uneven: no even split would give it
    argv = PIPER + BASE + ["--pipeline-model-parallel-layout", layout, "--pipeline-model-parallel-size", "2"]
    job = planned(argv)
    plans = [p.plan for p in job.best]
    assert plans and all(p.pipeline_layout == layout and p.pp == 2 and p.vpp == 2 for p in plans)
    from piper_megatron.args import megatron_settings

    settings = megatron_settings(job.model, plans[0], job.pins)
    assert "pipeline_model_parallel_layout" not in settings  # pinned: Megatron keeps the user's value
    assert settings.get("num_virtual_stages_per_pipeline_rank") is None  # Megatron derives vpp from the layout
    with pytest.raises(SpecError, match=r"--pipeline-model-parallel-layout=.*places 7 transformer layers \(t\), "
                                        r"but .* has 8"):
        planned(PIPER + BASE + ["--pipeline-model-parallel-layout", "Ettt|tt|t|tL"])
