"""Exports (Megatron-LM arguments, DeepSpeed config) and plots (timeline, memory, Pareto) of a plan,
and the timeline's 1F1B simulation against the step-time model's pipeline formula."""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import subprocess
import sys

import pytest

from piper_core.cli.main import main
from piper_core.errors import SpecError
from piper_core.export import deepspeed_compatible, deepspeed_config, megatron_args, moe_layer_freq
from piper_core.plots import pareto_front, write_plots
from piper_core.timing.step import step_time
from piper_core.timing.schedule import makespan, one_f_one_b_order, pass_parts, simulate_1f1b
from piper_core.presets import load_cluster, load_model
from piper_core.resource.predict import predict
from piper_core.scheduler.search import search
from piper_core.scheduler.space import SearchSpace
from piper_core.specs.parallel import ParallelPlan

H100, CPU = load_cluster("dgx-h100"), load_cluster("cpu-local")
MIXTRAL, DEEPSEEK, TINY = load_model("mixtral-8x7b"), load_model("deepseek-v3"), load_model("tiny-moe")

# Every flag the exporter may write, each present in the parser Megatron-LM core_v0.16.1 builds
# (megatron/training/arguments.py, TransformerConfig-generated flags included); a typo fails here.
MEGATRON_FLAGS = frozenset("""
--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --seq-length --max-position-embeddings
--make-vocab-size-divisible-by --position-embedding-type --normalization --attention-dropout --hidden-dropout
--swiglu --untie-embeddings-and-output-weights --disable-bias-linear --add-qkv-bias --qk-layernorm
--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim
--kv-channels --group-query-attention --num-query-groups --num-experts --moe-ffn-hidden-size --moe-router-topk
--moe-layer-freq --moe-token-dispatcher-type --moe-shared-expert-intermediate-size --moe-expert-capacity-factor
--moe-router-num-groups --moe-router-group-topk --moe-flex-dispatcher-backend --mtp-num-layers
--tensor-model-parallel-size --pipeline-model-parallel-size --context-parallel-size --expert-model-parallel-size
--expert-tensor-parallel-size --decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers
--num-layers-per-virtual-pipeline-stage --num-virtual-stages-per-pipeline-rank --sequence-parallel
--micro-batch-size --global-batch-size --bf16 --fp16 --attention-backend --recompute-granularity
--recompute-method --recompute-num-layers --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--grad-reduce-in-bf16 --optimizer-cpu-offload --optimizer-offload-fraction --use-precision-aware-optimizer
--moe-grouped-gemm --no-overlap-p2p-communication
""".split())


def mixtral_vpp():
    return predict(MIXTRAL, H100, ParallelPlan(gpus=64, tp=2, sequence_parallel=True, pp=4, vpp=2, cp=2, ep=8, etp=1,
                                               global_batch_size=512, recompute="full", recompute_num_layers=1,
                                               a2a="hierarchical", a2a_chunks=4))


def deepseek_uneven():
    return predict(DEEPSEEK, H100, ParallelPlan(gpus=1024, pp=16, num_layers_in_last_pipeline_stage=1, ep=64, etp=1,
                                                global_batch_size=4096, recompute="selective"))


