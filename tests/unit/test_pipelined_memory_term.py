"""The expert output Piper's pipelined exchange keeps until backward (activations.PIPELINED_EXPERT_OUTPUT):
priced for Megatron-Core in chunks > 1 only, counted in the peak, left out of the "parameters + saved
activations" figure that saved-tensor hooks measure (the measured side: tests/megatron/test_peak_memory.py)."""

from __future__ import annotations

import dataclasses

from piper_core.presets import load_cluster
from piper_core.resource.activations import HOST_KERNELS, PIPELINED_EXPERT_OUTPUT, layer_activation_terms, routed_rows
from piper_core.resource.predict import predict
from piper_core.validate.cases import select, suite_for

SUITE = suite_for("full-fp32")


def test_the_term_is_the_expert_output_of_megatron_s_chunked_exchange_only():
    (case,) = select(["2r-ep2-pipelined2"], suite=SUITE)
    plan = case.plan
    terms = layer_activation_terms(case.model, plan, moe=True, kernels=HOST_KERNELS)
    assert terms[PIPELINED_EXPERT_OUTPUT] == routed_rows(case.model, plan) * case.model.hidden_size * 4  # fp32
    one = dataclasses.replace(plan, a2a_chunks=1)
    assert PIPELINED_EXPERT_OUTPUT not in layer_activation_terms(case.model, one, moe=True, kernels=HOST_KERNELS)
    (ds,) = select(["ds-2r-ep2-pipelined2"], suite=SUITE)  # DeepSpeed: not priced yet (see the term's doc)
    assert PIPELINED_EXPERT_OUTPUT not in layer_activation_terms(ds.model, ds.plan, moe=True, kernels=HOST_KERNELS)


def test_peak_counts_it_and_the_saved_activation_figure_does_not():
    cluster = load_cluster("cpu-local")
    (piped, plain) = select(["2r-ep2-pipelined2", "2r-ep2-mbs2"], suite=SUITE)
    a, b = predict(piped.model, cluster, piped.plan).stages[0], predict(plain.model, cluster, plain.plan).stages[0]
    held = piped.model.num_layers * routed_rows(piped.model, piped.plan) * piped.model.hidden_size * 4
    assert a.unsaved == held and b.unsaved == 0
    assert a.total - b.total == held
    assert a.activations - a.unsaved == b.activations
