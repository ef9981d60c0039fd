"""What the instrumented CPU trainers share (:mod:`piper_megatron.train`, :mod:`piper_deepspeed.measure`):
the job they run, the activation ledger, and the summary ``piper validate`` compares with the model.

No torch import at module level: planning code may import this module.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.yamlio import from_dict, to_dict

if TYPE_CHECKING:  # piper_core.runtime imports torch: read lazily (from_json), not at module level
    from piper_core.runtime.placement import ExpertPlacement


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainJob:
    """One measured training run: ``model`` under ``plan`` for ``steps`` steps (the first
    ``warmup`` not timed into the median). ``stock``: the framework's own dispatcher/MoE layer.

    Uneven routing (issue 17): ``router_bias`` (logical expert -> a constant added to its router
    logit in every MoE layer; a mapping is accepted and kept as sorted pairs), ``placement`` (where
    Piper's dispatcher puts each logical expert; the model is built with the default placement and
    each slot then loaded with its logical expert's weights, so every placement trains the same
    model), ``trace_dir`` (each rank keeps its ``--piper-trace`` file of the timed steps there,
    ``trace.rank<R>.jsonl``). Megatron's trainer runs them (:mod:`piper_megatron.experts`).

    Expert migration while it trains (issue 17, deliverable 3): ``migrate_every`` steps, between two
    of them, every rank runs :func:`piper_megatron.live.decide` (the decision ``--piper-migrate-every``
    makes in Megatron-LM), priced on ``migrate_cluster`` over ``migrate_horizon`` steps (default
    ``migrate_every``), starting from ``placement``. The decisions run outside the timed steps and are
    reported with their own time. Megatron's trainer only, Piper's dispatcher."""

    model: ModelSpec
    plan: ParallelPlan
    steps: int = 4
    warmup: int = 1
    stock: bool = False
    seed: int = 1234
    lr: float = 1e-3
    forward_steps: int = 0  # extra forward-only passes timed after training (the host-overhead probe)
    sync_grads: bool = True  # False: no data-parallel gradient reduction (the probe times one rank's work)
    tune: bool = False  # Piper's chunk count measured per MoE layer at run time (--piper-chunks tune)
    memory: bool = False  # the whole job under a TensorLedger (peak tensor bytes); its step times are not timings
    router_bias: tuple[tuple[int, float], ...] = ()
    placement: ExpertPlacement | None = None
    trace_dir: str | None = None
    migrate_every: int | None = None
    migrate_horizon: int | None = None
    migrate_cluster: ClusterSpec | None = None

    def __post_init__(self) -> None:
        from piper_core.errors import SpecError

        bias = self.router_bias
        pairs = tuple(sorted(bias.items())) if isinstance(bias, Mapping) else tuple(tuple(p) for p in bias)
        object.__setattr__(self, "router_bias", tuple((int(e), float(b)) for e, b in pairs))
        _check_uneven(self)
        if self.steps <= self.warmup:
            raise SpecError("steps", self.steps, f"must be > warmup ({self.warmup}) to time a step",
                            f"use steps >= {self.warmup + 1}")
        if self.plan.optimizer_offload_fraction:
            raise SpecError("optimizer_offload_fraction", self.plan.optimizer_offload_fraction,
                            "the CPU trainers run no optimizer offload (the optimizer already runs on the host)",
                            "set offload=0")

    def to_json(self) -> dict[str, Any]:
        return {"model": to_dict(self.model), "plan": to_dict(self.plan), "steps": self.steps,
                "warmup": self.warmup, "stock": self.stock, "seed": self.seed, "lr": self.lr,
                "forward_steps": self.forward_steps, "sync_grads": self.sync_grads,
                "tune": self.tune, "memory": self.memory, "router_bias": [list(p) for p in self.router_bias],
                "placement": None if self.placement is None else self.placement.to_json(),
                "trace_dir": self.trace_dir, "migrate_every": self.migrate_every,
                "migrate_horizon": self.migrate_horizon,
                "migrate_cluster": None if self.migrate_cluster is None else to_dict(self.migrate_cluster)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainJob:
        placement = d.get("placement")
        if placement is not None:
            from piper_core.runtime.placement import placement_from_json

            placement = placement_from_json(placement, where="job")
        return cls(model=from_dict(ModelSpec, d["model"], where="job"), plan=from_dict(ParallelPlan, d["plan"], where="job"),
                   steps=d["steps"], warmup=d["warmup"], stock=d["stock"], seed=d["seed"], lr=d["lr"],
                   forward_steps=d.get("forward_steps", 0), sync_grads=d.get("sync_grads", True),
                   tune=d.get("tune", False), memory=d.get("memory", False),
                   router_bias=tuple(tuple(p) for p in d.get("router_bias", ())),
                   placement=placement,
                   trace_dir=d.get("trace_dir"), migrate_every=d.get("migrate_every"),
                   migrate_horizon=d.get("migrate_horizon"),
                   migrate_cluster=None if d.get("migrate_cluster") is None else
                   from_dict(ClusterSpec, d["migrate_cluster"], where="job: migrate_cluster"))

    @property
    def router_bias_map(self) -> dict[int, float]:
        return dict(self.router_bias)


def _check_uneven(job: TrainJob) -> None:
    """``router_bias`` and ``placement`` need a MoE model; each bias a finite number on an expert of
    the model; a placement of the model's experts over the plan's ep, with Piper's dispatcher."""
    from piper_core.errors import SpecError

    experts = job.model.num_experts if job.model.is_moe else 0
    if (job.router_bias or job.placement is not None) and not experts:
        raise SpecError("router_bias" if job.router_bias else "placement", job.model.name,
                        "routes no tokens: the model has no routed experts", "train a MoE model, or drop it")
    seen = set()
    for e, b in job.router_bias:
        if not 0 <= e < experts or e in seen:
            raise SpecError(f"router_bias[{e}]", b, f"must name each logical expert once, in 0 .. {experts - 1}",
                            "bias experts of the model")
        if not math.isfinite(b):
            raise SpecError(f"router_bias[{e}]", b, "must be a finite number (added to the router logit)",
                            "give e.g. 1.5")
        seen.add(e)
    _check_migration(job, experts)
    if job.placement is not None:
        job.placement.check(num_experts=experts, ep=job.plan.ep, key="placement",
                            fix_ep=f"write a placement for the plan's ep={job.plan.ep}")
        if job.stock and not job.placement.is_default:
            raise SpecError("placement", job.placement.describe(), "runs on Piper's dispatcher only: the stock "
                            "dispatcher sends logical expert l to slot l", "drop stock, or the placement")


