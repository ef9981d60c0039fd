"""The scheduler judged on its real output (piper_core.validate.scheduler): jobs, the runnable space,
the seeded draw, Kendall's tau and the verdict. The training itself: tests/megatron/test_scheduler_check.py."""

import json
import math
from pathlib import Path

import pytest

from piper_core.presets import load_cluster
from piper_core.scheduler.search import search
from piper_core.validate import scheduler as sc
from piper_core.validate.suite import load_suite

PROFILES = Path(__file__).resolve().parents[2] / "docs" / "validation" / "fp32" / "profiles"


@pytest.fixture(scope="module")
def jobs():
    return {j.name: j for j in sc.jobs_of(load_suite("full-fp32"))}


def _search(job):
    t = job.template
    cluster = load_cluster(str(PROFILES / f"{t.topology}.yaml"))
    return search(t.model, cluster, t.plan.gpus, t.plan.global_batch_size, space=sc.trainer_space(t, cluster),
                  attention_backend=t.plan.attention_backend)


def test_kendall_tau_known_values():
    assert sc.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert sc.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert sc.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)  # one discordant pair of six
    assert sc.kendall_tau([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(5 * 6))  # tau-b with a tie
    assert math.isnan(sc.kendall_tau([1, 1], [1, 2]))


def test_one_job_per_group_of_alternatives_and_no_stock_job(jobs):
    assert len(jobs) == 14  # 10 until the 3 cases registered 2026-12-06, 13 until the 8-layer pp4 job
    assert "val-moe/2r/gbs8/stock" not in jobs and "val-moe/2r/gbs8/deepspeed" in jobs
    assert {j.template.framework for j in jobs.values()} == {"megatron", "deepspeed"}
    assert all(not j.template.stock for j in jobs.values())


def test_space_is_what_the_cpu_trainers_run(jobs):
    for name, job in jobs.items():
        result = _search(job)
        assert result.feasible >= 4, name
        plans = [s.plan for s in result.scored]
        assert all(p.tp == 1 and p.cp == 1 and not p.vpp and p.etp_size == 1 for p in plans), name
        # the distributed optimizer on and off where the data-parallel ranks can shard it (Megatron-Core's
        # trainer runs Megatron-Core's own); DeepSpeed's trainer runs ZeRO 0
        assert {p.distributed_optimizer for p in plans if p.dp > 1} <= (
            {False} if job.template.framework == "deepspeed" else {False, True}), name
        assert all(p.a2a in ("flat", "hierarchical") and not p.ep_comm_overlap and not p.shared_expert_overlap
                   for p in plans), name
        assert any(p.a2a == "hierarchical" for p in plans) == (name == "val-moe/emu2x2/gbs16"), name
        if job.template.framework == "deepspeed":
            assert all(p.pp == 1 and p.ep > 1 and p.recompute == "none" for p in plans)
    assert any(s.plan.recompute == "full" for s in _search(jobs["val-moe/2r/gbs8"]).scored)
    assert any(s.plan.distributed_optimizer for s in _search(jobs["val-moe/2r/gbs8"]).scored)


def test_draw_is_fixed_by_seed_and_job_and_never_repeats_the_top(jobs):
    job = jobs["val-moe/2r/gbs8"]
    result = _search(job)
    chosen = sc.choose(job, result, seed=0)
    assert [k for k, _ in chosen] == ["top1", "top2", "top3", "random1", "random2", "random3"]
    assert chosen[0][1] is result.best(1)[0]
    plans = [s.plan for _, s in chosen]
    assert len(set(plans)) == 6
    assert [s.plan for _, s in sc.choose(job, result, seed=0)] == plans
    assert [s.plan for _, s in sc.choose(job, result, seed=1)][3:] != plans[3:]


def test_regret_tau_and_a_failed_run_fail_the_verdict():
    runs = [{"kind": "top1", "predicted_s": 1.0, "measured_s": 1.1, "step_error": -0.09},
            {"kind": "top2", "predicted_s": 2.0, "measured_s": 1.0, "step_error": 1.0},
            {"kind": "random1", "predicted_s": 3.0, "measured_s": 3.0, "step_error": 0.0}]
    fig = sc.job_figures(runs)
    assert fig["regret"] == pytest.approx(0.1) and not fig["regret_ok"] and fig["measured_fastest"] == "top2"
    assert fig["tau"] == pytest.approx(1 / 3, abs=1e-4)
    good = sc.job_figures([dict(runs[0], measured_s=0.9), runs[1], runs[2]])
    assert good["regret"] == 0 and good["regret_ok"] and good["tau"] == 1.0
    failed = [runs[0], {"kind": "top2", "failure": "RuntimeError: boom"}, runs[2]]
    ff = sc.job_figures(failed)
    assert ff["failed"] == ["top2"] and ff["regret"] == 0
    h = sc.headline([{"name": "a", "runs": failed, **ff}])
    assert h["failed_runs"] == 1 and not h["ok"]
    assert sc.headline([{"name": "a", "runs": runs, **good}])["ok"]


def test_run_job_reports_a_failing_plan_and_still_trains_the_others(jobs):
    job = jobs["e4-top1/2r/gbs8"]
    cluster = load_cluster(str(PROFILES / f"{job.template.topology}.yaml"))
    calls = []

    def train(case, cluster):
        calls.append(case.name)
        raise RuntimeError(f"cannot run {case.name}")

    out = sc.run_job(job, cluster, top=2, draws=1, train=train)
    assert calls == ["e4-top1/2r/gbs8:top1", "e4-top1/2r/gbs8:top2", "e4-top1/2r/gbs8:random1"]
    assert out["failed"] == ["top1", "top2", "random1"] and out["regret"] is None and not out["regret_ok"]
    assert "cannot run e4-top1/2r/gbs8:top1" in out["runs"][0]["failure"]


def test_plans_run_in_rotated_rounds_and_the_median_is_judged(jobs):
    from piper_core.validate.compare import Row

    job = jobs["e4-top1/2r/gbs8"]
    cluster = load_cluster(str(PROFILES / f"{job.template.topology}.yaml"))
    order, times = [], {"top1": [1.0, 5.0, 1.2], "top2": [2.0, 2.0, 2.0]}  # top1's second run an outlier

    def train(case, cluster):
        kind = case.name.split(":")[1]
        order.append(kind)
        return Row(case=case, measured_step_s=times[kind][order.count(kind) - 1], predicted_step_s=1.0,
                   measured_memory=(), predicted_memory=(), phases={}, losses=())

    out = sc.run_job(job, cluster, top=2, draws=0, repeats=3, train=train)
    assert order == ["top1", "top2", "top2", "top1", "top1", "top2"]
    assert [r["measured_s"] for r in out["runs"]] == [1.2, 2.0] and out["runs"][0]["measured_runs_s"] == [1.0, 5.0, 1.2]
    assert out["regret"] == 0 and out["runs"][0]["step_error"] == pytest.approx(1 / 1.2 - 1, abs=1e-4)


def test_cli_refuses_an_unknown_job_and_reports_a_recorded_run(tmp_path, capsys):
    assert sc.main(["--jobs", "nope"]) == 2
    assert "--jobs" in capsys.readouterr().err
    assert sc.main(["--repeats", "0"]) == 2
    assert "repeats >= 1" in capsys.readouterr().err
    runs = [{"kind": "top1", "plan": "tp1 ep2", "predicted_s": 1.0, "measured_s": 1.0, "step_error": 0.0},
            {"kind": "random1", "plan": "tp1 ep1", "predicted_s": 2.0, "measured_s": 1.5, "step_error": 0.33}]
    job = {"name": "j", "framework": "megatron", "topology": "local-2-fp32", "model": "m", "gpus": 2, "gbs": 8,
           "candidates": 9, "feasible": 5, "runs": runs} | sc.job_figures(runs)
    data = {"command": "python -m piper_core.validate.scheduler", "source": {"commit": "abc"}, "machine": "cpu",
            "seed": 0, "top": 1, "random": 1, "steps": 12, "warmup": 3, "jobs": [job], "headline": sc.headline([job])}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert sc.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| j | local-2-fp32 | 5 | `tp1 ep2` | `tp1 ep2` | +0.0 % | 1.0 |" in out
    assert "1 jobs, 2 runs (0 failed)" in out
