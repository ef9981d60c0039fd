"""Issue 17, routing as an input: reading histograms and --piper-trace files (and their errors),
pricing a distribution under a placement, and the ``--routing`` command lines."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from piper_core.cli.main import main
from piper_core.cli.parse import parse_parallel
from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.resource.predict import predict, to_json
from piper_core.resource.routing import (default_placement, dropped_fraction, layer_loads, load_factor,
                                         load_placement, predict_routed)
from piper_core.specs.routing import Routing, load_routing, moe_layer_numbers
from piper_core.timing.layer import layer_cost, shape_of
from piper_core.timing.step import with_load

TINY = load_model("tiny-moe")  # 4 layers, 8 experts, top-2, seq 64
QWEN = load_model("qwen3-30b-a3b")  # 48 layers, 128 experts, top-8
H100 = load_cluster("dgx-h100")
# layer 1 dense, then MoE every layer: layer_numbers 2, 3, 4 are the MoE layers
FIRST_DENSE = dataclasses.replace(TINY, name="tiny-first-dense", moe_first_k_dense=1)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def histogram(tmp_path, layers, *, experts=8, default=None, name="r.yaml"):
    data = {"num_experts": experts, "layers": {str(k): v for k, v in layers.items()}}
    if default is not None:
        data["default"] = default
    return write(tmp_path, name, json.dumps(data) if name.endswith(".json") else _yaml(data))


def _yaml(data):
    import yaml
    return yaml.safe_dump(data)


# ---- reading -----------------------------------------------------------------------------------------

def test_histogram_yaml_and_json_read_the_same(tmp_path):
    counts = [4, 1, 1, 1, 1, 1, 1, 2]
    layers = {n: counts for n in moe_layer_numbers(TINY)}
    a = load_routing(histogram(tmp_path, layers), TINY)
    b = load_routing(histogram(tmp_path, layers, name="r.json"), TINY)
    assert a.layers == b.layers
    assert [n for n, _ in a.layers] == [1, 2, 3, 4]
    assert a.counts(3) == tuple(float(c) for c in counts)
    assert a.max_over_mean(3) == pytest.approx(4 / (12 / 8))


def test_default_fills_the_layers_not_listed(tmp_path):
    r = load_routing(histogram(tmp_path, {3: [2] * 8}, default=[1, 0, 0, 0, 0, 0, 0, 1]), TINY)
    assert r.counts(3) == (2.0,) * 8
    assert r.counts(1) == r.counts(2) == r.counts(4) == (1.0, 0, 0, 0, 0, 0, 0, 1.0)


def test_trace_lines_are_summed_over_ranks_and_calls(tmp_path):
    """Two ranks of ep=2 (experts 0-3 and 4-7), two calls each, in two files, as --piper-trace writes."""
    def line(rank, layer, call, first, counts):
        return json.dumps({"rank": rank, "layer": layer, "call": call, "dispatch_ms": 0.1, "expert_ms": 0.2,
                           "combine_ms": 0.1, "first_expert": first, "tokens_per_expert": counts})
    rank0 = [line(0, n, c, 0, [10 * n, 1, 2, 3]) for n in (1, 2, 3, 4) for c in (0, 1)]
    rank1 = [line(1, n, c, 4, [4, 5, 6, c]) for n in (1, 2, 3, 4) for c in (0, 1)]
    a = write(tmp_path, "trace.rank0.jsonl", "\n".join(rank0) + "\n")
    b = write(tmp_path, "trace.rank1.jsonl", "\n".join(rank1) + "\n")
    r = load_routing([a, b], TINY)
    assert r.counts(3) == (60.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 1.0)
    assert r.counts(1)[0] == 20.0


def test_trace_with_a_rank_missing_is_refused(tmp_path):
    lines = [json.dumps({"layer": n, "first_expert": 0, "tokens_per_expert": [1, 1, 1, 1]}) for n in (1, 2, 3, 4)]
    path = write(tmp_path, "trace.rank0.jsonl", "\n".join(lines))
    with pytest.raises(SpecError, match=r"every expert must be covered equally often"):
        load_routing(path, TINY)


@pytest.mark.parametrize("layers, default, match", [
    ({1: [1] * 8, 2: [1] * 8, 3: [1] * 8, 9: [1] * 8}, None, r"layers\.9=.*is not a MoE layer of tiny-moe"),
    ({2: [1] * 7}, [1] * 8, r"layers\.2='7 counts': must give one count per expert \(8\)"),
    ({2: [1, 1, 1, -3, 1, 1, 1, 1]}, [1] * 8, r"layers\.2\[3\]=-3: is a token count and must be >= 0"),
    ({2: [0] * 8}, [1] * 8, r"counts all 0 tokens"),
    ({2: [1] * 8}, None, r"lacks MoE layers 1, 3, 4 of tiny-moe"),
    ({"first": [1] * 8}, [1] * 8, r"layers\.first=.*is not a layer number \(Megatron's 1-based layer_number\)"),
])
def test_bad_histograms_say_what_and_how_to_fix(tmp_path, layers, default, match):
    with pytest.raises(SpecError, match=match):
        load_routing(histogram(tmp_path, layers, default=default), TINY)


def test_a_dense_layer_is_an_unknown_layer(tmp_path):
    with pytest.raises(SpecError, match=r"layers\.1=.*is not a MoE layer of tiny-first-dense .*MoE layers: 2, 3, 4"):
        load_routing(histogram(tmp_path, {1: [1] * 8}, default=[1] * 8), FIRST_DENSE)


def test_wrong_expert_count_and_unknown_key_and_empty_file(tmp_path):
    with pytest.raises(SpecError, match=r"num_experts=16: must equal the model's num_experts \(8"):
        load_routing(histogram(tmp_path, {}, experts=16, default=[1] * 16), TINY)
    with pytest.raises(SpecError, match=r"defaults=.*did you mean 'default'"):
        load_routing(write(tmp_path, "k.yaml", "num_experts: 8\ndefaults: [1, 1, 1, 1, 1, 1, 1, 1]\n"), TINY)
    with pytest.raises(SpecError, match=r"the file is empty"):
        load_routing(write(tmp_path, "e.yaml", "\n  \n"), TINY)
    lines = json.dumps({"layer": 2, "first_expert": 6, "tokens_per_expert": [1, 1, 1, 1]})
    with pytest.raises(SpecError, match=r"first_expert=6: with 4 local experts must stay within the model's 8"):
        load_routing(write(tmp_path, "t.jsonl", lines), TINY)


# ---- pricing -----------------------------------------------------------------------------------------

PLANS = ["ep=8,mbs=1,gbs=512", "pp=4,ep=8,mbs=1,gbs=512", "pp=4,vpp=3,ep=16,mbs=1,gbs=512,a2a=hierarchical",
         "tp=2,sp=1,ep=4,mbs=2,gbs=512,recompute=full,recompute_layers=1", "ep=16,etp=2,mbs=1,gbs=256,chunks=4"]


@pytest.mark.parametrize("parallel", PLANS)
def test_even_histogram_prices_exactly_as_today(parallel):
    plan = parse_parallel(parallel, 64)
    for model in (QWEN, dataclasses.replace(QWEN, moe_capacity_factor=1.25)):
        today = predict(model, H100, plan)
        routed = predict_routed(model, H100, plan, Routing.even(model))
        assert routed.prediction == today
        assert to_json(routed.prediction) == to_json(today)
        assert all(x.rank_max_over_mean == 1.0 for x in routed.loads)


def _skewed(model, hot_layer, factor):
    """Every layer even but ``hot_layer``, whose experts 0-3 take ``factor`` times the others' tokens."""
    hot = (float(factor),) * 4 + (1.0,) * (model.num_experts - 4)
    even = (1.0,) * model.num_experts
    return Routing(num_experts=model.num_experts,
                   layers=tuple((n, hot if n == hot_layer else even) for n in moe_layer_numbers(model)))