def _check_migration(job: TrainJob, experts: int) -> None:
    """``migrate_every``: a whole number of steps >= 1, on a MoE model with Piper's dispatcher, with the
    cluster its decisions price on; ``migrate_horizon`` and ``migrate_cluster`` only with it."""
    from piper_core.errors import SpecError

    if job.migrate_every is None:
        for key, value in (("migrate_horizon", job.migrate_horizon), ("migrate_cluster", job.migrate_cluster)):
            if value is not None:
                raise SpecError(key, value if key == "migrate_horizon" else value.name,
                                "is used by migration decisions, and the job makes none without migrate_every",
                                "set migrate_every, or drop it")
        return
    for key, value in (("migrate_every", job.migrate_every), ("migrate_horizon", job.migrate_horizon)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(key, value, "must be a whole number of steps >= 1", "give e.g. 2")
    if not experts:
        raise SpecError("migrate_every", job.migrate_every, "moves routed experts: the model has none",
                        "train a MoE model, or drop it")
    if job.stock:
        raise SpecError("migrate_every", job.migrate_every, "needs Piper's dispatcher (it moves experts between "
                        "physical slots); the stock dispatcher has fixed slots", "drop stock, or migrate_every")
    if job.migrate_cluster is None:
        raise SpecError("migrate_cluster", None, "must be given with migrate_every: the decisions price the "
                        "predicted step and the move on it", "pass the job's cluster (a preset or a calibrated profile)")


class _Box:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


class ActivationPeak:
    """Saved-tensor hooks that keep a running sum of the unique storages autograd holds (each
    counted once however many saves share it; parameters and listed inputs excluded) and its peak."""

    def __init__(self, excluded: set[int]):
        self.excluded = excluded
        self.held: dict[int, list[int]] = {}  # storage address -> [saves alive, bytes]
        self.now = self.peak = 0

    def pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.excluded or storage.nbytes() == 0:
            return tensor
        box = _Box(tensor)
        entry = self.held.get(ptr)
        if entry is None:
            entry = self.held[ptr] = [0, storage.nbytes()]
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        weakref.finalize(box, self._release, ptr)
        return box

    def _release(self, ptr: int) -> None:
        entry = self.held[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.held[ptr]

    @staticmethod
    def unpack(box: Any) -> Any:
        return box.tensor if isinstance(box, _Box) else box


def tensor_ledger() -> Any:
    """A :class:`TensorLedger` (a ``TorchDispatchMode``; torch imported here, not at module level)."""
    return _ledger_class()()


_LEDGER: list[type] = []


def _ledger_class() -> type:
    if _LEDGER:
        return _LEDGER[0]
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class TensorLedger(TorchDispatchMode):
        """Every tensor storage any operator creates while the mode is on, counted once from its
        creation until it is freed (a weak finalizer on the storage): ``now`` live bytes and their
        ``peak``. What a device allocator's high-water mark counts for tensors -- parameters,
        gradients and their buffers, optimizer state, activations, communication buffers and
        temporaries -- except scratch space an operator allocates and frees inside one kernel."""

        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, int] = {}
            self.now = self.peak = 0

        def _track(self, t: Any) -> None:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                return
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.live:
                return
            self.live[key] = size
            self.now += size
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._release, key)

        def _release(self, key: int) -> None:
            self.now -= self.live.pop(key, 0)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                self._track(t)
            return out

    _LEDGER.append(TensorLedger)
    return TensorLedger


