"""The ``"piper"`` block of a DeepSpeed JSON config, validated in DeepSpeed's own style.

DeepSpeed keeps unknown top-level keys of its config (``engine.config["piper"]`` returns the block)
and validates its sub-configs with pydantic models derived from ``DeepSpeedConfigModel`` (extra keys
forbidden). :class:`PiperConfig` is such a model, in strict mode (no "yes" for true, no "4" for 4);
:meth:`PiperConfig.from_block` turns pydantic's errors into Piper's :class:`SpecError` (the key, the
value, the rule and the fix; an unknown key names the nearest valid one and all of them).

Keys (the block ``piper plan --export-deepspeed`` writes loads unchanged; ``piper_core/export.py``)::

    "piper": {
      "enabled": true,              # false (or no block): DeepSpeed runs untouched
      "cluster": "dgx-h100",        # a cluster preset or ClusterSpec YAML path; or instead:
      "profile": null,              # a calibrated profile written by `piper calibrate` (exactly one of
                                    # cluster and profile when enabled)
      "model": "switch-1t",         # model preset, ModelSpec YAML path or ModelSpec mapping; optional
                                    # when the model was built by piper_deepspeed.builder
      "a2a": "auto",                # exchange algorithm: auto | flat | hierarchical (the old "pipelined"
                                    # is read as flat with chunks >= 2, with a FutureWarning and a note)
      "chunks": "auto",             # pipeline chunks of every exchange, with either algorithm: int >= 1
                                    # (1: unpipelined; >= 2: chunk k+1's exchange overlaps chunk k's
                                    # experts) | auto (the scheduler picks) | tune (each MoE layer
                                    # measures 1/2/4/8 chunks, 3 steps each, then keeps the fastest)
      "defer_wgrad": false,         # true: each MoE layer computes its experts' weight gradients after
                                    # posting the dispatch's gradient, while it is in flight (Piper's
                                    # runtime; bit-identical gradients; plans with ep > 1; priced)
      "placement": null,            # where each logical expert lives: a placement JSON file or the same
                                    # object inline, {"num_experts": E, "ep": N, "ranks": [[ids], ...]}
                                    # (docs/placement.md); its ep restricts the plan; the slots' weights
                                    # must be those experts' (builder.build_model(placement=...))
      "migrate_every": null,        # N: every N optimizer steps, price moving experts to balance the
                                    # tokens each rank's experts got since the last decision, and move
                                    # them when the gain over migrate_horizon steps pays for the move
                                    # (ep > 1, ZeRO 0, no PipelineModule; piper_deepspeed/live.py)
      "migrate_horizon": null,      # the steps that gain is counted over (default: migrate_every)
      "routing": null,              # measured routing: a tokens-per-expert histogram file, or a list of
                                    # --piper-trace files (docs/routing.md); the scheduler prices each
                                    # MoE layer at its busiest rank under the placement
      "memory_headroom": 0.0,       # fraction of usable GPU memory the plan keeps free, in [0, 1);
                                    # a pinned plan over the limit is refused too
      "plan_only": false,           # true: rank 0 prints the plan, then PlanOnly (SystemExit 0)
      "trace": null,                # directory: per-rank JSON lines of the all-to-all schedule, plan.json
      "plan": {"tp": 1, "pp": 1, "ep": 8, "etp": 1, "cp": 1, "vpp": 1, "mbs": 2, "recompute": "none"},
                                    # optional: pins the plan (no search); written by the export
      "predicted": {"mfu": 0.31, "step_s": 1.2, "peak_memory_gib": 61.0}   # informational
    }

As everywhere in DeepSpeed's pydantic configs, a value of ``"auto"`` means the key's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, PrivateAttr, ValidationError

from piper_core.calibrate.profile import load_profile
from piper_core.errors import SpecError, nearest
from piper_core.presets import cluster_names, load_cluster, load_model, model_names
from piper_core.runtime.placement import ExpertPlacement, placement_from_json, read_placement
from piper_core.scheduler.space import CHUNK_CHOICES, A2AVariant
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import LEGACY_PIPELINED, read_a2a
from piper_core.specs.yamlio import from_dict

BLOCK = "piper"
A2AChoice = Literal["auto", "flat", "hierarchical"]

_STRICT = DeepSpeedConfigModel.model_config | {"strict": True}


class PlanPin(DeepSpeedConfigModel):
    """``piper.plan``: the plan to run instead of searching (as ``piper plan --export-deepspeed``
    writes it). DeepSpeed can express only tp = etp = cp = vpp = 1."""

    model_config = _STRICT
    tp: Annotated[int, Field(ge=1)] = 1
    pp: Annotated[int, Field(ge=1)] = 1
    ep: Annotated[int, Field(ge=1)] = 1
    etp: Annotated[int, Field(ge=1)] = 1
    cp: Annotated[int, Field(ge=1)] = 1
    vpp: Annotated[int, Field(ge=1)] = 1
    mbs: Annotated[int, Field(ge=1)]
    recompute: Literal["none", "selective", "full"] = "none"


class PiperConfig(DeepSpeedConfigModel):
    """The ``"piper"`` block (see the module doc for every key). Build with :meth:`from_block`."""

    model_config = _STRICT
    enabled: bool = True
    cluster: str | None = None
    profile: str | None = None
    a2a: A2AChoice = "auto"
    chunks: Annotated[int, Field(ge=1)] | Literal["auto", "tune"] = "auto"
    defer_wgrad: bool = False
    placement: str | dict[str, Any] | None = None
    routing: str | list[str] | None = None
    migrate_every: Annotated[int, Field(ge=1)] | None = None
    migrate_horizon: Annotated[int, Field(ge=1)] | None = None
    memory_headroom: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    plan_only: bool = False
    trace: str | None = None
    model: str | dict[str, Any] | None = None
    plan: PlanPin | None = None
    predicted: dict[str, float] | None = None
    # the old "a2a": "pipelined" (flat, chunks >= 2): the least chunk count and the note of its reading
    _min_chunks: int = PrivateAttr(default=1)
    _notes: tuple[str, ...] = PrivateAttr(default=())

    @classmethod
    def from_block(cls, block: Any) -> PiperConfig:
        """Validate the block's value; every error is a :class:`SpecError` naming ``piper.<key>``."""
        if not isinstance(block, Mapping):
            raise SpecError(BLOCK, block, "must be a mapping (a JSON object)",
                            'write e.g. "piper": {"cluster": "dgx-h100", "model": "tiny-moe"}')
        block, note = _read_legacy(block)
        try:
            cfg = cls(**block)
        except ValidationError as exc:
            raise _spec_error(exc, block) from None
        cfg._check_combinations()
        if note is not None:
            cfg._min_chunks, cfg._notes = 2, (note,)
        return cfg

    def _check_combinations(self) -> None:
        if self.profile is not None and self.cluster is not None:
            raise SpecError("piper.profile", self.profile, f"and piper.cluster ({self.cluster!r}) are exclusive: a "
                            "profile holds its own calibrated cluster", "remove one of them")
        if self.migrate_horizon is not None and self.migrate_every is None:
            raise SpecError("piper.migrate_horizon", self.migrate_horizon, "is the horizon of the migration decisions "
                            "that piper.migrate_every turns on", 'set "migrate_every": N too, or remove migrate_horizon')
        if not self.enabled:
            return
        if self.cluster is None and self.profile is None:
            raise SpecError("piper.cluster", None, "is required (or piper.profile): the scheduler plans for the "
                            "cluster the job runs on", f"set it to a preset ({', '.join(cluster_names())}) or a "
                            "ClusterSpec YAML path, or set piper.profile to a profile from `piper calibrate`")

    def expert_placement(self) -> ExpertPlacement | None:
        """``placement`` read (a file path or the object inline) and validated; errors name
        ``piper.placement``. None when the block has none."""
        if self.placement is None:
            return None
        try:
            if isinstance(self.placement, str):
                return read_placement(self.placement)
            return placement_from_json(self.placement, where='"piper" block')
        except SpecError as exc:
            key = exc.key if exc.key == "placement" else f"placement.{exc.key}"
            raise SpecError(f"{BLOCK}.{key}", exc.value, exc.rule, exc.fix, where=exc.where) from None

    def checked_placement(self, *, num_experts: int, ep: int) -> ExpertPlacement | None:
        """:meth:`expert_placement`, refused unless it places ``num_experts`` experts on ``ep`` ranks;
        with ep = 1 only the default placement (DeepSpeed's own layer runs it, in expert id order)."""
        placement = self.expert_placement()
        if placement is None:
            return None
        placement.check(num_experts=num_experts, ep=ep, key=f"{BLOCK}.placement",
                        fix_ep=f'write a placement for ep={ep}, or pin "plan": {{"ep": {placement.ep}, ...}}')
        if ep == 1 and not placement.is_default:
            raise SpecError(f"{BLOCK}.placement", placement.where or "inline", "reorders the experts of an ep=1 job, "
                            "which runs DeepSpeed's own MoE layer (experts in id order)",
                            "remove piper.placement, or plan with ep > 1")
        return placement

    @property
    def min_chunks(self) -> int:
        """The least chunk count ``"chunks": "auto"`` may pick: 2 for the old ``"a2a": "pipelined"``."""
        return self._min_chunks

    @property
    def notes(self) -> tuple[str, ...]:
        """How settings of an older spelling were read (for the report)."""
        return self._notes

    @property
    def requested_exchange(self) -> tuple[str, Any] | None:
        """The key and value that ask for a particular expert all-to-all (None: ``a2a`` auto with
        ``chunks`` auto or 1). Such a request is honoured or refused, never dropped: the search keeps
        only ep > 1 plans (``piper_megatron.pins.restrict`` does the same for ``--piper-a2a``). A
        chunk count >= 2 (or tune) is named before ``"a2a": "flat"``, which alone also fits ep = 1."""
        if self._min_chunks > 1:
            return "piper.a2a", LEGACY_PIPELINED
        if self.a2a == "hierarchical":
            return "piper.a2a", self.a2a
        if self.chunks == "tune" or (isinstance(self.chunks, int) and self.chunks >= 2):
            return "piper.chunks", self.chunks
        return ("piper.a2a", self.a2a) if self.a2a != "auto" else None

    def a2a_choices(self) -> tuple[A2AVariant, ...]:
        """(algorithm, chunks, EP overlap) variants the scheduler may pick from, as ``SearchSpace.a2a``:
        ``a2a`` and ``chunks`` chosen independently (``tune``: the plan assumes one of the counts the
        layers will measure). Never Megatron's EP overlap, which DeepSpeed-MoE does not have
        (:func:`piper_core.runners.deepspeed_piper`)."""
        algorithms = ("flat", "hierarchical") if self.a2a == "auto" else (self.a2a,)
        counts = (self.chunks,) if isinstance(self.chunks, int) else \
            tuple(c for c in CHUNK_CHOICES if c >= self._min_chunks)
        return tuple((a, c, False) for a in algorithms for c in counts)

    def cluster_spec(self) -> ClusterSpec:
        """The cluster to plan for: the profile's calibrated cluster, or the ``cluster`` preset/YAML."""
        try:
            if self.profile is not None:
                return load_profile(self.profile)
            return load_cluster(self.cluster or "")
        except SpecError as exc:
            raise _prefixed(exc) from None

    def model_spec(self, built: ModelSpec | None) -> ModelSpec:
        """The model's shape: the block's ``model`` if set (it must then equal the spec the model was
        built from, ``built``, if any), else ``built``."""
        if self.model is None:
            if built is None:
                raise SpecError("piper.model", None, "the block needs the model's shape (layers, heads, experts, "
                                "sequence length ...), which a DeepSpeed model does not carry",
                                f"set it to a preset ({', '.join(model_names())}), a ModelSpec YAML path or a "
                                "ModelSpec mapping, or build the model with piper_deepspeed.builder.build_model")
            return built
        try:
            spec = (from_dict(ModelSpec, self.model, where=f'"{BLOCK}" block', prefix="piper.model.")
                    if isinstance(self.model, dict) else load_model(self.model))
        except SpecError as exc:
            raise _prefixed(exc) from None
        if built is not None and spec != built:
            diff = [k for k in ModelSpec.__dataclass_fields__ if not k.startswith("_")
                    and getattr(spec, k) != getattr(built, k)]
            raise SpecError("piper.model", self.model, f"differs from the spec the model was built from ({built.name}) "
                            f"in {', '.join(diff)}", "remove piper.model (the built model carries its spec) or rebuild")
        return spec


