"""``piper capacity MODEL --cluster C --gpus N --scale experts|layers|width``: the largest model of
MODEL's family that some plan still fits on N GPUs, and the plan that trains it.

A family is MODEL with one size grown by an integer step ``k`` (the given model is one member):

* ``experts``: ``num_experts = k * gcd(num_experts, gpus)``, so each size keeps the expert-parallel
  sizes of the base model that divide the GPUs;
* ``layers``: ``num_layers = k`` (MoE layout rules unchanged: first dense layers, frequency);
* ``width``: ``hidden_size = k * u`` (``u`` keeps hidden_size divisible by the attention heads),
  with the FFN, expert and shared-expert widths scaled in proportion, rounded to the base widths'
  multiple of up to 128 (tensor-parallel sizes stay valid); heads, head dims and MLA ranks stay.

The boundary is found by doubling from the base size, then bisecting: the answer ``k`` fits and
``k + 1`` does not. Fitting is not strictly monotone in ``k`` (divisibility rules change with
it), so a larger member may fit again; the answer is a boundary, not a global maximum.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from piper_core.cli.plan import default_gbs, describe
from piper_core.cli.parse import add_target_args, target_cluster
from piper_core.cli.progress import Progress
from piper_core.errors import SpecError, nearest
from piper_core.presets import load_model
from piper_core.resource.memory import GIB
from piper_core.resource.predict import Prediction, to_json
from piper_core.scheduler.search import SearchResult, best_predictions, search
from piper_core.scheduler.space import UNPIPELINED, default_space
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.yamlio import to_dict

SCALES = ("experts", "layers", "width")
FIELD = {"experts": "num_experts", "layers": "num_layers", "width": "hidden_size"}
MAX_DOUBLINGS = 24


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capacity", help="largest model of a family that fits, and its plan",
                       description="Grow one size of MODEL (experts, layers or width) to the largest that some "
                                   "parallel plan fits in memory on --gpus GPUs; report it, its plan, MFU and memory.")
    add_target_args(p, "model preset name or ModelSpec YAML path (the family's base member)")
    p.add_argument("--scale", required=True, help="what grows: experts, layers or width")
    p.add_argument("--gbs", type=int, help="global batch size in sequences (default: as piper plan)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """Members ``resize(base_model, k)`` for integer ``k >= smallest``; ``base`` is the given model's k."""

    scale: str
    model: ModelSpec
    unit: int
    base: int
    smallest: int

    def value(self, k: int) -> int:
        """The grown field (num_experts, num_layers or hidden_size) of member ``k``."""
        return k * self.unit

    def member(self, k: int) -> ModelSpec:
        m, scale = self.model, self.scale
        if scale == "experts":
            return dataclasses.replace(m, name=f"{m.name}-experts{k * self.unit}", num_experts=k * self.unit)
        if scale == "layers":
            return dataclasses.replace(m, name=f"{m.name}-layers{k}", num_layers=k)
        ratio = k / self.base
        grown = {f: _scaled(getattr(m, f), ratio) for f in ("ffn_hidden_size", "moe_ffn_hidden_size",
                                                               "moe_shared_expert_intermediate_size")}
        return dataclasses.replace(m, name=f"{m.name}-h{k * self.unit}", hidden_size=k * self.unit, **grown)


def _scaled(width: int | None, ratio: float) -> int | None:
    """``width * ratio`` rounded to ``width``'s multiple of (up to) 128, at least one multiple."""
    if not width:
        return width
    step = math.gcd(width, 128)
    return max(step, round(width * ratio / step) * step)


