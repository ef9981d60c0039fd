"""Piper's MOELayer subclass equals stock DeepSpeed-MoE: outputs and gradients, fp32, <= 1e-6
(absolute, or relative to the largest reference value where that exceeds 1).

Reference: DeepSpeed's own ``MoE`` layer (``deepspeed.moe.layer.MoE``, its ``MOELayer`` with the
synchronous ``_AllToAll``), built twice from the same seed; one copy gets
:class:`piper_deepspeed.moe.PiperMOELayer` by :func:`swap_moe_layers`. Both run forward and backward
on the same tokens, with the gate's random draws (random token selection, second-expert sampling)
seeded alike, and are compared: layer output, ``l_aux``, ``exp_counts``, the input gradient and
every parameter gradient (gate and experts).

Grid, one spawn per world size: ep 2 on 2 processes; ep 2 (two expert-parallel groups) and ep 4 on
4 processes (2 "nodes" x 2, so the hierarchical and aggregated exchanges have an inter-node stage);
k 1 and 2; drop_tokens true (capacity factor 1, tokens are dropped) and false; every
:class:`Algorithm` with 1, 2 and 3 chunks; plus the no-grad path. The schedule events prove Piper's
exchange ran (one dispatch post per chunk), and the cases include experts that get no token on a rank.
"""

from __future__ import annotations

import pytest
import torch

from piper_core.runtime import Algorithm, NodeTopology
from tests.deepspeed import deepspeed_comm
from tests.gloo import run_ranks

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

HIDDEN, FFN, EXPERTS, SEED = 16, 32, 8, 7
VARIANTS = [(alg, chunks) for alg in Algorithm for chunks in (1, 2, 3)]
TOL = 1e-6


class CountPosts:
    """A tracer that counts forward dispatch posts (one per chunk when Piper's path runs)."""

    def __init__(self) -> None:
        self.posts = 0

    def event(self, layer: str, ev) -> None:
        if ev.direction == "forward" and ev.action == "post" and ev.exchange == "dispatch":
            self.posts += 1


def _moe(ep: int, k: int, drop: bool):
    from deepspeed.moe.layer import MoE

    from piper_deepspeed.builder import MLP, init_experts

    torch.manual_seed(SEED)
    moe = MoE(HIDDEN, MLP(HIDDEN, FFN, gated=True, bias=True), num_experts=EXPERTS, ep_size=ep, k=k,
              capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=2, drop_tokens=drop)
    init_experts(moe, seed=SEED, layer=0)
    return moe


def _step(moe, x: torch.Tensor, w: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the gate's random draws
    x = x.clone().requires_grad_(True)
    out, l_aux, counts = moe(x)
    ((out * w).sum() + l_aux).backward()
    got = {"out": out.detach(), "l_aux": l_aux.detach(), "exp_counts": counts.detach(), "x.grad": x.grad}
    got |= {f"{n}.grad": p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)
    return got


def _error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """max |ref - got|, relative to max |ref| where that exceeds 1 (fp32 rounding scales with it)."""
    ref, got = ref.double(), got.double()
    return ((ref - got).abs().max() / max(1.0, ref.abs().max().item())).item()


def _no_grad(moe, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return moe(x)[0]


def _compare_layers(rank: int, world: int, eps: tuple[int, ...]) -> list[dict]:
    from piper_deepspeed.moe import A2ASettings, attach_comm, swap_moe_layers

    deepspeed_comm()
    topology = NodeTopology.uniform(world_size=world, ranks_per_node=max(1, world // 2))
    rows, comms = [], {}
    for ep in eps:
        for k in (1, 2):
            for drop in (True, False):
                stock, piper = _moe(ep, k, drop), _moe(ep, k, drop)
                stock.set_deepspeed_parallelism()
                swap_moe_layers(piper, A2ASettings(algorithm=Algorithm.FLAT, chunks=1))
                piper.set_deepspeed_parallelism()
                if ep not in comms:
                    comms[ep] = attach_comm(piper, topology)  # collective, once per ep
                g = torch.Generator().manual_seed(1000 * rank + 10 * k + drop)
                x = torch.randn(2, 12, HIDDEN, generator=g)
                if rank == 0:  # skew rank 0's routing so that some of its experts get no token
                    x = x + 2.0 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(SEED))
                w = torch.randn(2, 12, HIDDEN, generator=g)
                seed = 100 + rank
                ref = _step(stock, x, w, seed)
                ref_eval = _no_grad(stock.eval(), x, seed)
                for alg, chunks in VARIANTS:
                    counter = CountPosts()
                    piper.deepspeed_moe.configure(A2ASettings(algorithm=alg, chunks=chunks), comm=comms[ep],
                                                  tracer=counter, name="moe")
                    got = _step(piper.train(), x, w, seed)
                    errors = {key: _error(ref[key], got[key]) for key in ref}
                    errors["eval out"] = _error(ref_eval, _no_grad(piper.eval(), x, seed))
                    rows.append({"ep": ep, "k": k, "drop": drop, "alg": alg.value, "chunks": chunks,
                                 "errors": errors, "posts": counter.posts,
                                 "empty_experts": int((ref["exp_counts"] == 0).sum()),
                                 "keys": sorted(ref)})
    return rows


@pytest.mark.parametrize("world, eps", [(2, (2,)), (4, (2, 4))])
def test_piper_moe_layer_matches_deepspeed(world: int, eps: tuple[int, ...]) -> None:
    per_rank = run_ranks(world, _compare_layers, eps, timeout_s=240)
    seen = set()
    for rank, rows in enumerate(per_rank):
        assert len(rows) == len(eps) * 2 * 2 * len(VARIANTS)
        for row in rows:
            case = f"rank {rank} ep={row['ep']} k={row['k']} drop_tokens={row['drop']} {row['alg']}/{row['chunks']}"
            assert any(key.startswith("experts") or "deepspeed_experts" in key for key in row["keys"]), case
            bad = {key: err for key, err in row["errors"].items() if not err <= TOL}
            assert not bad, f"{case}: max |stock - piper| above {TOL}: {bad}"
            # eval (no-grad) forwards also post, once per chunk each
            assert row["posts"] == 2 * row["chunks"], f"{case}: Piper's exchange did not run per chunk"
            seen.add((row["ep"], row["k"], row["drop"], row["alg"], row["chunks"]))
    assert len(seen) == len(eps) * 2 * 2 * len(VARIANTS)
    assert any(row["empty_experts"] > 0 for rows in per_rank for row in rows), "no case left an expert empty"
