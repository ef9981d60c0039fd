"""``piper plan``'s fair comparison: the best plan each runtime can run (Megatron-LM with and without
--piper, DeepSpeed-MoE with and without Piper's layer), from one search; the runner-up and the
tie-break rule in ``why``; ``--json`` writes JSON alone to standard output."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from piper_core.cli import plan as plan_cli
from piper_core.cli.main import main
from piper_core.presets import load_cluster, load_model
from piper_core.resource.predict import predict
from piper_core.runners import RUNNERS
from piper_core.scheduler.search import RETIME, Scored, _rank_key, as_run_by, best_runnable, search
from piper_core.specs import ParallelPlan
from piper_core.timing.step import step_time

H100 = load_cluster("dgx-h100")
MIXTRAL = load_model("mixtral-8x7b")
PLAN = ["plan", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "16", "--gbs", "128"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "piper_core.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def test_json_writes_only_json_to_stdout_and_notes_to_stderr(tmp_path):
    """The DeepSpeed export note (the best plan needs Megatron's EP overlap here) goes to stderr."""
    out = _cli(*PLAN, "--top", "2", "--json", "--export-deepspeed", str(tmp_path / "ds.json"))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)  # the whole of stdout is one JSON object
    assert "DeepSpeed export: the best plan needs Megatron" in out.stderr
    assert set(data["runtimes"]["best"]) == set(RUNNERS)
    assert set(data["runtimes"]["piper_vs_stock"]) == {"megatron", "deepspeed"}
    written = json.loads((tmp_path / "ds.json").read_text())["piper"]["plan"]
    ds = data["runtimes"]["best"]["deepspeed piper"]["settings"]
    assert {k: written[k] for k in ("tp", "pp", "ep", "mbs")} == {"tp": ds["tp"], "pp": ds["pp"], "ep": ds["ep"],
                                                                 "mbs": ds["micro_batch_size"]}


def test_json_without_a_fitting_plan_is_still_only_json():
    out = _cli("plan", "switch-1t", "--cluster", "frontier", "--gpus", "64", "--json")
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert data["plans"] == [] and data["needs"]["gpus"] == 256
    assert all(v["plan"] is None for v in data["runtimes"]["best"].values())