def family(model: ModelSpec, scale: str, gpus: int) -> Family:
    """The family of ``model`` along ``scale``; SpecError for an unknown scale or a dense model's experts."""
    if scale not in SCALES:
        guess = nearest(scale, SCALES)
        raise SpecError("--scale", scale, f"must be one of {', '.join(SCALES)}",
                        f"did you mean '{guess}'?" if guess else "use --scale experts, layers or width")
    if scale == "experts":
        if not model.is_moe:
            raise SpecError("--scale", scale, f"{model.name} is dense (num_experts=0), so it has no experts to grow",
                            "use --scale layers or --scale width")
        unit = math.gcd(model.num_experts, gpus)
        return Family(scale=scale, model=model, unit=unit, base=model.num_experts // unit,
                      smallest=-(-model.moe_router_topk // unit))
    if scale == "layers":
        return Family(scale=scale, model=model, unit=1, base=model.num_layers, smallest=model.moe_first_k_dense + 1)
    heads = model.num_attention_heads if model.kv_channels is None and model.mla is None else 1
    unit = math.gcd(model.hidden_size, math.lcm(heads, 128))
    return Family(scale=scale, model=model, unit=unit, base=model.hidden_size // unit, smallest=1)


def probe_space(model: ModelSpec, cluster: ClusterSpec, gpus: int):
    """The default space less choices that never decide whether a plan fits: the all-to-all variant
    (no memory), micro-batch > 1 and no distributed optimizer (each only adds memory)."""
    return dataclasses.replace(default_space(model, cluster, gpus), a2a=(UNPIPELINED,), mbs=(1,),
                               distributed_optimizer=(True,))


def fits(model: ModelSpec, cluster: ClusterSpec, gpus: int, gbs: int, progress=None) -> bool:
    """Whether any plan of :func:`probe_space` fits ``model`` in memory."""
    return search(model, cluster, gpus, gbs, space=probe_space(model, cluster, gpus), progress=progress).feasible > 0


def boundary(smallest: int, base: int, check: Callable[[int], bool]) -> tuple[int | None, list[tuple[int, bool]]]:
    """Largest ``k >= smallest`` found with ``check(k)`` true and ``check(k + 1)`` false, starting
    at ``base``: doubling up (or halving down) to bracket, then bisecting. None if even
    ``smallest`` fails. Also returns every (k, fits) probed, in order."""
    probes: list[tuple[int, bool]] = []

    def probe(k: int) -> bool:
        probes.append((k, check(k)))
        return probes[-1][1]

    k = max(base, smallest)
    if probe(k):
        lo, hi = k, None
        for _ in range(MAX_DOUBLINGS):
            if not probe(2 * lo):
                hi = 2 * lo
                break
            lo *= 2
        if hi is None:
            return lo, probes  # still fits after MAX_DOUBLINGS doublings; stop there
    else:
        lo, hi = None, k
        while hi > smallest:
            k = max(smallest, hi // 2)
            if probe(k):
                lo = k
                break
            hi = k
        if lo is None:
            return None, probes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return lo, probes


@dataclass(frozen=True, kw_only=True, slots=True)
class Capacity:
    family: Family
    k: int | None
    probes: list[tuple[int, bool]]
    best: Prediction | None
    result: SearchResult | None
    elapsed_s: float


def capacity(model: ModelSpec, cluster: ClusterSpec, gpus: int, gbs: int, scale: str) -> Capacity:
    """Find the boundary member and the best plan (full search space) that trains it."""
    fam, start = family(model, scale, gpus), time.perf_counter()
    field = FIELD[scale]
    k, probes = boundary(fam.smallest, fam.base, lambda k: fits(
        fam.member(k), cluster, gpus, gbs, Progress(f"{field}={fam.value(k)}")))
    best, result = None, None
    if k is not None:
        member = fam.member(k)
        result = search(member, cluster, gpus, gbs, progress=Progress(f"best plan for {field}={fam.value(k)}"))
        best = best_predictions(member, cluster, result, 1)[0]
    return Capacity(family=fam, k=k, probes=probes, best=best, result=result, elapsed_s=time.perf_counter() - start)


def run(args: argparse.Namespace) -> int:
    model, cluster = load_model(args.model), target_cluster(args)
    if args.gpus <= 0:
        raise SpecError("--gpus", args.gpus, "must be a positive number", "give the world size, e.g. --gpus 64")
    if args.gbs is not None and args.gbs <= 0:
        raise SpecError("--gbs", args.gbs, "must be a positive number", "omit it for the default or give e.g. 512")
    gbs = args.gbs or default_gbs(model, args.gpus)
    cap = capacity(model, cluster, args.gpus, gbs, args.scale)
    if args.json:
        print(json.dumps(capacity_json(cap, cluster, args.gpus, gbs), indent=2))
    else:
        print(render(cap, cluster, args.gpus, gbs))
    return 0 if cap.best else 1


def capacity_json(cap: Capacity, cluster: ClusterSpec, gpus: int, gbs: int) -> dict[str, Any]:
    fam, field = cap.family, FIELD[cap.family.scale]
    out: dict[str, Any] = {"family": fam.model.name, "scale": fam.scale, "field": field, "cluster": cluster.name,
                           "gpus": gpus, "global_batch_size": gbs, "base_value": fam.value(fam.base),
                           "probes": [{"value": fam.value(k), "fits": ok} for k, ok in cap.probes],
                           "elapsed_s": cap.elapsed_s, "value": None, "next_value": None, "model": None, "plan": None}
    if cap.best is not None:
        out |= {"value": fam.value(cap.k), "next_value": fam.value(cap.k + 1), "model": to_dict(cap.best.model),
                "plan": to_json(cap.best)}
    return out


def _count(n: int) -> str:
    """``5.6 B``, ``29.3 M``: a parameter count for people."""
    scale, unit = next((s, u) for s, u in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                       if n >= s or s == 1)
    return f"{n / scale:,.1f} {unit}".rstrip()


def render(cap: Capacity, cluster: ClusterSpec, gpus: int, gbs: int) -> str:
    fam, field = cap.family, FIELD[cap.family.scale]
    probed = ", ".join(f"{fam.value(k)} {'fits' if ok else 'no'}" for k, ok in cap.probes)
    lines = [f"piper capacity: {fam.model.name} grown by {fam.scale} on {gpus} GPUs of {cluster.name}, "
             f"global batch {gbs}",
             f"probed {field} ({len(cap.probes)} sizes, {cap.elapsed_s:.1f} s): {probed}"]
    if cap.best is None:
        lines.append(f"no member fits, not even {field}={fam.value(fam.smallest)}: add GPUs or lower --gbs")
        return "\n".join(lines)
    b, m = cap.best, cap.best.model
    widths = (f" (ffn {m.ffn_hidden_size}, expert ffn {m.moe_ffn_hidden_size})" if fam.scale == "width" else "")
    lines += [f"largest that fits: {field}={fam.value(cap.k)}{widths} (base {fam.value(fam.base)}): "
              f"{_count(b.params_total)} parameters, {_count(b.params_active)} active; "
              f"{field}={fam.value(cap.k + 1)} fits no plan",
              f"plan: {describe(b.plan)}",
              f"  predicted MFU {100 * b.rate.mfu:.1f}% ({b.rate.tflops_per_gpu:.0f} TFLOPS/GPU, "
              f"{b.rate.tokens_per_s:,.0f} tokens/s), step {b.time.step:.3f} s, peak memory "
              f"{b.peak_stage.total / GIB:.1f} of {b.capacity_bytes / GIB:.1f} GiB"]
    return "\n".join(lines)