def launch(target: str, job: TrainJob, *, nodes: int, inter_node_mbit: float | None, timeout_s: float,
           realtime: bool) -> list[dict[str, Any]]:
    """Run ``target(info, job_json)`` on ``job.plan.gpus`` ranks: local (``nodes == 1``) or on an
    emulated cluster of ``nodes`` nodes (root; links shaped to ``inter_node_mbit``); every rank's
    report, in rank order. ``realtime``: ranks under SCHED_FIFO (:func:`piper_core.emulate.launch.launch`)."""
    from piper_core.emulate import run_emulated, run_local

    world = job.plan.gpus
    if nodes == 1:
        return run_local(world, target, [job.to_json()], timeout_s=timeout_s, realtime=realtime)
    if world % nodes:
        raise ValueError(f"nodes={nodes}: must divide the plan's gpus ({world})")
    return run_emulated(nodes, world // nodes, inter_node_mbit, target, [job.to_json()], timeout_s=timeout_s,
                        realtime=realtime)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def summary(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The job's measured figures: step time (median over timed steps of the slowest rank), the
    largest parameter and activation bytes of any rank, per pipeline stage (and, from a ``memory``
    job, the largest peak and after-step tensor bytes), the losses."""
    steps = [max(r["step_s"][i] for r in reports) for i in range(len(reports[0]["step_s"]))]
    stages: dict[int, dict[str, int]] = {}
    for r in reports:
        st = stages.setdefault(r["pp_rank"], {"params": 0, "param_bytes": 0, "activation_peak_bytes": 0})
        for k in ("params", "param_bytes", "activation_peak_bytes", "peak_tensor_bytes", "state_tensor_bytes",
                  "workspace_bytes"):
            if k in r:
                st[k] = max(st.get(k, 0), r[k])
    losses = next((r["losses"] for r in reports if r["losses"]), [])
    return {"step_s": steps, "stages": [stages[k] for k in sorted(stages)], "losses": losses,
            "moe_phases_ms_per_step": reports[0]["moe_phases_ms_per_step"]}
