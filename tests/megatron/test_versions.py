"""The megatron-core releases ``--piper`` supports (piper_megatron/versions.py): the range and its
error, what differs per release, and the recorded facts against real Megatron code.

Pure: version strings in and out of the range (the check takes a string; the installed package is
never altered), the vocabulary each release's NullTokenizer makes of ``--vocab-size``, the range
against pyproject's pin. Real: the installed megatron-core's release and the signatures of the
dispatcher APIs Piper relies on; the core_v0.16.1 checkout beside the repository
(tests/megatron/checkout_driver.py: its entry to validation, its own tokenizer's padded vocabulary,
its own parser's defaults). The 0.18-0.19 side runs against the real 0.19.2 tree in
tests/megatron/test_piper_args.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from piper_core.errors import SpecError
from piper_megatron import versions
from piper_megatron.args import model_spec_from_args, parse_megatron_args, vocab_notes
from piper_megatron.versions import RELEASES, REQUIREMENT, SUPPORTED, check_relied_on, release

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1"]
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


@pytest.mark.parametrize(("version", "series", "entry"), [
    ("0.16.1", "0.16", "pretrain"), ("0.16.0rc0.dev100085", "0.16", "pretrain"),
    ("0.17.0rc0", "0.17", "pretrain"), ("0.17.1", "0.17", "pretrain"),
    ("0.18.0", "0.18", "parse_and_validate_args"), ("0.18.2", "0.18", "parse_and_validate_args"),
    ("0.19.2", "0.19", "parse_and_validate_args")])
def test_each_supported_version_is_its_release(version, series, entry):
    found = release(version)
    assert (found.series, found.entry) == (series, entry)


@pytest.mark.parametrize("version", ["0.15.2", "0.15.3", "0.20.0", "0.20.0rc0", "1.0.0", "not-a-version"])
def test_versions_outside_the_range_get_the_range_and_the_fix(version):
    with pytest.raises(SpecError) as caught:
        release(version)
    assert str(caught.value) == (
        f"megatron-core={version!r}: is not supported by --piper: supported 0.16.x-0.19.x, whose argument validation "
        "and MoE dispatcher APIs Piper hooks (piper_megatron/versions.py); install megatron-core>=0.16,<0.20, or run "
        "without --piper")


def test_the_range_is_the_pin_of_pyproject():
    """The releases are consecutive, SUPPORTED names their ends, and REQUIREMENT (what the error tells
    users to install) is pyproject's pin for both Megatron extras and admits exactly these releases."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {dep for name in ("megatron", "megatron-lm") for dep in extras[name] if dep.startswith("megatron-core")}
    assert pins == {REQUIREMENT}
    minors = [r.minor for r in RELEASES]
    assert minors == list(range(minors[0], minors[-1] + 1)) and SUPPORTED == f"0.{minors[0]}.x-0.{minors[-1]}.x"
    spec = SpecifierSet(REQUIREMENT.removeprefix("megatron-core"))
    assert all(f"0.{m}.0" in spec and f"0.{m}.9" in spec for m in minors)
    assert f"0.{minors[0] - 1}.9" not in spec and f"0.{minors[-1] + 1}.0" not in spec


@pytest.mark.parametrize(("version", "vocab"), [("0.16.1", 129), ("0.17.1", 129), ("0.18.2", 128), ("0.19.2", 128),
                                                (None, 128)])
def test_the_null_tokenizers_vocabulary_is_read_per_release(version, vocab):
    """core_v0.16.1 / core_v0.17.1: NullTokenizer.vocab_size = --vocab-size + 1 (an end-of-document
    token); core_v0.18.0 on: --vocab-size itself. Unknown release (None): the newest's reading."""
    found = None if version is None else release(version)
    ns = parse_megatron_args(MODEL + NULL)
    assert model_spec_from_args(ns, release=found).vocab_size == vocab
    notes = vocab_notes(ns, {}, found)
    assert notes == ([] if vocab == 128 else [f"megatron-core {found.series}'s NullTokenizer appends an "
                                              "end-of-document token: vocabulary 129 (--vocab-size 128 + 1), padded "
                                              "as Megatron pads it"])


