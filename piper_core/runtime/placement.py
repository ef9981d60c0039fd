"""Where each expert lives: a placement of ``E`` logical experts on ``ep`` expert-parallel ranks.

The router picks *logical* experts (its output columns). The model holds ``E`` *physical* slots:
expert-parallel rank ``r`` holds slots ``r * E/ep ... (r + 1) * E/ep - 1``, in that order as its local
experts (Megatron-Core's ``local_expert_indices``, DeepSpeed's ``deepspeed_experts``). The default
placement puts logical expert ``l`` in slot ``l``; any other placement is a permutation, and the
adapters' dispatchers send the tokens routed to ``l`` to slot :attr:`ExpertPlacement.slot_of` ``[l]``,
whose weights must be logical expert ``l``'s (docs/placement.md).

JSON (what the placement optimizer writes; :func:`read_placement`, :meth:`ExpertPlacement.write`)::

    {"num_experts": 8, "ep": 2, "ranks": [[5, 2, 7, 0], [3, 6, 1, 4]]}

``ranks[r]``: the logical experts rank ``r`` holds, in its local slot order. Pure Python (no torch):
the adapters turn :attr:`~ExpertPlacement.logical_at` / :attr:`~ExpertPlacement.slot_of` into index
tensors.

A placement per MoE layer (:class:`LayerPlacements`; what ``piper placement --out`` and a migrated
checkpoint write; Megatron-Core numbers its layers from 1, ``layer_number``)::

    {"num_experts": 8, "ep": 2, "layers": {"1": [[0, 5, 6, 7], [1, 2, 3, 4]], "3": [[...], [...]]}}

A layer the file does not list keeps the default placement. :func:`read_placements` reads either
form (JSON, or YAML by a ``.yaml``/``.yml`` suffix); every reader of a placement file goes through it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from piper_core.errors import SpecError, divisors, nearest

KEYS = ("num_experts", "ep", "ranks")
LAYER_KEYS = ("num_experts", "ep", "layers")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertPlacement:
    """``ranks[r]``: the logical expert ids expert-parallel rank ``r`` holds, slot by slot.

    Validated when built (SpecError naming the key, the value, the rule and the fix): ``ep`` lists
    of equal length ``num_experts / ep`` that together hold every id in ``0 .. num_experts - 1``
    exactly once. ``where`` names the source (a file) in those messages."""

    num_experts: int
    ep: int
    ranks: tuple[tuple[int, ...], ...]
    where: str | None = field(default=None, compare=False)  # the source, for messages only

    def __post_init__(self) -> None:
        where = self.where
        _check_sizes(self.num_experts, self.ep, where)
        ranks = self.ranks
        if not isinstance(ranks, (list, tuple)) or any(not isinstance(r, (list, tuple)) for r in ranks):
            raise SpecError("ranks", ranks, "must be a list of lists (the logical expert ids of each rank)",
                            'write e.g. "ranks": [[1, 0], [3, 2]]', where=where)
        if len(ranks) != self.ep:
            raise SpecError("ranks", _short(ranks), f"lists {len(ranks)} ranks, ep is {self.ep}",
                            f"give one list per expert-parallel rank ({self.ep})", where=where)
        per = self.num_experts // self.ep
        sizes = [len(r) for r in ranks]
        if any(s != per for s in sizes):
            raise SpecError("ranks", _short(ranks), f"slots per rank are {sizes}; every rank holds num_experts / ep "
                            f"= {per}", f"give each rank exactly {per} expert ids", where=where)
        object.__setattr__(self, "ranks", tuple(tuple(r) for r in ranks))
        _check_permutation(self.ranks, self.num_experts, where)

    @classmethod
    def default(cls, num_experts: int, ep: int) -> ExpertPlacement:
        """Logical expert ``l`` in slot ``l`` (what every framework does without a placement)."""
        per = num_experts // ep if ep >= 1 else 0
        return cls(num_experts=num_experts, ep=ep, ranks=tuple(tuple(range(r * per, (r + 1) * per))
                                                                for r in range(ep)))

    @classmethod
    def from_slots(cls, slot_of: Sequence[int], ep: int) -> ExpertPlacement:
        """From the permutation itself: ``slot_of[l]`` is logical expert ``l``'s physical slot."""
        n = len(slot_of)
        if sorted(slot_of) != list(range(n)):
            raise SpecError("slot_of", list(slot_of), f"must be a permutation of 0 .. {n - 1} (each slot once)",
                            "give every logical expert its own slot")
        logical_at = [0] * n
        for logical, slot in enumerate(slot_of):
            logical_at[slot] = logical
        per = n // ep if ep >= 1 and n % ep == 0 else n
        return cls(num_experts=n, ep=ep, ranks=tuple(tuple(logical_at[r * per:(r + 1) * per]) for r in range(ep)))

    @property
    def logical_at(self) -> tuple[int, ...]:
        """``logical_at[s]``: the logical expert in physical slot ``s``."""
        return tuple(e for rank in self.ranks for e in rank)

    @property
    def slot_of(self) -> tuple[int, ...]:
        """``slot_of[l]``: logical expert ``l``'s physical slot (the inverse of :attr:`logical_at`)."""
        slots = [0] * self.num_experts
        for slot, logical in enumerate(self.logical_at):
            slots[logical] = slot
        return tuple(slots)

    @property
    def is_default(self) -> bool:
        return self.logical_at == tuple(range(self.num_experts))

    def for_layer(self, layer_number: int | None) -> ExpertPlacement:
        """The placement of MoE layer ``layer_number``: this one, for every layer."""
        return self

    def moved(self) -> int:
        """Logical experts held by another rank than the default placement's."""
        per = self.num_experts // self.ep
        return sum(e // per != r for r, rank in enumerate(self.ranks) for e in rank)

    def check(self, *, num_experts: int, ep: int, key: str, fix_ep: str | None = None) -> None:
        """SpecError naming ``key`` unless this placement is for ``num_experts`` experts on ``ep`` ranks."""
        _check_job(self, num_experts=num_experts, ep=ep, key=key, fix_ep=fix_ep)

    def to_json(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "ep": self.ep, "ranks": [list(r) for r in self.ranks]}

    def write(self, path: Path | str) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json()) + "\n")
        return path

    def describe(self) -> str:
        """One line for reports, e.g. ``6 of 8 experts off their default rank``."""
        if self.is_default:
            return f"the default ({self.num_experts} experts in id order over {self.ep} ranks)"
        return f"{self.moved()} of {self.num_experts} experts off their default rank over {self.ep} ranks"


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerPlacements:
    """One :class:`ExpertPlacement` per MoE layer, keyed by Megatron's 1-based ``layer_number``; a layer
    not listed keeps the default placement. Every listed placement is for ``num_experts`` on ``ep``."""

    num_experts: int
    ep: int
    layers: Mapping[int, ExpertPlacement]
    where: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_sizes(self.num_experts, self.ep, self.where)
        for n, p in self.layers.items():
            if type(n) is not int or n < 1:
                raise SpecError(f"layers.{n}", n, "is not a layer number (Megatron's layer_number, from 1)",
                                "key layers by Megatron's layer_number", where=self.where)
            p.check(num_experts=self.num_experts, ep=self.ep, key=f"layers.{n}")
        object.__setattr__(self, "layers", dict(sorted(self.layers.items())))

    def for_layer(self, layer_number: int | None) -> ExpertPlacement | None:
        """MoE layer ``layer_number``'s placement; None (the default placement) for a layer not listed."""
        return self.layers.get(layer_number) if layer_number is not None else None

    @property
    def is_default(self) -> bool:
        return all(p.is_default for p in self.layers.values())

    def check(self, *, num_experts: int, ep: int, key: str, fix_ep: str | None = None) -> None:
        """SpecError naming ``key`` unless these placements are for ``num_experts`` experts on ``ep`` ranks."""
        _check_job(self, num_experts=num_experts, ep=ep, key=key, fix_ep=fix_ep)

    def to_json(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "ep": self.ep,
                "layers": {str(n): [list(r) for r in p.ranks] for n, p in self.layers.items()}}

    def describe(self) -> str:
        """One line for reports, e.g. ``per MoE layer: 3 layers placed, 10 expert moves off their default rank``."""
        placed = [n for n, p in self.layers.items() if not p.is_default]
        if not placed:
            return f"the default ({self.num_experts} experts in id order over {self.ep} ranks) on every layer listed"
        moves = sum(self.layers[n].moved() for n in placed)
        return (f"per MoE layer over {self.ep} ranks: layers {_ranges(placed)} placed ({moves} experts off their "
                "default rank in all), every other layer the default")


