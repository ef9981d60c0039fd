"""Benchmark (not a test): what ``--piper-trace`` costs.

``python -m tests.megatron.bench_trace`` prints two measurements:

1. the tracer alone, in one process: the host time of one layer record (begin, the marks a
   pipelined layer in 4 chunks makes, finish, and its share of a batched write), in microseconds;
2. a Megatron-Core MoE layer (hidden 256, 8 experts, top-2, 1024 tokens per rank, SequentialMLP,
   fp32) with Piper's dispatcher on 2 gloo processes, forward + backward, traced and untraced
   iterations interleaved; median times and the relative difference.

On this 2-core host (1) is the robust number: (2) carries a few percent of scheduling noise
either way. Overhead on a real layer = (1) / the layer's forward time.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HIDDEN, TOKENS, ITERS = 256, (512, 2), 40


def tracer_cost_us(records: int = 20000) -> float:
    from piper_megatron.trace import Tracer

    meta = SimpleNamespace(rows_in=1024, rows_out=1000, tokens_per_expert=(250, 250, 250, 250))
    with tempfile.TemporaryDirectory() as tmp:
        tracer = Tracer(Path(tmp) / "t.jsonl", rank=0)
        start = time.perf_counter()
        for _ in range(records):
            record = tracer.begin(algorithm="flat", chunks=4, meta=meta, first_expert=0)
            record.layer = 3
            for phase in ["dispatch"] * 2 + ["expert", "combine", "dispatch"] * 4 + ["combine"] * 4:
                record.mark(phase)
            record.finish()
        tracer.close()
        return (time.perf_counter() - start) / records * 1e6


def _rank(rank: int, world: int, chunks: int) -> dict[str, float]:
    import dataclasses
    import warnings

    warnings.filterwarnings("ignore")
    from piper_megatron.cpu import install_cpu_shims

    install_cpu_shims()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_layer

    from piper_core.presets import load_model
    from piper_core.runtime import Algorithm, NodeTopology
    from piper_core.specs.parallel import ParallelPlan
    from piper_megatron.build import layer_spec, transformer_config
    from piper_megatron.dispatcher import DispatchSettings, create_ep_comm, install_dispatcher
    from piper_megatron.trace import Tracer

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    model = dataclasses.replace(load_model("tiny-moe"), hidden_size=HIDDEN, num_attention_heads=4,
                                ffn_hidden_size=512, moe_ffn_hidden_size=512)
    config = transformer_config(model, ParallelPlan(gpus=world, ep=world, global_batch_size=world),
                                use_cpu_initialization=True, gradient_accumulation_fusion=False,
                                params_dtype=torch.float32, bf16=False, moe_aux_loss_coeff=0.0)
    comm = create_ep_comm(NodeTopology.uniform(world_size=world, ranks_per_node=1))
    settings = DispatchSettings(algorithm=Algorithm.FLAT, chunks=chunks)
    x = torch.randn(*TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        tracer = Tracer.for_rank(Path(tmp) / "trace.jsonl", rank=rank, world_size=world)
        layers = {}
        for mode, t in (("off", None), ("on", tracer)):
            patches = install_dispatcher(comm, settings, tracer=t)
            layers[mode] = moe_layer.MoELayer(config, layer_spec(model).submodules.mlp.submodules)
            patches.restore()
        patches = install_dispatcher(comm, settings)  # routed_experts_compute stays Piper's for both
        for i in range(2 * ITERS + 4):
            mode = ("off", "on")[i % 2]
            start = time.perf_counter()
            y, _ = layers[mode](x)
            y.sum().backward()
            if i >= 4:
                times[mode].append(time.perf_counter() - start)
        patches.restore()
        tracer.close()
    return {mode: statistics.median(v) for mode, v in times.items()}


def main() -> None:
    from tests.gloo import run_ranks

    print(f"tracer alone: {tracer_cost_us():.1f} us per layer record (pipelined, 4 chunks; host clock)")
    for chunks in (1, 4):
        results = run_ranks(2, _rank, chunks, timeout_s=600)
        off = max(r["off"] for r in results)
        on = max(r["on"] for r in results)
        print(f"MoE layer fwd+bwd, 2 ranks, chunks {chunks}: untraced {1e3 * off:.2f} ms, traced {1e3 * on:.2f} ms, "
              f"difference {100 * (on / off - 1):+.2f} %")


if __name__ == "__main__":
    main()
