"""Validation suites: the cases ``piper validate`` runs and the subsets it reports, as data.

A suite is a YAML file committed before the measurements that use it (the format is described at
the top of ``suites/full.yaml``); ``results.json`` records its name, path and sha256 beside the
commit, so a figure can be traced to the suite it was registered in. Every case of a suite is
counted in its headline figures; a subset (``where``: framework, ranks per node, nodes, topology, tp,
family: the suite model a case derives from)
is a figure shown beside the headline, never instead of it. Bad input is a :class:`SpecError`
naming the file, the case, the key, the value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from piper_core.errors import SpecError, nearest
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.yamlio import from_dict, to_dict

SUITES = Path(__file__).with_name("suites")
FRAMEWORKS = ("megatron", "deepspeed")
TOP_KEYS = ("suite", "models", "models_from", "plan_defaults", "cases", "cases_from", "plan_overrides", "subsets",
            "rounds", "probe")
PROBE_MODES = ("before", "interleaved")
CASE_KEYS = ("name", "group", "model", "model_overrides", "gpus", "plan", "nodes", "inter_node_mbit", "framework",
             "stock")
WHERE_KEYS = ("framework", "ranks_per_node", "nodes", "topology", "family", "stock", "tp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One validation run. ``nodes`` > 1: the emulated cluster, links shaped to ``inter_node_mbit``;
    ``framework``: the registered trainer that runs it (:mod:`piper_core.trainers`); ``stock``: with
    the framework's own exchange (Megatron-Core's alltoall dispatcher, DeepSpeed's MOELayer) instead
    of Piper's, as users run it today (the plan's exchange must then be flat and unpipelined)."""

    name: str
    group: str
    model: ModelSpec
    plan: ParallelPlan
    nodes: int = 1
    inter_node_mbit: float | None = None
    framework: str = "megatron"
    family: str = ""  # the suite's model the case's model derives from
    stock: bool = False

    @property
    def ranks_per_node(self) -> int:
        return self.plan.gpus // self.nodes

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def topology(self) -> str:
        """Which calibration profile predicts it: ``local-<ranks>`` or ``emu-<nodes>x<k>-<mbit>mbit``,
        with ``-deepspeed`` for a DeepSpeed case (its host overheads probed through DeepSpeed) and
        ``-fp32`` for a case that trains in fp32 (a profile calibrated in fp32)."""
        suffix = ("-deepspeed" if self.framework == "deepspeed" else "") + ("-fp32" if self.plan.precision == "fp32" else "")
        if self.nodes == 1:
            return f"local-{self.plan.gpus}{suffix}"
        return f"emu-{self.nodes}x{self.ranks_per_node}-{self.inter_node_mbit:g}mbit{suffix}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Subset:
    """Cases matching every key of ``where`` (each a list of accepted values); ``why`` it is shown."""

    name: str
    where: tuple[tuple[str, tuple[Any, ...]], ...]
    why: str

    def matches(self, case: Case) -> bool:
        return all(getattr(case, key) in values for key, values in self.where)


def by_subset(rows: list[Any], subsets: tuple[Subset, ...], figures: Any) -> dict[str, Any]:
    """Each subset's ``figures(members)`` over the ``rows`` (anything with a ``case``) it matches,
    with why it is shown and its cases; subsets matching nothing are left out."""
    out = {}
    for sub in subsets:
        members = [r for r in rows if sub.matches(r.case)]
        if members:
            out[sub.name] = {"why": sub.why, "case_names": [r.case.name for r in members]} | figures(members)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Suite:
    name: str
    path: Path
    sha256: str
    models: dict[str, ModelSpec]
    cases: tuple[Case, ...]
    subsets: tuple[Subset, ...]
    rounds: int = 1
    """How many times each case's timed job runs, in rounds over its topology's cases (each round runs
    every case once, in suite order), and each calibration's host-overhead probe runs its probe list:
    a case's measured step is the median over rounds of each round's step median (``piper validate``).
    A shared machine's speed drifts over minutes; one slow stretch then moves one round, not the case."""
    probe: str = "before"
    """When each profile's host-overhead probe runs: ``before`` (all its rounds in the calibration,
    before the topology's cases) or ``interleaved`` (one round in the calibration, then one right
    before each later round of the cases; :mod:`piper_core.calibrate.interleave`)."""

    def provenance(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "sha256": self.sha256, "rounds": self.rounds,
                "probe": self.probe}