def test_a_skewed_layer_costs_its_busiest_rank():
    """Experts 0-3 at 3x on ep=8 (16 experts a rank): rank 0 gets 4*3 + 12 = 24 tokens, 24/17 of the
    mean: 24 / (136/8); the stage pays exactly that layer's extra cost, and its exchange grows by the same factor."""
    plan = parse_parallel("ep=8,mbs=1,gbs=512", 64)
    routing = _skewed(QWEN, 5, 3)
    routed = predict_routed(QWEN, H100, plan, routing)
    today = predict(QWEN, H100, plan)
    f = 24 / 17
    load = {x.layer: x for x in routed.loads}
    assert load[5].rank_max_over_mean == pytest.approx(f, rel=1e-12) and load[5].busiest_rank == 0
    assert load[6].rank_max_over_mean == 1.0
    even = {x.layer: x for x in predict_routed(QWEN, H100, plan, Routing.even(QWEN)).loads}
    assert load[5].busiest_rank_tokens == pytest.approx(f * even[5].busiest_rank_tokens)
    (level, nbytes), = load[5].exchange_bytes
    assert level == "nvlink" and nbytes == pytest.approx(f * even[5].exchange_bytes[0][1])
    shape = shape_of(plan)
    hot, cold = layer_cost(with_load(QWEN, f), shape, H100, True), layer_cost(QWEN, shape, H100, True)
    assert hot.compute_fwd > cold.compute_fwd and hot.a2a_raw > cold.a2a_raw
    got, was = routed.prediction.time.stages[0], today.time.stages[0]
    assert got.compute - was.compute == pytest.approx((hot.compute_fwd + hot.compute_bwd)
                                                      - (cold.compute_fwd + cold.compute_bwd), rel=1e-9)
    assert got.a2a - was.a2a == pytest.approx((hot.a2a_fwd + hot.a2a_bwd) - (cold.a2a_fwd + cold.a2a_bwd), rel=1e-9)
    assert routed.prediction.time.step > today.time.step
    assert routed.prediction.stages[0].activations > today.stages[0].activations


