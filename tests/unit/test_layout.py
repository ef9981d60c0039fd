"""Megatron's pipeline layouts (issue 16): read, written, priced and searched.

DeepSeek-V3's 61 layers split over pp 8 x vpp 4 only with ``--pipeline-model-parallel-layout``;
Megatron-Bridge trains it so. The layout decides which layers each virtual stage holds, so every
term that walks the stages (parameters, memory, time) follows it. The check against Megatron-Core's
own parser is tests/megatron/test_export_flags.py::test_searched_layouts_are_megatron_cores.
"""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.cli.parse import parse_parallel
from piper_core.errors import SpecError
from piper_core.export import deepspeed_compatible, parallel_flags, plan_label
from piper_core.presets import load_cluster, load_model
from piper_core.resource.predict import predict
from piper_core.scheduler.search import layout_weights, search
from piper_core.specs.compat import stage_layers
from piper_core.specs.layout import balanced_layout, decoder_counts, layout_string, parse_layout
from piper_core.specs.parallel import ParallelPlan

DSV3 = load_model("deepseek-v3")  # with its one MTP layer
H100 = load_cluster("dgx-h100")
# Megatron-Bridge's DeepSeek-V3 layout at pp 8 x vpp 4, its MTP layer ("m") in the last stage
BRIDGE = "Et*2|(tt|)*22t|(tt|)*7mL"


def test_megatrons_syntax_unrolls_as_megatron_does():
    stages = parse_layout(BRIDGE)
    assert len(stages) == 32 and stages[0] == "Ett" and stages[23] == "t" and stages[-1] == "mL"
    assert sum(decoder_counts(stages)) == 61
    assert parse_layout("E|(t|)*3,m|m||L") == ("E", "t", "t", "t", "m", "m", "", "L")  # arguments.py's own example
    assert parse_layout("Ett|(tt|)*29,tL") == parse_layout("Ett|" + "tt|" * 29 + "tL")


@pytest.mark.parametrize("layers, pp, vpp, mtp", [(61, 8, 4, 0), (61, 16, 2, 0), (94, 8, 4, 0), (24, 4, 4, 0),
                                                   (61, 4, 2, 0), (61, 8, 4, 1), (61, 16, 2, 1), (30, 4, 2, 2)])
def test_balanced_layouts_hold_every_layer_and_read_back(layers, pp, vpp, mtp):
    text = balanced_layout(layers, pp, vpp, mtp)
    stages = parse_layout(text)
    assert len(stages) == pp * vpp and stages[0].startswith("E") and stages[-1].endswith("m" * mtp + "L")
    assert sum(decoder_counts(stages)) == layers and "".join(stages).count("m") == mtp
    # E, L and each m weigh a layer here: every rank's share within one layer of every other's
    ranks = [sum(len(stages[v * pp + p]) for v in range(vpp)) for p in range(pp)]
    assert max(ranks) - min(ranks) <= 1
    for p in range(pp):  # and inside a rank, its stages within one layer of each other
        chunk = [len(stages[v * pp + p]) for v in range(vpp)]
        assert max(chunk) - min(chunk) <= 1 + (mtp + 1 if p == pp - 1 else 0)
    assert parse_layout(layout_string(stages)) == stages


def test_flop_weighted_layout_is_megatron_bridges_for_deepseek_v3():
    """Weighing the loss and the MTP layer by their FLOPs (the search's weights), the layout of
    DeepSeek-V3 at pp 8 x vpp 4 is the one Megatron-Bridge trains it with; it is also faster than
    counting each as one layer, which overloads the last rank."""
    from piper_core.scheduler.search import layout_weights

    weights = layout_weights(DSV3)
    assert 1.2 < weights["loss"] < 1.6 and 2.2 < weights["mtp"] < 2.8  # logits; one MoE layer and its logits
    weighted = balanced_layout(61, 8, 4, 1, **weights)
    assert parse_layout(weighted) == parse_layout(BRIDGE)
    sizes = "tp=1,pp=8,vpp=4,cp=4,ep=64,mbs=1,gbs=8192,dist_opt=1,a2a=dedup,epov=1"
    fast = predict(DSV3, H100, parse_parallel(f"{sizes},layout={weighted}", 1024))
    plain = predict(DSV3, H100, parse_parallel(f"{sizes},layout={balanced_layout(61, 8, 4, 1)}", 1024))
    assert fast.time.step < 0.95 * plain.time.step
    assert max(s.total for s in fast.time.stages) < max(s.total for s in plain.time.stages)


