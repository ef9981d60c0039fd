"""A resumed ``--piper`` run keeps the plan its checkpoint was saved with (piper_megatron.resume),
at the level of ``Installation.prepare`` and ``plan_job`` on temporary directories; no training.

A "checkpoint" here is Megatron's tracker file (``latest_checkpointed_iteration.txt``), which is
what Megatron's ``checkpoint_exists`` looks for; the real-parser run of the same path is a scenario
of tests/megatron/test_piper_args.py.
"""

from __future__ import annotations

import argparse
import io
import json

import pytest

from piper_core.cli.plan import describe
from piper_core.errors import Infeasible, SpecError
from piper_megatron.args import add_piper_arguments, parse_megatron_args
from piper_megatron.install import Installation, report
from piper_megatron.versions import release
from piper_megatron.resume import RECORD_NAME, TRACKER_NAME, layout_of, read_record
from tests.megatron.test_piper_args import BASE, PINNED, PIPER, WORLD, planned


def megatron_args(argv: list[str], *, rank: int = 0, world: int = WORLD) -> argparse.Namespace:
    """A namespace with Megatron's names for ``argv`` and Piper's flags, as the validate_args hook sees it."""
    ns = parse_megatron_args(argv)
    parser = add_piper_arguments(argparse.ArgumentParser(allow_abbrev=False, add_help=False))
    ns, _ = parser.parse_known_args(argv, namespace=ns)
    ns.rank, ns.world_size = rank, world
    return ns


@pytest.fixture
def prepare(monkeypatch):
    """``Installation.prepare`` for a command line: (installation, args, what rank 0 printed).
    The dispatcher hook is left out (it needs Megatron-Core's parallel_state)."""
    monkeypatch.setattr(Installation, "hook_model_parallel", lambda self, request: None)

    def run(argv: list[str], **kw):
        out, args = io.StringIO(), megatron_args(argv, **kw)
        installation = Installation(release("0.19.2"), argv, out)
        installation.prepare(args, {})
        return installation, args, out.getvalue()

    return run