def test_the_dropless_receive_buffer_is_the_busiest_ranks():
    """pp=2: layer 5 (stage 0) skewed; stage 0's all-to-all receive buffer grows by f, stage 1's does not."""
    plan = parse_parallel("pp=2,ep=8,mbs=1,gbs=512", 64)
    routed = predict_routed(QWEN, H100, plan, _skewed(QWEN, 5, 3)).prediction
    today = predict(QWEN, H100, plan)
    tokens = 4096 * 8  # s b top-k
    assert today.stages[0].buffers == tokens * QWEN.hidden_size * 2
    assert routed.stages[0].buffers == math.ceil(tokens * 24 / 17) * QWEN.hidden_size * 2
    assert routed.stages[1] == today.stages[1]


def test_skew_raises_the_exchange_over_both_link_levels():
    """ep=16 spans two 8-GPU nodes: the busiest rank receives f x the even bytes over NVLink and InfiniBand."""
    plan = parse_parallel("ep=16,mbs=1,gbs=512", 64)
    routed = predict_routed(QWEN, H100, plan, _skewed(QWEN, 2, 4))
    even = predict_routed(QWEN, H100, plan, Routing.even(QWEN))
    a, b = routed.loads[1], even.loads[1]
    assert a.layer == 2 and dict(a.exchange_bytes).keys() == {"nvlink", "infiniband"}
    f = (4 * 4 + 4) / (140 / 16)  # 8 experts a rank: rank 0 holds the 4 hot ones
    assert a.rank_max_over_mean == pytest.approx(f)
    for (name, x), (_, y) in zip(a.exchange_bytes, b.exchange_bytes):
        assert x == pytest.approx(f * y), name
    assert routed.prediction.time.exposed_a2a > even.prediction.time.exposed_a2a


