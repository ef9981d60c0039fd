"""A tiny GPT-MoE trains the same with Piper's dispatcher as with Megatron-Core's.

On 2 gloo processes (pp 1, ep 2) and 4 (pp 2, ep 2, data parallel 2), tests/megatron/piper_ranks.py
builds tiny-moe (4 layers, hidden 64, 8 experts, top-2; fp32) with :mod:`piper_megatron.build`,
wraps it in Megatron-Core's ``DistributedDataParallel`` and trains 5 steps of 2 micro-batches with
Megatron-Core's own schedule (``get_forward_backward_func``: no pipelining at pp 1, 1F1B at pp 2),
``finalize_model_grads`` and ``torch.optim.Adam`` (on CPU with
:func:`piper_megatron.cpu.install_cpu_training_shims`). The same initial weights and data run once
with Megatron's alltoall dispatcher and once per Piper variant (flat, hierarchical, pipelined flat
in 2 chunks, aggregated in 4, and ``tune``: each layer measures 1/2/4/8 chunks, 3 calls each, then
keeps the fastest). Every micro-batch loss of every step must agree with the stock run.
"""

from __future__ import annotations

import pytest

from tests.megatron.piper_ranks import TRAIN_STEPS, TRAIN_VARIANTS, variant_id

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

TOL = 1e-5  # fp32 losses after 5 Adam steps; a wrong exchange moves them by > 1e-2
VARIANTS = [variant_id(v) for v in TRAIN_VARIANTS if v != "stock"]


def _last_stage(piper_ranks, world: int) -> list[dict]:
    runs = [r["training"] for r in piper_ranks(world) if r["training"]["last_stage"]]
    assert runs, "no rank reported the last pipeline stage"
    return runs


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("variant", VARIANTS)
def test_losses_agree_step_by_step(piper_ranks, world, variant):
    for run in _last_stage(piper_ranks, world):
        stock, piper = run["losses"]["stock"], run["losses"][variant]
        assert len(piper) == len(stock) == TRAIN_STEPS
        for step, (want, got) in enumerate(zip(stock, piper)):
            assert got == pytest.approx(want, abs=TOL, rel=0), f"step {step}: {variant} {got} vs stock {want}"


@pytest.mark.parametrize("world", (2, 4))
def test_tuned_layers_decide_together_and_keep_their_choice(piper_ranks, world):
    """Every MoE layer of every rank measured all four counts, then chose one of them, the same on
    the ranks of its expert-parallel group (they see the slowest rank's medians)."""
    by_layer: dict[int, list[dict]] = {}
    for r in piper_ranks(world):
        tuned = r["training"]["tuned"]
        assert tuned, "the tune run built no tuning layer"
        for t in tuned:
            by_layer.setdefault(t["layer"], []).append(t)
    for layer, ranks in by_layer.items():
        for t in ranks:
            # 2 micro-batches a step: undecided for 6 steps (12 measured calls), decided in the 7th
            assert t["after_step"][:6] == [None] * 6 and t["after_step"][6] == t["chosen"], (layer, t)
            assert t["chosen"] in (1, 2, 4, 8) and set(t["medians_s"]) == {1, 2, 4, 8}, (layer, t)
            assert all(0 < m < 10 for m in t["medians_s"].values()), (layer, t)
        assert len({t["chosen"] for t in ranks}) == 1 and len(ranks) == 2, (layer, ranks)  # ep 2: a pair


@pytest.mark.parametrize("world", (2, 4))
def test_the_model_learns(piper_ranks, world):
    """The run is training, not idling: the loss on the repeated batch falls every step."""
    for run in _last_stage(piper_ranks, world):
        means = [sum(step) / len(step) for step in run["losses"]["stock"]]
        assert all(b < a for a, b in zip(means, means[1:])), means
