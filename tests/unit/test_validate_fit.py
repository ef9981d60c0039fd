"""Pure parts of calibration and validation: the host-overhead fit recovers known terms from runs the
model itself generates; the verdict computes MAPE, the worst case, memory and the scheduler's pick."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.errors import SpecError
from piper_core.presets import load_cluster
from piper_core.validate.cases import CASES, QUICK, select
from piper_core.validate.compare import Row, verdict
from piper_core.validate.suite import load_suite

pytest.importorskip("numpy")

KNOWN = {"layer_overhead_us": 900.0, "moe_overhead_us": 2500.0, "expert_overhead_us": 120.0,
         "backward_overhead_factor": 1.6, "microbatch_overhead_us": 1500.0, "step_overhead_us": 7000.0,
         "elementwise_gb_per_s": 2.5}


def _synthetic_probe(world: int, cluster):
    """Probe results as a machine with overheads KNOWN would give them (the model's own times)."""
    from piper_core.calibrate.probe import BASES, FAMILY_FIELDS, PROBES, _base, probe_label

    truth = dataclasses.replace(cluster, accelerator=dataclasses.replace(cluster.accelerator, **KNOWN))
    runs = []
    for layers, experts, m, mbs, spread, key in PROBES:
        base = BASES[key]
        run = {"label": probe_label(layers, experts, m, mbs, spread, key), "layers": layers, "experts": experts,
               "micro_batches": m, "micro_batch_size": mbs, "spread": spread,
               "base": {k: getattr(base, k) for k in FAMILY_FIELDS}}
        step, fwd = _base(truth, run, world)
        runs.append(run | {"step_s": step, "forward_s": fwd})
    return [{"rank": r, "runs": runs} for r in range(world)]


def test_overhead_fit_recovers_the_terms_that_generated_the_runs():
    from piper_core.calibrate.probe import fit_overheads

    cluster = load_cluster("cpu-local")
    fields, info = fit_overheads(cluster, _synthetic_probe(2, cluster))
    for key in ("layer_overhead_us", "moe_overhead_us", "expert_overhead_us", "backward_overhead_factor",
                "elementwise_gb_per_s"):
        assert fields[key] == pytest.approx(KNOWN[key], rel=0.02), (key, fields)
    # the forward passes carry no per-micro-batch term here, so the training fit must find all of it
    assert fields["microbatch_overhead_us"] == pytest.approx(KNOWN["microbatch_overhead_us"], rel=0.05)
    assert fields["step_overhead_us"] == pytest.approx(KNOWN["step_overhead_us"], rel=0.05)
    assert info["r2"] > 0.999 and info["max_rel_residual"] < 0.01


def test_the_fit_report_prices_forward_passes_with_the_forward_fits_own_micro_batch_term():
    """Forward-only passes with a per-micro-batch host cost (no model field holds it: the training
    fit has its own): the fit finds it, and the reported forward residuals include it (they were
    8-59 % short in the profiles of 2026-12-06 for want of it)."""
    from piper_core.calibrate.probe import fit_overheads

    cluster = load_cluster("cpu-local")
    probe = _synthetic_probe(2, cluster)
    for run in probe[0]["runs"]:  # every rank's list is this one list
        run["forward_s"] += 800e-6 * run["micro_batches"]
    fields, info = fit_overheads(cluster, probe)
    assert info["forward_microbatch_overhead_us"] == pytest.approx(800.0, rel=0.02)
    assert info["forward"]["r2"] > 0.999 and info["forward"]["max_rel_residual"] < 0.01
    assert all(p["forward_predicted_s"] == pytest.approx(p["forward_measured_s"], rel=0.01) for p in info["runs"])
    assert fields["layer_overhead_us"] == pytest.approx(KNOWN["layer_overhead_us"], rel=0.02)


def _row(name: str, group: str, measured: float, predicted: float, mem=(100, 100)) -> Row:
    case = dataclasses.replace(CASES[0], name=name, group=group)
    return Row(case=case, measured_step_s=measured, predicted_step_s=predicted, measured_memory=(mem[0],),
               predicted_memory=(mem[1],), phases={}, losses=())


def test_verdict_mape_worst_memory_and_pick():
    rows = [_row("a", "g", 1.0, 1.05), _row("b", "g", 2.0, 1.8), _row("c", "g", 0.98, 1.2, mem=(100, 107)),
            _row("d", "h", 1.0, 1.0)]
    v = verdict(rows)
    assert v["step_mape"] == pytest.approx((0.05 + 0.10 + 0.2245 + 0.0) / 4, abs=1e-3)
    assert v["worst_step_case"] == "c" and not v["worst_step_ok"]
    assert v["worst_memory_case"] == "c" and not v["memory_ok"]
    # group g: least predicted is a (1.05 s predicted), measured 1.0 vs fastest c at 0.98: 2 % slower
    assert v["picks"]["g"]["pick"] == "a" and v["picks"]["g"]["measured_fastest"] == "c"
    assert v["picks"]["g"]["ok"] and "h" not in v["picks"]  # one-plan groups have no pick


def test_the_case_list_meets_the_issue():
    """At least 8 plans on a core each, varying ep, dp, pp, micro batch, experts and top-k, some on the
    emulated 2-node cluster, and 4-rank runs (2 cores); the quick suite's cases are cases of the full
    suite in fp32, and every run of either is counted (no case carries an exclusion)."""
    one_per_core = [c for c in CASES if c.ranks_per_node <= 2]
    assert len(one_per_core) >= 8 and {c.plan.gpus for c in CASES} == {2, 4}
    for key in ("ep", "dp", "pp", "micro_batch_size"):
        assert len({getattr(c.plan, key) for c in one_per_core}) > 1, key
    assert len({c.model.num_experts for c in CASES}) > 1 and len({c.model.moe_router_topk for c in CASES}) > 1
    assert any(c.nodes == 2 for c in CASES)
    assert [c.name for c in select(None, quick=True)] == list(QUICK)
    full = {c.name: c for c in load_suite("full-fp32").cases}  # the quick suite trains in fp32
    assert all(full[c.name] == c for c in select(None, quick=True))
    assert not any(hasattr(c, "excluded") for c in CASES)
    # four model families; the plan features the CPU trainers run
    assert {c.family for c in CASES} >= {"val-moe", "rms-swiglu", "shared-moe", "fine-moe"}
    assert {c.model.moe_router_topk for c in CASES} >= {1, 2, 4}
    assert any(c.model.moe_capacity_factor is None for c in CASES)  # dropless, the load as routed
    assert any(c.model.moe_shared_expert_intermediate_size for c in CASES)
    assert any(c.model.normalization == "RMSNorm" and c.model.gated_linear_unit for c in CASES)
    assert {c.plan.recompute for c in CASES} == {"none", "selective", "full"}
    assert {(c.plan.a2a, c.plan.a2a_chunks > 1) for c in CASES if c.plan.ep > 1} >= \
        {("flat", False), ("flat", True), ("hierarchical", False), ("hierarchical", True)}
    assert {(c.nodes, c.ranks_per_node) for c in CASES} >= {(1, 2), (1, 4), (2, 1), (2, 2)}
    # both paths: the stock exchanges of both frameworks, predicted and counted like Piper's
    assert {c.framework for c in CASES if c.stock} == {"megatron", "deepspeed"}
    ds = [c for c in CASES if c.framework == "deepspeed"]  # DeepSpeed with Piper's layer: ep > 1, SDPA
    assert ds and all(c.plan.ep > 1 and c.plan.attention_backend == "flash" and c.plan.pp == 1 for c in ds)
    assert {c.topology for c in ds} == {"local-2-deepspeed"}


def test_topology_names_carry_the_framework_whose_overheads_are_probed():
    from piper_core.calibrate.api import parse_topology, split_framework
    from piper_core.calibrate.steps import Topology, plan_steps
    from piper_core.calibrate.probe import PROBES, probes_for

    assert split_framework("local-2-deepspeed") == ("local-2", "deepspeed")
    assert split_framework("emu-2x1-200mbit") == ("emu-2x1-200mbit", "megatron")
    assert parse_topology("local-2-deepspeed") == parse_topology("local-2")
    with pytest.raises(SpecError, match="optionally followed by -deepspeed"):
        parse_topology("local-2-tutel")
    steps = {fw: [s for s in plan_steps(Topology(nodes=1, ranks_per_node=2), quick=True, timeout_s=30,
                                        overhead_probe=True, framework=fw) if s.name == "overheads"][0]
             for fw in ("megatron", "deepspeed")}
    assert steps["megatron"].args == ({"quick": True},)  # unchanged: cached Megatron probes stay valid
    assert steps["deepspeed"].args == ({"quick": True, "framework": "deepspeed"},)
    # DeepSpeed keeps its own MoE layer at ep 1: every MoE probe run spreads its experts (Piper's layer)
    assert all(spread == (experts is not None) for _, experts, _, _, spread, _ in probes_for("deepspeed"))
    assert probes_for("megatron") == PROBES


@pytest.mark.parametrize("command", ["validate", "calibrate"])
def test_realtime_without_the_right_is_a_clear_error(monkeypatch, capsys, tmp_path, command):
    """`--realtime` where SCHED_FIFO is not allowed: exit 2 naming the flag and the fix, before
    anything is launched, calibrated or written."""
    import os

    from piper_core.cli.main import main

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    argv = {"validate": ["validate", "--quick", "--realtime", "--profiles", str(tmp_path / "profiles")],
            "calibrate": ["calibrate", "--out", str(tmp_path / "p.yaml"), "--quick", "--realtime"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--realtime=True" in err and "SCHED_FIFO" in err and "without --realtime" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("fresh", [False, True])
def test_recalibrating_measures_afresh(monkeypatch, tmp_path, fresh):
    """`piper validate --recalibrate` (fresh): the cached benchmarks of an earlier hour are removed
    before calibrating, so the profile describes the machine now; without it the cache resumes."""
    import piper_core.calibrate.api as api

    out = tmp_path / "local-2.yaml"
    cache = tmp_path / "local-2.cache"
    cache.mkdir()
    (cache / "gemm-0.json").write_text("{}")
    seen = {}
    monkeypatch.setattr(api, "calibrate", lambda options: seen.setdefault("cache_left", options.cache_dir.is_dir()))
    api.calibrate_topology("local-2", out, quick=True, fresh=fresh)
    assert seen["cache_left"] is (not fresh)


def test_probe_rounds_reach_the_probe_scale_its_deadline_and_are_checked(monkeypatch, tmp_path, capsys):
    """``--probe-rounds 3`` (and a suite's ``rounds``): the probe step asks its ranks for 3 rounds, its
    deadline and ETA weight grow with them, and the profile's command says so; one round keeps the
    settings, so the cache keys, of earlier runs. Out-of-range values are refused before anything runs."""
    import piper_core.calibrate.api as api
    from piper_core.calibrate.steps import Topology, plan_steps
    from piper_core.cli.main import main

    topo = Topology(nodes=1, ranks_per_node=2)
    one, three = ([s for s in plan_steps(topo, quick=False, timeout_s=30, overhead_probe=True, probe_rounds=r)
                   if s.name == "overheads"][0] for r in (1, 3))
    assert one.args == ({"quick": False},) and one.rounds == 1
    assert three.args == ({"quick": False, "rounds": 3},) and three.rounds == 3 and three.weight == 3 * one.weight
    assert three.key(topo) != one.key(topo)
    seen = {}
    monkeypatch.setattr(api, "calibrate", lambda options: seen.setdefault("options", options))
    api.calibrate_topology("local-2-fp32", tmp_path / "local-2-fp32.yaml", quick=False, probe_rounds=3)
    assert seen["options"].probe_rounds == 3 and seen["options"].command.endswith("--precision fp32 --probe-rounds 3")
    for bad in ("0", "10"):
        assert main(["calibrate", "--out", str(tmp_path / "p.yaml"), "--probe-rounds", bad]) == 2
        assert f"--probe-rounds={bad}: must be a whole number from 1 to 9" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()