def test_runtimes_come_from_one_search_and_each_plan_runs_there(monkeypatch, capsys):
    calls = []
    real = plan_cli.search
    monkeypatch.setattr(plan_cli, "search", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert main(PLAN + ["--json"]) == 0
    assert len(calls) == 1
    data = json.loads(capsys.readouterr().out)
    best = data["runtimes"]["best"]
    for name, rule in RUNNERS.items():
        settings = {k: v for k, v in best[name]["settings"].items() if k not in ("dp", "edp", "num_microbatches")}
        assert rule(ParallelPlan(**settings)) is None, name
    stock = best["megatron stock"]["settings"]
    assert (stock["a2a"], stock["a2a_chunks"]) == ("flat", 1)
    # DeepSpeed stock plans are a subset of DeepSpeed piper plans: --piper is never slower there
    assert best["deepspeed piper"]["step_s"] <= best["deepspeed stock"]["step_s"]
    vs = data["runtimes"]["piper_vs_stock"]
    assert vs["deepspeed"]["speedup"] == pytest.approx(best["deepspeed stock"]["step_s"] / best["deepspeed piper"]["step_s"])
    # on 16 H100s Megatron's own EP overlap hides the exchange best: --piper (which replaces that
    # dispatcher) is not faster, and the sentence says which variant wins
    assert vs["megatron"]["speedup"] < 1 and "not faster" in vs["megatron"]["why"] and "+epov wins" in vs["megatron"]["why"]


def test_text_shows_each_runtime_and_the_speedup(capsys):
    assert main(PLAN + ["--top", "1"]) == 0
    text = capsys.readouterr().out
    for label in ("Megatron --piper", "Megatron stock", "DeepSpeed piper", "DeepSpeed stock"):
        assert f"\n  {label} " in text
    assert "Megatron-LM: --piper not faster" in text and "DeepSpeed: --piper " in text


def _reference_best(model, cluster, result, rule):
    """Every feasible plan as the runtime would run it, timed from scratch by the closed form; the
    RETIME best of those re-timed by the exact schedule (how the search ranks its own list)."""
    runnable = []
    for s in result.scored:
        plan = as_run_by(s.plan, rule)
        if plan is not None:
            runnable.append(Scored(plan=plan, step_s=step_time(model, plan, cluster, exact=False).step,
                                   peak_bytes=s.peak_bytes))
    head = sorted(runnable, key=_rank_key)[:RETIME]
    head = [dataclasses.replace(s, step_s=step_time(model, s.plan, cluster).step) for s in head]
    return min(head, key=_rank_key) if head else None


@pytest.mark.parametrize("model, gpus, gbs", [
    (dataclasses.replace(MIXTRAL, num_layers=8), 16, 64),
    # a shared expert: DeepSpeed runs it after the routed experts, re-timed without the overlap
    (dataclasses.replace(load_model("deepseek-v3"), num_layers=7, moe_first_k_dense=1), 64, 256),
])
def test_best_per_runtime_equals_a_from_scratch_reference(model, gpus, gbs):
    from piper_core.scheduler.space import SearchSpace

    space = SearchSpace(tp=(1, 2), pp=(1, 2, 4), vpp=(1, 2), cp=(1, 2), ep=(1, 2, 8, 32), mbs=(1, 2))
    result = search(model, H100, gpus, gbs, space=space)
    found = 0
    for name, rule in RUNNERS.items():
        fast, slow = best_runnable(model, H100, result, rule), _reference_best(model, H100, result, rule)
        assert (fast is None) == (slow is None), name
        if fast is not None:
            found += 1
            assert (fast.plan, fast.step_s, fast.peak_bytes) == (slow.plan, slow.step_s, slow.peak_bytes), name
            assert fast.step_s == predict(model, H100, fast.plan).time.step
    assert found == 4
    if model.moe_shared_expert_intermediate_size:
        ds = best_runnable(model, H100, result, RUNNERS["deepspeed piper"])
        assert not ds.plan.shared_expert_overlap and not ds.plan.ep_comm_overlap


def _pred(**kw):
    plan = ParallelPlan(gpus=16, pp=2, vpp=2, ep=8, global_batch_size=128, **kw)
    return predict(MIXTRAL, H100, plan)


def test_compare_names_the_reason_when_piper_is_not_faster():
    flat, chunked, epov = _pred(), _pred(a2a_chunks=4), _pred(ep_comm_overlap=True)
    same = plan_cli.compare(plan_cli.RuntimeBest(runtime="a", prediction=flat),
                            plan_cli.RuntimeBest(runtime="b", prediction=flat))
    assert same == (1.0, "same plan: the exchange is flat/1 in both")
    speedup, why = plan_cli.compare(plan_cli.RuntimeBest(runtime="a", prediction=chunked),
                                    plan_cli.RuntimeBest(runtime="b", prediction=epov))
    assert speedup == epov.time.step / chunked.time.step
    assert ("not faster" in why) == (speedup < 1 / 1.0005)
    assert "flat/1+epov" in why and "flat/4" in why and "exposed all-to-all" in why


def _scored(plan, step=1.0, peak=10):
    return Scored(plan=plan, step_s=step, peak_bytes=peak)


@pytest.mark.parametrize("changes, rule", [
    (dict(a2a_chunks=8), "fewer exchange chunks"),
    (dict(a2a="hierarchical"), "a flat exchange (not staged)"),
    (dict(micro_batch_size=2, global_batch_size=128), "a smaller micro-batch"),
    (dict(recompute="selective"), "no recompute"),
    (dict(ep=8), "fewer expert-parallel ranks"),
    (dict(pp=4), "fewer model-parallel ranks"),
])
def test_why_names_the_tie_break_rule_that_decided(changes, rule):
    """At equal speed and memory the sentence names the rule of the search's ranking that decided,
    not always "fewer model-parallel ranks"."""
    base = dict(gpus=32, pp=2, ep=4, global_batch_size=128)
    a, b = ParallelPlan(**base), ParallelPlan(**{**base, **changes})
    ranked = sorted([_scored(b), _scored(a)], key=_rank_key)
    assert ranked[0].plan == a
    sentence = plan_cli.why([predict(MIXTRAL, H100, a), predict(MIXTRAL, H100, b)], ranked)
    assert f"the tie goes to {rule} " in sentence
    others = {"fewer exchange chunks", "a flat exchange (not staged)", "a smaller micro-batch", "no recompute",
              "fewer expert-parallel ranks", "fewer model-parallel ranks"} - {rule}
    assert not any(f"goes to {o} " in sentence for o in others)


def test_top1_explains_the_pick_against_the_runner_up_of_the_whole_search(capsys):
    assert main(PLAN + ["--top", "1"]) == 0
    one = capsys.readouterr().out
    assert main(PLAN + ["--top", "3"]) == 0
    three = capsys.readouterr().out
    why_one = next(line for line in one.splitlines() if line.startswith("  why:"))
    assert "only feasible plan" not in why_one and "runner-up" in why_one
    assert why_one == next(line for line in three.splitlines() if line.startswith("  why:"))
    assert "the tie goes to fewer model-parallel ranks (tp*pp*cp*vpp 16 vs 32; cp=2 vs 4" in why_one