def sourced(text: str, tmp_path) -> tuple[dict[str, list[str]], str]:
    """The arrays PIPER_MEGATRON_ARGS and PIPER_ARGS as bash itself reads them, and the exported env."""
    path = tmp_path / "megatron.sh"
    path.write_text(text)
    script = (f'set -eu; source "{path}"; printf "%s\\0" "${{PIPER_MEGATRON_ARGS[@]}}"; printf "\\1";'
              f' printf "%s\\0" "${{PIPER_ARGS[@]}}"; printf "\\1%s" "${{CUDA_DEVICE_MAX_CONNECTIONS-}}"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    megatron, piper, env = out.split("\1")
    return {"megatron": megatron.split("\0")[:-1], "piper": piper.split("\0")[:-1]}, env


def as_flags(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` / ``--switch`` pairs; every flag once."""
    flags: dict[str, str | None] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            assert word not in flags, f"{word} written twice"
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            flags[word] = None if nxt is None or nxt.startswith("--") else nxt
    return flags


def test_megatron_args_for_a_known_plan(tmp_path):
    p = mixtral_vpp()
    arrays, env = sourced(megatron_args(p), tmp_path)
    f = as_flags(arrays["megatron"])
    assert set(f) <= MEGATRON_FLAGS
    assert {k: f[k] for k in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                              "--context-parallel-size", "--expert-model-parallel-size",
                              "--expert-tensor-parallel-size", "--micro-batch-size", "--global-batch-size",
                              "--num-layers-per-virtual-pipeline-stage")} == {
        "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "4", "--context-parallel-size": "2",
        "--expert-model-parallel-size": "8", "--expert-tensor-parallel-size": "1", "--micro-batch-size": "1",
        "--global-batch-size": "512", "--num-layers-per-virtual-pipeline-stage": "4"}  # 32 layers / (pp 4 * vpp 2)
    recompute = (f["--recompute-granularity"], f["--recompute-method"], f["--recompute-num-layers"])
    assert recompute == ("full", "uniform", "1")
    for switch in ("--sequence-parallel", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather", "--swiglu", "--untie-embeddings-and-output-weights",
                   "--disable-bias-linear", "--group-query-attention"):
        assert f[switch] is None
    m = MIXTRAL
    assert {k: f[k] for k in ("--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups",
                              "--ffn-hidden-size", "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk",
                              "--seq-length", "--moe-token-dispatcher-type", "--normalization")} == {
        "--num-layers": str(m.num_layers), "--hidden-size": str(m.hidden_size),
        "--num-attention-heads": str(m.num_attention_heads), "--num-query-groups": str(m.num_query_groups),
        "--ffn-hidden-size": str(m.ffn_hidden_size), "--num-experts": str(m.num_experts),
        "--moe-ffn-hidden-size": str(m.moe_ffn_hidden_size), "--moe-router-topk": str(m.moe_router_topk),
        "--seq-length": str(m.seq_length), "--moe-token-dispatcher-type": "alltoall", "--normalization": "RMSNorm"}
    assert "--fp16" not in f and "--decoder-last-pipeline-num-layers" not in f
    assert as_flags(arrays["piper"]) == {"--piper-a2a": "hierarchical", "--piper-chunks": "4"}
    assert env == "1"  # tp > 1: Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1


def test_megatron_uneven_split_and_layer_pattern(tmp_path):
    p = deepseek_uneven()
    arrays, env = sourced(megatron_args(p), tmp_path)
    f = as_flags(arrays["megatron"])
    assert set(f) <= MEGATRON_FLAGS
    assert f["--decoder-last-pipeline-num-layers"] == "1" and "--decoder-first-pipeline-num-layers" not in f
    assert not {"--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"} & set(f)
    assert f["--recompute-granularity"] == "selective" and "--recompute-method" not in f
    # Megatron evaluates the list expression (moe_freq_type); 1 marks a MoE layer.
    assert [bool(x) for x in eval(f["--moe-layer-freq"])] == list(DEEPSEEK.moe_layer_pattern)
    assert f["--moe-layer-freq"] == "([0]*3+[1]*58)"
    assert f["--mtp-num-layers"] == "1"  # DeepSeek-V3 trains one MTP layer
    assert {"--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-pos-emb-head-dim"} <= set(f)
    assert "--group-query-attention" not in f  # exclusive with MLA in validate_args
    assert env == ""  # tp = cp = 1


def test_moe_layer_freq_with_frequency_and_dense_prefix():
    model = dataclasses.replace(TINY, num_layers=9, moe_layer_freq=2, moe_first_k_dense=1)
    assert [bool(x) for x in eval(moe_layer_freq(model))] == list(model.moe_layer_pattern)
    assert moe_layer_freq(TINY) == 1


def test_megatron_vpp_with_uneven_split_uses_virtual_stage_count(tmp_path):
    plan = ParallelPlan(gpus=64, pp=4, vpp=2, num_layers_in_first_pipeline_stage=6, num_layers_in_last_pipeline_stage=6,
                        ep=8, global_batch_size=512)
    f = as_flags(sourced(megatron_args(predict(MIXTRAL, H100, plan)), tmp_path)[0]["megatron"])
    assert f["--num-virtual-stages-per-pipeline-rank"] == "2"
    assert "--num-layers-per-virtual-pipeline-stage" not in f  # validate_args refuses it with an uneven split
    assert (f["--decoder-first-pipeline-num-layers"], f["--decoder-last-pipeline-num-layers"]) == ("6", "6")


def test_megatron_memory_savers(tmp_path):
    plan = ParallelPlan(gpus=64, pp=4, ep=8, global_batch_size=512, grad_reduce_in_bf16=True,
                        optimizer_offload_fraction=0.5)
    f = as_flags(sourced(megatron_args(predict(MIXTRAL, H100, plan)), tmp_path)[0]["megatron"])
    assert f["--optimizer-offload-fraction"] == "0.5"
    assert {"--grad-reduce-in-bf16", "--optimizer-cpu-offload", "--use-precision-aware-optimizer"} <= set(f)


def test_deepspeed_config_block_and_batch_arithmetic():
    p = predict(MIXTRAL, H100, ParallelPlan(gpus=64, pp=4, ep=8, micro_batch_size=2, global_batch_size=512,
                                            a2a="hierarchical"))
    cfg = json.loads(json.dumps(deepspeed_config(p)))
    dp = p.plan.gpus // p.plan.pp
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    assert cfg["gradient_accumulation_steps"] == p.plan.num_microbatches == 16
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["zero_optimization"] == {"stage": 1}
    piper = cfg["piper"]
    assert list(piper) == ["enabled", "cluster", "profile", "a2a", "chunks", "defer_wgrad", "memory_headroom",
                           "plan_only", "trace", "plan", "predicted"]
    assert piper["defer_wgrad"] is False
    assert (piper["enabled"], piper["cluster"], piper["profile"], piper["a2a"], piper["chunks"]) == (
        True, "dgx-h100", None, "hierarchical", 1)
    assert (piper["memory_headroom"], piper["plan_only"], piper["trace"]) == (0.0, False, None)
    assert piper["plan"] == {"tp": 1, "pp": 4, "ep": 8, "etp": 1, "cp": 1, "vpp": 1, "mbs": 2, "recompute": "none"}
    assert piper["predicted"] == {"mfu": p.rate.mfu, "step_s": p.time.step,
                                  "peak_memory_gib": pytest.approx(p.peak_stage.total / 2**30, abs=1e-4)}


def test_deepspeed_config_savers():
    p = predict(MIXTRAL, H100, ParallelPlan(gpus=64, pp=4, ep=8, global_batch_size=512, grad_reduce_in_bf16=True,
                                            optimizer_offload_fraction=1.0))
    cfg = deepspeed_config(p)
    assert cfg["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    assert (cfg["communication_data_type"], cfg["data_types"]) == ("bf16", {"grad_accum_dtype": "bf16"})
    no_dopt = predict(MIXTRAL, H100, ParallelPlan(gpus=64, pp=4, ep=8, global_batch_size=512,
                                                  distributed_optimizer=False))
    assert deepspeed_config(no_dopt)["zero_optimization"] == {"stage": 0}


@pytest.mark.parametrize("changes, reason", [
    (dict(tp=2, sequence_parallel=True, etp=1), r"tp=2: the DeepSpeed export has no tensor parallelism"),
    (dict(cp=2), r"cp=2: DeepSpeed has no context parallelism"),
    (dict(vpp=2), r"vpp=2: DeepSpeed's pipeline engine has no interleaved schedule"),
    (dict(num_layers_in_last_pipeline_stage=5, num_layers_in_first_pipeline_stage=9), r"uneven pipeline split"),
    (dict(optimizer_offload_fraction=0.5), r"optimizer_offload_fraction=0.5: DeepSpeed offloads part of the optimizer "
                                           r"only under ZeRO-3"),
    (dict(recompute="selective"), r"recompute=selective: a DeepSpeed config cannot make the model recompute"),
])
def test_deepspeed_refuses_what_it_cannot_express(changes, reason):
    plan = ParallelPlan(**{"gpus": 64, "pp": 4, "ep": 8, "global_batch_size": 512} | changes)
    assert deepspeed_compatible(plan) is not None
    with pytest.raises(SpecError, match=r"cannot be expressed in DeepSpeed \(" + reason + r".*--export-deepspeed FILE. writes the best DeepSpeed-compatible plan"):
        deepspeed_config(predict(MIXTRAL, H100, plan))


def test_deepspeed_refuses_expert_tensor_parallelism():
    assert "no expert tensor parallelism" in deepspeed_compatible(
        ParallelPlan(gpus=64, pp=4, ep=4, etp=2, global_batch_size=512))


# ---- the 1F1B simulation -----------------------------------------------------------------------

def test_1f1b_order_matches_megatron_warmup():
    assert one_f_one_b_order(4, 0, 5) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                          ("B", 2), ("B", 3), ("B", 4)]
    assert one_f_one_b_order(4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b_order(8, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # fewer micro-batches than stages


def test_simulation_respects_dependencies_and_the_model_bounds_it():
    """Random stages: passes wait for their inputs and never overlap on a stage; the analytical
    ``(m-1) max T + sum T`` is an upper bound, reached when the slowest stage is the last."""
    rng = random.Random(7)
    for _ in range(300):
        n, m = rng.randint(1, 6), rng.randint(1, 12)
        total = [rng.uniform(0.5, 2.0) for _ in range(n)]
        if rng.random() < 0.5:
            total[-1] = max(total) * 1.1
        fwd = [t * rng.uniform(0.25, 0.5) for t in total]
        ops = simulate_1f1b(fwd, [t - f for t, f in zip(total, fwd)], m)
        end = {(op.kind, op.micro, op.stage): op.end for stage in ops for op in stage}
        for stage in ops:
            assert len(stage) == 2 * m
            assert all(a.end <= b.start + 1e-12 for a, b in zip(stage, stage[1:]))
            for op in stage:
                dep = op.stage - 1 if op.kind == "F" else op.stage + 1
                if 0 <= dep < n:
                    assert op.start >= end[(op.kind, op.micro, dep)] - 1e-12
        analytical = (m - 1) * max(total) + sum(total)
        assert makespan(ops) <= analytical * (1 + 1e-12)
        if max(total) == total[-1]:
            assert makespan(ops) == pytest.approx(analytical, rel=1e-12)


@pytest.mark.parametrize("model, cluster, plan", [
    (TINY, CPU, ParallelPlan(gpus=8, pp=4, ep=2, global_batch_size=64)),
    (MIXTRAL, H100, ParallelPlan(gpus=64, tp=2, sequence_parallel=True, pp=4, ep=8, global_batch_size=512,
                                 recompute="selective")),
], ids=["tiny-pp4", "mixtral-pp4"])
def test_timeline_makespan_equals_step_model(model, cluster, plan):
    """vpp=1, slowest stage last (the logits): the drawn schedule and the step model agree."""
    p = predict(model, cluster, plan)
    assert p.time.slowest_stage == plan.pp - 1
    parts = [pass_parts(st) for st in p.time.stages]
    m = plan.num_microbatches
    ops = simulate_1f1b([sum(f.values()) for f, _ in parts], [sum(b.values()) for _, b in parts], m)
    assert makespan(ops) == pytest.approx(p.time.pipeline, rel=1e-9)
    assert p.time.pipeline + p.time.optimizer < p.time.step  # the rest is data-parallel sync


def test_timeline_makespan_equals_step_model_when_an_early_stage_is_slowest():
    """DeepSeek-V3 pp16 with a 1-layer last stage: stage 1 (4 MoE layers) is slowest; the step model
    simulates 1F1B, so it matches, and the closed form (the search's fast path) is ~0.5 % high."""
    p = deepseek_uneven()
    assert p.time.slowest_stage not in (0, p.plan.pp - 1)
    fast = step_time(p.model, p.plan, p.cluster, exact=False)
    assert fast.pipeline > p.time.pipeline * 1.001
    parts = [pass_parts(st) for st in p.time.stages]
    m = p.plan.num_microbatches
    ops = simulate_1f1b([sum(f.values()) for f, _ in parts], [sum(b.values()) for _, b in parts], m)
    assert makespan(ops) == pytest.approx(p.time.pipeline, rel=1e-9)


def test_pareto_front():
    points = [(1.0, 5.0), (2.0, 4.0), (2.0, 7.0), (3.0, 6.0), (4.0, 9.0), (0.5, 1.0)]
    assert pareto_front(points) == [(0.5, 1.0), (1.0, 5.0), (2.0, 7.0), (4.0, 9.0)]


# ---- the pictures ------------------------------------------------------------------------------

def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_write_plots(tmp_path):
    space = SearchSpace(tp=(1, 2), pp=(1, 2, 4), vpp=(1, 2), cp=(1,), ep=(1, 2, 4, 8), mbs=(1, 2),
                        recompute=("none", "full"), memory_savers=((False, 0.0),))
    result = search(TINY, CPU, 8, 64, space=space)
    best = predict(TINY, CPU, ParallelPlan(gpus=8, pp=4, ep=2, global_batch_size=64))  # 16 micro-batches drawn
    paths = write_plots(tmp_path / "plots", best, result)
    assert [p.name for p in paths] == ["timeline.png", "memory.png", "pareto.png"]
    for path in paths:
        width, height = png_size(path)
        assert 500 <= width <= 3000 and 300 <= height <= 3000
        assert 20_000 < path.stat().st_size < 2_000_000


def test_plots_without_matplotlib_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    best = predict(TINY, CPU, ParallelPlan(gpus=8, pp=2, ep=2, global_batch_size=64))
    with pytest.raises(SpecError, match="pip install matplotlib"):
        write_plots(tmp_path / "plots", best, search(TINY, CPU, 8, 64, space=SearchSpace(tp=(1,), pp=(2,), ep=(2,))))
    assert not (tmp_path / "plots").exists()


def test_plan_cli_writes_exports_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["plan", "tiny-moe", "--cluster", "cpu-local", "--gpus", "8", "--gbs", "64", "--top", "1",
            "--export-megatron", str(tmp_path / "m.sh"), "--plot", str(out)]
    assert main(argv) == 0
    assert "PIPER_MEGATRON_ARGS=(" in (tmp_path / "m.sh").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["memory.png", "pareto.png", "timeline.png"]


def test_megatron_export_of_an_etp_plan_runs_it_with_piper():
    """Piper's token dispatcher runs expert tensor parallelism (etp = tp, with sequence parallelism):
    the file offers `--piper` with the plan's sizes, etp included, and no stock-only note."""
    etp = megatron_args(predict(MIXTRAL, H100, ParallelPlan(gpus=64, tp=2, sequence_parallel=True, ep=8, etp=2,
                                                            global_batch_size=512)))
    assert "--expert-tensor-parallel-size 2" in etp and "--sequence-parallel" in etp
    assert "--piper --piper-cluster" in etp and "run it with stock Megatron-LM" not in etp
    plain = megatron_args(predict(MIXTRAL, H100, ParallelPlan(gpus=64, ep=8, global_batch_size=512)))
    assert "--piper --piper-cluster" in plain and "stock Megatron-LM" not in plain
