"""Strict YAML <-> frozen dataclass conversion.

Rules (STYLE.md, "Strict YAML"): an unknown key is an error naming the file, the key and the
nearest valid key; a missing required key is an error; a value of the wrong type is an error;
``dump(load(text))`` of a file written by :func:`dump_yaml` gives the same text back.
Nested specs are dataclasses; optional nested specs may be ``null``; tuples load from lists.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import yaml

from piper_core.errors import SpecError, nearest

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, key: str, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert lists/dicts to tuples/dataclasses."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise SpecError(key, value, "a value is required", "give a value or remove the key to use the default", where=where)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key, where)
            except SpecError as exc:
                errors.append(exc.rule)
        raise SpecError(key, value, " or ".join(errors), "fix the value's type", where=where)
    if origin is typing.Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise SpecError(key, value, f"must be one of {list(allowed)}", f"use one of {list(allowed)}", where=where)
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SpecError(key, value, "must be a list", "write it as a YAML list", where=where)
        (item_tp, *_rest) = get_args(tp)
        return tuple(_convert(item_tp, v, f"{key}[{i}]", where) for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SpecError(key, value, f"must be a mapping ({_type_name(tp)})", "write it as a YAML mapping", where=where)
        return from_dict(tp, value, where=where, prefix=f"{key}.")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = [m.value for m in tp]
            raise SpecError(key, value, f"must be one of {allowed}", f"use one of {allowed}", where=where) from None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(key, value, "must be a number", "write a number such as 1.0", where=where)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(key, value, "must be an integer", "write a whole number", where=where)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(key, value, "must be true or false", "write true or false", where=where)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(key, value, "must be a string", "quote the value", where=where)
        return value
    raise TypeError(f"yamlio cannot convert annotation {tp!r} (key {key})")


def from_dict(cls: type[T], data: dict[str, Any], *, where: str = "<dict>", prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys name the nearest valid key."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = get_type_hints(cls)
    legacy = getattr(cls, "read_legacy", None)  # settings written by older versions, read with a warning
    data = data if legacy is None else legacy(data, where)
    for key in data:
        if key not in fields:
            guess = nearest(str(key), fields)
            fix = f"did you mean '{prefix}{guess}'?" if guess else f"valid keys: {sorted(fields)}"
            raise SpecError(f"{prefix}{key}", data[key], f"is not a key of {cls.__name__}", fix, where=where)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], f"{prefix}{name}", where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(f"{prefix}{name}", None, f"is required by {cls.__name__}", f"add '{prefix}{name}: ...'", where=where)
    try:
        return cls(**kwargs)
    except SpecError as exc:
        if exc.where is None:
            raise SpecError(prefix + exc.key, exc.value, exc.rule, exc.fix, where=where) from None
        raise


def to_dict(spec: Any) -> dict[str, Any]:
    """Plain-data view of a spec, in field order, with every field written (defaults included)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(spec):
        if not f.init:
            continue
        out[f.name] = _plain(getattr(spec, f.name))
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


def load_yaml(cls: type[T], path: str | Path) -> T:
    """Load ``cls`` from a YAML file; errors name the file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError("path", str(path), "file does not exist", "give an existing YAML file or a preset name") from None
    except yaml.YAMLError as exc:
        raise SpecError("yaml", str(path), f"is not valid YAML ({exc})", "fix the syntax", where=str(path)) from None
    if not isinstance(data, dict):
        raise SpecError("document", type(data).__name__, "top level must be a mapping", f"write {cls.__name__} keys at top level", where=str(path))
    return from_dict(cls, data, where=str(path))


def dump_yaml(spec: Any, path: str | Path | None = None) -> str:
    """Write ``spec`` as YAML (field order kept); returns the text. Loads back to an equal spec."""
    text = yaml.safe_dump(to_dict(spec), sort_keys=False, default_flow_style=False, width=100)
    if path is not None:
        Path(path).write_text(text)
    return text