def checkpoint(directory) -> None:
    """What Megatron leaves after saving iteration 10."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TRACKER_NAME).write_text("10\n")


def saved(prepare, directory, argv=BASE + PIPER + PINNED):
    """A run of ``argv`` that saved a checkpoint to ``directory``; its plan."""
    installation, _, _ = prepare(argv + ["--save", str(directory)])
    checkpoint(directory)
    return installation.planned.top.plan


# ---- --save records the plan ---------------------------------------------------------------------

def test_save_records_the_plan_creating_the_directory(prepare, tmp_path):
    directory = tmp_path / "runs" / "ckpt"  # does not exist yet: created before Megatron would
    installation, args, printed = prepare(BASE + PIPER + ["--save", str(directory)])
    plan = installation.planned.top.plan
    record = read_record(directory / RECORD_NAME)
    assert record.fields == dict(layout_of(plan))
    assert (record.model, record.world_size, record.cluster, record.plan) == (
        installation.planned.model.name, WORLD, "dgx-h100", describe(plan))
    megatron = dict(record.megatron)
    for dest in ("tensor_model_parallel_size", "expert_model_parallel_size", "micro_batch_size",
                 "use_distributed_optimizer", "overlap_grad_reduce", "moe_token_dispatcher_type"):
        assert megatron[dest] == getattr(args, dest)
    assert f"piper: plan recorded in {directory / RECORD_NAME}" in printed
    body = json.loads((directory / RECORD_NAME).read_text())
    assert body["format"] == 2 and body["layout"]["ep"] == plan.ep
    assert (body["layout"]["shared_expert_overlap"], body["layout"]["ep_comm_overlap"]) == (False, False)


@pytest.mark.parametrize("changes", [{"shared_expert_overlap": True, "a2a": "hierarchical", "a2a_chunks": 4},
                                     {"ep_comm_overlap": True}])
def test_the_exchange_fields_round_trip(tmp_path, changes):
    from piper_core.presets import load_model
    from piper_core.specs.parallel import ParallelPlan
    from piper_megatron.resume import make_record, write_record

    plan = ParallelPlan(gpus=8, ep=8, global_batch_size=64, **changes)
    record = make_record(model=load_model("deepseek-v3"), cluster="dgx-h100", plan=plan, label=describe(plan))
    read = read_record(write_record(tmp_path, record))
    assert read == record
    assert ParallelPlan(gpus=8, global_batch_size=64, **read.fields) == plan

def test_only_rank_0_records_and_plan_only_never_does(prepare, tmp_path):
    prepare(BASE + PIPER + ["--save", str(tmp_path / "rank1")], rank=1)
    assert not (tmp_path / "rank1").exists()
    with pytest.raises(SystemExit) as exit_:
        prepare(BASE + PIPER + ["--piper-plan-only", "--save", str(tmp_path / "preview")])
    assert exit_.value.code == 0 and not (tmp_path / "preview").exists()


# ---- --load resumes the recorded plan ------------------------------------------------------------

def test_resume_keeps_the_recorded_plan_and_says_so(prepare, tmp_path):
    directory = tmp_path / "ckpt"
    plan = saved(prepare, directory)
    assert planned(BASE + PIPER).top.plan != plan  # unpinned, the search would choose another plan
    installation, args, printed = prepare(BASE + PIPER + ["--load", str(directory), "--save", str(directory)])
    job = installation.planned
    assert job.top.plan == plan and job.result.candidates == 1
    assert (args.tensor_model_parallel_size, args.micro_batch_size) == (plan.tp, plan.micro_batch_size)
    assert (f"piper: note: --load {directory}: resuming with the plan its checkpoint was saved with, "
            f"{describe(plan)} ({directory / RECORD_NAME}, Piper ") in printed
    again = prepare(BASE + PIPER + PINNED + ["--load", str(directory)])[0]  # the same pins agree with it
    assert again.planned.top.plan == plan


def test_a_load_directory_without_a_checkpoint_is_a_fresh_start(tmp_path):
    directory = tmp_path / "ckpt"  # `--save D --load D` on the first run: nothing to resume
    argv = BASE + PIPER + ["--load", str(directory), "--save", str(directory)]
    free = planned(BASE + PIPER).top.plan
    assert planned(argv).top.plan == free
    directory.mkdir()
    (directory / RECORD_NAME).write_text("{}")  # a record without a checkpoint describes nothing yet
    assert planned(argv).top.plan == free


def test_resume_refuses_another_world_size(prepare, tmp_path):
    saved(prepare, tmp_path / "ckpt")
    argv = BASE + PIPER + ["--load", str(tmp_path / "ckpt")]
    with pytest.raises(SpecError, match="--load=.*: its checkpoint was saved by a run on 8 GPUs .*and this run has 16"
                                        ".*; launch on 8 GPUs, or start a new run with a fresh --save directory"):
        planned(argv, world=16)


def test_resume_refuses_another_model(prepare, tmp_path):
    saved(prepare, tmp_path / "ckpt")
    argv = [a if a != "8" else "4" for a in BASE] + PIPER + ["--load", str(tmp_path / "ckpt")]  # --num-layers 4
    with pytest.raises(SpecError, match="its checkpoint is of model gpt-8L-1024H-16E-top2 .*this command line "
                                        "describes gpt-4L-1024H-16E-top2"):
        planned(argv)


@pytest.mark.parametrize(("flags", "what"), [
    (["--tensor-model-parallel-size", "4"], "tp 2 \\(allowed now: 4; set by --tensor-model-parallel-size"),
    (["--micro-batch-size", "2"], "micro_batch_size 1 .*set by --micro-batch-size"),
    (["--piper-a2a", "flat"], "a2a \\('hierarchical', 2, False\\) .*set by --piper-a2a or --piper-chunks"),
    (["--piper-chunks", "4"], "a2a \\('hierarchical', 2, False\\) .*set by --piper-a2a or --piper-chunks"),
    (["--piper-off", "use-distributed-optimizer"],
     "distributed_optimizer True .*--piper-off use-distributed-optimizer"),
    (["--piper-off", "sequence-parallel"], "sequence_parallel True .*set by --piper-off sequence-parallel"),
    (["--recompute-granularity", "full"], "recompute 'none' .*set by --recompute-granularity"),
])
def test_resume_refuses_a_flag_that_rules_the_recorded_plan_out(prepare, tmp_path, flags, what):
    plan = saved(prepare, tmp_path / "ckpt")
    assert (plan.tp, plan.micro_batch_size, plan.a2a, plan.a2a_chunks, plan.distributed_optimizer, plan.recompute) == (
        2, 1, "hierarchical", 2, True, "none")
    with pytest.raises(SpecError, match=f"--load=.*: its checkpoint was saved with the plan {describe(plan)} .*"
                                        f"rules out its {what}.*; drop or change that flag so that the run resumes"):
        planned(BASE + PIPER + flags + ["--load", str(tmp_path / "ckpt")])


def test_resume_refuses_a_batch_the_recorded_plan_cannot_split(prepare, tmp_path):
    saved(prepare, tmp_path / "ckpt")  # dp 4 (tp 2 on 8 GPUs), micro batch 1
    argv = [a if a != "64" else "6" for a in BASE] + PIPER + ["--load", str(tmp_path / "ckpt")]
    with pytest.raises(SpecError, match="does not hold for this command line: .*global_batch_size"):
        planned(argv)


def test_a_recorded_plan_that_no_longer_fits_says_why_the_search_held_one_plan(prepare, tmp_path):
    saved(prepare, tmp_path / "ckpt", BASE + PIPER + ["--micro-batch-size", "4"])
    longer = [a if a != "2048" else "131072" for a in BASE] + PIPER + ["--load", str(tmp_path / "ckpt")]
    with pytest.raises(Infeasible, match="1 plans searched, rejected: 1 exceeds memory.* The search held only the "
                                         "plan --load .* was saved with"):
        planned(longer)


def test_a_damaged_record_is_an_error(prepare, tmp_path):
    directory = tmp_path / "ckpt"
    saved(prepare, directory)
    body = json.loads((directory / RECORD_NAME).read_text())
    (directory / RECORD_NAME).write_text(json.dumps(body | {"extra": 1}))
    with pytest.raises(SpecError, match=f"{RECORD_NAME}=.*must hold exactly the keys format, "):
        planned(BASE + PIPER + ["--load", str(directory)])
    del body["layout"]["tp"]
    (directory / RECORD_NAME).write_text(json.dumps(body))
    with pytest.raises(SpecError, match="layout=.*must hold exactly tp, pp"):
        planned(BASE + PIPER + ["--load", str(directory)])


def test_a_format_1_record_with_pipelined_resumes_as_flat_chunks_with_a_note(prepare, tmp_path):
    """A record written before the algorithm and the chunks were independent (format 1: no overlap
    fields, ``a2a: pipelined``) resumes the same plan as the record of today's spelling, with the
    FutureWarning of ParallelPlan.read_legacy and a note in the report."""
    flat2 = BASE + PIPER + ["--tensor-model-parallel-size", "2", "--piper-a2a", "flat", "--piper-chunks", "2"]
    current, legacy = tmp_path / "current", tmp_path / "legacy"
    plan = saved(prepare, current, flat2)
    assert (plan.a2a, plan.a2a_chunks) == ("flat", 2)
    body = json.loads((current / RECORD_NAME).read_text())
    layout = {k: v for k, v in body["layout"].items() if k not in ("shared_expert_overlap", "ep_comm_overlap")}
    checkpoint(legacy)
    (legacy / RECORD_NAME).write_text(json.dumps(body | {"format": 1, "layout": layout | {"a2a": "pipelined"},
                                                         "plan": body["plan"].replace("flat/2", "pipelined/2")}))
    with pytest.warns(FutureWarning, match=f"{legacy / RECORD_NAME}: a2a 'pipelined' is read as a2a 'flat' with 2 "
                                           "chunks"):
        record = read_record(legacy / RECORD_NAME)
    assert record.fields == read_record(current / RECORD_NAME).fields
    with pytest.warns(FutureWarning):
        installation, _, printed = prepare(BASE + PIPER + ["--load", str(legacy)])
    assert installation.planned.top.plan == plan == prepare(BASE + PIPER + ["--load", str(current)])[0].planned.top.plan
    assert (f"(format 1, Piper {body['piper_version']}): its a2a 'pipelined' is read as a2a 'flat' in 2 "
            "chunks") in printed
    (legacy / RECORD_NAME).write_text(json.dumps(body | {"format": 1}))  # format 1 has no overlap fields
    with pytest.raises(SpecError, match="layout=.*must hold exactly tp, .* \\(format 1\\)"):
        read_record(legacy / RECORD_NAME)


# ---- a checkpoint saved without --piper ------------------------------------------------------------

def test_a_checkpoint_without_a_record_needs_its_sizes_written(prepare, tmp_path):
    directory = tmp_path / "megatron-ckpt"
    checkpoint(directory)
    with pytest.raises(SpecError, match="--load=.*: holds a Megatron checkpoint \\(latest_checkpointed_iteration.txt\\)"
                                        " but no piper_plan.json.*; write the sizes it was saved with: "
                                        "--tensor-model-parallel-size, --pipeline-model-parallel-size, "
                                        "--expert-model-parallel-size"):
        planned(BASE + PIPER + ["--load", str(directory)])
    sizes = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
             "--expert-model-parallel-size", "4"]
    free = planned(BASE + PIPER + sizes)
    assert any(s.plan.vpp for s in free.result.scored) and any(s.plan.distributed_optimizer for s in free.result.scored)
    installation, args, printed = prepare(BASE + PIPER + sizes + ["--load", str(directory), "--save", str(directory)])
    job = installation.planned
    assert all((s.plan.tp, s.plan.pp, s.plan.ep, s.plan.vpp, s.plan.distributed_optimizer) == (1, 2, 4, None, False)
               for s in job.result.scored)
    assert "a checkpoint saved without --piper" in printed
    assert read_record(directory / RECORD_NAME).fields == dict(layout_of(job.top.plan))  # now it has one
    assert prepare(BASE + PIPER + ["--load", str(directory)])[0].planned.top.plan == job.top.plan


# ---- --save into a directory that holds another run's checkpoint --------------------------------

def test_save_refuses_a_directory_with_a_checkpoint_this_run_does_not_resume(prepare, tmp_path):
    foreign = tmp_path / "foreign"
    checkpoint(foreign)
    with pytest.raises(SpecError, match="--save=.*: already holds a checkpoint, saved with no piper_plan.json "
                                        "\\(without --piper\\), that this run does not resume \\(--load not given\\)"
                                        ".*; resume it with --load .*, or save to a new directory"):
        prepare(BASE + PIPER + ["--save", str(foreign)])
    other = tmp_path / "other"
    plan = saved(prepare, other)  # tp 2 micro batch 1
    with pytest.raises(SpecError, match=f"already holds a checkpoint, saved with the plan {describe(plan)}"):
        prepare(BASE + PIPER + ["--save", str(other)])
    prepare(BASE + PIPER + PINNED + ["--save", str(other)])  # the same plan: its checkpoints may join
    resumed = tmp_path / "resumed"
    installation = prepare(BASE + PIPER + ["--load", str(other), "--save", str(resumed)])[0]
    assert read_record(resumed / RECORD_NAME).fields == dict(layout_of(installation.planned.top.plan))
    assert "resuming with the plan" in report(installation.planned, [], None)
