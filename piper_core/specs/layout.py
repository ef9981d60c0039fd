"""Megatron's pipeline layouts (``--pipeline-model-parallel-layout``), read and written as Megatron does.

A layout lists the model's layers over the ``pp x vpp`` virtual stages in layer order (stage
``v * pp + p`` is virtual chunk ``v`` of pipeline rank ``p``), stages split by ``|``: ``E`` the
embedding, ``t`` a transformer (decoder) layer, ``m`` a multi-token-prediction layer, ``L`` the loss
(final norm, output layer and cross-entropy). ``x*n`` repeats a symbol, ``(...)*n`` a group, commas
are cosmetic: ``"Ett|(tt|)*29,tL"`` is 31 stages. Megatron-Core reads it with
``PipelineParallelLayerLayout`` (transformer/pipeline_parallel_layer_layout.py); the rules here are
its rules, with Piper's messages: the embedding first and once, the loss last and once, as many
``t`` as the model has layers, and as many ``m`` as it has MTP layers (:func:`mtp_ranks`). A stage
may be empty.

:func:`balanced_layout` writes the layout Piper's search gives an uneven ``pp x vpp`` split: the
layers spread so that every pipeline rank carries an equal share of the work, the embedding, the
loss and the MTP layers weighed in layers. Pure Python, no Megatron import.
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


def mtp_ranks(stages: tuple[str, ...], pp: int, mtp_num_layers: int, *, text: str,
              key: str = "pipeline_layout") -> tuple[int, ...]:
    """Per pipeline rank, the MTP layers ``stages`` put on it, after Megatron's rules
    (``PipelineParallelLayerLayout.validate_layer_layout``): as many ``m`` as the model has MTP layers,
    none before a transformer layer, all of them in one stage and that stage the last virtual stage
    of its rank. Megatron also runs them on a rank before the last ("standalone" MTP); Piper does not
    price that yet and says so."""
    flat = "".join(stages)
    count = flat.count("m")
    if count != mtp_num_layers:
        raise SpecError(key, text, f"places {count} MTP layers (m), but the model has {mtp_num_layers} "
                        "(mtp_num_layers; Megatron validate_layer_layout)",
                        f"write {mtp_num_layers} m's" if mtp_num_layers else "drop the m's, or give the model "
                        "mtp_num_layers")
    out = [0] * pp
    if not count:
        return tuple(out)
    if "t" in flat[flat.index("m"):]:
        raise SpecError(key, text, "has a transformer layer (t) after an MTP layer (m); Megatron places the MTP "
                        "layers after every decoder layer", "move the m's after the last t")
    vpp = len(stages) // pp
    holders = [i for i, s in enumerate(stages) if "m" in s]
    stage = holders[0]
    rank, chunk = stage % pp, stage // pp
    if len(holders) > 1 or chunk != vpp - 1:
        raise SpecError(key, text, "must hold all MTP layers (m) in one stage, the last virtual stage of its pipeline "
                        "rank (Megatron validate_layer_layout)", "put every m in the last stage, before the L")
    if rank != pp - 1:
        raise SpecError(key, text, f"runs the MTP layers on pipeline rank {rank}, before the last ({pp - 1}): "
                        "Megatron's standalone MTP, which Piper does not price yet",
                        "put the m's in the last stage, before the L")
    out[rank] = count
    return tuple(out)


def balanced_layout(num_layers: int, pp: int, vpp: int, mtp_num_layers: int = 0, *, loss: float = 1.0,
                    mtp: float = 1.0) -> str | None:
    """A layout of ``num_layers`` layers over ``pp x vpp`` stages that balances the pipeline ranks.

    Weights are in layers: the embedding one, as Megatron's ``--account-for-embedding-in-pipeline-split``
    counts it; the loss ``loss`` (its work over a mean layer's; the search passes FLOPs), but at least
    one, as ``--account-for-loss-in-pipeline-split`` counts it; each MTP layer ``mtp``. Each rank gets
    whole layers so that they and its fixed work (the embedding on rank 0, the MTP layers and the
    loss on the last rank) come as close to an equal share as they go: largest remainder, ties first
    to the ranks whose fixed work costs less time than it weighs (the embedding, a lookup, weighs a
    layer; a loss lighter than a layer weighs one), then to the lower ranks. Within a rank the layers
    go one at a time to its lightest virtual stage.
    For DeepSeek-V3 at pp 8 x vpp 4 with FLOP weights this is Megatron-Bridge's own layout.
    When those weights would leave a stage other than the first and the last without a layer (a
    loss many layers heavy on a rank with few layers), the loss and the MTP layers weigh one layer
    each instead; None when even that leaves one empty."""
    out = _rank_balanced(num_layers, pp, vpp, mtp_num_layers, loss, mtp)
    if out is None and (loss, mtp) != (1.0, 1.0):
        out = _rank_balanced(num_layers, pp, vpp, mtp_num_layers, 1.0, 1.0)
    return out


def _rank_balanced(num_layers: int, pp: int, vpp: int, mtp_num_layers: int, loss: float, mtp: float) -> str | None:
    stages = pp * vpp
    fixed = [0.0] * pp
    slack = [0.0] * pp  # weight of the rank's fixed work above its time
    fixed[0] += 1.0
    slack[0] += 1.0
    fixed[-1] += max(1.0, loss) + mtp_num_layers * mtp
    slack[-1] += max(1.0, loss) - loss
    share = (num_layers + sum(fixed)) / pp
    want = [max(0.0, share - f) for f in fixed]
    scale = num_layers / sum(want)
    want = [w * scale for w in want]
    counts = [int(w) for w in want]
    by_remainder = sorted(range(pp), key=lambda r: (-round(want[r] - counts[r], 9), -slack[r], r))
    for r in by_remainder[:num_layers - sum(counts)]:
        counts[r] += 1
    out = [""] * stages
    for rank, count in enumerate(counts):
        load = [0.0] * vpp
        load[0] += 1.0 if rank == 0 else 0.0
        load[-1] += fixed[-1] if rank == pp - 1 else 0.0
        layers = [0] * vpp
        for _ in range(count):
            chunk = min(range(vpp), key=lambda v: (load[v] + layers[v], v))
            layers[chunk] += 1
        for v in range(vpp):
            out[v * pp + rank] = "t" * layers[v]
    if any(not s for s in out[1:-1]):
        return None
    out[0] = "E" + out[0]
    out[-1] += "m" * mtp_num_layers + "L"
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
