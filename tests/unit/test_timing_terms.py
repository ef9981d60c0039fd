"""Timing terms read off Megatron-Core 0.16.1 (issue 15, Deliver 9): pipeline sends overlapped
under interleaving, grouped expert GEMMs, and the sequence length and capacity factor set from
the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

import pytest

from piper_core.cli.main import main
from piper_core.cli.parse import parse_parallel, target_model
from piper_core.errors import SpecError
from piper_core.export import parallel_flags
from piper_core.presets import load_cluster, load_model
from piper_core.specs import ParallelPlan, check_plan
from piper_core.timing.compute import GROUPED_GEMM_STREAMS, moe_forward
from piper_core.timing.layer import shape_of
from piper_core.timing.step import ExchangeVariants, _p2p_message, plain_1f1b_waits, step_time

H100 = load_cluster("dgx-h100")
CPU = load_cluster("cpu-local")
MIXTRAL = load_model("mixtral-8x7b")
SWITCH = load_model("switch-1t")


def plan(model, **kw) -> ParallelPlan:
    p = ParallelPlan(**kw)
    check_plan(model, p)
    return p


def _slow_pp(cluster, gb_per_s):
    """Inter-node links so slow that a pipeline send outlasts a model chunk's passes."""
    nv, ib = cluster.links
    return dataclasses.replace(cluster, links=(nv, dataclasses.replace(ib, bandwidth_gb_per_s=gb_per_s)))


# ---- 1. pipeline sends under interleaving --------------------------------------------------------

VPP = dict(gpus=64, pp=4, vpp=2, ep=8, global_batch_size=128)  # pp ranks 16 GPUs apart: sends cross nodes


def _megatron_exposed(p: ParallelPlan, rank: int, message: float, st) -> float:
    """The exposed sends per micro-batch of Megatron's interleaved schedule with overlap_p2p_comm:
    warm-up forwards and cool-down backwards send and wait (get_pp_rank_microbatches); each steady
    1F1B step hides a forward chunk's send behind one backward chunk and a backward chunk's behind
    one forward chunk (pp_post_forward / pp_pre_forward, pp_post_backward / pp_pre_backward)."""
    m, vpp = p.num_microbatches, p.virtual_stages
    warmup = min(2 * (p.pp - rank - 1) + (vpp - 1) * p.pp, m * vpp)
    f_chunk = (st.compute / 3 + (st.a2a + st.comm) / 2) / vpp
    b_chunk = (2 * st.compute / 3 + (st.a2a + st.comm) / 2) / vpp
    steady = max(0.0, message - b_chunk) + max(0.0, message - f_chunk)
    return (2 * warmup * message + (m * vpp - warmup) * steady) / m


@pytest.mark.parametrize("cluster", [H100, _slow_pp(H100, 0.05)], ids=["fast-links", "slow-links"])
def test_interleaved_sends_expose_only_what_the_neighbouring_chunk_does_not_hide(cluster):
    p = plan(MIXTRAL, **VPP)
    message = _p2p_message(MIXTRAL, p, cluster)
    assert message > 0
    t = step_time(MIXTRAL, p, cluster)
    for st in t.stages:
        assert st.p2p == pytest.approx(_megatron_exposed(p, st.stage, message, st), rel=1e-12)
        assert st.p2p < 2 * p.virtual_stages * message  # the old price: every send waited for
    assert t.stages[0].p2p > t.stages[-1].p2p  # rank 0 has the longest warm-up


def test_fast_links_expose_only_the_warm_up_and_cool_down_sends():
    p = plan(MIXTRAL, **VPP)
    message = _p2p_message(MIXTRAL, p, H100)
    for st in step_time(MIXTRAL, p, H100).stages:
        warmup = min(2 * (p.pp - st.stage - 1) + (p.vpp - 1) * p.pp, p.num_microbatches * p.vpp)
        assert st.p2p == pytest.approx(2 * warmup * message / p.num_microbatches, rel=1e-12)


def test_interleaving_without_p2p_overlap_waits_for_every_send():
    off = plan(MIXTRAL, **VPP, overlap_p2p_comm=False)
    message = _p2p_message(MIXTRAL, off, H100)
    assert all(st.p2p == 2 * off.virtual_stages * message for st in step_time(MIXTRAL, off, H100).stages)
    assert step_time(MIXTRAL, plan(MIXTRAL, **VPP), H100).step < step_time(MIXTRAL, off, H100).step