def _read_legacy(block: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    """``block`` with the old ``"a2a": "pipelined"`` (flat exchanges in 2 chunks or more) read by
    :func:`read_a2a` as ``"flat"`` (FutureWarning), and the note saying so; unchanged otherwise."""
    if block.get("a2a") != LEGACY_PIPELINED:
        return block, None
    chunks = block.get("chunks", "auto")
    if type(chunks) is int and chunks == 1:
        raise SpecError("piper.chunks", 1, 'a2a "pipelined" meant flat exchanges in 2 chunks or more, so one chunk '
                        "contradicts it", 'write "a2a": "flat", "chunks": 1 (unpipelined), or "a2a": "flat" with '
                        'chunks 2, 4, 8 or "auto"')
    shown = {"auto": "2 or more (auto)", "tune": "tuned"}.get(chunks, chunks) if isinstance(chunks, str) else chunks
    a2a, _, note = read_a2a(LEGACY_PIPELINED, shown, where=f'the "{BLOCK}" block')
    return {**block, "a2a": a2a}, note


def read_block(config: Mapping[str, Any]) -> PiperConfig | None:
    """The validated ``"piper"`` block of a DeepSpeed config dict, or None if it has none."""
    if BLOCK not in config:
        return None
    return PiperConfig.from_block(config[BLOCK])


def _prefixed(exc: SpecError) -> SpecError:
    key = exc.key if exc.key.startswith(f"{BLOCK}.") else f"{BLOCK}.{exc.key}"
    return SpecError(key, exc.value, exc.rule, exc.fix, where=exc.where)


_RULES: dict[str, tuple[str, str]] = {
    "enabled": ("must be true or false", "write true or false"),
    "cluster": ("must be a cluster preset name or a ClusterSpec YAML path", "write a string, e.g. \"dgx-h100\""),
    "profile": ("must be the path of a profile written by piper calibrate, or null",
                'write e.g. "profile": "me.yaml", or remove the key'),
    "a2a": ("must be one of auto, flat, hierarchical", 'write e.g. "a2a": "hierarchical" (pipeline it with "chunks")'),
    "chunks": ('must be an int >= 1, "auto" or "tune"', 'write e.g. "chunks": 4, "chunks": "auto" or "chunks": "tune"'),
    "memory_headroom": ("must be a number in [0, 1): the fraction of usable GPU memory kept free",
                        'write e.g. "memory_headroom": 0.1'),
    "plan_only": ("must be true or false", "write true or false"),
    "trace": ("must be a directory path or null", 'write e.g. "trace": "runs/trace"'),
    "model": ("must be a model preset name, a ModelSpec YAML path or a ModelSpec mapping",
              'write e.g. "model": "tiny-moe"'),
    "plan": ("must be a mapping (tp, pp, ep, etp, cp, vpp, mbs, recompute)",
             "write it as piper plan --export-deepspeed does, or remove it to let Piper search"),
    "placement": ("must be the path of a placement JSON file or the placement object itself",
                  'write e.g. "placement": "placement.json" or {"num_experts": 4, "ep": 2, "ranks": [[1, 0], [3, 2]]}'),
    "routing": ("must be the path of a routing file or a list of --piper-trace files",
                'write e.g. "routing": "routing.yaml" (docs/routing.md)'),
    "migrate_every": ("must be an int >= 1 (optimizer steps between migration decisions) or null",
                      'write e.g. "migrate_every": 50, or remove the key'),
    "migrate_horizon": ("must be an int >= 1 (the steps a move must pay for itself over) or null",
                        'write e.g. "migrate_horizon": 500, or remove the key'),
    "predicted": ("must be a mapping of numbers (informational, written by piper plan)", "remove the key"),
    "plan.recompute": ("must be one of none, selective, full", 'write e.g. "recompute": "none"'),
    "plan.mbs": ("is required and must be an int >= 1 (micro-batch size)", 'write e.g. "mbs": 1'),
}
_INT_RULE = ("must be an int >= 1", "write a whole number such as 1")


def _spec_error(exc: ValidationError, block: Mapping[str, Any]) -> SpecError:
    """The first of pydantic's errors as a SpecError naming ``piper.<key>``."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    top_field = loc[0]
    if err["type"] == "extra_forbidden":
        model = PlanPin if top_field == "plan" and len(loc) > 1 else PiperConfig
        name = loc[-1]
        valid = list(model.model_fields)
        guess = nearest(name, valid)
        hint = f"did you mean '{guess}'? " if guess else ""
        where = "piper.plan" if model is PlanPin else "the piper block"
        return SpecError(f"piper.{'.'.join(loc)}", err["input"], f"is not a key of {where}",
                         f"{hint}valid keys: {', '.join(valid)}")
    field = top_field if top_field != "plan" or len(loc) == 1 else f"plan.{loc[1]}"
    value: Any = block.get(top_field) if top_field != "plan" or len(loc) == 1 else \
        (block.get("plan") or {}).get(loc[1]) if isinstance(block.get("plan"), Mapping) else None
    rule, fix = _RULES.get(field, _INT_RULE if field.startswith("plan.") else (err["msg"], "fix the value"))
    return SpecError(f"piper.{field}", value, rule, fix)
