"""``--piper`` with Megatron checkpoints: a resumed run keeps the plan its checkpoint was saved with.

* ``--save DIR``: rank 0 writes ``DIR/piper_plan.json`` (:class:`PlanRecord`) as the run starts,
  before any model exists, creating DIR if needed: the plan's label and fields, the Megatron
  settings the run holds for them, the model name, the world size, the cluster and Piper's version.
  A record written before the first checkpoint describes none yet; it counts only beside one.
* ``--load DIR`` where DIR holds a checkpoint (Megatron's tracker file
  ``latest_checkpointed_iteration.txt``; ``checkpoint_exists`` in megatron/training/checkpointing.py):
  with a record, the search is restricted to the recorded plan, and a different world size or model,
  or a flag that rules the recorded plan out, is a SpecError saying what differs. Without one (a
  checkpoint saved without ``--piper``) the sizes that shape the checkpoint (tp, pp, and ep for MoE
  models) must be written on the command line; virtual pipeline stages and the distributed optimizer
  then stay as written (Megatron's defaults: off). Piper does not read the layout Megatron pickles into
  its checkpoints: that is a ``torch.load`` of a pickle (code execution for an untrusted file), in a
  format-specific place, before ``torch.distributed`` exists, and a guess that happens to fit would
  load wrongly or be resharded silently.
* ``--save DIR`` where DIR already holds a checkpoint this run does not resume is refused unless its
  record is this run's plan: the record can describe only one layout.
* Records of format 1 (written before the exchange algorithm and its chunk count were independent)
  load with both overlap fields off and an ``a2a: pipelined`` read as flat in its chunks
  (:meth:`ParallelPlan.read_legacy`, a FutureWarning), which the resume note repeats.

Pure Python (json, pathlib); no torch, no Megatron import.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import piper_core
from piper_core.errors import SpecError
from piper_core.scheduler.space import SearchSpace
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_megatron.pins import Pins, admits

RECORD_NAME = "piper_plan.json"
TRACKER_NAME = "latest_checkpointed_iteration.txt"  # megatron/training/checkpointing.py get_checkpoint_tracker_filename
FORMAT = 2
# ParallelPlan fields a resumed run keeps (gpus is the world size; batch, precision and attention are inputs).
LAYOUT_FIELDS: tuple[str, ...] = (
    "tp", "pp", "vpp", "cp", "ep", "etp", "sequence_parallel", "micro_batch_size", "recompute", "recompute_method",
    "recompute_num_layers", "distributed_optimizer", "grad_reduce_in_bf16", "optimizer_offload_fraction", "a2a",
    "a2a_chunks", "shared_expert_overlap", "ep_comm_overlap", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage")
# Format 1 (before the exchange algorithm and its chunk count were independent): no overlap fields (both
# off then), and a2a may be "pipelined" (flat in a2a_chunks chunks; ParallelPlan.read_legacy).
_FORMAT_1_ADDED = {"shared_expert_overlap": False, "ep_comm_overlap": False}
_KEYS = ("format", "piper_version", "model", "world_size", "cluster", "plan", "layout", "megatron")
# What can rule out a recorded value, per dimension of the search space (for the error message).
_RULED_OUT_BY = {
    "tp": "--tensor-model-parallel-size or --sequence-parallel", "pp": "--pipeline-model-parallel-size",
    "vpp": "--num-virtual-stages-per-pipeline-rank", "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size, --piper-a2a or --piper-chunks (which need ep > 1)",
    "etp": "--expert-tensor-parallel-size", "micro_batch_size": "--micro-batch-size",
    "recompute": "--recompute-granularity, --piper-off recompute-granularity or --piper-chunks tune",
    "distributed_optimizer": "--use-distributed-optimizer, --overlap-param-gather, --optimizer-cpu-offload or "
                             "--piper-off use-distributed-optimizer",
    "a2a": "--piper-a2a or --piper-chunks",
    "memory_savers": "--grad-reduce-in-bf16, --optimizer-cpu-offload, --optimizer-offload-fraction, --piper-off or "
                     "training in fp32 (no --bf16)",
    "sequence_parallel": "--piper-off sequence-parallel",
    "pipeline split": "--num-layers-per-virtual-pipeline-stage or --decoder-last-pipeline-num-layers",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRecord:
    """``piper_plan.json``: the plan a ``--piper`` run saved its checkpoints with. ``layout``: the
    :data:`LAYOUT_FIELDS` of its ParallelPlan; ``megatron``: Megatron dest -> the value the run's
    arguments held for each setting Piper owns (after the rewrite, pinned ones included)."""

    piper_version: str
    model: str
    world_size: int
    cluster: str
    plan: str
    layout: tuple[tuple[str, Any], ...]
    megatron: tuple[tuple[str, Any], ...]
    notes: tuple[str, ...] = ()  # how an older format was read (not written)

    @property
    def fields(self) -> dict[str, Any]:
        return dict(self.layout)

    def to_json(self) -> str:
        body = {"format": FORMAT, "piper_version": self.piper_version, "model": self.model,
                "world_size": self.world_size, "cluster": self.cluster, "plan": self.plan,
                "layout": dict(self.layout), "megatron": dict(self.megatron)}
        return json.dumps(body, indent=1) + "\n"


def layout_of(plan: ParallelPlan) -> tuple[tuple[str, Any], ...]:
    return tuple((f, getattr(plan, f)) for f in LAYOUT_FIELDS)


def make_record(*, model: ModelSpec, cluster: str, plan: ParallelPlan, label: str,
                megatron: dict[str, Any] | None = None) -> PlanRecord:
    plain = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
             for k, v in (megatron or {}).items()}
    return PlanRecord(piper_version=piper_core.__version__, model=model.name, world_size=plan.gpus, cluster=cluster,
                      plan=label, layout=layout_of(plan), megatron=tuple(plain.items()))


def has_checkpoint(directory: Path) -> bool:
    """Megatron's ``checkpoint_exists``: the directory has the tracker of its latest checkpoint."""
    return (directory / TRACKER_NAME).is_file()