def test_other_tokenizers_are_read_alike_in_every_release():
    ns = parse_megatron_args(MODEL + ["--tokenizer-type", "GPT2BPETokenizer"])
    assert {model_spec_from_args(ns, release=r).vocab_size for r in RELEASES} == {50257}
    assert all(vocab_notes(ns, {}, r) == [] for r in RELEASES)


# ---- against real Megatron code -----------------------------------------------------------------------

def test_the_installed_megatron_core_is_supported_and_has_the_apis_piper_relies_on():
    info = pytest.importorskip("megatron.core.package_info", reason="needs megatron-core installed")
    assert versions.installed_release() == release(info.__version__)
    assert versions.distribution_release() == release(info.__version__)
    assert versions.drift() == []


def test_an_api_that_drifted_is_named_before_the_dispatcher_binds_to_it(monkeypatch):
    """The check can fail: a recorded signature the installed megatron-core does not have is named."""
    pytest.importorskip("megatron.core", reason="needs megatron-core installed")
    name = "megatron.core.transformer.moe.moe_layer:MoELayer.routed_experts_compute"
    monkeypatch.setitem(versions.RELIED_ON, name, ("self", "hidden_states", "probs", "padding_mask"))
    with pytest.raises(SpecError, match=r"megatron-core='0\.16': differs from the APIs --piper relies on in "
                                        rf"0\.16\.x-0\.19\.x: {name} takes \('self', 'hidden_states', 'probs'\), "
                                        r"--piper relies on \('self', 'hidden_states', 'probs', 'padding_mask'\)"):
        check_relied_on(release("0.16.1"))


@pytest.fixture(scope="module")
def checkout_016(tmp_path_factory) -> dict:
    from piper_megatron.cpu_run import default_checkout, find_script

    checkout = Path(os.environ.get("PIPER_MEGATRON_LM") or default_checkout(REPO))
    if find_script(checkout) is None:
        why = f"no Megatron-LM checkout at {checkout} (set PIPER_MEGATRON_LM to a core_v0.16.1 checkout)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"the checkout must be there in CI: {why}")
        pytest.skip(why)
    out = tmp_path_factory.mktemp("checkout") / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env |= {"PYTHONPATH": os.pathsep.join([str(checkout), str(REPO)]), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "tests.megatron.checkout_driver", str(out), *MODEL, *NULL],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.megatron
def test_the_0_16_checkout_reaches_validation_as_recorded(checkout_016):
    """core_v0.16.1's megatron.training: no parse_and_validate_args, and initialize.py holds the
    validate_args it imported by name: the "pretrain" entry, whose binding --piper hooks too."""
    assert (checkout_016["series"], checkout_016["entry"]) == ("0.16", "pretrain")
    assert not checkout_016["parse_and_validate_args"] and checkout_016["initialize_binds_validate_args"]


@pytest.mark.megatron
def test_the_0_16_checkout_pads_the_vocabulary_piper_plans(checkout_016):
    """Its own NullTokenizer and padding make 256 of --vocab-size 128 (129 tokens); Piper planning
    for 0.16 pads the same, and the newest release's reading would not (128)."""
    ns = parse_megatron_args(MODEL + NULL)
    assert model_spec_from_args(ns, release=release("0.16.1")).padded_vocab(1) == checkout_016["padded_vocab_size"]
    assert model_spec_from_args(ns).padded_vocab(1) != checkout_016["padded_vocab_size"]


@pytest.mark.megatron
def test_plan_only_parser_has_the_0_16_parsers_defaults(checkout_016):
    """The flags Piper reads, with their defaults, in core_v0.16.1's own parser (0.19.2's:
    test_piper_args.py)."""
    real = checkout_016["parser_defaults"]
    mine = vars(parse_megatron_args([]))
    assert {k: real[k] for k in mine} == {k: (v if not isinstance(v, list) else str(v)) for k, v in mine.items()}