def test_dropped_fraction_by_hand():
    # 4 experts, 100 token copies, cf 1: capacity 25; expert 0 gets 40 and drops 15
    assert dropped_fraction((40, 20, 20, 20), 100, 100, 1.0) == pytest.approx(0.15)
    assert dropped_fraction((40, 20, 20, 20), 100, 100, 2.0) == 0.0
    assert dropped_fraction((40, 20, 20, 20), 100, 100, None) == 0.0
    # tiny-moe, cf 1: T = 64 tokens, top-2 -> 128 copies, capacity ceil(128/8) = 16; expert 0 gets 4/11 of them
    model = dataclasses.replace(TINY, moe_capacity_factor=1.0)
    routing = Routing(num_experts=8, layers=tuple((n, (4.0,) + (1.0,) * 7) for n in (1, 2, 3, 4)))
    plan = parse_parallel("ep=2,mbs=1,gbs=8", 2)
    loads = layer_loads(model, plan, load_cluster("cpu-local"), routing, {n: default_placement(8, 2) for n in (1, 2, 3, 4)})
    assert loads[0].dropped_fraction == pytest.approx((128 * 4 / 11 - 16) / 128)
    # padded to capacity: the busiest rank's buffer is E x cap whatever the routing
    assert loads[0].busiest_rank_tokens == 8 * 16


def test_load_factor_is_exactly_one_for_an_even_split():
    counts = (0.1,) * 6
    assert load_factor(counts, default_placement(6, 3)) == 1.0
    assert load_factor((3, 1, 1, 1), default_placement(4, 2)) == 4 / 3


def test_placement_file_round_trip_and_errors(tmp_path):
    good = write(tmp_path, "p.json", json.dumps({"num_experts": 8, "ep": 2, "layers": {"2": [[0, 7, 1, 6], [2, 3, 4, 5]]}}))
    assert load_placement(str(good), TINY, 2) == {2: ((0, 7, 1, 6), (2, 3, 4, 5))}
    slots = write(tmp_path, "s.json", json.dumps({"num_experts": 8, "ep": 2, "layers": {"2": [[0, 7, 1], [2, 3, 4, 5, 6]]}}))
    with pytest.raises(SpecError, match=r"s.json layer 2: ranks=.*slots per rank are \[3, 5\]; every rank holds "
                                         r"num_experts / ep = 4"):
        load_placement(str(slots), TINY, 2)
    twice = write(tmp_path, "t.json", json.dumps({"num_experts": 8, "ep": 2, "layers": {"2": [[0, 0, 1, 6], [2, 3, 4, 5]]}}))
    with pytest.raises(SpecError, match=r"t.json layer 2: ranks\[0\]=\[0, 0, 1, 6\]: holds expert 0, which rank 0 "
                                         r"holds too"):
        load_placement(str(twice), TINY, 2)
    with pytest.raises(SpecError, match=r"ep=2: must equal the plan's expert parallelism \(4\)"):
        load_placement(str(good), TINY, 4)
    # one placement for every layer (piper placement --shared --out), YAML by its suffix: each MoE layer gets it
    shared = write(tmp_path, "shared.yaml", "num_experts: 8\nep: 2\nranks: [[0, 7, 1, 6], [2, 3, 4, 5]]\n")
    assert load_placement(str(shared), TINY, 2) == {n: ((0, 7, 1, 6), (2, 3, 4, 5)) for n in moe_layer_numbers(TINY)}
    stray = write(tmp_path, "x.json", json.dumps({"num_experts": 8, "ep": 2, "layers": {"99": [[0, 7, 1, 6], [2, 3, 4, 5]]}}))
    with pytest.raises(SpecError, match=r"layers.99=99: is not a MoE layer of"):
        load_placement(str(stray), TINY, 2)


# ---- command line ------------------------------------------------------------------------------------

ARGS = ["predict", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "64", "--parallel", "ep=8,mbs=1,gbs=512"]