def _megatron_1f1b_calls(pp: int, rank: int, m: int) -> int:
    """Megatron-Core's blocking p2p calls on ``rank`` over one step of 1F1B without interleaving,
    walked call by call as forward_backward_pipelining_without_interleaving makes them (a call
    whose every message has no peer, at the first or last stage, is a no-op and not counted)."""
    first, last = rank == 0, rank == pp - 1
    warmup = min(pp - rank - 1, m)
    calls = 0
    for _ in range(warmup):
        calls += (not first) + (not last)  # recv_forward, send_forward
    if m - warmup:
        calls += not first  # recv_forward before the steady loop
    for _ in range(m - warmup):
        calls += not last  # send_forward_recv_backward (one link, both directions at once)
        calls += not first  # send_backward_recv_forward, or send_backward on the last iteration
    for _ in range(warmup):
        calls += (not last) + (not first)  # recv_backward, send_backward
    return calls


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 2), (8, 32), (3, 1)])
def test_plain_1f1b_waits_for_each_call_megatron_makes(pp, m):
    for rank in range(pp):
        assert plain_1f1b_waits(pp, rank, m) * m == _megatron_1f1b_calls(pp, rank, m)


def test_plain_1f1b_end_stages_wait_one_message_per_micro_batch_and_middle_stages_two():
    p = plan(MIXTRAL, gpus=64, pp=4, ep=8, global_batch_size=128)
    message, m = _p2p_message(MIXTRAL, p, H100), p.num_microbatches
    p2p = [st.p2p for st in step_time(MIXTRAL, p, H100).stages]
    assert p2p[0] == pytest.approx((m + 3) / m * message) and p2p[-1] == pytest.approx((m + 1) / m * message)
    assert p2p[1] == pytest.approx((2 * m + 2 * 2 + 1) / m * message)
    assert max(p2p[0], p2p[-1]) < 1.5 * message and p2p[1] > 2 * message  # the old price: 2 messages everywhere


def test_the_search_prices_overlapped_sends_as_step_time_does():
    for kw in (VPP, dict(VPP, overlap_p2p_comm=False), dict(VPP, vpp=None)):
        p = plan(MIXTRAL, **kw)
        for cluster in (H100, _slow_pp(H100, 0.05)):
            assert ExchangeVariants(MIXTRAL, p, cluster).step(p) == step_time(MIXTRAL, p, cluster, exact=False).step


def test_p2p_overlap_rules_and_flags():
    with pytest.raises(SpecError, match=r"overlap_p2p_comm=False: interleaving without p2p overlap needs pp > 2 "
                                        r"\(got pp=2; Megatron validate_args"):
        ParallelPlan(gpus=16, pp=2, vpp=2, global_batch_size=16, overlap_p2p_comm=False)
    assert parse_parallel("pp=4,vpp=2,gbs=64,p2pov=0", 64).overlap_p2p_comm is False
    assert parse_parallel("pp=4,vpp=2,gbs=64", 64).overlap_p2p_comm is True  # Megatron's default
    on = dict(parallel_flags(MIXTRAL, plan(MIXTRAL, **VPP)))
    off = dict(parallel_flags(MIXTRAL, plan(MIXTRAL, **VPP, overlap_p2p_comm=False)))
    assert "--no-overlap-p2p-communication" not in on and off["--no-overlap-p2p-communication"] is None


# ---- 2. grouped expert GEMMs ---------------------------------------------------------------------

def test_grouped_gemm_pays_launches_per_grouped_gemm_not_per_expert():
    p = plan(MIXTRAL, gpus=8, ep=1, global_batch_size=8)  # 8 local experts
    local = MIXTRAL.num_experts // p.ep
    acc = H100.accelerator
    _, sequential = moe_forward(MIXTRAL, dataclasses.replace(shape_of(p), grouped_gemm=False), acc)
    _, grouped = moe_forward(MIXTRAL, dataclasses.replace(shape_of(p), grouped_gemm=True), acc)
    launches_saved = 2 * (local - math.ceil(local / GROUPED_GEMM_STREAMS))  # fc1 and fc2
    assert sequential - grouped == pytest.approx(launches_saved * acc.kernel_latency_us * 1e-6, rel=1e-9)


