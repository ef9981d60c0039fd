"""Strict YAML: round trips, unknown keys name file/key/nearest key, types are checked."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.errors import SpecError
from piper_core.presets import cluster_names, load_cluster, load_model, model_names
from piper_core.specs import ClusterSpec, ModelSpec, ParallelPlan
from piper_core.specs.yamlio import dump_yaml, load_yaml


@pytest.mark.parametrize("name", model_names())
def test_model_presets_round_trip(tmp_path, name):
    spec = load_model(name)
    path = tmp_path / "m.yaml"
    text = dump_yaml(spec, path)
    again = load_yaml(ModelSpec, path)
    assert again == spec
    assert dump_yaml(again) == text  # a file the tool wrote loads back unchanged


@pytest.mark.parametrize("name", cluster_names())
def test_cluster_presets_round_trip(tmp_path, name):
    spec = load_cluster(name)
    path = tmp_path / "c.yaml"
    text = dump_yaml(spec, path)
    assert load_yaml(ClusterSpec, path) == spec
    assert dump_yaml(load_yaml(ClusterSpec, path)) == text


def test_plan_round_trip(tmp_path):
    plan = ParallelPlan(gpus=64, tp=2, pp=4, vpp=2, ep=8, etp=1, sequence_parallel=True, global_batch_size=256,
                        recompute="full", recompute_num_layers=2, a2a="hierarchical", a2a_chunks=4,
                        shared_expert_overlap=True)
    path = tmp_path / "p.yaml"
    dump_yaml(plan, path)
    assert load_yaml(ParallelPlan, path) == plan


def test_plan_file_with_the_old_pipelined_exchange_is_read_with_a_note(tmp_path):
    new = ParallelPlan(gpus=8, ep=8, global_batch_size=8, a2a="flat", a2a_chunks=4)
    path = tmp_path / "old.yaml"
    path.write_text(dump_yaml(new).replace("a2a: flat", "a2a: pipelined"))
    with pytest.warns(FutureWarning, match=rf"{path}: a2a 'pipelined' is read as a2a 'flat' with 4 chunks"):
        assert load_yaml(ParallelPlan, path) == new
    with pytest.raises(SpecError, match="a2a='pipelined': is no longer an exchange algorithm.*write a2a=flat, "
                                        "a2a_chunks=4"):
        ParallelPlan(gpus=8, ep=8, global_batch_size=8, a2a="pipelined", a2a_chunks=4)


def test_misspelled_key_names_file_key_and_nearest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(dump_yaml(load_model("tiny-moe")).replace("num_experts:", "num_expert:"))
    with pytest.raises(SpecError) as err:
        load_yaml(ModelSpec, path)
    msg = str(err.value)
    assert str(path) in msg and "num_expert=" in msg and "did you mean 'num_experts'" in msg


def test_nested_misspelled_key(tmp_path):
    path = tmp_path / "bad-cluster.yaml"
    path.write_text(dump_yaml(load_cluster("dgx-h100")).replace("hbm_gib:", "hbm_gb:"))
    with pytest.raises(SpecError, match=r"bad-cluster.yaml: accelerator.hbm_gb=.*did you mean 'accelerator.hbm_gib'"):
        load_yaml(ClusterSpec, path)


def test_missing_required_key(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: x\nnum_layers: 2\n")
    with pytest.raises(SpecError, match=r"m.yaml: hidden_size=None: is required by ModelSpec"):
        load_yaml(ModelSpec, path)


@pytest.mark.parametrize("line, message", [
    ("num_layers: two", r"num_layers='two': must be an integer"),
    ("num_layers: true", r"num_layers=True: must be an integer"),
    ("gated_linear_unit: 1", r"gated_linear_unit=1: must be true or false"),
    ("normalization: batchnorm", r"normalization='batchnorm': must be one of"),
])
def test_wrong_types_are_errors(tmp_path, line, message):
    key = line.split(":")[0]
    text = "\n".join(ln for ln in dump_yaml(load_model("tiny-moe")).splitlines() if not ln.startswith(key + ":"))
    path = tmp_path / "m.yaml"
    path.write_text(text + "\n" + line + "\n")
    with pytest.raises(SpecError, match=message):
        load_yaml(ModelSpec, path)


def test_validation_rule_in_file_names_the_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(dump_yaml(dataclasses.replace(load_model("tiny-moe"))).replace("moe_router_topk: 2", "moe_router_topk: 9"))
    with pytest.raises(SpecError, match=r"m.yaml: moe_router_topk=9: must be <= num_experts \(8\)"):
        load_yaml(ModelSpec, path)


def test_unknown_preset_suggests_nearest():
    with pytest.raises(SpecError, match=r"model='mixtral-8x7': is neither a model preset nor a YAML file; did you mean 'mixtral-8x7b'"):
        load_model("mixtral-8x7")
    with pytest.raises(SpecError, match=r"path=.*nope.yaml.*file does not exist"):
        load_cluster("nope.yaml")


def test_yaml_syntax_error_names_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match=r"broken.yaml.*is not valid YAML"):
        load_yaml(ModelSpec, path)
