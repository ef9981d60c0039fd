"""Rank side of the Piper dispatcher and training tests: what each gloo process runs.

One spawn per world size runs everything below (process start-up and importing Megatron cost more
than the cases), and :func:`tests.megatron.conftest.piper_ranks` caches its results for
``test_dispatcher.py`` and ``test_training.py``.

* :func:`_dispatcher_cases`: a real Megatron-Core ``MoELayer`` (``SequentialMLP`` experts, fp32)
  built with Megatron's ``MoEAlltoAllTokenDispatcher`` and again, with the same weights, with
  Piper's (:func:`piper_megatron.dispatcher.install_dispatcher`); one forward and backward of each
  on the same input; the largest absolute differences of the output, the input gradient and every
  parameter gradient; how many times the experts ran (1, or once per chunk when pipelined).
* :func:`_trace_case`: the same layer with ``--piper-trace``'s tracer on; the records it wrote and
  what they must hold.
* :func:`_hook_case`: the run-time path of ``--piper`` (the ``initialize_model_parallel`` hook of
  :class:`piper_megatron.install.Installation` installs dispatcher and tracer; ``restore()``).
* :func:`_training`: a tiny GPT-MoE (tiny-moe, 4 layers, 8 experts, top-2) trained 5 steps with
  Megatron-Core's ``get_forward_backward_func`` schedule, its ``DistributedDataParallel`` and
  ``torch.optim.Adam``, once per dispatcher variant, from the same initial weights and data; the
  loss of every micro-batch of every step on the last pipeline stage.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

HIDDEN, TOKENS = 16, (16, 2)  # MoE layer width; input [seq, batch] per rank
CAPACITY = {"dropless": (None, False), "cf1.0": (1.0, False), "cf1.0-pad": (1.0, True)}
ALGORITHMS = ("flat", "hierarchical", "aggregated")
# (tp, ep) layouts per world size; tp 2 runs the MoE layer under sequence parallelism (each tp rank
# routes its own tokens) with expert tensor parallelism 1.
LAYOUTS = {2: ((1, 2),), 4: ((1, 2), (1, 4), (2, 2))}
# Nodes per (world, tp, ep): every expert-parallel group spans two "nodes" where it can, so the
# hierarchical and aggregated exchanges run their inter-node stages too.
TOPOLOGY = {(2, 1, 2): ((0,), (1,)), (4, 1, 2): ((0, 2), (1, 3)), (4, 1, 4): ((0, 1), (2, 3)),
            (4, 2, 2): ((0, 1), (2, 3))}
TRAIN = {2: {"pp": 1, "ep": 2}, 4: {"pp": 2, "ep": 2}}  # world 4: stages (0, 1) and (2, 3)
# "tune": every layer measures 1/2/4/8 chunks for 3 calls each (12 calls: 6 steps of 2 micro-batches),
# then runs its choice in the last step. Flat and hierarchical variants get their settings from the
# flags --piper-a2a A --piper-chunks N (the plan's algorithm and chunks, independent of each other).
# "dwg": hierarchical in 2 chunks with --piper-defer-wgrad (the experts' weight gradients deferred).
TRAIN_VARIANTS: tuple[tuple[str, int] | str, ...] = ("stock", ("flat", 1), ("hierarchical", 1), ("flat", 2),
                                                    ("hierarchical", 2), ("aggregated", 4), "tune", "dwg")
TRAIN_STEPS, MICRO_BATCHES, MBS, SEQ = 7, 2, 2, 32


@dataclasses.dataclass(frozen=True)
class DispatchCase:
    tp: int
    ep: int
    topk: int
    capacity: str
    algorithm: str
    chunks: int
    defer: bool = False  # the experts' weight gradients deferred (--piper-defer-wgrad)

    @property
    def id(self) -> str:
        tp = f"tp{self.tp}-" if self.tp > 1 else ""
        dwg = "-dwg" if self.defer else ""
        return f"{tp}ep{self.ep}-top{self.topk}-{self.capacity}-{self.algorithm}-chunks{self.chunks}{dwg}"


def dispatch_cases(world: int) -> list[DispatchCase]:
    """Every combination at tp 1; at tp 2 (sequence parallel) a smaller set; deferred weight
    gradients on a smaller set of each layout (top-2, with and without dropping, flat and
    hierarchical, unpipelined and in 2 chunks)."""
    full = [DispatchCase(1, ep, topk, cap, alg, chunks) for tp, ep in LAYOUTS[world] if tp == 1 for topk in (1, 2)
            for cap in CAPACITY for alg in ALGORITHMS for chunks in (1, 2, 4)]
    deferred = [DispatchCase(tp, ep, 2, cap, alg, chunks, defer=True) for tp, ep in LAYOUTS[world]
                for cap in ("dropless", "cf1.0") for alg in ("flat", "hierarchical") for chunks in (1, 2)]
    return full + [DispatchCase(tp, ep, 2, cap, alg, chunks) for tp, ep in LAYOUTS[world] if tp > 1
                   for cap in ("dropless", "cf1.0") for alg in ("flat", "hierarchical") for chunks in (1, 2)] + deferred


def variant_id(variant: tuple[str, int] | str) -> str:
    return variant if isinstance(variant, str) else f"{variant[0]}-chunks{variant[1]}"


# ---- helpers run on the ranks ---------------------------------------------------------------------

def _moe_config(world: int, ep: int, topk: int, capacity: str, tp: int = 1) -> tuple[Any, Any]:
    from piper_core.presets import load_model
    from piper_core.specs.parallel import ParallelPlan
    from piper_megatron.build import layer_spec, transformer_config

    factor, pad = CAPACITY[capacity]
    model = dataclasses.replace(load_model("tiny-moe"), hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=32,
                                moe_ffn_hidden_size=24, num_experts=8, moe_router_topk=topk,
                                moe_capacity_factor=factor)
    plan = ParallelPlan(gpus=world, tp=tp, ep=ep, etp=1, sequence_parallel=tp > 1, global_batch_size=world)
    config = transformer_config(model, plan,
                                use_cpu_initialization=True, gradient_accumulation_fusion=False,
                                params_dtype=torch.float32, bf16=False, moe_pad_expert_input_to_capacity=pad,
                                moe_aux_loss_coeff=0.0)
    return config, layer_spec(model).submodules.mlp.submodules


def _layer(config: Any, submodules: Any, source: Any = None) -> Any:
    from megatron.core.transformer.moe import moe_layer

    layer = moe_layer.MoELayer(config, submodules)  # looks the dispatcher class up now: stock or Piper's
    layer.set_layer_number(1)
    if source is not None:
        layer.load_state_dict(source.state_dict())
    return layer


def _forward_backward(layer: Any, rank: int) -> dict[str, Any]:
    """One forward and backward on this rank's fixed input; outputs, gradients, expert calls."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(*TOKENS, HIDDEN, generator=g).requires_grad_(True)
    grad_y = torch.randn(*TOKENS, HIDDEN, generator=g)
    calls: list[list[int]] = []
    hook = layer.experts.register_forward_hook(lambda m, args, out: calls.append(args[1].tolist()))
    start = time.perf_counter()
    y, _ = layer(x)
    forward_s = time.perf_counter() - start
    (y * grad_y).sum().backward()
    hook.remove()
    return {"y": y.detach(), "x_grad": x.grad, "calls": calls, "forward_s": forward_s,
            "grads": {n: p.grad for n, p in layer.named_parameters()}}


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return float("inf") if (a is None) != (b is None) else 0.0
    return (a - b).abs().max().item() if a.numel() else 0.0


