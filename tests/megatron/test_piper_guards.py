"""``--piper``'s silent paths, closed (issue 13): a misspelt Piper flag is an error, every switch
``--piper`` turns on can be kept off (``--piper-off``), an infeasible candidate never ends the
search, and a missing package of Megatron-LM's training code is named.

No Megatron is needed here (the real parsers are exercised in tests/megatron/test_piper_args.py's
subprocess scenarios); the missing-package cases import a stand-in ``megatron.training`` from a
temporary directory.
"""

from __future__ import annotations

import argparse
import functools
import io
import sys

import pytest

from piper_core.errors import SpecError
from piper_core.presets import load_model
from piper_megatron.args import (
    PIPER_FLAGS,
    add_piper_arguments,
    apply_settings,
    check_piper_flags,
    megatron_settings,
    parse_megatron_args,
    parse_piper_options,
)
from piper_megatron.install import Installation, report
from piper_megatron.versions import release
from piper_megatron.pins import OFF_NAMES, pins_from
from tests.megatron.test_piper_args import BASE, PIPER, _launch, flags_of, planned

# ---- 1. misspelt Piper flags ------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "flag", "near"), [
    (["--piper-chunk", "2"], "--piper-chunk", "--piper-chunks"),  # argparse would take it as an abbreviation
    (["--piper-clusters=dgx-h100"], "--piper-clusters", "--piper-cluster"),
    (["--piper-of", "sequence-parallel"], "--piper-of", "--piper-off"),
    (["--piper-planonly"], "--piper-planonly", "--piper-plan-only"),
])
def test_misspelt_piper_flags_are_errors_naming_the_nearest(argv, flag, near):
    message = f"flag='{flag}': is not one of Piper's flags .*; write {near}"
    with pytest.raises(SpecError, match=message):
        parse_piper_options(BASE + PIPER + argv)
    with pytest.raises(SpecError, match=message):  # Megatron's namespace holds no trace of it: argv is checked
        planned(BASE + PIPER + argv)
    with pytest.raises(SpecError, match=message):  # without --piper too: it is no Megatron flag either
        parse_piper_options(BASE + argv)


def test_every_real_piper_flag_passes_the_check():
    parser = add_piper_arguments(argparse.ArgumentParser(add_help=False))
    assert PIPER_FLAGS == {s for a in parser._actions for s in a.option_strings}
    check_piper_flags([*PIPER_FLAGS, "--piper-a2a=flat", "--pipeline-model-parallel-size", "2", "--num-layers"])


def test_a_misspelt_flag_stops_the_launcher_before_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = _launch([str(script), *BASE, *PIPER, "--piper-chunk", "2"], tmp_path)
    assert proc.returncode == 2
    assert "piper_megatron: error: flag='--piper-chunk': is not one of Piper's flags" in proc.stderr
    assert not marker.exists(), "the script ran"
    assert proc.stdout.splitlines()[-1] == "MODULES []"
    plan_only = _launch(["pretrain_gpt.py", *BASE, *PIPER, "--piper-plan-only", "--piper-world-size", "8",
                         "--piper-chunk", "2"], tmp_path)
    assert plan_only.returncode == 2 and "write --piper-chunks" in plan_only.stderr


# ---- 2. --piper-off ----------------------------------------------------------------------------------

# Mixtral 8x7B on 16 H100s: among the feasible plans, some use each switch (dopt, sp, gbf16, offload, recompute).
MIXTRAL = flags_of(load_model("mixtral-8x7b")) + ["--global-batch-size", "64", "--bf16"] + PIPER
GPUS = 16
USES = {"use-distributed-optimizer": lambda p: p.distributed_optimizer,
        "sequence-parallel": lambda p: p.sequence_parallel,
        "grad-reduce-in-bf16": lambda p: p.grad_reduce_in_bf16,
        "optimizer-cpu-offload": lambda p: p.optimizer_offload_fraction > 0,
        "use-precision-aware-optimizer": lambda p: p.optimizer_offload_fraction > 0,  # Piper sets it with offload
        "recompute-granularity": lambda p: p.recompute != "none"}


@functools.cache
def _free():
    return planned(MIXTRAL, GPUS)