def test_gpu_presets_group_the_experts_and_cpu_ranks_do_not():
    p = plan(MIXTRAL, gpus=8, ep=1, global_batch_size=8)
    grouped, sequential = (dataclasses.replace(p, moe_grouped_gemm=v) for v in (True, False))
    assert H100.accelerator.grouped_gemm and not CPU.accelerator.grouped_gemm
    assert step_time(MIXTRAL, p, H100).step == step_time(MIXTRAL, grouped, H100).step
    assert step_time(MIXTRAL, p, H100).compute < step_time(MIXTRAL, sequential, H100).compute
    tiny = load_model("tiny-moe")
    small = plan(tiny, gpus=2, ep=2, global_batch_size=8)
    sequential_small = dataclasses.replace(small, moe_grouped_gemm=False)
    assert step_time(tiny, small, CPU).step == step_time(tiny, sequential_small, CPU).step
    assert dict(parallel_flags(MIXTRAL, p, H100.accelerator))["--moe-grouped-gemm"] is None
    assert "--moe-grouped-gemm" not in dict(parallel_flags(MIXTRAL, p, CPU.accelerator))
    assert parse_parallel("ep=8,gbs=8,grouped_gemm=0", 8).moe_grouped_gemm is False


# ---- 3. sequence length and capacity factor from the command line --------------------------------

def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"model": "switch-1t", "seq_length": None, "capacity_factor": None} | kw)


def test_seq_length_and_capacity_factor_reach_the_model():
    assert target_model(_args()) == SWITCH
    model = target_model(_args(seq_length="4096", capacity_factor="1.5"))
    assert (model.seq_length, model.moe_capacity_factor) == (4096, 1.5)
    assert target_model(_args(capacity_factor="none")).moe_capacity_factor is None


