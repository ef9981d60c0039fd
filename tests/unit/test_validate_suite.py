"""Pre-registered validation suites: the format, its errors, the headline over every run with the
registered subsets beside it, and the provenance a results file records."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from piper_core.errors import SpecError
from piper_core.validate.compare import Row, passed, verdict
from piper_core.validate.report import main as report_main
from piper_core.validate.report import profile_record, provenance, rows_from_json, table
from piper_core.validate.suite import SUITES, load_suite

ROOT = Path(__file__).resolve().parents[2]
GOOD = """suite: mine
models:
  m: {name: m, num_layers: 2, hidden_size: 64, num_attention_heads: 4, ffn_hidden_size: 128, num_experts: 4,
      moe_ffn_hidden_size: 128, moe_router_topk: 1, vocab_size: 256, seq_length: 64}
plan_defaults: {distributed_optimizer: false}
cases:
  - {name: a, group: g, model: m, gpus: 2, plan: {ep: 2, micro_batch_size: 1, global_batch_size: 4}}
  - {name: b, group: g, model: m, model_overrides: {num_experts: 8}, gpus: 2, nodes: 2, inter_node_mbit: 100,
     plan: {ep: 1, micro_batch_size: 1, global_batch_size: 4}}
subsets:
  - {name: local, where: {nodes: [1]}, why: one node only}
