"""Small validators shared by the spec dataclasses; each raises :class:`SpecError`."""

from __future__ import annotations

import dataclasses
import functools
import typing

from piper_core.errors import SpecError, divisors, nearest


def positive(key: str, value: int | float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or value <= 0:
        raise SpecError(key, value, "must be a positive number", f"set {key} to a value > 0")


def non_negative(key: str, value: int | float) -> None:
    if isinstance(value, bool) or value < 0:
        raise SpecError(key, value, "must be >= 0", f"set {key} to 0 or more")


def fraction(key: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise SpecError(key, value, "must be in (0, 1]", f"set {key} to a fraction such as 0.9")


def divides(key: str, value: int, other_key: str, other: int) -> None:
    """``value`` must divide ``other``; suggests the valid choices."""
    if other % value != 0:
        choices = divisors(other)
        shown = choices if len(choices) <= 24 else choices[:12] + ["..."] + choices[-4:]
        raise SpecError(
            key, value, f"must divide {other_key} ({other})",
            f"choose {key} in {{{', '.join(map(str, shown))}}}",
        )


def _allowed(hint: object) -> tuple[object, ...] | None:
    """The values a ``Literal[...]`` (or ``Literal[...] | None``) hint allows; None for other hints."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        inner = _allowed(next(a for a in args if a is not type(None)))
        return None if inner is None else (*inner, None)
    return None


@functools.cache
def _literal_fields(cls: type) -> tuple[tuple[str, tuple[object, ...]], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, allowed) for f in dataclasses.fields(cls) if (allowed := _allowed(hints[f.name])) is not None)


def literals(spec: object) -> None:
    """Every ``Literal[...]`` field of dataclass ``spec`` holds one of its allowed values."""
    for name, allowed in _literal_fields(type(spec)):
        value = getattr(spec, name)
        if value not in allowed:
            guess = nearest(str(value), [str(a) for a in allowed if a is not None])
            hint = f"did you mean '{guess}'? " if guess else ""
            raise SpecError(name, value, f"must be one of {list(allowed)}", f"{hint}use one of {list(allowed)}")


@functools.cache
def _compared_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.compare)


def freeze_hash(spec: object) -> None:
    """Store the hash of a frozen spec's compared fields once (specs key many caches)."""
    object.__setattr__(spec, "_hash", hash(tuple(getattr(spec, n) for n in _compared_fields(type(spec)))))