def test_predict_prices_the_given_sequence_length(capsys):
    argv = ["predict", "switch-1t", "--cluster", "dgx-h100", "--gpus", "1024", "--parallel",
            "ep=512,mbs=2,gbs=2048,a2a=hierarchical"]
    assert main(argv + ["--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(argv + ["--seq-length", "4096", "--capacity-factor", "1.5", "--json"]) == 0
    longer = json.loads(capsys.readouterr().out)
    assert longer["flops_per_step"]["tokens"] == 2 * base["flops_per_step"]["tokens"] == 2048 * 4096
    assert longer["time_s"]["step"] > base["time_s"]["step"]
    assert main(argv + ["--seq-length", "4096", "--capacity-factor", "none"]) == 0
    assert capsys.readouterr().out.startswith(
        "piper predict: switch-1t (seq_length 4096, moe_capacity_factor none (dropless)) on dgx-h100")


@pytest.mark.parametrize("flags, message", [
    (["--seq-length", "4k"], r"--seq-length='4k': must be a whole number of tokens; write e.g. --seq-length 4096"),
    (["--seq-length", "0"], r"--seq-length=0: must be positive"),
    (["--capacity-factor", "big"], r"--capacity-factor='big': must be a number or 'none' \(dropless\)"),
    (["--capacity-factor", "-1"], r"--capacity-factor=-1.0: must be a finite positive number"),
])
@pytest.mark.parametrize("command", ["predict", "plan"])
def test_bad_model_settings_exit_2_naming_key_value_rule_and_fix(capsys, flags, message, command):
    tail = ["--parallel", "ep=2,gbs=8"] if command == "predict" else []
    assert main([command, "tiny-moe", "--cluster", "cpu-local", "--gpus", "2"] + flags + tail) == 2
    assert re.search(message, capsys.readouterr().err)


def test_capacity_factor_needs_experts():
    dense = dataclasses.replace(load_model("tiny-moe"), name="dense", num_experts=0, moe_ffn_hidden_size=None,
                                moe_capacity_factor=None)
    with pytest.raises(SpecError, match=r"--capacity-factor='1.0': applies to MoE models; dense has no routed experts"):
        from piper_core.cli import parse
        parse._capacity_factor(dense, "1.0")


# ---- 4. flash attention's backward, the dispatcher's host sync ------------------------------------

def _layer(model, cluster, moe, **kw):
    from piper_core.timing.layer import layer_cost
    p = plan(model, **{**dict(gpus=8, ep=8, global_batch_size=8), **kw})
    return layer_cost(model, shape_of(p), cluster, moe)


@pytest.mark.parametrize("moe", [False, True])
def test_flash_backward_recomputes_the_scores_unfused_keeps_them(moe):
    """Only the core attention's backward factor differs between the backends (2.5x against 2x
    its forward); the unfused forward also streams the scores, so compare each against its own core."""
    from piper_core.timing.compute import attention_forward
    for backend, factor in (("flash", 2.5), ("unfused", 2.0)):
        p = plan(MIXTRAL, gpus=8, ep=8, global_batch_size=8, attention_backend=backend)
        s = shape_of(p)
        _, core = attention_forward(MIXTRAL, s, H100.accelerator)
        with_core = _layer(MIXTRAL, H100, moe, attention_backend=backend)
        bwd_rest = with_core.compute_bwd - factor * core
        assert core > 0
        assert bwd_rest == pytest.approx(_backward_without_core(MIXTRAL, s, moe), rel=1e-9), backend


def _backward_without_core(model, s, moe):
    """The backward the layer prices for everything but core attention (2x each forward GEMM and
    element-wise pass, the experts' 2x, host work at its factor): built from the compute terms."""
    from piper_core.timing.compute import (attention_forward, dense_mlp_forward, host_overhead_forward,
                                           moe_forward)
    acc = H100.accelerator
    attn_rest, _ = attention_forward(model, s, acc)
    if not moe:
        return 2 * (attn_rest + dense_mlp_forward(model, s, acc)) + acc.backward_overhead_factor * host_overhead_forward(
            model, s, acc, moe=False)
    rest, experts = moe_forward(model, s, acc)
    return 2 * (attn_rest + rest + experts) + acc.backward_overhead_factor * host_overhead_forward(model, s, acc, moe=True)


def test_each_moe_forward_pays_the_dispatch_sync_and_a_full_recompute_pays_it_again():
    sync = H100.accelerator.moe_sync_us * 1e-6
    assert sync == pytest.approx(26e-6)
    off = dataclasses.replace(H100, accelerator=dataclasses.replace(H100.accelerator, moe_sync_us=0.0))
    on, none = _layer(MIXTRAL, H100, True), _layer(MIXTRAL, off, True)
    assert on.compute_fwd - none.compute_fwd == pytest.approx(sync)
    assert on.compute_bwd == pytest.approx(none.compute_bwd)  # the backward reuses the host's splits
    full = dict(recompute="full", recompute_num_layers=1)
    assert (_layer(MIXTRAL, H100, True, **full).compute_bwd - _layer(MIXTRAL, off, True, **full).compute_bwd
            == pytest.approx(sync))
    dense_on, dense_off = _layer(MIXTRAL, H100, False), _layer(MIXTRAL, off, False)
    assert dense_on.compute_fwd == pytest.approx(dense_off.compute_fwd)  # dense layers do not route
    assert CPU.accelerator.moe_sync_us == 0.0  # CPU ranks: host and device are one


def test_a_negative_sync_is_refused_naming_the_key():
    with pytest.raises(SpecError, match="accelerator.moe_sync_us"):
        dataclasses.replace(H100.accelerator, moe_sync_us=-1.0)


def _shared(cluster, share):
    return dataclasses.replace(cluster, accelerator=dataclasses.replace(cluster.accelerator, core_share=share))


def test_ranks_sharing_cores_run_the_pipeline_fill_and_drain_faster_but_no_rank_its_own_passes():
    """``core_share`` < 1 (4 CPU ranks on 2 cores: 0.5): the schedule at the all-busy rates shrinks to
    ``share`` of itself, never below the slowest rank's own passes; plans without a pipeline, and
    every GPU preset (share 1), are priced as before; the search's fast path prices it the same way."""
    from piper_core.timing.step import ExchangeVariants, shared_cores

    assert shared_cores(11.0, 8, 1.0, 1.0) == 11.0
    assert shared_cores(11.0, 8, 1.0, 0.5) == 8.0     # pp 4, 8 micro-batches: the own passes bound it
    assert shared_cores(20.0, 4, 1.0, 0.5) == 10.0    # a long fill (slow sends): half of it
    from piper_core.validate.cases import VAL_MODEL as model

    half = _shared(CPU, 0.5)
    pp4 = plan(model, gpus=4, pp=4, micro_batch_size=2, global_batch_size=16, distributed_optimizer=False)
    from piper_core.timing.step import _pipeline, _stage_times

    shared = step_time(model, pp4, half)
    stages, _ = _stage_times(model, pp4, half)
    unshared = _pipeline(stages, pp4.num_microbatches, 1, True)  # the schedule at the all-busy rates
    m, slow = pp4.num_microbatches, max(s.total for s in stages)
    assert unshared > m * slow and shared.pipeline == pytest.approx(max(m * slow, 0.5 * unshared))
    assert shared.pipeline < unshared and shared.bubble >= 0
    flat = plan(model, gpus=4, ep=4, micro_batch_size=2, global_batch_size=16, distributed_optimizer=False)
    stages, _ = _stage_times(model, flat, half)  # no pipeline: nothing waits, the all-busy rates stand
    assert step_time(model, flat, half).pipeline == pytest.approx(flat.num_microbatches * stages[0].total)
    for p in (pp4, flat):
        assert ExchangeVariants(model, p, half).step(p) == pytest.approx(step_time(model, p, half, exact=False).step)
    assert H100.accelerator.core_share == 1.0 and CPU.accelerator.core_share == 1.0
    with pytest.raises(SpecError, match="accelerator.core_share"):
        dataclasses.replace(CPU.accelerator, core_share=0.0)


def test_calibration_writes_the_share_of_a_core_each_rank_had(tmp_path):
    """The profile's ``core_share`` is the host's cores over the run's ranks (at most 1), from the
    machine the calibration records; a refit of an older profile computes it the same way."""
    from piper_core.calibrate.profile import read_profile
    from piper_core.calibrate.run import refit

    for cores, expect in ((2, 1.0), (1, 0.5)):  # the profile was measured on 2 ranks
        src = tmp_path / f"src{cores}.yaml"
        text = open("docs/e2e/profiles/megatron-2x1-50mbit.yaml").read()
        src.write_text(re.sub(r"(\n    cores: )\d+", rf"\g<1>{cores}", text, count=1))
        assert read_profile(src).calibration["machine"]["cores"] == cores and read_profile(src).calibration["ranks"] == 2
        out = refit(src, tmp_path / f"out{cores}.yaml", "test")
        assert out.cluster.accelerator.core_share == expect


def test_gemms_and_copies_run_at_the_core_share_of_the_benchmarked_rate_when_ranks_share_cores():
    """The GEMM and copy benchmarks time one call while its rank holds a core (4 ranks on 2 cores
    fitted the same fp32 rate as 2 ranks: 0.1015 and 0.1003 TFLOP/s), so a step with every rank busy
    runs them at core_share of it; the probe-fitted element-wise rate and host terms are not scaled."""
    from piper_core.timing.compute import gemm_time, stream_time

    cpu = load_cluster("cpu-local").accelerator
    full, half = dataclasses.replace(cpu, core_share=1.0), dataclasses.replace(cpu, core_share=0.5)
    latency = cpu.kernel_latency_us * 1e-6
    t1, t2 = gemm_time(full, "fp32", 512, 512, 512), gemm_time(half, "fp32", 512, 512, 512)
    assert t2 - latency == pytest.approx(2 * (t1 - latency))
    assert stream_time(half, 1e8, elementwise=False) == pytest.approx(2 * stream_time(full, 1e8, elementwise=False))
    with_rate = dataclasses.replace(half, elementwise_gb_per_s=2.0)
    assert stream_time(with_rate, 1e8) == pytest.approx(1e8 / 2e9)  # fitted to whole steps: already shared
    h100 = load_cluster("dgx-h100").accelerator
    assert h100.core_share == 1.0  # a device per rank: no GPU prediction moves
