"""Multi-token prediction (issue 16, item 4): DeepSeek-V3's MTP layer in the model spec, its layout
slot, parameters, memory, time and FLOPs.

Parameters are checked against Megatron-Core's own build in tests/megatron/test_param_counts.py
(tiny-moe-mtp, tiny-mtp-tied, DeepSeek-V3, with and without a layout holding ``m``), and model
FLOPs against Megatron-LM's ``num_floating_point_operations`` in tests/megatron/test_flops_formula.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.cli.parse import parse_parallel
from piper_core.errors import SpecError
from piper_core.export import model_flags
from piper_core.presets import load_cluster, load_model
from piper_core.resource import activations
from piper_core.resource.memory import stage_memory
from piper_core.resource.params import _layer_params, embedding_params, mtp_extra_params, stage_params, total_params
from piper_core.resource.predict import predict
from piper_core.specs.compat import mtp_layers, stage_blocks
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

DSV3 = load_model("deepseek-v3")
PLAIN = dataclasses.replace(DSV3, mtp_num_layers=0)
H100 = load_cluster("dgx-h100")
BRIDGE = "Et*2|(tt|)*22t|(tt|)*7mL"  # Megatron-Bridge's DeepSeek-V3 layout, pp 8 x vpp 4
BRIDGE_SIZES = "tp=2,sp=1,pp=8,vpp=4,ep=64,mbs=1,gbs=8192"


def test_the_preset_has_deepseeks_one_mtp_layer():
    """DeepSeek-V3 trains one MTP layer (D = 1) of the last decoder layer's kind, a MoE layer; its
    module with its own embedding and output head is the 14B the report adds to the 671B."""
    assert DSV3.mtp_num_layers == 1 and DSV3.mtp_is_moe
    extra = total_params(DSV3) - total_params(DSV3, mtp=False)
    assert extra == _layer_params(DSV3, 1, 1, 1, True).total + mtp_extra_params(DSV3, 1)
    own_copies = 2 * DSV3.padded_vocab(1) * DSV3.hidden_size  # the released module's embedding and head
    assert (extra + own_copies) / 1e9 == pytest.approx(14, abs=0.6)
    assert "--mtp-num-layers" in dict(model_flags(DSV3)) and dict(model_flags(DSV3))["--mtp-num-layers"] == 1
    with pytest.raises(SpecError, match="mtp_num_layers"):
        dataclasses.replace(DSV3, mtp_num_layers=-1)


def test_without_a_layout_the_mtp_layer_sits_on_the_last_stage():
    plan = ParallelPlan(gpus=1024, tp=1, pp=4, vpp=None, ep=64, global_batch_size=8192,
                        num_layers_in_first_pipeline_stage=13)
    assert mtp_layers(DSV3, plan) == (0, 0, 0, 1)
    blocks = stage_blocks(DSV3, plan)
    assert [sum(len(c) for c in r) for r in blocks] == [13, 16, 16, 17]
    assert blocks[-1][-1][-1] is True  # a MoE layer, last in the last chunk


def test_megatron_bridges_layout_and_sizes_are_predicted():
    """Issue 16's acceptance: ``piper predict`` takes Megatron-Bridge's DeepSeek-V3 layout string,
    ``m`` included, with its parallel sizes."""
    plan = parse_parallel(f"{BRIDGE_SIZES},layout={BRIDGE}", 1024)
    p = predict(DSV3, H100, plan)
    assert mtp_layers(DSV3, plan) == (0,) * 7 + (1,)
    assert [s.layers for s in p.stages] == [8, 8, 8, 8, 8, 8, 8, 6]
    # against the same layout without the m, on the model without MTP: the last rank alone changes
    q = predict(PLAIN, H100, dataclasses.replace(plan, pipeline_layout=BRIDGE.replace("mL", "L")))
    assert [a.params for a in p.stages[:-1]] == [b.params for b in q.stages[:-1]]
    grown = p.stages[-1].params.total - q.stages[-1].params.total
    assert grown == (_layer_params(DSV3, plan.tp, plan.ep, plan.etp_size, True).total
                     + mtp_extra_params(DSV3, plan.tp) + embedding_params(DSV3, plan.tp))
    assert p.stages[-1].activations > q.stages[-1].activations
    assert [a.total for a in p.time.stages[:-1]] == pytest.approx([b.total for b in q.time.stages[:-1]])
    assert p.time.stages[-1].compute > q.time.stages[-1].compute
    assert p.flops.model > q.flops.model


@pytest.mark.parametrize("layout, message", [
    (BRIDGE.replace("mL", "L"), r"places 0 MTP layers \(m\), but the model has 1"),
    (BRIDGE.replace("mL", "mmL"), r"places 2 MTP layers \(m\), but the model has 1"),
    ("Et*2|(tt|)*22m|(tt|)*7tL", r"transformer layer \(t\) after an MTP layer"),
    # stage 30 is pipeline rank 6's last virtual stage: Megatron's standalone MTP
    ("|".join(["Ett", *["tt"] * 22, "t", *["tt"] * 6, "ttm", "L"]),
     r"runs the MTP layers on pipeline rank 6, before the last \(7\).*standalone"),
    # stage 23 is pipeline rank 7's third virtual stage of four
    ("|".join(["E" + "t" * 17, *["tt"] * 22, "m", *[""] * 7, "L"]), r"the last virtual stage of its pipeline rank"),
])
def test_megatrons_mtp_layout_rules(layout, message):
    with pytest.raises(SpecError, match=message):
        predict(DSV3, H100, parse_parallel(f"{BRIDGE_SIZES},layout={layout}", 1024))


def test_a_model_without_mtp_refuses_an_m():
    with pytest.raises(SpecError, match=r"places 1 MTP layers \(m\), but the model has 0.*give the model mtp_num_layers"):
        predict(PLAIN, H100, parse_parallel(f"{BRIDGE_SIZES},layout={BRIDGE}", 1024))


def _tiny(**fields) -> ModelSpec:
    return dataclasses.replace(load_model("tiny-moe"), **fields)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_last_stage_keeps_the_mtp_layers_activations(recompute):
    """Per micro-batch the MTP layer keeps its transformer layer's activations (a MoE layer's) and
    its own projection, norms, embedding lookup and loss (activations.mtp_activation_bytes)."""
    model = _tiny(mtp_num_layers=1)
    cluster = H100
    plan = ParallelPlan(gpus=2, pp=2, global_batch_size=8, micro_batch_size=1, recompute=recompute,
                        recompute_num_layers=1 if recompute == "full" else None)
    with_mtp = stage_memory(model, plan, cluster)
    without = stage_memory(_tiny(), plan, cluster)
    assert with_mtp[0] == without[0]
    extra = with_mtp[-1].activations - without[-1].activations
    own = activations.mtp_activation_bytes(model, plan)
    if recompute == "full":  # the checkpointed layer keeps its input; the loss's terms are freed before it is rebuilt
        assert 0 < extra < own + activations.layer_activation_bytes(model, plan, moe=True)
    else:
        assert extra == own + activations.layer_activation_bytes(model, plan, moe=True)


def test_flops_and_time_grow_with_the_mtp_layers():
    base = predict(PLAIN, H100, parse_parallel("tp=1,pp=4,ep=64,mbs=1,gbs=8192,first_stage_layers=13", 1024))
    one = predict(DSV3, H100, base.plan)
    three = predict(dataclasses.replace(DSV3, mtp_num_layers=3), H100, base.plan)
    assert base.flops.model < one.flops.model < three.flops.model
    assert base.time.stages[-1].compute < one.time.stages[-1].compute < three.time.stages[-1].compute
    assert stage_params(DSV3, base.plan)[:-1] == stage_params(PLAIN, base.plan)[:-1]
