"""The placement type (piper_core/runtime/placement.py): the permutation both ways, JSON round trip,
and the messages of every malformed placement."""

from __future__ import annotations

import json

import pytest

from piper_core.errors import SpecError
from piper_core.runtime.placement import ExpertPlacement, placement_from_json, read_placement


def test_slots_and_logical_ids_are_inverse():
    p = ExpertPlacement(num_experts=8, ep=2, ranks=[[5, 2, 7, 0], [3, 6, 1, 4]])
    assert p.logical_at == (5, 2, 7, 0, 3, 6, 1, 4)
    assert p.slot_of == (3, 6, 1, 4, 7, 0, 5, 2)
    assert all(p.logical_at[p.slot_of[e]] == e for e in range(8))
    assert ExpertPlacement.from_slots(p.slot_of, 2) == p
    assert not p.is_default and p.moved() == 4
    assert p.describe() == "4 of 8 experts off their default rank over 2 ranks"
    default = ExpertPlacement.default(8, 4)
    assert default.ranks == ((0, 1), (2, 3), (4, 5), (6, 7)) and default.is_default and default.moved() == 0


def test_json_round_trip(tmp_path):
    p = ExpertPlacement(num_experts=4, ep=2, ranks=((1, 3), (0, 2)))
    path = p.write(tmp_path / "placement.json")
    assert json.loads(path.read_text()) == {"num_experts": 4, "ep": 2, "ranks": [[1, 3], [0, 2]]}
    back = read_placement(path)
    assert back.ranks == p.ranks and (back.num_experts, back.ep) == (4, 2) and back.where == str(path)


@pytest.mark.parametrize("data, message", [
    ({"num_experts": 8, "ep": 2, "ranks": [[0, 1, 2, 3]]},
     r"ranks='\[\[0, 1, 2, 3\]\]': lists 1 ranks, ep is 2; give one list per expert-parallel rank \(2\)"),
    ({"num_experts": 8, "ep": 2, "ranks": [[0, 1, 2], [3, 4, 5, 6, 7]]},
     r"slots per rank are \[3, 5\]; every rank holds num_experts / ep = 4; give each rank exactly 4 expert ids"),
    ({"num_experts": 4, "ep": 2, "ranks": [[0, 1], [1, 3]]},
     r"ranks\[1\]=\[1, 3\]: holds expert 1, which rank 0 holds too: a placement is a permutation"),
    ({"num_experts": 4, "ep": 2, "ranks": [[0, 1], [2, 4]]},
     r"ranks\[1\]=\[2, 4\]: holds 4, not a logical expert id in 0 .. 3"),
    ({"num_experts": 4, "ep": 2, "ranks": [[0, 1], [2, "3"]]}, r"holds '3', not a logical expert id"),
    ({"num_experts": 6, "ep": 4, "ranks": [[0], [1], [2], [3]]},
     r"ep=4: must divide num_experts \(6\); choose ep in \[1, 2, 3, 6\]"),
    ({"num_experts": 4, "ep": 2, "rank": [[0, 1], [2, 3]]},
     r"rank=.*is not a key of a placement; did you mean 'ranks'"),
    ({"num_experts": 4, "ranks": [[0, 1], [2, 3]]}, r"ep=None: is required"),
    ({"num_experts": True, "ep": 1, "ranks": [[0]]}, r"num_experts=True: must be an int >= 1"),
    ([[0, 1], [2, 3]], r"must be a JSON object with num_experts, ep and ranks"),
])
def test_malformed_placements_are_refused_with_the_rule(data, message):
    with pytest.raises(SpecError, match=message):
        placement_from_json(data, where="p.json")


def test_unreadable_and_non_json_files_name_the_file(tmp_path):
    with pytest.raises(SpecError, match=r"placement='.*missing.json': cannot be read"):
        read_placement(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{ranks: }")
    with pytest.raises(SpecError, match=r"bad.json': is not JSON"):
        read_placement(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"num_experts": 4, "ep": 2, "ranks": [[0, 0], [2, 3]]}))
    with pytest.raises(SpecError, match=r"^.*wrong.json: ranks\[0\]=\[0, 0\]: holds expert 0, which rank 0 holds"):
        read_placement(wrong)


def test_check_against_the_job():
    p = ExpertPlacement(num_experts=8, ep=2, ranks=[[5, 2, 7, 0], [3, 6, 1, 4]], where="p.json")
    p.check(num_experts=8, ep=2, key="--piper-placement")
    with pytest.raises(SpecError, match=r"--piper-placement='p.json': places 8 experts, the model has 16"):
        p.check(num_experts=16, ep=2, key="--piper-placement")
    with pytest.raises(SpecError, match=r"--piper-placement='p.json': is for ep=2, the job runs ep=4; pin it"):
        p.check(num_experts=8, ep=4, key="--piper-placement", fix_ep="pin it")