def test_the_plan_takes_a_layout_and_its_vpp():
    plan = parse_parallel(f"tp=1,pp=8,vpp=4,ep=64,mbs=1,gbs=8192,layout={BRIDGE}", 1024)
    layers = stage_layers(DSV3, plan)
    # stage i = v * pp + p holds consecutive layers in layer order (Megatron get_layer_offset)
    assert layers[0][0] == (0, 1) and layers[0][1] == tuple(range(16, 18)) and layers[7][3] == ()
    assert layers[7][2] == (46,) and layers[6][3] == (59, 60) and sum(len(c) for rank in layers for c in rank) == 61
    assert parse_parallel("tp=1,pp=4,vpp=2,ep=64,mbs=1,gbs=8192,layout=Ett*7|(t*8|)*6,t*7L", 1024).pipeline_layout


@pytest.mark.parametrize("fields, message", [
    (dict(pp=8, vpp=2), r"vpp=2: the pipeline layout has 32 stages over pp 8, so vpp is 4.*set vpp=4"),
    (dict(pp=8), r"vpp=None: the pipeline layout has 32 stages over pp 8, so vpp is 4"),
    (dict(pp=6, vpp=4), r"has 32 stages, not a multiple of pp \(6\)"),
    (dict(pp=8, vpp=4, num_layers_in_last_pipeline_stage=4), r"replaces the first/last pipeline stage layer counts"),
])
def test_plan_rules(fields, message):
    with pytest.raises(SpecError, match=message):
        ParallelPlan(gpus=1536 if fields["pp"] == 6 else 1024, global_batch_size=8192, pipeline_layout=BRIDGE, **fields)


@pytest.mark.parametrize("layout, message", [
    ("tE|(tt|)*30tL", r"must hold E \(embedding\) exactly once, as the first symbol"),
    ("Ett|(tt|)*30t", r"must hold L \(loss\) exactly once"),
    ("Ext|(tt|)*30L", r"has 'x', which no layout symbol is"),
])
def test_bad_layouts_are_refused(layout, message):
    with pytest.raises(SpecError, match=message):
        ParallelPlan(gpus=1024, pp=8, vpp=4, global_batch_size=8192, pipeline_layout=layout)


def test_the_model_checks_the_layers():
    with pytest.raises(SpecError, match=r"places 60 transformer layers \(t\), but deepseek-v3 has 61"):
        predict(DSV3, H100, ParallelPlan(gpus=1024, pp=8, vpp=4, ep=64, global_batch_size=8192,
                                         pipeline_layout="Et|(tt|)*22t|(tt|)*7mL"))


def test_stages_are_priced_as_the_layout_puts_them():
    plan = parse_parallel(f"tp=1,pp=8,vpp=4,ep=64,mbs=1,gbs=8192,layout={BRIDGE}", 1024)
    p = predict(DSV3, H100, plan)
    # the last rank: t, tt, tt, and the MTP layer's transformer layer with the loss
    assert [s.layers for s in p.stages] == [8, 8, 8, 8, 8, 8, 8, 6]
    assert p.stages[-1].params.total < p.stages[1].params.total + p.stages[0].params.total
    # without the MTP layer the last rank, three layers and the loss, is the fastest
    plain = dataclasses.replace(DSV3, mtp_num_layers=0)
    q = predict(plain, H100, dataclasses.replace(plan, pipeline_layout=BRIDGE.replace("mL", "L")))
    assert q.time.stages[-1].compute < q.time.stages[1].compute


