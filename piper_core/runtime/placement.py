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
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from piper_core.errors import SpecError, divisors, nearest

KEYS = ("num_experts", "ep", "ranks")


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
        for key in ("num_experts", "ep"):
            value = getattr(self, key)
            if type(value) is not int or value < 1:
                raise SpecError(key, value, "must be an int >= 1", f"write the job's {key}", where=where)
        if self.num_experts % self.ep:
            raise SpecError("ep", self.ep, f"must divide num_experts ({self.num_experts})",
                            f"choose ep in {divisors(self.num_experts)}", where=where)
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

    def moved(self) -> int:
        """Logical experts held by another rank than the default placement's."""
        per = self.num_experts // self.ep
        return sum(e // per != r for r, rank in enumerate(self.ranks) for e in rank)

    def check(self, *, num_experts: int, ep: int, key: str, fix_ep: str | None = None) -> None:
        """SpecError naming ``key`` unless this placement is for ``num_experts`` experts on ``ep`` ranks."""
        if self.num_experts != num_experts:
            raise SpecError(key, self.where or "placement", f"places {self.num_experts} experts, the model has "
                            f"{num_experts}", f"write a placement of {num_experts} experts", where=None)
        if self.ep != ep:
            raise SpecError(key, self.where or "placement", f"is for ep={self.ep}, the job runs ep={ep}",
                            fix_ep or f"write a placement for ep={ep}", where=None)

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


def placement_from_json(data: Any, *, where: str | None = None) -> ExpertPlacement:
    """An :class:`ExpertPlacement` from the decoded JSON object (unknown or missing keys: SpecError)."""
    if not isinstance(data, Mapping):
        raise SpecError("placement", _short(data), "must be a JSON object with num_experts, ep and ranks",
                        'write e.g. {"num_experts": 4, "ep": 2, "ranks": [[1, 0], [3, 2]]}', where=where)
    for key in data:
        if key not in KEYS:
            guess = nearest(str(key), KEYS)
            raise SpecError(str(key), data[key], "is not a key of a placement",
                            f"{f'did you mean {guess!r}? ' if guess else ''}valid keys: {', '.join(KEYS)}", where=where)
    for key in KEYS:
        if key not in data:
            raise SpecError(key, None, "is required", f"a placement holds {', '.join(KEYS)}", where=where)
    return ExpertPlacement(num_experts=data["num_experts"], ep=data["ep"], ranks=data["ranks"], where=where)


def read_placement(path: Path | str) -> ExpertPlacement:
    """The placement JSON file at ``path`` (SpecError naming the file when unreadable or invalid)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError("placement", str(path), f"cannot be read ({exc.strerror or exc})",
                        "pass the JSON file the placement optimizer wrote") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError("placement", str(path), f"is not JSON ({exc.msg} at line {exc.lineno})",
                        'write e.g. {"num_experts": 4, "ep": 2, "ranks": [[1, 0], [3, 2]]}') from None
    return placement_from_json(data, where=str(path))


__all__ = ["ExpertPlacement", "placement_from_json", "read_placement"]
