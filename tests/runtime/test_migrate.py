"""The framework-free half of expert migration (piper_core/runtime/migrate.py): the plan every rank
makes alike, the byte packing, the kept buffers, the placement file of a checkpoint, and the exchange on
2 gloo ranks (a missing peer fails in time, naming the operation and the ranks). The adapters' own
tests (tests/megatron/test_migrate.py, tests/deepspeed/test_migrate.py) train through it."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from piper_core.errors import SpecError
from piper_core.runtime import migrate as move
from piper_core.runtime.placement import ExpertPlacement
from tests.gloo import run_ranks

DEFAULT = ExpertPlacement.default(4, 2)  # rank 0: 0, 1; rank 1: 2, 3
SWAPPED = ExpertPlacement(num_experts=4, ep=2, ranks=((2, 1), (0, 3)))


def test_the_plan_moves_only_the_experts_that_change_rank_and_keeps_the_others_in_their_slots():
    plan, after = move.plan_moves({1: DEFAULT, 3: DEFAULT}, {3: SWAPPED})
    assert after[1] == DEFAULT and after[3] == SWAPPED
    crossing = [(m.layer, m.expert, m.src_rank, m.dst_rank) for m in plan.crossing]
    assert crossing == [(3, 0, 0, 1), (3, 2, 1, 0)]
    assert all(m.layer == 3 for m in plan.moves)


@pytest.mark.parametrize("current, target, match", [
    ({}, DEFAULT, r"^model='no MoE layers': has no experts to migrate"),
    ({1: DEFAULT}, {2: SWAPPED}, r"^placement layers=\[2\]: are not MoE layers of this rank \(it holds \[1\]\)"),
    ({1: DEFAULT}, ExpertPlacement.default(8, 2), r"^placement of layer 1='placement': places 8 experts, the model has 4"),
])
def test_a_wrong_target_is_refused_before_anything_moves(current, target, match):
    with pytest.raises(SpecError, match=match):
        move.plan_moves(current, target)


def test_packing_keeps_every_dtype_and_shape_and_the_buffers_are_reused():
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.tensor(4.0), torch.arange(6).view(2, 3)]
    buffers = move.MoveBuffers()
    first = buffers.get("send", 1, move.nbytes(tensors))
    packed = move.pack(tensors, first)
    assert packed.numel() == 64 + 16 + 8 + 48  # fp32 60 -> 64, bf16 14 -> 16, a scalar 4 -> 8, int64 48: aligned
    assert packed.numel() == move.nbytes(tensors) and move.nbytes(tensors) % move.ALIGN == 0
    out = [torch.empty_like(t) for t in tensors]
    assert move.unpack(packed, out) == packed.numel()
    assert all(torch.equal(a, b) for a, b in zip(tensors, out))
    smaller = buffers.get("send", 1, 10)
    assert smaller.data_ptr() == first.data_ptr()  # the kept buffer, not a new one
    larger = buffers.get("send", 1, 10 * packed.numel())
    assert larger.numel() == 10 * packed.numel()
    assert buffers.release() == larger.numel() and buffers.release() == 0


def test_the_checkpoint_placement_file_round_trips_and_a_single_placement_is_refused(tmp_path):
    path = move.write_placements(tmp_path, {1: DEFAULT, 3: SWAPPED})
    assert path.name == move.PLACEMENT_NAME
    assert move.read_placements(tmp_path) == {1: DEFAULT, 3: SWAPPED}
    single = tmp_path / "one.json"
    SWAPPED.write(single)
    with pytest.raises(SpecError, match=r"holds one placement for every layer \(ranks\); a checkpoint's placement "
                                        r"file lists each MoE layer"):
        move.read_placements(single)


def _swap(rank: int, world: int, absent: bool) -> dict:
    import torch.distributed as dist

    from piper_core.runtime.timeouts import CollectiveError

    group = dist.new_group(ranks=[0, 1])
    slots = {(3, s): [torch.full((2,), float(s), dtype=torch.bfloat16), torch.full((4,), 10.0 * rank + s)]
             for s in range(2)}
    plan, _ = move.plan_moves({3: DEFAULT}, SWAPPED)
    if absent and rank == 1:
        return {"slots": None}
    try:
        sent, received, _ = move.exchange(plan, lambda layer, local: slots[(layer, local)], group, (0, 1), rank,
                                          timedelta(seconds=2), move.MoveBuffers())
    except CollectiveError as exc:
        return {"error": str(exc)}
    return {"slots": {s: [t.tolist() for t in ts] for (_, s), ts in slots.items()}, "sent": sent, "received": received}


def test_two_ranks_trade_their_experts_in_place():
    r0, r1 = run_ranks(2, _swap, False, timeout_s=60)
    # expert 0 (rank 0, slot 0) went to rank 1's slot 0; expert 2 (rank 1, slot 0) came to rank 0's slot 0
    assert r0["slots"][0][1] == [10.0] * 4 and r1["slots"][0][1] == [0.0] * 4
    assert r0["slots"][1][1] == [1.0] * 4 and r1["slots"][1][1] == [11.0] * 4  # expert 1 and 3 stayed
    assert r0["sent"] == r0["received"] == r1["sent"] == 4 * 4 + 8  # fp32 16 bytes, bf16 4 padded to 8


def test_a_missing_peer_fails_in_time_naming_the_operation_and_the_ranks():
    r0, _ = run_ranks(2, _swap, True, timeout_s=60)
    assert "expert migration receive" in r0["error"] and "global rank 1" in r0["error"], r0