"""


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    return path


def test_a_suite_loads_with_its_cases_models_and_subsets(tmp_path):
    suite = load_suite(_write(tmp_path, GOOD))
    a, b = suite.cases
    assert suite.name == "mine" and len(suite.sha256) == 64
    assert (a.topology, b.topology) == ("local-2", "emu-2x1-100mbit")
    assert b.model.num_experts == 8 and b.model.name == "m-experts8" and a.model.num_experts == 4
    assert a.plan.distributed_optimizer is False and a.plan.ep == 2
    assert [s.name for s in suite.subsets] == ["local"] and suite.subsets[0].matches(a)
    assert not suite.subsets[0].matches(b)


@pytest.mark.parametrize(("change", "message"), [
    (("ep: 2, micro_batch_size: 1", "ep: 2, micro_batch_sz: 1"),
     r"case 'a' plan.micro_batch_sz=1: is not a ParallelPlan field; did you mean 'micro_batch_size'"),
    (("model: m, gpus: 2, plan: {ep: 2", "model: x, gpus: 2, plan: {ep: 2"), r"case 'a' model='x': is not a model of this suite"),
    (("nodes: 2, inter_node_mbit: 100,", "nodes: 2,"), r"nodes/inter_node_mbit='2/None'"),
    (("why: one node only", "why: ''"), r"subsets\[0\].why='': is required"),
    (("where: {nodes: [1]}", "where: {node: [1]}"), r"subsets\[0\].where.node=\[1\]: is not a suite key; did you mean 'nodes'"),
    (("name: b,", "name: a,"), r"cases.name='a': names a second case"),
    (("suite: mine", "suite: mine\nexcluded: [a]"), r"excluded=\['a'\]: is not a suite key"),
    (("{num_experts: 8}", "{num_expert: 8}"), r"model_overrides.num_expert=8"),
    (("gpus: 2, plan: {ep: 2,", "gpus: 2, stock: true, plan: {a2a: hierarchical, ep: 2,"),
     r"case 'a' stock=True: is true or false, and a stock case exchanges flat in one piece"),
    (("suite: mine", "suite: mine\nrounds: 0"), r"rounds=0: is a whole number of rounds from 1 to 9"),
    (("suite: mine", "suite: mine\nrounds: '3'"), r"rounds='3': is a whole number of rounds from 1 to 9"),
    (("suite: mine", "suite: mine\nrounds: true"), r"rounds=True: is a whole number of rounds"),
    (("suite: mine", "suite: mine\nrounds: 12"), r"rounds=12: .*write e.g. rounds: 3"),
])
def test_bad_suites_are_refused_naming_the_key_value_and_fix(tmp_path, change, message):
    old, new = change
    assert old in GOOD
    with pytest.raises(SpecError, match=message):
        load_suite(_write(tmp_path, GOOD.replace(old, new, 1)))


def test_unknown_suite_names_say_which_exist():
    with pytest.raises(SpecError, match=r"--suite='nope': is not a built-in suite; choose from full, full-fp32, quick"):
        load_suite("nope")


def test_the_built_in_suites_count_every_run():
    """No case carries an exclusion, and every subset says why it is shown."""
    for path in sorted(SUITES.glob("*.yaml")):
        suite = load_suite(path)
        assert suite.cases, path
        assert all(s.why and s.where for s in suite.subsets), path
        assert "excluded" not in path.read_text().split("subsets:")[0], path


def _row(case, measured: float, predicted: float) -> Row:
    return Row(case=case, measured_step_s=measured, predicted_step_s=predicted, measured_memory=(100,),
               predicted_memory=(101,), phases={}, losses=())


def test_the_headline_counts_every_run_and_subsets_stand_beside_it(tmp_path):
    """A subset that meets the limits does not rescue a headline that misses them."""
    suite = load_suite(_write(tmp_path, GOOD))
    a, b = suite.cases
    rows = [_row(a, 1.0, 1.02), _row(b, 1.0, 1.5)]
    v = verdict(rows, suite.subsets)
    assert v["cases"] == 2 and v["step_mape"] == pytest.approx(0.26) and not passed(v)
    local = v["subsets"]["local"]
    assert local["case_names"] == ["a"] and local["step_mape"] == pytest.approx(0.02) and local["step_mape_ok"]
    text = table(rows, v)
    assert "step time MAPE 26.0% (limit 10%): FAIL" in text
    assert "beside the headline (every one of the 2 runs above), never instead of it" in text
    assert "local (1 runs): step MAPE 2.0%" in text


def test_a_results_file_records_commit_suite_and_profiles_and_reads_back(tmp_path, capsys):
    suite = load_suite("quick")
    profile = tmp_path / "local-2.yaml"
    profile.write_text("x: 1\n")
    record = provenance(suite, {"local-2": profile})
    assert record["suite"] == {"name": "quick", "path": str(SUITES / "quick.yaml"), "sha256": suite.sha256, "rounds": 1,
                               "probe": "before"}
    assert record["profiles"]["local-2"] == {"path": str(profile), "sha256": hashlib.sha256(b"x: 1\n").hexdigest()}
    assert len(record["source"]["commit"] or "") == 40 and isinstance(record["source"]["dirty"], bool)
    # piper validate takes each profile's record when its cases are predicted, and the commit when the
    # run begins: a profile removed or rewritten afterwards neither loses the run's record nor changes it
    taken, source = profile_record(profile), {"commit": "0" * 40, "dirty": False}
    profile.unlink()
    later = provenance(suite, {"local-2": taken}, source)
    assert later["profiles"]["local-2"] == record["profiles"]["local-2"] and later["source"] == source
    # the recorded validation results judged again under this rule: every one of the 16 runs
    rows, full = rows_from_json(json.loads((ROOT / "docs/validation/results.json").read_text()))
    assert full.name == "full" and len(rows) == 16
    assert report_main([str(ROOT / "docs/validation/results.json")]) == 0
    out = capsys.readouterr().out
    assert "step time MAPE 15.1% (limit 10%): FAIL" in out and "Megatron-Core, one rank per core (10 runs): step MAPE 7.2%" in out


def test_a_row_of_a_case_the_suite_lacks_is_refused():
    data = {"rows": [{"case": "nope", "step_s": {"measured": 1, "predicted": 1},
                      "memory_bytes": {"measured": [1], "predicted": [1]}}]}
    with pytest.raises(KeyError, match="'nope' is not a case of the suite 'full'"):
        rows_from_json(data)


def test_measured_peaks_join_the_verdict_and_round_trip_through_json(tmp_path):
    from piper_core.validate.compare import row_json
    from piper_core.validate.peak import PeakRow

    suite = load_suite(_write(tmp_path, GOOD))
    a, b = suite.cases
    good = dataclasses.replace(_row(a, 1.0, 1.0), peak=PeakRow(case=a, measured=(100,), predicted=(103,),
                                                                measured_state=(50,), predicted_state=(50,)))
    bad = dataclasses.replace(_row(b, 1.0, 1.0), peak=PeakRow(case=b, measured=(100,), predicted=(90,),
                                                               measured_state=(50,), predicted_state=(60,)))
    v = verdict([good, bad])
    assert (v["worst_peak_case"], v["worst_peak_error"], v["peak_ok"]) == ("b", -0.1, False) and not passed(v)
    assert v["peak_mean_abs_error"] == pytest.approx(0.065) and v["worst_state_error"] == pytest.approx(0.2)
    assert passed(verdict([good])) and v["peak_not_measured"] == []
    partial = verdict([good, _row(b, 1.0, 1.0)])
    assert partial["peak_cases"] == 1 and partial["peak_not_measured"] == ["b"]
    assert "peak not measured for: b" in table([good, _row(b, 1.0, 1.0)], partial)
    data = {"suite": suite.provenance(), "rows": [row_json(good), row_json(bad)]}
    rows, _ = rows_from_json(json.loads(json.dumps(data)))
    assert [r.peak for r in rows] == [good.peak, bad.peak]
    assert "peak tensor memory: mean |error| 6.5%, worst -10.0% on b (limit 5%): FAIL" in table(rows, v)


def _summary(steps: list[float]) -> dict:
    return {"step_s": steps, "stages": [{"param_bytes": 10, "activation_peak_bytes": 5}], "losses": [2.0, 1.9],
            "moe_phases_ms_per_step": {}}


def test_rounds_measure_each_case_in_turn_and_take_the_median_over_rounds(tmp_path, monkeypatch):
    """``rounds: 3``: every case's timed job runs once per round, round after round (a, b, a, b, a, b:
    not a, a, a), and a case's step is the median of the rounds' medians; each round's median and the
    spread are recorded and read back from the JSON."""
    from piper_core.presets import load_cluster
    from piper_core.validate import run as run_mod
    from piper_core.validate.compare import row_json

    suite = load_suite(_write(tmp_path, "rounds: 3\n" + GOOD))
    assert suite.rounds == 3 and load_suite(_write(tmp_path, GOOD)).rounds == 1
    a, b = suite.cases
    order = []
    # each round of `a` is slower; the one outlier round of `b` does not move its median
    times = {"a": iter([[9.0, 1.0, 1.0, 1.0], [9.0, 2.0, 2.0, 2.0], [9.0, 3.0, 3.0, 3.0]]),
             "b": iter([[9.0, 1.0, 1.0, 1.0], [9.0, 5.0, 5.0, 5.0], [9.0, 1.2, 1.2, 1.2]])}

    def timed(case, steps, warmup, timeout_s, realtime):
        order.append(case.name)
        return _summary(next(times[case.name]))

    monkeypatch.setattr(run_mod, "_timed", timed)
    cluster = load_cluster("cpu-local")
    rows = run_mod.run_cases([a, b], {a.topology: cluster, b.topology: cluster}, steps=4, warmup=1, rounds=3,
                             peak=False)
    assert order == ["a", "b", "a", "b", "a", "b"]
    ra, rb = rows
    assert ra.measured_step_s == 2.0 and ra.round_steps_s == (1.0, 2.0, 3.0) and ra.round_spread == pytest.approx(2.0)
    assert rb.measured_step_s == 1.2 and rb.round_spread == pytest.approx(4.0)
    data = {"suite": {"path": str(tmp_path / "suite.yaml")}, "rows": [row_json(r) for r in rows]}
    assert data["rows"][0]["step_s"]["rounds"] == [1.0, 2.0, 3.0]
    back, _ = rows_from_json(json.loads(json.dumps(data)))
    assert back[1].round_steps_s == (1.0, 5.0, 1.2) and back[1].measured_step_s == 1.2
    assert "round spread" in table(back, verdict(back)) and "median over 3 interleaved rounds" in table(back, verdict(back))


def test_a_recorded_run_is_predicted_again_by_this_version_from_its_refitted_profiles(capsys):
    """``--repredict``: the measurements stay the run's, every prediction is this version's from the
    run's own profiles fitted again (4 ranks on this 2-core host: core_share 0.5), and the output says
    it is not a run of this version."""
    from piper_core.validate.report import repredicted

    path = ROOT / "docs/validation/fp32/rounds3/1/results.json"
    data = json.loads(path.read_text())
    rows, _ = rows_from_json(data)
    again = repredicted(rows, data)
    assert [r.measured_step_s for r in again] == [r.measured_step_s for r in rows]
    by_name = {r.case.name: (old, r) for old, r in zip(rows, again)}
    old, new = by_name["4r-pp4"]
    assert new.predicted_step_s < 0.8 * old.predicted_step_s  # recorded before core_share: the bubble at full price
    old, new = by_name["4r-ep4-mbs2"]  # no pipeline: no bubble to shrink; the GEMMs, at the shared rate
    # since 2026-12-07, and the host terms refitted with them move it a little
    assert 0.85 * old.predicted_step_s < new.predicted_step_s < old.predicted_step_s
    assert report_main([str(path), "--repredict"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("re-predicted by this version from the run's profiles, refitted (not a run of this version; "
                          f"measured at {data['source']['commit']}")