def read_record(path: Path) -> PlanRecord:
    """A record as :meth:`PlanRecord.to_json` wrote it (SpecError naming the key otherwise)."""
    fix = f"restore the file --piper wrote, or move {path} aside and pin the sizes the checkpoint was saved with"
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(RECORD_NAME, str(path), f"cannot be read as JSON ({exc})", fix) from exc
    if not isinstance(body, dict) or set(body) != set(_KEYS):
        keys = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise SpecError(RECORD_NAME, keys, f"must hold exactly the keys {', '.join(_KEYS)}", fix, where=str(path))
    if body["format"] not in (1, FORMAT):
        raise SpecError("format", body["format"], f"this Piper reads formats 1 and {FORMAT}", fix, where=str(path))
    layout, notes = _layout(body, path, fix)
    for key, kind in (("piper_version", str), ("model", str), ("world_size", int), ("cluster", str), ("plan", str),
                      ("megatron", dict)):
        if not isinstance(body[key], kind):
            raise SpecError(key, body[key], f"must be a {kind.__name__}", fix, where=str(path))
    return PlanRecord(piper_version=body["piper_version"], model=body["model"], world_size=body["world_size"],
                      cluster=body["cluster"], plan=body["plan"], layout=tuple((f, layout[f]) for f in LAYOUT_FIELDS),
                      megatron=tuple(body["megatron"].items()), notes=notes)


