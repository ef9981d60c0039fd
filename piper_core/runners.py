"""Which runtime can run a plan: stock Megatron-LM, Megatron-LM with ``--piper``, stock DeepSpeed-MoE,
DeepSpeed-MoE with a ``piper`` block. Each rule returns why not (None: it can), so a plan report can
put the best plan of each runtime side by side and say why the faster one is out of the other's reach.

Stock runs each exchange flat in one piece (Megatron-Core's ``MoEAlltoAllTokenDispatcher``,
DeepSpeed's ``_AllToAll``); a hierarchical or a pipelined (chunked) exchange is Piper's; one that
sends a token to a node once (``dedup``) is Megatron's flex dispatcher's (DeepEP/HybridEP) alone. Megatron's
own EP overlap (``--overlap-moe-expert-parallel-comm``) runs only on its stock dispatcher. Deferred
expert weight gradients (``defer_wgrad``) are Piper's runtime's (``moe_alltoall(defer_wgrad=True)``),
asked for by both adapters (``--piper-defer-wgrad``, ``"defer_wgrad": true``); neither stock path has
them (Megatron's own delay comes only with its EP overlap, ``ep_comm_overlap``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from piper_core.export import deepspeed_compatible
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.parallel import ParallelPlan

Rule = Callable[[ParallelPlan], "str | None"]


DEDUP = ("a2a=dedup: a token sent once per destination node is DeepEP/HybridEP's, which only Megatron's flex "
         "dispatcher runs (Piper's exchanges and DeepSpeed's send a copy per expert)")


def _stock_exchange(plan: ParallelPlan, *, flex: bool = False) -> str | None:
    if plan.a2a == "dedup" and not flex:
        return DEDUP
    if plan.a2a == "hierarchical":
        return f"a2a={plan.a2a}: the stock dispatchers exchange flat (the staged exchange is Piper's)"
    if plan.a2a_chunks > 1:
        return f"chunks={plan.a2a_chunks}: the stock dispatchers do not pipeline the exchange (Piper's)"
    return None


def _deferred_wgrad(plan: ParallelPlan, who: str) -> str | None:
    if not plan.defer_wgrad:
        return None
    return f"defer_wgrad: {who}"


def megatron_stock(plan: ParallelPlan) -> str | None:
    return _deferred_wgrad(plan, "the stock dispatcher's experts compute their weight gradients in their backward "
                                 "(Megatron's own delay comes with ep_comm_overlap)") or _stock_exchange(plan, flex=True)


def megatron_piper(plan: ParallelPlan) -> str | None:
    if plan.a2a == "dedup":
        return DEDUP
    if plan.defer_wgrad and plan.moe_grouped_gemm:
        return f"defer_wgrad with moe_grouped_gemm: {DEFERRED_EXPERTS}"
    if plan.ep_comm_overlap:
        return ("ep_comm_overlap: Megatron's --overlap-moe-expert-parallel-comm runs on its own dispatcher, which "
                "--piper replaces")
    return None


def _grouped(plan: ParallelPlan, who: str) -> str | None:
    if plan.moe_grouped_gemm:
        return f"moe_grouped_gemm: {who}"
    return None


def deepspeed_stock(plan: ParallelPlan) -> str | None:
    why = _deferred_wgrad(plan, "DeepSpeed-MoE's experts compute their weight gradients in their backward")
    if why:
        return why
    if plan.shared_expert_overlap or plan.ep_comm_overlap:
        return "DeepSpeed-MoE has no exchange/compute overlap option"
    return _grouped(plan, DS_EXPERTS) or deepspeed_compatible(plan) or _stock_exchange(plan)


DS_EXPERTS = "DeepSpeed-MoE's experts run one after another (its MOELayer and Piper's have no grouped GEMM)"
DEFERRED_EXPERTS = ("the deferred weight gradients split each expert linear's autograd graph, which a grouped "
                    "GEMM's fused function does not allow (piper_megatron.dispatcher.splittable_linears)")


def deepspeed_piper(plan: ParallelPlan) -> str | None:
    if plan.a2a == "dedup":
        return DEDUP
    if plan.shared_expert_overlap or plan.ep_comm_overlap:
        return "Piper's DeepSpeed-MoE layer has no shared expert and no Megatron EP overlap"
    return _grouped(plan, DS_EXPERTS) or deepspeed_compatible(plan)


RUNNERS: dict[str, Rule] = {"megatron --piper": megatron_piper, "megatron stock": megatron_stock,
                            "deepspeed piper": deepspeed_piper, "deepspeed stock": deepspeed_stock}


def sequential_experts(rule: Rule, plan: ParallelPlan) -> bool:
    """Whether the runtime of ``rule`` runs ``plan``'s local experts one GEMM each, whatever the
    accelerator's default: DeepSpeed always; Megatron with --piper when the weight gradients are
    deferred. :func:`piper_core.scheduler.search.as_run_by` prices such plans that way."""
    return rule in (deepspeed_stock, deepspeed_piper) or (rule is megatron_piper and plan.defer_wgrad)


def with_grouped_gemm(cluster: ClusterSpec, grouped: bool) -> ClusterSpec:
    """``cluster`` whose plans run their experts as grouped GEMMs by default (``grouped``) or one GEMM
    each (a runtime without grouped GEMM, or a job that does not ask for it)."""
    if cluster.accelerator.grouped_gemm == grouped:
        return cluster
    return dataclasses.replace(cluster, accelerator=dataclasses.replace(cluster.accelerator, grouped_gemm=grouped))