def _compare(stock: dict[str, Any], piper: dict[str, Any]) -> dict[str, Any]:
    return {"output": _max_diff(stock["y"], piper["y"]), "input_grad": _max_diff(stock["x_grad"], piper["x_grad"]),
            "param_grads": max(_max_diff(g, piper["grads"].get(n)) for n, g in stock["grads"].items()),
            "missing_grads": sorted(n for n, g in {**stock["grads"], **piper["grads"]}.items() if g is None),
            "expert_calls": len(piper["calls"])}


def _comm(world: int, tp: int, ep: int) -> Any:
    from piper_core.runtime import NodeTopology
    from piper_megatron.dispatcher import create_ep_comm

    return create_ep_comm(NodeTopology(nodes=TOPOLOGY[world, tp, ep]))


def _dispatcher_cases(rank: int, world: int, trace_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from megatron.core import parallel_state, tensor_parallel

    from piper_core.runtime import Algorithm
    from piper_megatron.dispatcher import DispatchSettings, install_dispatcher

    results, trace = {}, {}
    for tp, ep in LAYOUTS[world]:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        comm = _comm(world, tp, ep)
        for case in (c for c in dispatch_cases(world) if (c.tp, c.ep) == (tp, ep)):
            config, submodules = _moe_config(world, ep, case.topk, case.capacity, tp)
            stock_layer = _layer(config, submodules)
            stock = _forward_backward(stock_layer, rank)
            settings = DispatchSettings(algorithm=Algorithm(case.algorithm), chunks=case.chunks, defer_wgrad=case.defer)
            patches = install_dispatcher(comm, settings)
            try:
                piper_layer = _layer(config, submodules, source=stock_layer)
                result = _compare(stock, _forward_backward(piper_layer, rank))
                result["dispatcher"] = type(piper_layer.token_dispatcher).__name__
            finally:
                patches.restore()
            results[case.id] = result
        if (tp, ep) == (1, world):
            trace = _trace_case(rank, world, comm, Path(trace_dir))
        parallel_state.destroy_model_parallel()
    return results, trace


def _trace_case(rank: int, world: int, comm: Any, trace_dir: Path) -> dict[str, Any]:
    """Pipelined flat/2, top-2, dropless, traced over two forward+backward calls."""
    from piper_core.runtime import Algorithm
    from piper_megatron.dispatcher import DispatchSettings, install_dispatcher
    from piper_megatron.trace import Tracer, read_trace

    config, submodules = _moe_config(world, world, 2, "dropless")
    stock_layer = _layer(config, submodules)
    stock = _forward_backward(stock_layer, rank)
    tracer = Tracer.for_rank(trace_dir / "trace.jsonl", rank=rank, world_size=world)
    patches = install_dispatcher(comm, DispatchSettings(algorithm=Algorithm.FLAT, chunks=2), tracer=tracer)
    try:
        layer = _layer(config, submodules, source=stock_layer)
        runs = [_forward_backward(layer, rank) for _ in range(2)]
    finally:
        patches.restore()
        tracer.close()
    return {"path": str(tracer.path), "records": read_trace(tracer.path), "forward_s": [r["forward_s"] for r in runs],
            "expected_tokens_per_expert": stock["calls"][0], "first_expert": rank * (8 // world)}


def _hook_case(rank: int, world: int, trace_dir: Path) -> dict[str, Any]:
    """The path ``--piper`` takes at run time: ``Installation.hook_model_parallel``, then Megatron's
    ``initialize_model_parallel`` (hooked: creates Piper's groups, installs the dispatcher and the
    tracer), a layer built and run, ``restore()``."""
    import io

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    from piper_megatron.install import DispatchRequest, Installation
    from piper_megatron.versions import installed_release

    installation = Installation(installed_release(), [], io.StringIO())
    installation.hook_model_parallel(DispatchRequest(a2a="hierarchical", chunks=2, ranks_per_node=1,
                                                     timeout_minutes=1, trace=trace_dir / "hook.jsonl"))
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        config, submodules = _moe_config(world, world, 2, "dropless")
        layer = _layer(config, submodules)
        settings = type(layer.token_dispatcher).binding.settings
        run = _forward_backward(layer, rank)
    finally:
        installation.restore()
        parallel_state.destroy_model_parallel()
    suffix = f".rank{rank}" if world > 1 else ""
    return {"dispatcher": type(layer.token_dispatcher).__name__, "algorithm": settings.algorithm.value,
            "chunks": settings.chunks,
            "expert_calls": len(run["calls"]), "trace_lines": len((trace_dir / f"hook{suffix}.jsonl").read_text()
                                                                  .splitlines()),
            "restored": moe_layer.MoEAlltoAllTokenDispatcher is token_dispatcher.MoEAlltoAllTokenDispatcher
            and not hasattr(parallel_state.initialize_model_parallel, "__wrapped__")
            and not hasattr(moe_layer.MoELayer.routed_experts_compute, "__wrapped__")}


def _batches(dp_rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + dp_rank)
    return [torch.randint(0, 256, (MBS, SEQ + 1), generator=g) for _ in range(MICRO_BATCHES)]


def _forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    output = model(tokens, positions, None, labels=labels)

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _settings(variant: tuple[str, int] | str) -> Any:
    """The dispatcher settings of a training variant (None: stock). Flat and hierarchical come from
    the flags, as ``--piper`` reads them; aggregated (no plan's algorithm) directly."""
    from piper_core.runtime import Algorithm
    from piper_megatron.args import parse_piper_options
    from piper_megatron.dispatcher import DispatchSettings

    if variant == "stock":
        return None
    if variant == "tune":
        return DispatchSettings(algorithm=Algorithm.FLAT, chunks=2, tune=True)
    if variant == "dwg":
        options = parse_piper_options(["--piper", "--piper-a2a", "hierarchical", "--piper-chunks", "2",
                                       "--piper-defer-wgrad"])
        assert options.defer_wgrad
        return DispatchSettings.from_plan(options.a2a, options.chunks, defer_wgrad=options.defer_wgrad)
    algorithm, chunks = variant
    if algorithm == "aggregated":
        return DispatchSettings(algorithm=Algorithm.AGGREGATED, chunks=chunks)
    options = parse_piper_options(["--piper", "--piper-a2a", algorithm, "--piper-chunks", str(chunks)])
    return DispatchSettings.from_plan(options.a2a, options.chunks)


def _exchange(model: Any) -> dict[str, Any] | None:
    """What the first MoE layer's last step ran: algorithm, chunks, stages of each chunk's dispatch."""
    dispatchers = [m.token_dispatcher for m in model.modules() if getattr(m, "token_dispatcher", None) is not None]
    meta = getattr(dispatchers[0], "_meta", None) if dispatchers else None
    if meta is None:
        return None
    return {"algorithm": meta.algorithm.value, "chunks": meta.chunks,
            "stages": [len(c.dispatch.forward.stages) for c in meta.chunk]}


def _train(world: int, comm: Any, variant: tuple[str, int] | str) -> tuple[list[list[float]], list[dict] | None,
                                                                          dict[str, Any] | None]:
    """Losses per step and micro-batch; for "tune", each MoE layer's tuner (what it handed out per
    call, what it chose from which medians); the exchange the first MoE layer ran last."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from piper_core.presets import load_model
    from piper_core.specs.parallel import ParallelPlan
    from piper_megatron.build import gpt_model
    from piper_megatron.dispatcher import install_dispatcher

    sizes = TRAIN[world]
    plan = ParallelPlan(gpus=world, pp=sizes["pp"], ep=sizes["ep"], global_batch_size=world // sizes["pp"] * MBS * 2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    settings = _settings(variant)
    patches = None if settings is None else install_dispatcher(comm, settings)
    try:
        model = gpt_model(dataclasses.replace(load_model("tiny-moe"), seq_length=SEQ), plan, device="cpu",
                          params_dtype=torch.float32, bf16=False, pipeline_dtype=torch.float32,
                          moe_aux_loss_coeff=0.0)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = ddp.no_sync
        optimizer = torch.optim.Adam(ddp.parameters(), lr=3e-3)
        batches = _batches(parallel_state.get_data_parallel_rank())
        losses, handed = [], {}
        tuners = {m.layer_number: m.token_dispatcher.auto_chunks for m in model.modules()
                  if getattr(getattr(m, "token_dispatcher", None), "auto_chunks", None) is not None}
        for _ in range(TRAIN_STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            out = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(batches),
                                              model=[ddp], num_microbatches=MICRO_BATCHES, seq_length=SEQ,
                                              micro_batch_size=MBS, forward_only=False)
            for p in ddp.parameters():
                p.grad = p.main_grad  # DDP accumulates into main_grad; torch.optim reads .grad
            optimizer.step()
            losses.append([r["lm loss"].item() for r in out])
            for layer, tuner in tuners.items():  # what this step's layers ran with (their last plan)
                handed.setdefault(layer, []).append(tuner.chosen)
        tuned = [{"layer": layer, "chosen": t.chosen, "medians_s": t.medians_s, "after_step": handed[layer]}
                 for layer, t in sorted(tuners.items())] if variant == "tune" else None
        return losses, tuned, None if settings is None else _exchange(model)
    finally:
        if patches is not None:
            patches.restore()


def _training(world: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    sizes = TRAIN[world]
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=sizes["pp"],
                                             expert_model_parallel_size=sizes["ep"])
    comm = _comm(world, 1, sizes["ep"])
    last_stage = parallel_state.is_pipeline_last_stage()
    runs = {variant_id(v): _train(world, comm, v) for v in TRAIN_VARIANTS}
    parallel_state.destroy_model_parallel()
    return {"last_stage": last_stage, "losses": {k: losses for k, (losses, _, _) in runs.items()},
            "tuned": runs["tune"][1], "exchange": {k: exchange for k, (_, _, exchange) in runs.items()}}


def run_rank(rank: int, world: int, trace_dir: str) -> dict[str, Any]:
    """Everything this rank contributes; picklable results only."""
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    from piper_megatron.cpu import install_cpu_training_shims

    install_cpu_training_shims()
    start = time.perf_counter()
    dispatcher, trace = _dispatcher_cases(rank, world, trace_dir)
    hook = _hook_case(rank, world, Path(trace_dir))
    middle = time.perf_counter()
    training = _training(world)
    timing = {"dispatcher_s": middle - start, "training_s": time.perf_counter() - middle}
    return {"dispatcher": dispatcher, "trace": trace, "hook": hook, "training": training, "timing": timing}
