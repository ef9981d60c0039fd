"""The host-overhead probe's model family is disjoint from every validation model (issue 15, Deliver 2):
a calibration is fitted on models the validation never judges, so the validation's error is the error a
user meets on their own model."""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.calibrate.probe import BASES, PROBE_MODEL, PROBE_WIDE, PROBES, probe_model
from piper_core.validate.suite import load_suite

SUITES = ("full", "full-fp32", "quick")
# what makes a model family here: widths, sequence, vocabulary, normalization and MLP kind
WIDTHS = ("hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "seq_length", "vocab_size")


def _model(probe):
    layers, experts, *_, base = probe
    return probe_model(layers, experts, BASES[base])


def test_the_probe_trains_both_widths():
    assert {_model(p).hidden_size for p in PROBES} == {PROBE_MODEL.hidden_size, PROBE_WIDE.hidden_size}
    for dense in (True, False):  # dense and MoE runs each at both widths
        assert {p[-1] for p in PROBES if (p[1] is None) == dense} >= {"", "wide"}


def _validation_models():
    for name in SUITES:
        for case in load_suite(name).cases:
            yield name, case.name, case.model


@pytest.mark.parametrize("field", WIDTHS)
def test_no_validation_model_shares_a_probe_width(field):
    probe = {getattr(_model(p), field) for p in PROBES}
    shared = [(s, c, getattr(m, field)) for s, c, m in _validation_models() if getattr(m, field) in probe]
    assert not shared, f"{field} of the probe family {sorted(probe)} also in validation cases {shared[:5]}"


def test_no_validation_model_has_the_probe_structure():
    kind = (PROBE_MODEL.normalization, PROBE_MODEL.gated_linear_unit)
    same = [(s, c) for s, c, m in _validation_models() if (m.normalization, m.gated_linear_unit) == kind]
    assert not same, f"validation cases with the probe's {kind}: {same[:5]}"


def test_every_probe_model_differs_from_every_validation_model():
    probes = {dataclasses.replace(_model(p), name="x") for p in PROBES}
    for _, case, model in _validation_models():
        assert dataclasses.replace(model, name="x") not in probes, case


def test_a_refit_prices_each_recorded_run_on_the_model_it_trained():
    from piper_core.calibrate.probe import FAMILY_FIELDS, base_of

    assert base_of({"base": {k: getattr(PROBE_WIDE, k) for k in FAMILY_FIELDS}}).hidden_size == 192
    # records made before 2026-12-06 carry no base: they trained the val-moe widths
    legacy = base_of({})
    assert (legacy.hidden_size, legacy.seq_length, legacy.normalization) == (128, 128, "LayerNorm")
