"""Megatron's pipeline layouts (``--pipeline-model-parallel-layout``), read and written as Megatron does.

A layout lists the model's layers over the ``pp x vpp`` virtual stages in layer order (stage
``v * pp + p`` is virtual chunk ``v`` of pipeline rank ``p``), stages split by ``|``: ``E`` the
embedding, ``t`` a transformer (decoder) layer, ``m`` a multi-token-prediction layer, ``L`` the loss
(final norm, output layer and cross-entropy). ``x*n`` repeats a symbol, ``(...)*n`` a group, commas
are cosmetic: ``"Ett|(tt|)*29,tL"`` is 31 stages. Megatron-Core reads it with
``PipelineParallelLayerLayout`` (transformer/pipeline_parallel_layer_layout.py); the rules here are
its rules, with Piper's messages: the embedding first and once, the loss last and once, as many
``t`` as the model has layers. A stage may be empty.

:func:`balanced_layout` writes the layout Piper's search gives an uneven ``pp x vpp`` split: the
embedding and the loss each take one layer's slot (Megatron's ``--account-for-embedding-in-pipeline-
split`` / ``--account-for-loss-in-pipeline-split`` count them so), and the slots are spread over the
stages as evenly as they go. Pure Python, no Megatron import.
"""

from __future__ import annotations

import functools
import re

from piper_core.errors import SpecError

SYMBOLS = {"E": "embedding", "t": "transformer layer", "m": "MTP layer", "L": "loss"}
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")


@functools.cache
def parse_layout(text: str, key: str = "pipeline_layout") -> tuple[str, ...]:
    """The stages of a layout string, in layer order, each the string of its symbols (unrolled)."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(key, text, "must be a layout string such as 'Ett|(tt|)*6,tL'",
                        "write the stages split by '|' with E, t, m, L (Megatron --pipeline-model-parallel-layout)")
    flat = text.replace(",", "").replace(" ", "")
    for pattern in (_GROUP, _REPEAT):  # Megatron's order: groups first, then single symbols
        flat = pattern.sub(lambda m: m.group(1) * int(m.group(2)), flat)
    bad = sorted(set(flat) - set(SYMBOLS) - {"|"})
    if bad:
        raise SpecError(key, text, f"has {''.join(bad)!r}, which no layout symbol is (nested groups are not "
                        "unrolled, as in Megatron)", "use E (embedding), t (layer), m (MTP), L (loss), '|' between "
                        "stages, x*n and (...)*n")
    return tuple(flat.split("|"))


def check_layout(stages: tuple[str, ...], pp: int, *, text: str, key: str = "pipeline_layout") -> int:
    """The virtual stages per rank (vpp) of ``stages`` over ``pp`` ranks, after Megatron's rules that
    need no model: the stage count a multiple of pp, the embedding first and the loss last, once each."""
    if len(stages) % pp:
        raise SpecError(key, text, f"has {len(stages)} stages, not a multiple of pp ({pp})",
                        f"give pp x vpp stages (e.g. {pp * 2} for vpp 2), or change pp")
    flat = "".join(stages)
    for symbol, where, at in (("E", "first", 0), ("L", "last", -1)):
        if flat.count(symbol) != 1 or flat[at] != symbol:
            raise SpecError(key, text, f"must hold {symbol} ({SYMBOLS[symbol]}) exactly once, as the {where} symbol "
                            "of the whole layout (Megatron validate_layer_layout)",
                            f"put one {symbol} at the {'start of the first' if at == 0 else 'end of the last'} stage")
    return len(stages) // pp


def decoder_counts(stages: tuple[str, ...]) -> tuple[int, ...]:
    """Transformer layers per stage, in layer order."""
    return tuple(s.count("t") for s in stages)


def balanced_layout(num_layers: int, pp: int, vpp: int) -> str | None:
    """A layout of ``num_layers`` layers over ``pp x vpp`` stages with the embedding and the loss each
    in one layer's slot, the slots spread as evenly as they go (the surplus slots in the middle
    stages); None when a stage would get no layer slot at all."""
    stages = pp * vpp
    slots = num_layers + 2
    base, extra = divmod(slots, stages)
    if base == 0:
        return None
    start = (stages - extra) // 2
    sizes = [base + (start <= i < start + extra) for i in range(stages)]
    out = []
    for i, size in enumerate(sizes):
        layers = size - (i == 0) - (i == stages - 1)
        out.append(("E" if i == 0 else "") + "t" * layers + ("L" if i == stages - 1 else ""))
    if any(s.count("t") == 0 for s in out[1:-1]):
        return None
    return layout_string(tuple(out))


def layout_string(stages: tuple[str, ...]) -> str:
    """The compact Megatron string of ``stages``: runs of equal stages as ``(...|)*n``, runs of 3 or
    more layers as ``t*n`` (Megatron's parser reads it back to the same stages)."""
    def stage(s: str) -> str:
        return re.sub(r"t{3,}", lambda m: f"t*{len(m.group(0))}", s)

    parts, i = [], 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) and stages[j + 1] == stages[i]:
            j += 1
        n = j - i + 1
        last = j == len(stages) - 1
        if n > 1 and not last:
            parts.append(f"({stage(stages[i])}|)*{n}")
        else:
            parts.append("|".join([stage(stages[i])] * n) + ("" if last else "|"))
        i = j + 1
    return "".join(parts)
