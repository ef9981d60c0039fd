"""A routing distribution: tokens per expert in each MoE layer (issue 17, "routing as an input").

Three ways to say how tokens spread over the experts:

* **even** -- no routing input; every expert gets ``tokens x topk / num_experts`` (today's model);
* **a skew parameter** -- ``ModelSpec.moe_expert_load_skew`` (max/mean, priced as before);
* **a histogram** -- this module: counts per expert per MoE layer, from a file.

Two file formats are read (:func:`load_routing`):

1. A histogram, YAML or JSON (``.yaml``/``.yml``/``.json``)::

       num_experts: 8                 # required: must equal the model's
       layers:                        # Megatron's 1-based layer_number -> counts per expert
         1: [130, 121, 126, 121, 250, 60, 70, 50]
         2: [...]
       default: [...]                 # optional: the counts of every MoE layer not listed

   Counts are non-negative numbers (tokens, or any unit: only their shares matter); a layer's
   counts must not all be 0. Every MoE layer of the model needs counts, from ``layers`` or
   ``default``.
2. The JSON lines Megatron's ``--piper-trace`` writes (``piper_megatron/trace.py``; one line per
   rank, layer and forward call with ``layer``, ``first_expert`` and ``tokens_per_expert``, the
   tokens the rank's local experts received; under an expert placement ``logical_experts`` names the
   logical expert of each local slot, and the counts go to those). All lines of all the given files are summed into
   one histogram per layer; each expert must be covered as often as every other of its layer (a
   rank's file left out would bias the histogram).

Errors are :class:`SpecError` s naming the file, the key, the rule and the fix: an unknown layer
(not a MoE layer of the model), a wrong expert count, a negative count, an empty file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from piper_core.errors import SpecError, nearest
from piper_core.specs.model import ModelSpec

Counts = tuple[float, ...]
HISTOGRAM_KEYS = ("num_experts", "layers", "default")
TRACE_KEYS = ("layer", "first_expert", "tokens_per_expert")


@dataclass(frozen=True, kw_only=True, slots=True)
class Routing:
    """Tokens per expert of every MoE layer of one model.

    ``layers``: (Megatron's 1-based ``layer_number``, counts per expert), one entry per MoE layer,
    in layer order. ``source``: the file(s) it came from, for reports.
    """

    num_experts: int
    layers: tuple[tuple[int, Counts], ...]
    source: str = ""

    def __post_init__(self) -> None:
        for number, counts in self.layers:
            _check_counts(f"layers.{number}", counts, self.num_experts, self.source)

    def counts(self, layer_number: int) -> Counts:
        """Counts per expert of Megatron layer ``layer_number`` (1-based)."""
        for number, counts in self.layers:
            if number == layer_number:
                return counts
        raise SpecError("layer", layer_number, "has no routing counts",
                        f"use one of the MoE layers {[n for n, _ in self.layers]}", where=self.source or None)

    def max_over_mean(self, layer_number: int) -> float:
        """Busiest expert's tokens over the mean (1 for even routing)."""
        counts = self.counts(layer_number)
        return max(counts) * len(counts) / sum(counts)

    @staticmethod
    def even(model: ModelSpec) -> Routing:
        """The same count on every expert of every MoE layer (prices as no routing input)."""
        counts = (1.0,) * model.num_experts
        return Routing(num_experts=model.num_experts, source="even",
                       layers=tuple((i + 1, counts) for i, moe in enumerate(model.moe_layer_pattern) if moe))


def moe_layer_numbers(model: ModelSpec) -> tuple[int, ...]:
    """Megatron's 1-based ``layer_number`` of each MoE layer of ``model``."""
    return tuple(i + 1 for i, moe in enumerate(model.moe_layer_pattern) if moe)


def _check_counts(key: str, counts: Any, experts: int, where: str | None) -> Counts:
    where = where or None
    if not isinstance(counts, (list, tuple)):
        raise SpecError(key, counts, "must be a list of tokens per expert", f"write {experts} numbers", where=where)
    if len(counts) != experts:
        raise SpecError(key, f"{len(counts)} counts", f"must give one count per expert ({experts})",
                        f"write {experts} numbers, one per expert in Megatron's expert order", where=where)
    for i, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c):
            raise SpecError(f"{key}[{i}]", c, "must be a finite number of tokens", "write a count such as 128",
                            where=where)
        if c < 0:
            raise SpecError(f"{key}[{i}]", c, "is a token count and must be >= 0", "fix or remove the negative count",
                            where=where)
    if sum(counts) <= 0:
        raise SpecError(key, list(counts), "counts all 0 tokens, so the layer has no distribution",
                        "give the counts of a layer that routed tokens", where=where)
    return tuple(float(c) for c in counts)


