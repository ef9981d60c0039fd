"""How many nodes a token's experts span: what an exchange that deduplicates per node sends.

A flat or Tutel-style hierarchical all-to-all sends a token once per selected expert (``topk``
copies); DeepEP and HybridEP (Megatron-Core's flex dispatcher) send it once per destination node and
fan it out over NVLink there. With experts spread evenly over the ``nodes`` nodes of the
expert-parallel group (``num_experts / nodes`` contiguous experts each, as Megatron places them),
and routing that is uniform over the allowed experts, the expected number of nodes a token reaches
is a hypergeometric miss count:

* plain top-k over ``E`` experts: a node is missed when all ``k`` picks fall on the other
  ``E - E/N`` experts, so ``N (1 - C(E - E/N, k) / C(E, k))``;
* group-limited routing (``G`` groups, ``M`` picked per token; Megatron ``group_limited_topk``):
  when a node holds whole groups (``N`` divides ``G``) a node is reached when one of its ``G/N``
  groups is picked, ``N (1 - C(G - G/N, M) / C(G, M))`` -- an upper bound, as a picked group may
  end up with none of the ``k`` experts; when a group spans ``N/G`` nodes, a picked group holds
  about ``k/M`` of the token's experts (Megatron scores a group by its top ``k/M``), drawn from its
  ``E/G``: ``N (M / G) (1 - C(E/G - E/N, k/M) / C(E/G, k/M))``.

Checked against Megatron-Core's own router (``topk_routing_with_score_function`` on random
scores, tests/unit/test_exchange_dedup.py): within 7 % for DeepSeek-V3 at 2-16 nodes.

Routing is uniform here; a measured, skewed distribution is issue 17's.
"""

from __future__ import annotations

import math

from piper_core.specs.model import ModelSpec


def _reach(pool: int, on_node: int, picks: int) -> float:
    """Probability that ``picks`` draws without replacement from ``pool`` hit a given ``on_node``."""
    if on_node >= pool:
        return 1.0
    return 1.0 - math.comb(pool - on_node, picks) / math.comb(pool, picks)


def nodes_per_token(model: ModelSpec, nodes: int) -> float:
    """Expected number of the ``nodes`` nodes (of the expert-parallel group) a token's experts span."""
    experts, k = model.num_experts, model.moe_router_topk
    if nodes <= 1 or experts == 0:
        return 1.0
    groups, picked = model.moe_router_num_groups, model.moe_router_group_topk
    if experts % nodes:  # uneven placement: at most one node per expert
        return float(min(nodes, k))
    plain = nodes * _reach(experts, experts // nodes, k)
    if groups is None:
        return plain
    if groups % nodes == 0:
        return min(plain, nodes * _reach(groups, groups // nodes, picked))
    if nodes % groups == 0:
        return min(plain, nodes * picked / groups * _reach(experts // groups, experts // nodes, k // picked))
    return min(plain, float(picked * math.ceil(nodes / groups)))


def dedup_ratio(model: ModelSpec, nodes: int) -> float:
    """Inter-node bytes of a per-node deduplicated exchange over those of one that sends a copy per
    expert: remote nodes reached per token over remote expert copies per token (both ``(N-1)/N`` of
    their totals by symmetry, so the ratio of the totals)."""
    if nodes <= 1 or model.num_experts == 0:
        return 1.0
    return nodes_per_token(model, nodes) / model.moe_router_topk
