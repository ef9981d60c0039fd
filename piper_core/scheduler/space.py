"""The search space: every combination of parallel sizes and options the scheduler considers,
and the cheap structural rules that reject a combination before any cost is computed."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from piper_core.errors import divisors
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec

A2AVariant = tuple[str, int, bool]  # (algorithm, chunks, Megatron's EP overlap)
CHUNK_CHOICES: tuple[int, ...] = (1, 2, 4, 8)
A2A_CHOICES: tuple[A2AVariant, ...] = tuple((a, c, False) for a in ("flat", "hierarchical") for c in CHUNK_CHOICES) \
    + (("flat", 1, True), ("dedup", 1, False), ("dedup", 1, True))
UNPIPELINED: A2AVariant = ("flat", 1, False)


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """Values tried per dimension (defaults: the full space of ``piper plan``).

    ``memory_savers`` are (grad_reduce_in_bf16, optimizer_offload_fraction) pairs tried in order for
    each combination, the first that fits being kept: they only ever cost time, so a plan uses
    one only when it does not fit without it (offload needs the distributed optimizer and host
    memory in the cluster spec). ``a2a``: the exchange variants tried for every plan with ep > 1
    (algorithm x pipeline chunks, and Megatron's EP overlap where its rules allow it; ``dedup``, Megatron's
    flex dispatcher, in one chunk); a model with a
    shared expert overlaps it with the exchange wherever Megatron allows (it only hides time), unless
    ``shared_expert_overlap`` is False (a runtime that runs the shared expert after the exchange). ``sequence_parallel``: whether plans with tp > 1 use sequence
    parallelism (Megatron-Core needs it for MoE with tp > 1, so False leaves MoE models at tp = 1).
    ``defer_wgrad``: every plan with ep > 1 defers its experts' weight gradients (a runtime that asks
    for it, e.g. a DeepSpeed ``piper`` block with ``"defer_wgrad": true``; never varied by the search,
    as it only hides time where a runtime runs it). ``precision``: every plan's (``fp32`` for a job that
    trains in fp32: bf16 gradient reduction and optimizer offload then do not apply). ``fp8`` and
    ``fp8_recipe``: every plan's FP8 setting (``piper plan --fp8``), not searched: FP8 is a choice of
    numerics a team makes, not a free parameter of the plan. ``pipeline_layout``: every plan's
    Megatron layout (a layout the user pinned; ``pp x vpp`` must give its stage count), in place of
    the even split or the search's own layout.
    """

    tp: tuple[int, ...]
    pp: tuple[int, ...]
    vpp: tuple[int, ...] = (1, 2, 4)
    cp: tuple[int, ...] = (1, 2, 4)
    ep: tuple[int, ...]
    etp_equals_tp: tuple[bool, ...] = (False, True)
    mbs: tuple[int, ...] = (1, 2, 4)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    distributed_optimizer: tuple[bool, ...] = (True, False)
    a2a: tuple[A2AVariant, ...] = A2A_CHOICES
    memory_savers: tuple[tuple[bool, float], ...] = ((False, 0.0), (True, 0.0), (True, 1.0))
    sequence_parallel: bool = True
    shared_expert_overlap: bool = True
    defer_wgrad: bool = False
    precision: str = "bf16"
    fp8: str | None = None
    fp8_recipe: str = "delayed"
    pipeline_layout: str | None = None

    @property
    def size(self) -> int:
        dims = (self.tp, self.pp, self.vpp, self.cp, self.ep, self.etp_equals_tp, self.mbs, self.recompute,
                self.distributed_optimizer, self.a2a)
        n = 1
        for d in dims:
            n *= len(d)
        return n


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


TP_ACROSS_NODES = 8
"""Largest tp searched across nodes that share an NVLink domain: tensor parallelism exchanges
activations in every layer and thins every GEMM, and 8 is the largest tp an 8-GPU server allows; the
search keeps that bound where NVLink spans nodes (a planning choice, not a hardware limit)."""


def tp_limit(cluster: ClusterSpec) -> int:
    """The largest tp the search tries: a node, or up to :data:`TP_ACROSS_NODES` GPUs where the
    fastest link's domain spans nodes (GB200 NVL72: 4 GPUs per tray, 72 per NVLink domain)."""
    domain = cluster.fast_domain_gpus or cluster.gpus_per_node
    return max(cluster.gpus_per_node, min(domain, TP_ACROSS_NODES))


def default_space(model: ModelSpec, cluster: ClusterSpec, gpus: int) -> SearchSpace:
    """tp within the fastest link's domain (:func:`tp_limit`), pp up to the layer count, ep over powers of two and divisors of the experts."""
    pp = sorted({p for p in _powers_of_two(min(gpus, model.num_layers))} | {d for d in divisors(model.num_layers) if d <= gpus})
    ep = [1]
    if model.is_moe:
        ep = sorted(({e for e in _powers_of_two(gpus)} | set(divisors(model.num_experts))) - {0})
        ep = [e for e in ep if e <= gpus]
    space = SearchSpace(tp=tuple(_powers_of_two(min(tp_limit(cluster), gpus))), pp=tuple(pp), ep=tuple(ep))
    if not model.is_moe:
        space = SearchSpace(tp=space.tp, pp=space.pp, ep=(1,), etp_equals_tp=(True,), a2a=(UNPIPELINED,))
    return space


def pipeline_split(num_layers: int, pp: int, vpp: int) -> tuple[int | None, str | None]:
    """Layers on the last stage for an uneven split (None: even), or a rejection reason.

    When ``pp * vpp`` does not divide the layers, the last stage takes the remainder so that the
    other stages hold ``ceil(L / pp)`` each (Megatron ``--decoder-last-pipeline-num-layers``).
    """
    if num_layers % (pp * vpp) == 0:
        return None, None
    if pp == 1 or vpp > 1:
        return None, "layers do not split evenly over pp*vpp"
    base = -(-num_layers // pp)
    last = num_layers - base * (pp - 1)
    if last <= 0:
        return None, "layers do not split over pp"
    return last, None


def grid(space: SearchSpace) -> Iterator[tuple]:
    """Raw combinations (tp, pp, vpp, cp, ep, etp_equals_tp, mbs, recompute, dist_opt)."""
    return itertools.product(space.tp, space.pp, space.vpp, space.cp, space.ep, space.etp_equals_tp, space.mbs,
                             space.recompute, space.distributed_optimizer)