@pytest.mark.parametrize("name", OFF_NAMES)
def test_each_switch_piper_turns_on_can_be_kept_off(name):
    free, job = _free(), planned(MIXTRAL + ["--piper-off", name], GPUS)
    dest, off = name.replace("-", "_"), None if name == "recompute-granularity" else False
    uses = USES.get(name)
    if uses is not None:  # the search honours it: no plan uses it, where some would
        assert any(uses(s.plan) for s in free.result.scored)
        assert job.result.scored and not any(uses(s.plan) for s in job.result.scored)
    else:  # the overlaps: every plan would set them
        assert megatron_settings(free.model, free.top.plan, free.pins)[dest] is True
        assert any("the predicted step time assumes Megatron overlaps" in note for note in job.notes)
    settings = megatron_settings(job.model, job.top.plan, job.pins)
    assert settings[dest] == off
    ns = parse_megatron_args(MIXTRAL)
    apply_settings(ns, settings)
    assert getattr(ns, dest) == off
    assert f"--piper-off {name}" in job.pins.describe()
    assert f"piper: pinned by the command line: {job.pins.describe()}" in report(job, [], None)


def test_off_implies_what_megatron_needs_with_it_and_lists_it():
    job = planned(MIXTRAL + ["--piper-off", "use-distributed-optimizer"], GPUS)
    assert job.pins.off_all == ("use-distributed-optimizer", "overlap-param-gather", "optimizer-cpu-offload")
    assert job.pins.describe() == ("--moe-token-dispatcher-type alltoall, --piper-off use-distributed-optimizer "
                                   "(so also off: overlap-param-gather, optimizer-cpu-offload)")
    settings = megatron_settings(job.model, job.top.plan, job.pins)
    assert (settings["use_distributed_optimizer"], settings["overlap_param_gather"],
            settings["optimizer_cpu_offload"], settings["overlap_grad_reduce"]) == (False, False, False, True)
    both = parse_piper_options(["--piper", "--piper-off", "sequence-parallel,recompute-granularity",
                                "--piper-off", "grad-reduce-in-bf16"])
    assert both.off == ("sequence-parallel", "grad-reduce-in-bf16", "recompute-granularity")


@pytest.mark.parametrize(("argv", "message"), [
    (["--piper-off", "distributed-optimizer"], "--piper-off='distributed-optimizer': names a Megatron switch --piper "
                                               "may turn on, without its dashes: one of use-distributed-optimizer, .*; "
                                               "write --piper-off use-distributed-optimizer"),
    (["--piper-off", "sequence-parallel,"], "--piper-off='': names a Megatron switch"),
    (["--piper-off", "use-distributed-optimizer", "--use-distributed-optimizer"],
     "--piper-off='use-distributed-optimizer': keeps --use-distributed-optimizer off, and --use-distributed-optimizer "
     "is on the command line too; drop --use-distributed-optimizer or take use-distributed-optimizer out of"),
    (["--piper-off", "use-distributed-optimizer", "--optimizer-cpu-offload"],
     "--piper-off='optimizer-cpu-offload': keeps --optimizer-cpu-offload off \\(implied by --piper-off "
     "use-distributed-optimizer"),
    (["--piper-off", "overlap-grad-reduce", "--overlap-param-gather"], "implied by --piper-off overlap-grad-reduce"),
    (["--piper-off", "recompute-granularity", "--recompute-granularity", "full"], "keeps --recompute-granularity off"),
])
def test_off_errors(argv, message):
    with pytest.raises(SpecError, match=message):
        pins_from(argv, parse_piper_options(["--piper", *argv]))


def test_off_without_piper_is_refused():
    with pytest.raises(SpecError, match="--piper-off=.*only together with --piper"):
        parse_piper_options(["--piper-off", "sequence-parallel"])


def test_pinned_overlap_param_gather_keeps_the_distributed_optimizer():
    job = planned(BASE + PIPER + ["--overlap-param-gather"])
    assert job.result.scored and all(s.plan.distributed_optimizer for s in job.result.scored)
    assert not all(s.plan.distributed_optimizer for s in planned(BASE + PIPER).result.scored)


# ---- 3. an infeasible candidate never ends the search ----------------------------------------------