def _layout(body: dict[str, Any], path: Path, fix: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The record's layout in this format's fields, and how an older format was read."""
    layout, format_1 = body["layout"], body["format"] == 1
    fields = [f for f in LAYOUT_FIELDS if not (format_1 and f in _FORMAT_1_ADDED)]
    if not isinstance(layout, dict) or set(layout) != set(fields):
        raise SpecError("layout", layout, f"must hold exactly {', '.join(fields)} (format {body['format']})", fix,
                        where=str(path))
    if not format_1:
        return layout, ()
    read = ParallelPlan.read_legacy({**_FORMAT_1_ADDED, **layout}, str(path))  # FutureWarning for "pipelined"
    if read["a2a"] == layout["a2a"]:
        return read, ()
    return read, (f"{path} (format 1, Piper {body['piper_version']}): its a2a 'pipelined' is read as a2a "
                  f"'{read['a2a']}' in {read['a2a_chunks']} chunks, the same exchange",)


def write_record(directory: Path, record: PlanRecord) -> Path:
    """Write ``directory/piper_plan.json`` atomically (readers see the old file or the new one)."""
    path = directory / RECORD_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{RECORD_NAME}.{os.getpid()}"
        partial.write_text(record.to_json())
        os.replace(partial, path)
    except OSError as exc:
        raise SpecError("--save", str(directory), f"cannot hold {RECORD_NAME} ({exc}), the record a resumed run "
                        "needs to keep this plan", "save to a writable directory") from exc
    return path


@dataclass(frozen=True, kw_only=True, slots=True)
class Resume:
    """A ``--load`` directory that holds a checkpoint, and its record (None: saved without --piper)."""

    directory: Path
    record: PlanRecord | None

    @property
    def path(self) -> Path:
        return self.directory / RECORD_NAME

    def note(self, cluster: str) -> str:
        if self.record is None:
            return (f"--load {self.directory}: a checkpoint saved without --piper (no {RECORD_NAME}); the sizes you "
                    "wrote are kept, and virtual pipeline stages and the distributed optimizer stay as written")
        r = self.record
        other = f", planned then for {r.cluster}" if r.cluster != cluster else ""
        return (f"--load {self.directory}: resuming with the plan its checkpoint was saved with, {r.plan} "
                f"({self.path}, Piper {r.piper_version}{other})" + "".join(f"; {n}" for n in r.notes))

    def hint(self) -> str:
        """For the no-plan message: why the search held only one plan."""
        if self.record is None:
            return ""
        return (f" The search held only the plan --load {self.directory} was saved with ({self.record.plan}); "
                "resume where it fits, or start a new run with a fresh --save directory.")


def resume_from(ns: Any, model: ModelSpec, world_size: int, pins: Pins) -> Resume | None:
    """The checkpoint ``--load`` resumes (None: no --load, or no checkpoint there yet), checked
    against this run's world size and model (SpecError when they differ or, with no record, when
    the sizes that shape the checkpoint are not written on the command line)."""
    load = getattr(ns, "load", None)
    if not load or not has_checkpoint(Path(load)):
        return None
    directory = Path(load)
    if not (directory / RECORD_NAME).is_file():
        _require_layout_pins(directory, model, pins)
        return Resume(directory=directory, record=None)
    record = read_record(directory / RECORD_NAME)
    fresh = "or start a new run with a fresh --save directory"
    if record.world_size != world_size:
        raise SpecError("--load", str(directory), f"its checkpoint was saved by a run on {record.world_size} GPUs "
                        f"({record.plan}; {directory / RECORD_NAME}) and this run has {world_size}: another "
                        "data-parallel size shards the distributed optimizer's state differently",
                        f"launch on {record.world_size} GPUs, {fresh} (if your checkpoint format reshards, e.g. "
                        f"torch_dist, move {RECORD_NAME} aside and pin the sizes instead)")
    if record.model != model.name:
        raise SpecError("--load", str(directory), f"its checkpoint is of model {record.model} "
                        f"({directory / RECORD_NAME}); this command line describes {model.name}",
                        f"resume with the model flags it was saved with, {fresh}")
    return Resume(directory=directory, record=record)


def _require_layout_pins(directory: Path, model: ModelSpec, pins: Pins) -> None:
    need = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
            "pipeline_model_parallel_size": "--pipeline-model-parallel-size"}
    if model.is_moe:
        need["expert_model_parallel_size"] = "--expert-model-parallel-size"
    missing = [flag for dest, flag in need.items() if dest not in pins.values]
    if missing:
        raise SpecError("--load", str(directory), f"holds a Megatron checkpoint ({TRACKER_NAME}) but no {RECORD_NAME}, "
                        "so Piper does not know the layout it was saved with (saved without --piper)",
                        f"write the sizes it was saved with: {', '.join(missing)} (Piper keeps them and plans the "
                        "rest), or resume without --piper")


def widen(space: SearchSpace, resume: Resume | None) -> SearchSpace:
    """``space`` with the recorded plan's values added to each dimension (they may lie outside the
    default range, pinned when the checkpoint was saved), so that only pins can rule them out."""
    if resume is None or resume.record is None:
        return space
    r = resume.record.fields

    def add(values: tuple, value: Any) -> tuple:
        return values if value in values else (*values, value)

    return dataclasses.replace(
        space, tp=add(space.tp, r["tp"]), pp=add(space.pp, r["pp"]), vpp=add(space.vpp, r["vpp"] or 1),
        cp=add(space.cp, r["cp"]), ep=add(space.ep, r["ep"]), mbs=add(space.mbs, r["micro_batch_size"]),
        recompute=add(space.recompute, r["recompute"]),
        distributed_optimizer=add(space.distributed_optimizer, r["distributed_optimizer"]),
        a2a=add(space.a2a, _variant(r)),
        memory_savers=add(space.memory_savers, (r["grad_reduce_in_bf16"], r["optimizer_offload_fraction"])))


def narrow(space: SearchSpace, resume: Resume, model: ModelSpec, pins: Pins, *, world_size: int, gbs: int,
           attention: str) -> SearchSpace:
    """The part of ``space`` (restricted by the pins) a resumed run may use: the recorded plan alone
    (SpecError naming what rules it out), or, for a checkpoint saved without --piper, no virtual
    stages and no distributed optimizer unless written."""
    if resume.record is None:
        return _as_written(space, pins)
    r = resume.record.fields
    wanted = {"tp": (r["tp"], space.tp), "pp": (r["pp"], space.pp), "vpp": (r["vpp"] or 1, space.vpp),
              "cp": (r["cp"], space.cp), "ep": (r["ep"], space.ep),
              "etp": (_etp(r), tuple(r["tp"] if same else 1 for same in space.etp_equals_tp)),
              "micro_batch_size": (r["micro_batch_size"], space.mbs), "recompute": (r["recompute"], space.recompute),
              "distributed_optimizer": (r["distributed_optimizer"], space.distributed_optimizer),
              "memory_savers": ((r["grad_reduce_in_bf16"], r["optimizer_offload_fraction"]), space.memory_savers)}
    if r["ep"] > 1:
        wanted["a2a"] = (_variant(r), space.a2a)
    if r["sequence_parallel"]:
        wanted["sequence_parallel"] = (True, (space.sequence_parallel,))
    for dim, (value, allowed) in wanted.items():
        if value not in allowed:
            _ruled_out(resume, pins, dim, value, allowed)
    try:
        plan = ParallelPlan(gpus=world_size, global_batch_size=gbs, attention_backend=attention,
                            precision=space.precision, **r)
    except SpecError as exc:
        raise SpecError("--load", str(resume.directory), f"the plan its checkpoint was saved with, "
                        f"{resume.record.plan}, does not hold for this command line: {exc}", "resume with the batch "
                        "sizes it was saved with, or start a new run with a fresh --save directory") from exc
    if not admits(plan, model, pins):
        _ruled_out(resume, pins, "pipeline split", plan.num_layers_in_last_pipeline_stage, "the pinned split")
    return dataclasses.replace(
        space, tp=(r["tp"],), pp=(r["pp"],), vpp=(r["vpp"] or 1,), cp=(r["cp"],), ep=(r["ep"],),
        etp_equals_tp=(_etp_is_tp(r),), mbs=(r["micro_batch_size"],), recompute=(r["recompute"],),
        distributed_optimizer=(r["distributed_optimizer"],), a2a=(_variant(r),),
        memory_savers=((r["grad_reduce_in_bf16"], r["optimizer_offload_fraction"]),),
        sequence_parallel=r["sequence_parallel"] or r["tp"] == 1)


def _etp(r: dict[str, Any]) -> int:
    """The recorded expert tensor parallel size (None in a plan: equal to tp)."""
    return r["tp"] if r["etp"] is None else r["etp"]


def _etp_is_tp(r: dict[str, Any]) -> bool:
    """The recorded expert tensor parallel size as the search's ``etp_equals_tp`` dimension (the search
    runs experts with etp 1 or etp = tp, which ``narrow`` checked; etp 1 at tp 1 reads as False, the
    one the search keeps of the two)."""
    return _etp(r) > 1


def _variant(r: dict[str, Any]) -> tuple[str, int, bool]:
    """The recorded exchange as a ``SearchSpace.a2a`` variant (algorithm, chunks, EP overlap)."""
    return r["a2a"], r["a2a_chunks"], r["ep_comm_overlap"]


def _as_written(space: SearchSpace, pins: Pins) -> SearchSpace:
    """Virtual stages and the distributed optimizer as the command line has them: a checkpoint saved
    without --piper was saved with its command line's layout (Megatron's defaults: both off)."""
    vstages = {"num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage"} & set(pins.values)
    written = space.distributed_optimizer == (True,)  # --use-distributed-optimizer (or what needs it) written
    return dataclasses.replace(space, vpp=space.vpp if vstages else (1,), distributed_optimizer=(written,))


def _ruled_out(resume: Resume, pins: Pins, dim: str, value: Any, allowed: Any) -> None:
    raise SpecError("--load", str(resume.directory), f"its checkpoint was saved with the plan {resume.record.plan} "
                    f"({resume.path}), and this command line rules out its {dim} {value!r} (allowed now: "
                    f"{_show(allowed)}; set by {_RULED_OUT_BY[dim]})", f"drop or change that flag so that the run resumes with the "
                    f"layout it saved (pinned now: {pins.describe()}), or start a new run with a fresh --save "
                    "directory")


def _show(allowed: Any) -> str:
    return ", ".join(map(str, allowed)) if isinstance(allowed, tuple) else str(allowed)


def check_save(ns: Any, resume: Resume | None, model: ModelSpec, plan: ParallelPlan) -> None:
    """``--save DIR`` may hold checkpoints of this run's plan only (SpecError otherwise): DIR is the
    checkpoint being resumed, or holds none, or its record is this plan."""
    save = getattr(ns, "save", None)
    if not save or not has_checkpoint(Path(save)):
        return
    if resume is not None and os.path.realpath(resume.directory) == os.path.realpath(save):
        return
    path = Path(save) / RECORD_NAME
    existing = read_record(path) if path.is_file() else None
    if existing is not None and (existing.model, existing.world_size, existing.layout) == (
            model.name, plan.gpus, layout_of(plan)):
        return
    saved = f"the plan {existing.plan}" if existing else f"no {RECORD_NAME} (without --piper)"
    raise SpecError("--save", save, f"already holds a checkpoint, saved with {saved}, that this run does not resume "
                    f"(--load {getattr(ns, 'load', None) or 'not given'}); this run's checkpoints would join it with "
                    f"another layout, and {RECORD_NAME} describes only one", f"resume it with --load {save}, or save "
                    "to a new directory")