def test_exports_write_the_layout_not_vpp_flags():
    plan = parse_parallel(f"tp=1,pp=8,vpp=4,ep=64,mbs=1,gbs=8192,layout={BRIDGE}", 1024)
    flags = dict(parallel_flags(DSV3, plan))
    assert flags["--pipeline-model-parallel-layout"] == BRIDGE
    assert "--num-layers-per-virtual-pipeline-stage" not in flags and "--num-virtual-stages-per-pipeline-rank" not in flags
    assert " layout " in plan_label(plan) and "pipeline layout" in deepspeed_compatible(plan)


def test_deepseek_v3_plans_with_vpp_exist_now():
    """Issue 16's acceptance: ``piper plan deepseek-v3 --cluster dgx-h100 --gpus 1024 --gbs 8192``
    includes layout plans with vpp > 1 (none existed: 61 layers split over no pp x vpp)."""
    result = search(DSV3, H100, 1024, 8192)
    layouts = [s.plan for s in result.scored if s.plan.pipeline_layout is not None]
    assert layouts and all(p.vpp and p.vpp > 1 for p in layouts)
    assert any(s.plan.pipeline_layout for s in result.best(10))
    for plan in {p.pipeline_layout: p for p in layouts}.values():
        want = balanced_layout(61, plan.pp, plan.vpp, 1, **layout_weights(DSV3))
        assert parse_layout(plan.pipeline_layout) == parse_layout(want)
        assert parse_layout(plan.pipeline_layout)[-1].endswith("mL")


@pytest.mark.parametrize("argv", [["--pipeline-model-parallel-layout", BRIDGE], [f"--pipeline-model-parallel-layout={BRIDGE}"]])
def test_piper_pins_a_layout_given_on_the_command_line(argv):
    """--piper keeps a layout given on the command line: the search's space takes it, with the pipeline
    sizes whose pp x vpp give its 32 stages (tests/megatron/test_piper_args.py plans with it)."""
    from piper_core.scheduler.space import default_space
    from piper_megatron.args import parse_piper_options
    from piper_megatron.pins import pins_from, restrict

    rest = ["--num-layers", "61", *argv]
    pins = pins_from(rest, parse_piper_options(["--piper", *rest]))
    space = restrict(default_space(DSV3, H100, 1024), pins)
    assert space.pipeline_layout == BRIDGE and set(space.pp) <= {1, 2, 4, 8, 16, 32}
    assert all(32 % p == 0 for p in space.pp) and set(space.vpp) == {32 // p for p in space.pp}
    with pytest.raises(SpecError, match=r"--pipeline-model-parallel-layout=.*places every layer itself, so "
                                        r"--decoder-last-pipeline-num-layers cannot be given beside it"):
        pins_from(rest + ["--decoder-last-pipeline-num-layers", "5"], parse_piper_options(["--piper", *rest]))
    with pytest.raises(SpecError, match=r"--pipeline-model-parallel-layout='Ett\|tL': has 2 stages, not a multiple "
                                        r"of pp \(4\)"):
        pins_from(["--pipeline-model-parallel-layout", "Ett|tL", "--pipeline-model-parallel-size", "4"],
                  parse_piper_options(["--piper"]))


def test_a_heavy_loss_falls_back_to_one_layer_rather_than_an_empty_stage():
    """Weighed by FLOPs, a loss several layers heavy would leave the last rank's first virtual stages
    empty; the layout then weighs it as one layer (Megatron's account-for-loss), keeping the plan."""
    heavy = balanced_layout(26, 4, 4, loss=6.0)
    assert heavy == balanced_layout(26, 4, 4)
    assert all(decoder_counts(parse_layout(heavy))[1:-1])
    assert balanced_layout(61, 8, 4, 1, loss=1.39, mtp=2.54) != balanced_layout(61, 8, 4, 1)