def test_unfused_attention_plans_with_the_rejections_counted():
    job = planned(BASE + PIPER + ["--attention-backend", "unfused"])
    unfused = {reason: n for reason, n in job.result.rejected.items() if "unfused" in reason}
    assert unfused and all(n > 0 for n in unfused.values())
    assert job.result.scored and all(s.plan.cp == 1 and s.plan.attention_backend == "unfused"
                                     for s in job.result.scored)
    assert any(s.plan.cp > 1 for s in planned(BASE + PIPER).result.scored)  # cp > 1 was in the space


# ---- 4. a missing package of megatron.training is named ---------------------------------------------

@pytest.fixture
def fake_training(tmp_path, monkeypatch):
    """A stand-in ``megatron/training`` whose ``arguments.py`` imports what the test writes; joins the
    ``megatron`` namespace package (megatron-core's ``megatron/`` has no ``__init__.py``)."""
    from importlib.util import find_spec

    if find_spec("megatron.training") is not None:
        pytest.skip("a real megatron.training is importable here")
    training = tmp_path / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(body: str) -> None:
        (training / "arguments.py").write_text(body)

    yield write
    for name in [m for m in sys.modules if m == "megatron.training" or m.startswith("megatron.training.")]:
        del sys.modules[name]
    if hasattr(sys.modules.get("megatron"), "training"):
        delattr(sys.modules["megatron"], "training")


def _apply() -> None:
    Installation(release("0.19.2"), [], io.StringIO()).apply()


@pytest.mark.parametrize("module", ["six", "regex"])
def test_a_missing_dependency_of_megatron_training_is_named(fake_training, monkeypatch, module):
    fake_training(f"import {module}\n")
    monkeypatch.setitem(sys.modules, module, None)  # `import six` now fails as if it were not installed
    with pytest.raises(SpecError, match=f"megatron.training='needs {module}': Megatron-LM's training code imports "
                                        f"{module}, which is not installed .*; pip install six regex \\(or the extra that "
                                        "holds them: pip install 'piper-moe\\[megatron-lm\\]'\\)$") as caught:
        _apply()
    assert "checkout" not in str(caught.value)


def test_another_missing_package_is_named_with_the_extras(fake_training):
    fake_training("import piper_test_no_such_package.sub\n")
    with pytest.raises(SpecError, match="needs piper_test_no_such_package'.*imports piper_test_no_such_package, "
                                        "which is not installed.*pip install piper_test_no_such_package six regex"):
        _apply()


def test_a_megatron_module_missing_means_mismatched_versions(fake_training):
    fake_training("import megatron.piper_test_newer_module\n")
    with pytest.raises(SpecError, match="needs megatron.piper_test_newer_module'.*the installed megatron-core lacks"
                                        ".*checkout of the same version as megatron-core"):
        _apply()


ARGUMENTS_016 = "def add_megatron_arguments(parser):\n    return parser\n\n\ndef validate_args(args, defaults={}):\n    pass\n"


def test_a_checkout_without_the_entry_of_its_release_is_named(fake_training, tmp_path):
    """0.18-0.19's scripts validate through ``parse_and_validate_args`` (core_v0.18.0 on), 0.16-0.17's
    through the ``validate_args`` that ``initialize.py`` imported: a checkout of the other kind
    beside megatron-core is refused with the tag to check out (piper_megatron/versions.py)."""
    fake_training(ARGUMENTS_016)  # 0.16-0.17's arguments.py: no parse_and_validate_args
    with pytest.raises(SpecError, match=r"arguments='parse_and_validate_args missing': megatron-core reports 0\.19, "
                                        r"whose scripts call it.*tag core_v0\.19\.x\)$"):
        _apply()
    (tmp_path / "megatron" / "training" / "initialize.py").write_text("def initialize_megatron():\n    pass\n")
    with pytest.raises(SpecError, match=r"initialize='validate_args missing': megatron-core reports 0\.17, whose "
                                        r"initialize_megatron calls validate_args imported by name.*core_v0\.17\.x\)$"):
        Installation(release("0.17.1"), [], io.StringIO()).apply()


def test_without_megatron_training_the_checkout_is_blamed():
    pytest.importorskip("megatron.core")
    from importlib.util import find_spec

    if find_spec("megatron.training") is not None:
        pytest.skip("megatron.training is importable here")
    with pytest.raises(SpecError, match="megatron.training='not importable'.*ships only megatron/core; run the script "
                                        "from a Megatron-LM checkout"):
        _apply()