def test_predict_routing_text_and_json(tmp_path, capsys):
    hot = [4] * 4 + [1] * 124
    path = histogram(tmp_path, {}, experts=128, default=hot)
    assert main(ARGS + ["--routing", str(path)]) == 0
    text = capsys.readouterr().out
    assert "placement default over ep=8; busiest rank up to 1.6x the mean" in text  # (16 + 12) / (140 / 8)
    assert main(ARGS + ["--routing", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["routing"]["layers"]) == 48
    assert out["routing"]["layers"][0]["rank_max_over_mean"] == pytest.approx(1.6)
    assert main(ARGS + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time_s"]["step"] < out["time_s"]["step"]


def test_bad_routing_file_exits_2_with_the_rule(tmp_path, capsys):
    path = histogram(tmp_path, {49: [1] * 128}, experts=128, default=[1] * 128)
    assert main(ARGS + ["--routing", str(path)]) == 2
    assert "layers.49=" in capsys.readouterr().err


def test_placement_cli_writes_what_predict_reads(tmp_path, capsys):
    path = histogram(tmp_path, {}, experts=128, default=[4] * 4 + [1] * 124)
    out = tmp_path / "placement.json"
    assert main(["placement", "qwen3-30b-a3b", "--routing", str(path), "--cluster", "dgx-h100", "--gpus", "64",
                 "--parallel", "ep=8,mbs=1,gbs=512", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["predicted"]["optimized"]["time_s"]["step"] < result["predicted"]["default"]["time_s"]["step"]
    assert main(ARGS + ["--routing", str(path), "--placement", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["time_s"]["step"] == result["predicted"]["optimized"]["time_s"]["step"]
    assert again["routing"]["placement"] == "custom"
    # 4 hot experts on 4 of the 8 ranks: (4 + 15) / 17.5
    assert again["routing"]["max_rank_over_mean"] == pytest.approx(19 / 17.5)
    assert math.isclose(result["layers"][0]["gap"], 0.0, abs_tol=1e-12)


def _plan_json(capsys, argv):
    code = main(argv + ["--json", "--workers", "1"])
    out = json.loads(capsys.readouterr().out)
    return code, out


def test_plan_with_even_routing_picks_what_plan_picks(tmp_path, capsys):
    base = ["plan", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "16", "--top", "3"]
    even = histogram(tmp_path, {}, experts=128, default=[7] * 128)
    _, plain = _plan_json(capsys, base)
    _, routed = _plan_json(capsys, base + ["--routing", str(even)])
    assert [p["plan"] for p in routed["plans"]] == [p["plan"] for p in plain["plans"]]
    assert [p["time_s"]["step"] for p in routed["plans"]] == [p["time_s"]["step"] for p in plain["plans"]]
    assert routed["candidates"] == plain["candidates"] and routed["feasible"] == plain["feasible"]
    assert all(x["rank_max_over_mean"] == 1.0 for x in routed["plans"][0]["routing"]["layers"])


def test_plan_with_skewed_routing_prices_each_plan_per_layer(tmp_path, capsys):
    """The plans `plan --routing` prints are priced as `predict --routing` prices them; placing the
    experts for each ep (--optimize-placement) never makes the best plan slower."""
    from piper_core.specs.parallel import ParallelPlan
    from piper_core.specs.yamlio import from_dict

    skewed = histogram(tmp_path, {}, experts=128, default=[4] * 4 + [1] * 124)
    base = ["plan", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "16", "--top", "2", "--routing", str(skewed)]
    _, default = _plan_json(capsys, base)
    _, optimized = _plan_json(capsys, base + ["--optimize-placement"])
    fields = {f.name for f in dataclasses.fields(ParallelPlan) if f.init}
    routing = load_routing(skewed, QWEN)
    for entry in default["plans"]:
        plan = from_dict(ParallelPlan, {k: v for k, v in entry["plan"].items() if k in fields})
        again = predict_routed(QWEN, H100, plan, routing)
        assert entry["time_s"]["step"] == again.prediction.time.step
        assert entry["routing"]["placement"] == "default"
        assert entry["routing"]["max_rank_over_mean"] == load_factor(routing.counts(1), default_placement(128, plan.ep))
    assert optimized["plans"][0]["time_s"]["step"] <= default["plans"][0]["time_s"]["step"]
    assert optimized["plans"][0]["routing"]["max_rank_over_mean"] < default["plans"][0]["routing"]["max_rank_over_mean"]


def test_the_documented_placement_is_the_optimizers():
    """docs/routing/qwen3-30b-ep16-placement.json is what `piper placement --out` writes for the
    documented distribution (so docs/routing.md prices what the command makes)."""
    from pathlib import Path

    from piper_core.scheduler.placement import optimize

    root = Path(__file__).resolve().parents[2] / "docs" / "routing"
    routing = load_routing(root / "qwen3-30b-skewed.yaml", QWEN)
    assert load_placement(str(root / "qwen3-30b-ep16-placement.json"), QWEN, 16) == {
        p.layer: p.placement for p in optimize(routing, 16)}


def test_the_skew_parameter_on_the_command_line(capsys):
    """--expert-load-skew S prices as a model spec with moe_expert_load_skew: S; not with --routing."""
    assert main(ARGS + ["--expert-load-skew", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    plan = parse_parallel("ep=8,mbs=1,gbs=512", 64)
    want = to_json(predict(dataclasses.replace(QWEN, moe_expert_load_skew=2.0), H100, plan))
    assert got == json.loads(json.dumps(want))
    assert main(ARGS + ["--expert-load-skew", "0.9"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_routing_flags_that_do_not_apply_are_refused(tmp_path, capsys):
    path = histogram(tmp_path, {}, experts=128, default=[1] * 128)
    assert main(ARGS + ["--placement", str(path)]) == 2
    assert "--placement=" in capsys.readouterr().err
    plan = ["plan", "qwen3-30b-a3b", "--cluster", "dgx-h100", "--gpus", "16"]
    assert main(plan + ["--routing", str(path), "--export-megatron", str(tmp_path / "a.sh")]) == 2
    assert "is not yet available with --routing" in capsys.readouterr().err
    assert main(plan + ["--optimize-placement"]) == 2
    assert "add --routing FILE" in capsys.readouterr().err
    assert main(["predict", "tiny-moe", "--cluster", "cpu-local", "--gpus", "2", "--parallel", "ep=2,mbs=1,gbs=8",
                 "--routing", str(path)]) == 2
    assert "num_experts=128: must equal the model's num_experts (8" in capsys.readouterr().err


def test_shared_cores_price_the_busiest_ranks_excess_on_the_freed_cores():
    """Processor sharing, by hand: loads 84, 17, 14, 16 on 2 cores. All four run at half a core until
    14 is done (t 28), three at 2/3 until 16 (t 31), two at a core each until 17 (t 32), then 84 alone
    (t 99). The mean load, 32.75 on each, takes 65.5: the layer is priced at 99 / 65.5 = 1.51 times
    its even cost, not at the busiest rank's 2.56 (what a core per rank gives)."""
    from piper_core.resource.routing import shared_load, shared_makespan

    loads = (84.0, 17.0, 14.0, 16.0)
    assert shared_makespan(loads, 2.0) == pytest.approx(99.0)
    assert shared_makespan((32.75,) * 4, 2.0) == pytest.approx(65.5)
    assert shared_load(loads, 0.5) == pytest.approx(99.0 / 65.5)
    assert shared_load(loads, 1.0) == pytest.approx(84.0 / 32.75)  # a core per rank: the busiest over the mean
    assert shared_load((10.0, 10.0, 10.0, 10.0), 0.5) == pytest.approx(1.0)
    assert shared_load((40.0, 0.0, 0.0, 0.0), 0.25) == pytest.approx(1.0)  # one core: the work is the work