Placements = ExpertPlacement | LayerPlacements
"""What a placement file holds: one placement for every MoE layer, or one per layer."""


def _ranges(numbers: Sequence[int]) -> str:
    """``1-3,7`` for ``[1, 2, 3, 7]``."""
    out: list[tuple[int, int]] = []
    for n in numbers:
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _check_sizes(num_experts: Any, ep: Any, where: str | None) -> None:
    for key, value in (("num_experts", num_experts), ("ep", ep)):
        if type(value) is not int or value < 1:
            raise SpecError(key, value, "must be an int >= 1", f"write the job's {key}", where=where)
    if num_experts % ep:
        raise SpecError("ep", ep, f"must divide num_experts ({num_experts})", f"choose ep in {divisors(num_experts)}",
                        where=where)


def _check_job(p: Placements, *, num_experts: int, ep: int, key: str, fix_ep: str | None) -> None:
    if p.num_experts != num_experts:
        raise SpecError(key, p.where or "placement", f"places {p.num_experts} experts, the model has "
                        f"{num_experts}", f"write a placement of {num_experts} experts", where=None)
    if p.ep != ep:
        raise SpecError(key, p.where or "placement", f"is for ep={p.ep}, the job runs ep={ep}",
                        fix_ep or f"write a placement for ep={ep}", where=None)