def suite_path(ref: str | Path) -> Path:
    """A suite by name (a file of ``suites/``) or a path to a suite YAML."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise SpecError("--suite", str(ref), "no such file", "give a suite YAML path or the name of a built-in suite")
        return path
    known = sorted(p.stem for p in SUITES.glob("*.yaml"))
    if str(ref) not in known:
        raise SpecError("--suite", str(ref), "is not a built-in suite", f"choose from {', '.join(known)} or give a path")
    return SUITES / f"{ref}.yaml"


def _keys(data: Any, allowed: tuple[str, ...], where: str, what: str, kind: str = "a suite key") -> dict[str, Any]:
    if not isinstance(data, dict):
        raise SpecError(what, data, "must be a mapping", "write key: value pairs", where=where)
    for key in data:
        if key not in allowed:
            guess = nearest(str(key), allowed)
            raise SpecError(f"{what}.{key}" if what else str(key), data[key], f"is not {kind}",
                            f"did you mean {guess!r}?" if guess else f"use one of {', '.join(allowed)}", where=where)
    return data


def _model(base: ModelSpec, overrides: dict[str, Any], where: str) -> ModelSpec:
    if not overrides:
        return base
    data = to_dict(base) | dict(overrides)
    data["name"] = base.name + "".join(f"-{k.split('_')[-1]}{v}" for k, v in overrides.items())
    return from_dict(ModelSpec, data, where=where, prefix="model_overrides.")


def _case(raw: Any, index: int, models: dict[str, ModelSpec], defaults: dict[str, Any], where: str) -> Case:
    what = f"cases[{index}]"
    raw = _keys(raw, CASE_KEYS, where, what)
    for key in ("name", "group", "model", "gpus", "plan"):
        if key not in raw:
            raise SpecError(f"{what}.{key}", None, "is required", f"add {key}: to the case", where=where)
    label = f"case {raw['name']!r}"
    if raw["model"] not in models:
        raise SpecError(f"{label} model", raw["model"], "is not a model of this suite",
                        f"use one of {', '.join(models) or '(none: add models:)'}", where=where)
    framework = raw.get("framework", "megatron")
    if framework not in FRAMEWORKS:
        raise SpecError(f"{label} framework", framework, f"is not one of {', '.join(FRAMEWORKS)}",
                        "name a framework with a registered trainer", where=where)
    nodes = raw.get("nodes", 1)
    mbit = raw.get("inter_node_mbit")
    if not isinstance(nodes, int) or nodes < 1 or (nodes > 1) != (mbit is not None):
        raise SpecError(f"{label} nodes/inter_node_mbit", f"{nodes}/{mbit}", "nodes is a positive integer and "
                        "inter_node_mbit is given exactly when nodes > 1", "set both (emulated cluster) or neither",
                        where=where)
    plan_fields = _keys(raw["plan"], tuple(f.name for f in dataclasses.fields(ParallelPlan) if not f.name.startswith("_")),
                        where, f"{label} plan", "a ParallelPlan field")
    try:
        plan = ParallelPlan(gpus=raw["gpus"], **(defaults | plan_fields))
    except TypeError as exc:
        raise SpecError(f"{label} plan", plan_fields, str(exc), "give ParallelPlan fields", where=where) from exc
    stock = raw.get("stock", False)
    if not isinstance(stock, bool) or stock and (plan.a2a != "flat" or plan.a2a_chunks != 1 or plan.defer_wgrad):
        raise SpecError(f"{label} stock", stock, "is true or false, and a stock case exchanges flat in one piece (the "
                        "stock dispatchers run nothing else)", "drop a2a/a2a_chunks/defer_wgrad or stock", where=where)
    if plan.gpus % nodes:
        raise SpecError(f"{label} gpus", plan.gpus, f"must be a multiple of nodes ({nodes})", "fix gpus or nodes",
                        where=where)
    model = _model(models[raw["model"]], raw.get("model_overrides") or {}, f"{where}: {label}")
    return Case(name=raw["name"], group=raw["group"], model=model, plan=plan, nodes=nodes,
                inter_node_mbit=None if mbit is None else float(mbit), framework=framework, family=raw["model"],
                stock=stock)


def _subset(raw: Any, index: int, where: str) -> Subset:
    what = f"subsets[{index}]"
    raw = _keys(raw, ("name", "where", "why"), where, what)
    for key in ("name", "where", "why"):
        if not raw.get(key):
            raise SpecError(f"{what}.{key}", raw.get(key), "is required", f"add {key}: (a subset says why it is shown)",
                            where=where)
    cond = _keys(raw["where"], WHERE_KEYS, where, f"{what}.where")
    for key, values in cond.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{what}.where.{key}", values, "must be a non-empty list of accepted values",
                            f"write e.g. {key}: [{values!r}]", where=where)
    return Subset(name=str(raw["name"]), where=tuple((k, tuple(v)) for k, v in cond.items()), why=" ".join(str(raw["why"]).split()))


def _overridden(case: Case, overrides: dict[str, Any], where: str) -> Case:
    """``case`` with ``overrides`` (ParallelPlan fields) over its plan."""
    fields = tuple(f.name for f in dataclasses.fields(ParallelPlan) if not f.name.startswith("_"))
    _keys(overrides, fields, where, "plan_overrides", "a ParallelPlan field")
    plan = from_dict(ParallelPlan, to_dict(case.plan) | dict(overrides), where=f"{where}: case {case.name!r}",
                     prefix="plan_overrides.")
    return dataclasses.replace(case, plan=plan)


def load_suite(ref: str | Path = "full") -> Suite:
    path = suite_path(ref)
    text = path.read_text()
    where = str(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError("suite", str(path), f"is not valid YAML ({exc})", "fix the file", where=where) from exc
    data = _keys(data, TOP_KEYS, where, "")
    models: dict[str, ModelSpec] = {}
    if "models_from" in data:
        models |= load_suite(data["models_from"]).models
    for key, spec in (data.get("models") or {}).items():
        models[key] = from_dict(ModelSpec, spec, where=f"{where}: models.{key}")
    cases = tuple(_case(raw, i, models, data.get("plan_defaults") or {}, where) for i, raw in enumerate(data.get("cases") or []))
    subsets = tuple(_subset(raw, i, where) for i, raw in enumerate(data.get("subsets") or []))
    if "cases_from" in data:  # another suite's cases (and, unless given here, its subsets), plans overridden
        base = load_suite(data["cases_from"])
        cases += tuple(_overridden(c, data.get("plan_overrides") or {}, where) for c in base.cases)
        subsets = subsets or base.subsets
    elif "plan_overrides" in data:
        raise SpecError("plan_overrides", data["plan_overrides"], "applies to the cases of cases_from",
                        "add cases_from: SUITE, or write the fields in plan_defaults", where=where)
    if not cases:
        raise SpecError("cases", None, "a suite runs at least one case", "add cases:", where=where)
    seen: set[str] = set()
    for c in cases:
        if c.name in seen:
            raise SpecError("cases.name", c.name, "names a second case", "give every case its own name", where=where)
        seen.add(c.name)
    rounds = data.get("rounds", 1)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or not 1 <= rounds <= 9:
        raise SpecError("rounds", rounds, "is a whole number of rounds from 1 to 9 (each case's timed job runs once "
                        "per round)", "write e.g. rounds: 3, or leave it out for one round", where=where)
    probe = data.get("probe", "before")
    if probe not in PROBE_MODES:
        raise SpecError("probe", probe, f"is when the host-overhead probe runs: one of {', '.join(PROBE_MODES)}",
                        "write probe: interleaved (one probe round before each round of cases), or leave it out",
                        where=where)
    return Suite(name=str(data.get("suite") or path.stem), path=path, sha256=hashlib.sha256(text.encode()).hexdigest(),
                 models=models, cases=cases, subsets=subsets, rounds=rounds, probe=probe)
