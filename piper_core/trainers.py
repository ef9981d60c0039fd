"""The instrumented CPU trainers, as the adapters register them: the core never names an adapter.

Calibration's host-overhead probe (:mod:`piper_core.calibrate.probe`), ``piper validate``
(:mod:`piper_core.validate.run`) and ``make bench-e2e`` (:mod:`piper_core.bench.e2e`) train real
framework models; which code trains them is the adapter's business. An adapter registers a
:class:`Trainer` under the entry-point group :data:`GROUP` in its package metadata
(``pyproject.toml``)::

    [project.entry-points."piper.trainers"]
    megatron = "piper_megatron.train:TRAINER"

and the core looks it up by framework name with :func:`get`. A framework whose adapter is not
installed, or cannot be imported here, is refused with the reason (:func:`unavailable`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import importlib.util
from importlib import metadata
from pathlib import Path
from typing import Any

GROUP = "piper.trainers"
TIMEOUT_S = 600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Trainer:
    """One framework's trainer.

    ``rank_target``: ``"module:function"`` the launchers run on every rank as
    ``function(info, job_json) -> report`` (:func:`piper_core.validate.instrument.launch`).
    ``probe_setup``: rank side, called once per process with the launcher's rank ``info``; returns
    ``train(job, tmp_dir) -> report`` for many small jobs in that process (the overhead probe).
    ``check``: launcher side, raises ``ValueError`` for a job this trainer cannot run, before any
    process starts (None: it can run every job the plan allows). ``requires``: modules that must be
    importable for it to train (checked by :func:`unavailable` without importing them).
    ``gradients_after_step``: whether the gradients outlive the optimizer step (part of the model
    state a memory job measures after its last step: :mod:`piper_core.validate.peak`)."""

    name: str
    rank_target: str
    probe_setup: Callable[[Any], Callable[[Any, Path], dict[str, Any]]]
    check: Callable[[Any], None] | None = None
    requires: tuple[str, ...] = ()
    gradients_after_step: bool = True

    def run(self, job: Any, *, nodes: int = 1, inter_node_mbit: float | None = None, timeout_s: float = TIMEOUT_S,
            realtime: bool = False) -> list[dict[str, Any]]:
        """Train ``job`` (a :class:`~piper_core.validate.instrument.TrainJob`) on ``job.plan.gpus``
        ranks, local or on an emulated cluster of ``nodes`` nodes; every rank's report in rank order."""
        from piper_core.validate.instrument import launch

        if self.check is not None:
            self.check(job)
        return launch(self.rank_target, job, nodes=nodes, inter_node_mbit=inter_node_mbit, timeout_s=timeout_s,
                      realtime=realtime)


class TrainerUnavailable(LookupError):
    """No usable trainer for a framework; the message says why and what to install."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"trainer {name!r}: {why}")
        self.name, self.why = name, why

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.name, self.why)


def registered() -> dict[str, metadata.EntryPoint]:
    """Every trainer entry point installed, by framework name."""
    return {ep.name: ep for ep in metadata.entry_points(group=GROUP)}


def get(name: str) -> Trainer:
    """The trainer registered as ``name``, or :class:`TrainerUnavailable` saying why not."""
    points = registered()
    if name not in points:
        have = ", ".join(sorted(points)) or "none"
        raise TrainerUnavailable(name, f"no adapter registers it under the entry-point group {GROUP!r} (registered: "
                                       f"{have}); name a registered framework, or install the adapter that provides "
                                       f"it (`make install` installs Piper's megatron and deepspeed trainers)")
    try:
        trainer = points[name].load()
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here, say why
        raise TrainerUnavailable(name, f"{points[name].value} cannot be imported ({type(exc).__name__}: {exc})") from exc
    if not isinstance(trainer, Trainer) or trainer.name != name:
        raise TrainerUnavailable(name, f"{points[name].value} is not a Trainer named {name!r} (got {trainer!r})")
    return trainer


def unavailable(name: str) -> str | None:
    """None when the trainer ``name`` can be used here, else why not."""
    try:
        trainer = get(name)
    except TrainerUnavailable as exc:
        return str(exc)
    missing = [m for m in trainer.requires if _find(m) is None]
    if missing:
        return f"trainer {name!r}: {', '.join(missing)} is not installed (pip install -e '.[{name}]')"
    return None


def _find(module: str) -> object | None:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