def _short(ranks: Any) -> Any:
    text = json.dumps(ranks) if isinstance(ranks, (list, tuple)) else repr(ranks)
    return text if len(text) <= 120 else text[:117] + "..."


def _check_permutation(ranks: tuple[tuple[int, ...], ...], num_experts: int, where: str | None) -> None:
    """Every id an int in range, none twice, none missing (the first fault, with its rank)."""
    seen: dict[int, int] = {}
    for r, rank in enumerate(ranks):
        for e in rank:
            if type(e) is not int or not 0 <= e < num_experts:
                raise SpecError(f"ranks[{r}]", list(rank), f"holds {e!r}, not a logical expert id in 0 .. "
                                f"{num_experts - 1}", "list each rank's logical expert ids", where=where)
            if e in seen:
                raise SpecError(f"ranks[{r}]", list(rank), f"holds expert {e}, which rank {seen[e]} holds too: a "
                                "placement is a permutation (each expert in exactly one slot)",
                                "place every expert once", where=where)
            seen[e] = r
    missing = sorted(set(range(num_experts)) - set(seen))
    if missing:  # unreachable with equal sizes and no repeats, kept for the message's sake
        raise SpecError("ranks", _short(ranks), f"leaves experts {missing} unplaced", "place every expert once",
                        where=where)


def _unknown_keys(data: Mapping[str, Any], keys: tuple[str, ...], what: str, where: str | None) -> None:
    for key in data:
        if key not in keys:
            guess = nearest(str(key), keys)
            raise SpecError(str(key), data[key], f"is not a key of {what}",
                            f"{f'did you mean {guess!r}? ' if guess else ''}valid keys: {', '.join(keys)}", where=where)
    for key in keys:
        if key not in data:
            raise SpecError(key, None, "is required", f"{what} holds {', '.join(keys)}", where=where)


