"""``piper capacity``: the member it reports fits and the next size up fits no plan of the full
search space; families contain the base model; the boundary search; errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from piper_core.cli.capacity import boundary, capacity, family
from piper_core.cli.main import main
from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.resource.params import total_params
from piper_core.scheduler.search import search

TINY, MIXTRAL = load_model("tiny-moe"), load_model("mixtral-8x7b")
CPU, H100 = load_cluster("cpu-local"), load_cluster("dgx-h100")


@pytest.mark.parametrize("model, cluster, gpus, gbs, scale", [
    (TINY, CPU, 8, 64, "width"),
    (TINY, CPU, 8, 64, "experts"),
    (MIXTRAL, H100, 8, 8, "layers"),
], ids=["tiny-width", "tiny-experts", "mixtral-layers"])
def test_largest_fits_and_next_size_up_does_not(model, cluster, gpus, gbs, scale):
    cap = capacity(model, cluster, gpus, gbs, scale)
    assert cap.k is not None and cap.k > cap.family.base  # all three grow beyond the preset
    assert cap.best.feasible and cap.best.model == cap.family.member(cap.k)
    # Independent check on the full default space (capacity probes a reduced one).
    assert search(cap.family.member(cap.k), cluster, gpus, gbs).feasible > 0
    assert search(cap.family.member(cap.k + 1), cluster, gpus, gbs).feasible == 0
    assert cap.best.params_total < total_params(cap.family.member(cap.k + 1))


@pytest.mark.parametrize("scale, field", [("experts", "num_experts"), ("layers", "num_layers"),
                                          ("width", "hidden_size")])
def test_family_contains_the_base_model(scale, field):
    for model in (TINY, MIXTRAL, load_model("deepseek-v3"), load_model("qwen3-30b-a3b")):
        fam = family(model, scale, 64)
        assert dataclasses.replace(fam.member(fam.base), name=model.name) == model
        assert getattr(fam.member(fam.base + 1), field) > getattr(model, field)


def test_width_keeps_heads_divisible_and_widths_proportional():
    fam = family(MIXTRAL, "width", 64)
    wide = fam.member(2 * fam.base)
    assert wide.hidden_size == 2 * MIXTRAL.hidden_size and wide.hidden_size % wide.num_attention_heads == 0
    assert (wide.ffn_hidden_size, wide.moe_ffn_hidden_size) == (2 * MIXTRAL.ffn_hidden_size,
                                                                 2 * MIXTRAL.moe_ffn_hidden_size)
    assert wide.num_attention_heads == MIXTRAL.num_attention_heads


@pytest.mark.parametrize("limit, base", [(37, 4), (37, 100), (4, 4), (1, 3), (64, 64)])
def test_boundary_brackets_then_bisects(limit, base):
    k, probes = boundary(1, base, lambda k: k <= limit)
    assert k == limit
    assert (limit, True) in probes and (limit + 1, False) in probes


def test_boundary_when_nothing_fits():
    assert boundary(2, 16, lambda k: False)[0] is None


def test_bad_scale_is_a_spec_error():
    with pytest.raises(SpecError, match=r"--scale='expert': must be one of experts, layers, width; did you mean "
                                        r"'experts'\?"):
        family(TINY, "expert", 8)
    dense = dataclasses.replace(TINY, num_experts=0, moe_ffn_hidden_size=None, moe_router_topk=1)
    with pytest.raises(SpecError, match=r"is dense \(num_experts=0\).*use --scale layers or --scale width"):
        family(dense, "experts", 8)


def test_cli_json_and_exit_codes(capsys):
    argv = ["capacity", "tiny-moe", "--cluster", "cpu-local", "--gpus", "8", "--gbs", "64", "--scale", "width"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["field"], out["base_value"]) == ("hidden_size", 64)
    assert out["model"]["hidden_size"] == out["value"] and out["plan"]["feasible"] is True
    assert {"value": out["value"], "fits": True} in out["probes"]
    assert {"value": out["next_value"], "fits": False} in out["probes"]
    assert main(argv) == 0 and "largest that fits: hidden_size=" in capsys.readouterr().out
    assert main(argv[:-1] + ["depth"]) == 2
    assert "--scale='depth': must be one of experts, layers, width" in capsys.readouterr().err
