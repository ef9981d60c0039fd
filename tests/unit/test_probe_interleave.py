"""The interleaved host-overhead probe (suite key ``probe: interleaved``): one probe round before each
round of a topology's cases, the profile refitted from the median over the rounds."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest

from piper_core.calibrate import interleave
from piper_core.calibrate.interleave import ProbeRounds, combine
from piper_core.calibrate.profile import read_profile
from piper_core.errors import SpecError
from piper_core.presets import load_cluster
from piper_core.validate.suite import load_suite

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs/validation/fp32/rounds3-shared/2/profiles/local-2-fp32.yaml"  # a 3-round probe


def _ranks(scale: float) -> list[dict]:
    """The recorded profile's probe results, every time times ``scale`` (one round, no ``rounds``)."""
    ranks = copy.deepcopy(read_profile(RECORDED).calibration["benchmarks"]["overheads"]["result"]["ranks"])
    for rank in ranks:
        for run in rank["runs"]:
            run.pop("rounds", None)
            run["step_s"] *= scale
            run["forward_s"] *= scale
    return ranks


def test_combine_takes_the_median_over_rounds_and_keeps_each_round():
    rounds = [_ranks(1.0), _ranks(3.0), _ranks(1.5)]
    out = combine(rounds)
    first = rounds[0][1]["runs"][4]
    got = out[1]["runs"][4]
    assert got["label"] == first["label"] and got["step_s"] == pytest.approx(1.5 * first["step_s"])
    assert got["forward_s"] == pytest.approx(1.5 * first["forward_s"])
    assert [s for s, _ in got["rounds"]] == pytest.approx([round(x * first["step_s"], 6) for x in (1.0, 3.0, 1.5)],
                                                          abs=1e-6)
    short = _ranks(1.0)
    short[0]["runs"].pop()
    with pytest.raises(SpecError, match=r"probe rounds=2: has another probe list or rank count than round 1"):
        combine([rounds[0], short])
    with pytest.raises(SpecError, match="at least one round"):
        combine([])


@pytest.mark.parametrize("fresh", [True, False])
def test_each_round_probes_first_and_the_profile_is_refitted_from_all_rounds(tmp_path, monkeypatch, fresh):
    """Fresh calibration: its stored probe is round 1 and rounds 2 and 3 probe before their cases; an
    older profile probes before round 1 too. The refit uses the median over the rounds (here the
    machine turned 1.5x slower after the calibration, so the host terms grow) and records every round."""
    profile = tmp_path / "local-2-fp32.yaml"
    shutil.copy(RECORDED, profile)
    stored = read_profile(profile).calibration["benchmarks"]["overheads"]["result"]["ranks"]
    calls = []

    def fake_round(name, *, realtime, quick=False):
        calls.append((name, realtime))
        return _ranks(1.5)

    monkeypatch.setattr(interleave, "probe_round", fake_round)
    probe = ProbeRounds("local-2-fp32", profile, fresh=fresh, realtime=True)
    before = load_cluster(str(profile)).accelerator
    for r in range(3):
        probe.before_round(r)
    assert calls == [("local-2-fp32", True)] * (2 if fresh else 3)
    after = probe.profiles()["local-2-fp32"].accelerator
    cal = read_profile(profile).calibration
    assert cal["probe_interleaved"]["rounds"] == (3 if fresh else 3) and len(cal["probe_interleaved"]["utc"]) == 3
    runs = cal["benchmarks"]["overheads"]["result"]["ranks"][0]["runs"]
    assert all(len(run["rounds"]) == 3 for run in runs)
    assert runs[0]["step_s"] == pytest.approx(1.5 * _ranks(1.0)[0]["runs"][0]["step_s"], rel=1e-6)
    if fresh:  # round 1 is the calibration's own (its median over its 3 rounds)
        assert runs[0]["rounds"][0][0] == pytest.approx(stored[0]["runs"][0]["step_s"], abs=1e-6)
    slower = sum(getattr(after, f) for f in ("layer_overhead_us", "moe_overhead_us", "microbatch_overhead_us",
                                             "step_overhead_us"))
    assert slower > 1.2 * sum(getattr(before, f) for f in ("layer_overhead_us", "moe_overhead_us",
                                                           "microbatch_overhead_us", "step_overhead_us"))
    assert "probe: interleaved" in cal["command"]


def test_a_profile_without_a_probe_cannot_interleave(tmp_path):
    import yaml

    data = yaml.safe_load(RECORDED.read_text())
    del data["calibration"]["benchmarks"]["overheads"]
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(data))
    with pytest.raises(RuntimeError, match="has no host-overhead probe to interleave"):
        ProbeRounds("local-2-fp32", profile, fresh=True, realtime=False)


def test_the_suite_key_says_when_the_probe_runs(tmp_path):
    from tests.unit.test_validate_suite import GOOD

    path = tmp_path / "s.yaml"
    path.write_text("probe: interleaved\nrounds: 3\n" + GOOD)
    suite = load_suite(path)
    assert suite.probe == "interleaved" and suite.provenance()["probe"] == "interleaved"
    path.write_text(GOOD)
    assert load_suite(path).probe == "before"
    path.write_text("probe: after\n" + GOOD)
    with pytest.raises(SpecError, match=r"probe='after': is when the host-overhead probe runs: one of before, "
                                        r"interleaved.*write probe: interleaved"):
        load_suite(path)


def test_run_cases_probes_before_each_round_and_predicts_after_the_last(tmp_path, monkeypatch):
    from tests.unit.test_validate_suite import GOOD, _summary
    from piper_core.validate import run as run_mod

    path = tmp_path / "s.yaml"
    path.write_text(GOOD)
    a, b = load_suite(path).cases
    events = []
    monkeypatch.setattr(run_mod, "_timed", lambda case, *args: events.append(case.name) or _summary([9.0, 1.0, 1.0]))
    cluster = load_cluster("cpu-local")

    def profiles():
        events.append("refit")
        return {a.topology: cluster, b.topology: cluster}

    rows = run_mod.run_cases([a, b], profiles, steps=3, warmup=1, rounds=2, peak=False,
                             before_round=lambda r: events.append(f"probe{r}"))
    assert events == ["probe0", "a", "b", "probe1", "a", "b", "refit"]
    assert [r.case.name for r in rows] == ["a", "b"]