def _one_for_every_layer(key: str, value: Any, where: str | None) -> SpecError:
    return SpecError(key, value, "holds one placement per MoE layer (layers); this input takes one placement for "
                     "every layer (ranks)", "write one with piper placement ... --shared --out FILE", where=where)


def placement_from_json(data: Any, *, where: str | None = None) -> ExpertPlacement:
    """An :class:`ExpertPlacement` from the decoded JSON object (unknown or missing keys, or a per-layer
    object: SpecError)."""
    if not isinstance(data, Mapping):
        raise SpecError("placement", _short(data), "must be a JSON object with num_experts, ep and ranks",
                        'write e.g. {"num_experts": 4, "ep": 2, "ranks": [[1, 0], [3, 2]]}', where=where)
    if "layers" in data and "ranks" not in data:
        raise _one_for_every_layer("layers", _short(data["layers"]), where)
    _unknown_keys(data, KEYS, "a placement", where)
    return ExpertPlacement(num_experts=data["num_experts"], ep=data["ep"], ranks=data["ranks"], where=where)


def placements_from_json(data: Any, *, where: str | None = None) -> Placements:
    """Either form of a placement file, decoded: ``ranks`` (one placement for every layer) or ``layers``
    (one per MoE layer, keyed by ``layer_number``)."""
    if not (isinstance(data, Mapping) and "layers" in data):
        return placement_from_json(data, where=where)
    _unknown_keys(data, LAYER_KEYS, "a per-layer placement file", where)
    layers = data["layers"]
    if not isinstance(layers, Mapping):
        raise SpecError("layers", _short(layers), "must map layer numbers to each rank's expert ids",
                        'write e.g. "layers": {"1": [[1, 0], [3, 2]]}', where=where)
    _check_sizes(data["num_experts"], data["ep"], where)
    out = {}
    for key, ranks in layers.items():
        if isinstance(key, bool) or not str(key).isdigit() or int(key) < 1:
            raise SpecError(f"layers.{key}", key, "is not a layer number (Megatron's layer_number, from 1)",
                            "key layers by Megatron's layer_number", where=where)
        out[int(key)] = ExpertPlacement(num_experts=data["num_experts"], ep=data["ep"], ranks=ranks,
                                        where=f"{where} layer {key}" if where else f"layer {key}")
    return LayerPlacements(num_experts=data["num_experts"], ep=data["ep"], layers=out, where=where)


def read_placements(path: Path | str, *, key: str = "placement") -> Placements:
    """The placement file at ``path``, either form (SpecError naming ``key`` and the file when it is
    missing, empty, unparsable or invalid)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(key, str(path), f"cannot be read ({exc.strerror or exc})",
                        "pass the file piper placement --out (or a migration) wrote") from None
    if not text.strip():
        raise SpecError(key, str(path), "the file is empty", "pass the file piper placement --out wrote")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError(key, str(path), f"is not YAML ({str(exc).splitlines()[0]})", "fix the syntax") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(key, str(path), f"is not JSON ({exc.msg} at line {exc.lineno})",
                            'write e.g. {"num_experts": 4, "ep": 2, "ranks": [[1, 0], [3, 2]]}') from None
    return placements_from_json(data, where=str(path))


def read_placement(path: Path | str, *, key: str = "placement") -> ExpertPlacement:
    """A file holding one placement for every MoE layer (SpecError for a per-layer file: this input
    takes one placement)."""
    p = read_placements(path, key=key)
    if isinstance(p, LayerPlacements):
        raise _one_for_every_layer(key, str(path), None)
    return p


__all__ = ["ExpertPlacement", "LayerPlacements", "Placements", "placement_from_json", "placements_from_json",
           "read_placement", "read_placements"]