def load_routing(paths: str | Path | list, model: ModelSpec) -> Routing:
    """Read a histogram file, or one or more ``--piper-trace`` JSON-lines files, for ``model``."""
    paths = [Path(p) for p in (paths if isinstance(paths, (list, tuple)) else [paths])]
    if not model.is_moe:
        raise SpecError("--routing", str(paths[0]), f"applies to MoE models; {model.name} has no routed experts",
                        "drop --routing")
    texts = [(p, _read(p)) for p in paths]
    kinds = {p: _kind(p, t) for p, t in texts}
    if set(kinds.values()) == {"trace"}:
        return _from_trace(texts, model)
    if len(texts) > 1:
        raise SpecError("--routing", ", ".join(map(str, paths)), "several files are read only as --piper-trace "
                        "JSON lines (one per rank)", "give one histogram file")
    path, text = texts[0]
    return _from_histogram(path, _parse_mapping(path, text), model)


def _read(path: Path) -> str:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError("--routing", str(path), "file does not exist", "give a routing histogram (YAML/JSON) or "
                        "the JSON lines of --piper-trace") from None
    if not text.strip():
        raise SpecError("--routing", str(path), "the file is empty", "give a histogram {num_experts, layers} or "
                        "the JSON lines --piper-trace wrote", where=str(path))
    return text


def _kind(path: Path, text: str) -> str:
    """'trace' for JSON lines whose first line is a trace record, else 'histogram'."""
    first = text.strip().splitlines()[0]
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return "histogram"
    return "trace" if isinstance(record, dict) and "tokens_per_expert" in record else "histogram"


def _parse_mapping(path: Path, text: str) -> dict:
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError("--routing", str(path), f"is not valid {'JSON' if path.suffix == '.json' else 'YAML'} "
                        f"({str(exc).splitlines()[0]})", "fix the syntax", where=str(path)) from None
    if not isinstance(data, dict):
        raise SpecError("document", type(data).__name__, "top level must be a mapping",
                        "write num_experts and layers at top level", where=str(path))
    return data


def _layer_number(key: Any, model: ModelSpec, where: str) -> int:
    """A ``layers`` key as a MoE layer number of ``model``."""
    moe = moe_layer_numbers(model)
    number = None
    if isinstance(key, int) and not isinstance(key, bool):
        number = key
    elif isinstance(key, str) and key.strip().isdigit():
        number = int(key)
    if number is None or number not in moe:
        shown = ", ".join(map(str, moe[:8])) + (", ..." if len(moe) > 8 else "")
        rule = ("is not a layer number (Megatron's 1-based layer_number)" if number is None else
                f"is not a MoE layer of {model.name} ({model.num_layers} layers; MoE layers: {shown})")
        raise SpecError(f"layers.{key}", key, rule, f"use MoE layer numbers {moe[0]}..{moe[-1]}", where=where)
    return number


def _from_histogram(path: Path, data: dict, model: ModelSpec) -> Routing:
    where = str(path)
    for key in data:
        if key not in HISTOGRAM_KEYS:
            guess = nearest(str(key), HISTOGRAM_KEYS)
            raise SpecError(str(key), data[key], "is not a key of a routing histogram",
                            f"did you mean '{guess}'?" if guess else f"valid keys: {list(HISTOGRAM_KEYS)}", where=where)
    experts = data.get("num_experts")
    if experts != model.num_experts:
        raise SpecError("num_experts", experts, f"must equal the model's num_experts ({model.num_experts}, "
                        f"{model.name})", "give the histogram of this model's experts", where=where)
    layers = data.get("layers") or {}
    if not isinstance(layers, dict):
        raise SpecError("layers", layers, "must map layer numbers to counts", "write e.g. layers: {1: [...]}",
                        where=where)
    given = {}
    for key, counts in layers.items():
        number = _layer_number(key, model, where)
        given[number] = _check_counts(f"layers.{key}", counts, experts, where)
    default = data.get("default")
    if default is not None:
        default = _check_counts("default", default, experts, where)
    return _complete(given, default, model, where)


