"""The placement type (piper_core/runtime/placement.py): the permutation both ways, JSON round trip,
and the messages of every malformed placement."""

from __future__ import annotations

import json

import pytest

from piper_core.errors import SpecError
from piper_core.runtime.placement import (ExpertPlacement, LayerPlacements, placement_from_json, placements_from_json,
                                         read_placement, read_placements)


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


# ---- one placement per MoE layer ----------------------------------------------------------------------

def test_a_per_layer_file_round_trips_and_leaves_unlisted_layers_default(tmp_path):
    data = {"num_experts": 4, "ep": 2, "layers": {"3": [[3, 2], [1, 0]], "1": [[1, 0], [3, 2]]}}
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(data))
    got = read_placements(path)
    assert isinstance(got, LayerPlacements) and list(got.layers) == [1, 3]
    assert got.for_layer(1).ranks == ((1, 0), (3, 2)) and got.for_layer(3).ranks == ((3, 2), (1, 0))
    assert got.for_layer(2) is None and got.for_layer(None) is None
    assert got.to_json() == {"num_experts": 4, "ep": 2, "layers": {"1": [[1, 0], [3, 2]], "3": [[3, 2], [1, 0]]}}
    assert got.describe() == ("per MoE layer over 2 ranks: layers 1,3 placed (4 experts off their default rank in "
                              "all), every other layer the default")
    single = ExpertPlacement(num_experts=4, ep=2, ranks=((1, 0), (3, 2)))
    assert single.for_layer(7) is single and read_placements(single.write(tmp_path / "one.json")) == single
    yaml_file = tmp_path / "layers.yaml"
    yaml_file.write_text("num_experts: 4\nep: 2\nlayers:\n  1: [[1, 0], [3, 2]]\n")
    assert read_placements(yaml_file).for_layer(1).ranks == ((1, 0), (3, 2))


@pytest.mark.parametrize("data, message", [
    ({"num_experts": 4, "ep": 2, "layers": {"x": [[0, 1], [2, 3]]}},
     r"layers.x='x': is not a layer number \(Megatron's layer_number, from 1\)"),
    ({"num_experts": 4, "ep": 2, "layers": {"0": [[0, 1], [2, 3]]}}, r"layers.0='0': is not a layer number"),
    ({"num_experts": 4, "ep": 2, "layers": {"2": [[0, 1], [1, 3]]}},
     r"p.json layer 2: ranks\[1\]=\[1, 3\]: holds expert 1, which rank 0 holds too"),
    ({"num_experts": 4, "ep": 2, "layers": [[0, 1], [2, 3]]}, r"layers=.*must map layer numbers"),
    ({"num_experts": 4, "ep": 3, "layers": {}}, r"ep=3: must divide num_experts \(4\)"),
    ({"num_experts": 4, "ep": 2, "layers": {}, "rank": 1}, r"rank=1: is not a key of a per-layer placement file"),
])
def test_malformed_per_layer_files_are_refused_with_the_rule(data, message):
    with pytest.raises(SpecError, match=message):
        placements_from_json(data, where="p.json")


def test_one_placement_inputs_refuse_a_per_layer_file_with_the_fix(tmp_path):
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"num_experts": 4, "ep": 2, "layers": {"1": [[1, 0], [3, 2]]}}))
    with pytest.raises(SpecError, match=r"holds one placement per MoE layer \(layers\); this input takes one "
                                        r"placement for every layer \(ranks\); write one with piper placement "
                                        r"... --shared --out FILE"):
        read_placement(path)
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    with pytest.raises(SpecError, match=r"empty.json': the file is empty"):
        read_placements(empty)
    placements = read_placements(path)
    with pytest.raises(SpecError, match=r"is for ep=2, the job runs ep=4"):
        placements.check(num_experts=4, ep=4, key="placement")
