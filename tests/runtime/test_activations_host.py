"""What torch's host kernels keep for backward, as HOST_KERNELS prices it for Piper's CPU trainers
(cpu-local and profiles calibrated from it): RMSNorm's decomposition keeps two fp32 copies of its
input; the GPU kernels keep the input itself."""

from __future__ import annotations

import dataclasses

import torch

from piper_core.presets import load_cluster
from piper_core.resource.activations import GPU_DEFAULTS, HOST_KERNELS, kernels_for, layer_activation_terms
from piper_core.specs.parallel import ParallelPlan
from piper_core.validate.cases import VAL_MODEL


def _saved_bytes(fn, *inputs) -> int:
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(saved.values())


def test_host_rms_norm_keeps_two_fp32_copies_of_its_input():
    tokens, hidden = 256, 128
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(hidden, dtype=torch.bfloat16, requires_grad=True)
    kept = _saved_bytes(lambda a, b: torch.nn.functional.rms_norm(a, (hidden,), b, 1e-5), x, w)
    per_element = HOST_KERNELS.rms_norm_input_bytes
    # the input copies, plus the fp32 rstd per token and the weight
    assert kept == tokens * hidden * per_element + tokens * 4 + hidden * 2


def test_the_cpu_preset_prices_host_kernels_and_the_gpu_presets_cuda_ones():
    assert kernels_for(load_cluster("cpu-local").accelerator) is HOST_KERNELS
    assert kernels_for(load_cluster("dgx-h100").accelerator) is GPU_DEFAULTS
    rms = dataclasses.replace(VAL_MODEL, normalization="RMSNorm", gated_linear_unit=True)
    plan = ParallelPlan(gpus=2, ep=2, micro_batch_size=2, global_batch_size=8, distributed_optimizer=False)
    host = layer_activation_terms(rms, plan, moe=True, kernels=HOST_KERNELS)
    cuda = layer_activation_terms(rms, plan, moe=True, kernels=GPU_DEFAULTS)
    tokens = rms.seq_length * plan.micro_batch_size
    assert host["input_norm.input"] == tokens * rms.hidden_size * 8 and cuda["input_norm.input"] == tokens * rms.hidden_size * 2
    # LayerNorm is torch's native kernel on both: it keeps its input
    ln = layer_activation_terms(VAL_MODEL, plan, moe=True, kernels=HOST_KERNELS)
    assert ln["input_norm.input"] == tokens * VAL_MODEL.hidden_size * 2