def _complete(given: dict[int, Counts], default: Counts | None, model: ModelSpec, where: str) -> Routing:
    missing = [n for n in moe_layer_numbers(model) if n not in given]
    if missing and default is None:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise SpecError("layers", f"{len(given)} layers", f"lacks MoE layers {shown} of {model.name}",
                        "add them, or a 'default' histogram for the layers not listed (with --piper-trace: give "
                        "every rank's file)", where=where)
    layers = tuple((n, given.get(n, default)) for n in moe_layer_numbers(model))
    return Routing(num_experts=model.num_experts, layers=layers, source=where)


def _from_trace(texts: list[tuple[Path, str]], model: ModelSpec) -> Routing:
    """Sum ``tokens_per_expert`` over ranks and calls into one histogram per layer."""
    experts = model.num_experts
    sums: dict[int, list[float]] = {}
    covered: dict[int, list[int]] = {}
    where = ", ".join(str(p) for p, _ in texts)
    for path, text in texts:
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            at = f"{path}:{line_no}"
            record = _trace_record(line, at)
            number = _layer_number(record["layer"], model, at)
            first, counts = record["first_expert"], record["tokens_per_expert"]
            if isinstance(first, bool) or not isinstance(first, int) or first < 0 \
                    or not isinstance(counts, list) or first + len(counts) > experts:
                raise SpecError("first_expert", first, f"with {len(counts) if isinstance(counts, list) else '?'} "
                                f"local experts must stay within the model's {experts} experts",
                                f"trace a run of {model.name} ({experts} experts)", where=at)
            _check_nonnegative(counts, at)
            ids = _logical_ids(record, first, len(counts), experts, at)
            row, seen = sums.setdefault(number, [0.0] * experts), covered.setdefault(number, [0] * experts)
            for e, c in zip(ids, counts):
                row[e] += c
                seen[e] += 1
    if not sums:
        raise SpecError("--routing", where, "holds no trace records", "give the files --piper-trace wrote",
                        where=where)
    for number, seen in covered.items():
        if min(seen) != max(seen):
            lo, hi = seen.index(min(seen)), seen.index(max(seen))
            raise SpecError(f"layers.{number}", f"expert {lo} {min(seen)}x, expert {hi} {max(seen)}x",
                            "every expert must be covered equally often (a rank's file is missing?)",
                            "give the trace files of all ranks", where=where)
    given = {n: _check_counts(f"layers.{n}", row, experts, where) for n, row in sums.items()}
    return _complete(given, None, model, where)


def _logical_ids(record: dict, first: int, count: int, experts: int, at: str) -> list[int]:
    """The logical expert of each local slot of a trace record: its ``logical_experts`` (written under
    an expert placement), else the slots ``first, first + 1, ...`` themselves."""
    ids = record.get("logical_experts")
    if ids is None:
        return list(range(first, first + count))
    if not isinstance(ids, list) or len(ids) != count or any(
            isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < experts for e in ids):
        raise SpecError("logical_experts", ids, f"must list one logical expert id (0 .. {experts - 1}) per local slot "
                        f"({count})", "give the files --piper-trace wrote", where=at)
    return ids


def _trace_record(line: str, at: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecError("line", line[:60], f"is not JSON ({exc.msg})", "give the files --piper-trace wrote",
                        where=at) from None
    if not isinstance(record, dict):
        raise SpecError("line", line[:60], "must be a JSON object", "give the files --piper-trace wrote", where=at)
    for key in TRACE_KEYS:
        if key not in record:
            raise SpecError(key, None, "is required in a --piper-trace record", "give the files --piper-trace wrote",
                            where=at)
    return record


def _check_nonnegative(counts: list, at: str) -> None:
    for i, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c):
            raise SpecError(f"tokens_per_expert[{i}]", c, "must be a finite number of tokens",
                            "give the files --piper-trace wrote", where=at)
        if c < 0:
            raise SpecError(f"tokens_per_expert[{i}]", c, "is a token count and must be >= 0",
                            "fix or remove the negative count", where=at)
