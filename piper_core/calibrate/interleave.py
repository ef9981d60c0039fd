"""The host-overhead probe in rounds between a validation's rounds (suite key ``probe: interleaved``).

A shared machine's speed drifts over minutes (the 3-round runs of 2026-12-06 measured the same case a
median 17 % apart between rounds of one run). A profile whose probe ran once, in the minute before
the cases, describes the machine of that minute; the cases then meet another. Interleaved, the
probe's list runs once in the calibration (round 1) and once more right before each later round of
the topology's cases; the profile's host terms are then fitted from the median over those rounds
(of each round's median per probe run), as each case's step is the median over its rounds. The
fit still sees only the probe's own models (:data:`piper_core.calibrate.probe.PROBE_MODEL`), never a
validation run: the probe runs at the times the cases run, nothing more.

:func:`probe_round` runs one round (not cached: each round is a measurement of its moment);
:func:`combine` (pure) takes the median over rounds; :func:`refit_with_probe` writes the profile
again from its stored medians with the combined probe, recording every round.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from piper_core.calibrate.steps import FULL_TIMEOUT_S, QUICK_TIMEOUT_S, plan_steps, run_step
from piper_core.errors import SpecError


def probe_round(name: str, *, realtime: bool, quick: bool = False) -> list[dict[str, Any]]:
    """One round of topology ``name``'s host-overhead probe (every rank's results, in rank order);
    raises :class:`RuntimeError` naming the topology and the error when it fails."""
    import dataclasses

    from piper_core.calibrate.api import parse_topology, split_framework, split_precision

    topology = dataclasses.replace(parse_topology(name), realtime=realtime)
    timeout = QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S
    step = next(s for s in plan_steps(topology, quick=quick, timeout_s=timeout, overhead_probe=True,
                                      framework=split_framework(name)[1], precision=split_precision(name)[1])
                if s.name == "overheads")
    outcome = run_step(step, topology, timeout_s=timeout, cache=None)
    if outcome.status != "ok":
        raise RuntimeError(f"the host-overhead probe of {name} failed ({outcome.error})")
    return list(outcome.results)


def _step_forward(run: dict[str, Any]) -> tuple[float, float]:
    return run["step_s"], run["forward_s"]


def combine(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per rank and probe run, the median over ``rounds`` (each a probe's per-rank results) of each
    round's figures; each round's are kept in ``"rounds"``. The rounds must be of one probe list."""
    if not rounds:
        raise SpecError("probe rounds", 0, "combining needs at least one round", "run the probe first")
    first = rounds[0]
    for i, other in enumerate(rounds[1:], start=2):
        if [len(r["runs"]) for r in other] != [len(r["runs"]) for r in first] or \
                [x["label"] for x in other[0]["runs"]] != [x["label"] for x in first[0]["runs"]]:
            raise SpecError("probe rounds", i, "has another probe list or rank count than round 1",
                            "combine rounds of one topology's probe, from one Piper version")
    out = []
    for rank, rec in enumerate(first):
        runs = []
        for j, run in enumerate(rec["runs"]):
            figures = [_step_forward(r[rank]["runs"][j]) for r in rounds]
            runs.append({k: v for k, v in run.items() if k != "rounds"}
                        | {"step_s": statistics.median(s for s, _ in figures),
                           "forward_s": statistics.median(f for _, f in figures),
                           "rounds": [[round(s, 6), round(f, 6)] for s, f in figures]})
        out.append({**rec, "runs": runs})
    return out


def refit_with_probe(profile: Path, rounds: list[list[dict[str, Any]]], times: list[str]) -> Any:
    """Fit ``profile`` again (every term from its stored medians) with the probe's ``rounds``
    combined (:func:`combine`), and write it in place; the record's ``probe_interleaved`` lists when
    each round ran. Returns the :class:`~piper_core.calibrate.run.Calibration`."""
    from piper_core.calibrate.run import refit

    return refit(profile, profile, "piper validate (probe: interleaved)", overheads={"ranks": combine(rounds)},
                 note={"probe_interleaved": {"rounds": len(rounds), "utc": times,
                                             "why": "the probe's list ran once per validation round, right before "
                                                    "that round's cases (suite key probe: interleaved)"}})


class ProbeRounds:
    """The interleaved probe of one topology's profile during a validation: :meth:`before_round` is
    the hook of :func:`piper_core.validate.run.run_cases`, :meth:`profiles` refits the profile after the
    last round. ``fresh``: the profile was calibrated just now, so its stored probe is round 1; else
    (a profile from an earlier hour) round 1 is measured before the first round too."""

    def __init__(self, name: str, profile: Path, *, fresh: bool, realtime: bool, quick: bool = False) -> None:
        import datetime

        from piper_core.calibrate.profile import read_profile

        self.name, self.profile, self.realtime, self.quick = name, profile, realtime, quick
        self.rounds: list[list[dict[str, Any]]] = []
        self.times: list[str] = []
        self._now = lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if fresh:
            cal = read_profile(profile).calibration
            stored = (cal.get("benchmarks") or {}).get("overheads")
            if stored is None:
                raise RuntimeError(f"{profile}: the calibration of {name} has no host-overhead probe to interleave "
                                   f"({(cal.get('failures') or {}).get('overheads', {}).get('error', 'not run')})")
            self.rounds.append(stored["result"]["ranks"])
            self.times.append(str(cal["date"]))

    def before_round(self, r: int) -> None:
        if r == 0 and self.rounds:
            return  # the calibration's own probe, run just before
        self.rounds.append(probe_round(self.name, realtime=self.realtime, quick=self.quick))
        self.times.append(self._now())

    def profiles(self) -> dict[str, Any]:
        from piper_core.presets import load_cluster

        refit_with_probe(self.profile, self.rounds, self.times)
        return {self.name: load_cluster(str(self.profile))}
