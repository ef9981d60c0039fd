"""piper calibrate's fits recover known parameters from data the model itself generates; profiles
round-trip and load wherever a cluster does; --cluster and --profile exclude each other."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from piper_core.calibrate.assemble import fit_accelerator, fit_bulk, fit_links, shape_cluster
from piper_core.calibrate.fit import GemmPoint, LinkSample, fit_alpha_beta, fit_roofline, quality
from piper_core.calibrate.profile import is_profile, load_profile, profile_text, read_profile, write_profile
from piper_core.calibrate.steps import Topology, gemm_shapes
from piper_core.cli.main import main
from piper_core.emulate.spec import TCP_PAYLOAD_EFFICIENCY
from piper_core.errors import SpecError
from piper_core.presets import load_cluster
from piper_core.timing import comm
from piper_core.timing.compute import gemm_time
from piper_core.timing.topology import Group

BASE = load_cluster("cpu-local")
ACC = dataclasses.replace(BASE.accelerator, peak_tflops_bf16=1.2, peak_tflops_fp32=0.2, peak_tflops_fp16=0.15,
                          gemm_efficiency=0.8, hbm_gb_per_s=20.0, hbm_efficiency=0.9, kernel_latency_us=15.0)
SIZES = [2 ** e for e in range(10, 23, 2)]


def test_quality_reports_r2_and_the_largest_relative_residual():
    q = quality([1.0, 2.0, 4.0], [1.1, 2.0, 3.0])
    assert q.points == 3
    assert q.max_rel_residual == pytest.approx(0.25)
    assert q.r2 == pytest.approx(1 - (0.01 + 1.0) / np.var([1.0, 2.0, 4.0]) / 3)


def test_alpha_beta_recovers_latency_and_bandwidth():
    samples = [LinkSample(peers=3, nbytes=3 * n / 4, seconds=3 * 40e-6 + 3 * n / 4 / 2e9) for n in SIZES]
    fit = fit_alpha_beta(samples)
    assert fit.latency_us == pytest.approx(40.0, rel=1e-6)
    assert fit.bandwidth_gb_per_s == pytest.approx(2.0, rel=1e-6)
    assert fit.fit.r2 == pytest.approx(1.0) and fit.fit.max_rel_residual < 1e-9


def test_alpha_beta_shrugs_off_one_disturbed_median():
    rng = np.random.default_rng(0)
    samples = [LinkSample(peers=1, nbytes=n / 2, seconds=(100e-6 + n / 2 / 1e9) * (1 + 0.03 * rng.standard_normal()))
               for n in SIZES]
    samples[2] = dataclasses.replace(samples[2], seconds=samples[2].seconds * 4)  # a burst of load elsewhere
    fit = fit_alpha_beta(samples)
    assert fit.latency_us == pytest.approx(100.0, rel=0.15)
    assert fit.bandwidth_gb_per_s == pytest.approx(1.0, rel=0.1)
    assert fit.fit.max_rel_residual > 0.7  # the outlier (4x the model) is reported, not hidden


def _curve(group: Group, cluster) -> dict:
    return {"group_size": group.size, "stride": group.stride,
            "points": [{"bytes": n, "seconds": comm.all_to_all_flat(group, n, cluster)} for n in SIZES]}


def test_one_level_fit_makes_comm_reproduce_the_measured_all_to_all():
    topo = Topology(nodes=1, ranks_per_node=4)
    truth = shape_cluster(topo, BASE, [(60.0, 1.5)])
    bench = {"alltoall-all": _curve(Group(name="all", size=4, stride=1), truth)}
    cluster, report = fit_links(bench, topo, BASE)
    assert cluster.links == truth.links
    assert report["curves"]["alltoall-all"]["r2"] == pytest.approx(1.0)
    assert report["curves"]["alltoall-all"]["max_rel_residual"] < 1e-4


def test_bulk_fit_recovers_the_exchange_rate_and_keeps_the_all_to_all_links():
    """The bulk two-way exchange (``exchange-intra``) sets the inner level's ``bulk_gb_per_s`` given its
    fitted latency; the all-to-all's bandwidth is kept. Without the benchmark nothing changes."""
    topo = Topology(nodes=1, ranks_per_node=2)
    cluster = shape_cluster(topo, BASE, [(200.0, 2.5)])
    points = [{"bytes": n, "seconds": 200e-6 + n / 1.6e9} for n in (8 << 20, 32 << 20)]
    fitted, report = fit_bulk({"exchange-intra": {"group_size": 2, "stride": 1, "points": points}}, cluster)
    link = fitted.links[0]
    assert link.bulk_gb_per_s == pytest.approx(1.6, rel=1e-4) and link.bandwidth_gb_per_s == 2.5
    assert link.latency_us == 200.0 and report["r2"] == pytest.approx(1.0, abs=1e-6)
    assert report["bulk_gb_per_s"] == link.bulk_gb_per_s and report["all_to_all_gb_per_s"] == 2.5
    same, report = fit_bulk({}, cluster)
    assert same == cluster and same.links[0].bulk_rate_gb_per_s == 2.5 and "not measured" in report["source"]


def test_two_level_fit_recovers_intra_and_inter_node_links():
    # links with no token bucket (data the model generates has none; the emulated link's bucket is
    # the next test's)
    topo = Topology(nodes=2, ranks_per_node=2)
    truth = shape_cluster(topo, BASE, [(50.0, 2.0), (80.0, 0.006)])
    bench = {"alltoall-all": _curve(Group(name="all", size=4, stride=1), truth),
             "alltoall-intra": _curve(Group(name="intra", size=2, stride=1), truth),
             "alltoall-inter": _curve(Group(name="inter", size=2, stride=2), truth)}
    cluster, report = fit_links(bench, topo, BASE)
    assert [(lvl.latency_us, lvl.bandwidth_gb_per_s) for lvl in cluster.links] == [
        pytest.approx((50.0, 2.0), rel=1e-3), pytest.approx((80.0, 0.006), rel=1e-3)]
    assert all(c["max_rel_residual"] < 1e-3 for c in report["curves"].values())


def test_missing_link_data_falls_back_to_the_base_and_says_so():
    topo = Topology(nodes=1, ranks_per_node=2)
    cluster, report = fit_links({}, topo, BASE)
    assert cluster.links[0].latency_us == BASE.links[0].latency_us
    assert "not measured" in report["levels"]["intra-node"]["source"]


def _gemm_bench(acc, shapes) -> dict:
    return {"gemm": {dtype: [{"m": m, "n": n, "k": k, "seconds": gemm_time(acc, dtype, m, n, k)} for m, n, k in rows]
                     for dtype, rows in shapes.items()}}


def test_roofline_fit_makes_gemm_time_reproduce_the_measured_gemms():
    bench = _gemm_bench(ACC, gemm_shapes(quick=False))
    acc, report = fit_accelerator(bench, BASE.accelerator)
    assert acc.peak_flops("bf16") * acc.gemm_efficiency == pytest.approx(ACC.peak_flops("bf16") * 0.8, rel=1e-4)
    assert acc.peak_flops("fp32") * acc.gemm_efficiency == pytest.approx(ACC.peak_flops("fp32") * 0.8, rel=1e-3)
    assert acc.hbm_gb_per_s * acc.hbm_efficiency == pytest.approx(18.0, rel=1e-4)
    assert acc.kernel_latency_us == pytest.approx(15.0, rel=1e-4)
    for dtype in ("bf16", "fp32", "fp16"):
        assert report["gemm"][dtype]["r2"] == pytest.approx(1.0, abs=1e-6)
        assert report["gemm"][dtype]["max_rel_residual"] < 1e-3
    curve = report["gemm"]["bf16"]["curve"]  # the efficiency curve: achieved / peak per shape
    assert len(curve) == len(bench["gemm"]["bf16"]) and max(p["efficiency"] for p in curve) <= 1.0


def test_roofline_fit_with_a_copy_benchmark_keeps_hbm_at_the_measured_copy_rate():
    bench = _gemm_bench(ACC, gemm_shapes(quick=True)) | {"memory": {"gb_per_s": 40.0}}
    acc, _ = fit_accelerator(bench, BASE.accelerator)
    assert acc.hbm_gb_per_s == 40.0
    assert acc.hbm_gb_per_s * acc.hbm_efficiency == pytest.approx(18.0, rel=1e-3)
    assert acc.copy_gb_per_s == 40.0 and acc.copy_rate_gb_per_s == 40.0


def test_a_copy_slower_than_the_gemms_stream_keeps_its_own_rate_for_cold_copies():
    """Where the GEMMs stream faster than the copy (cache-resident weights), HBM is raised to their
    rate, and ``copy_gb_per_s`` keeps the copy's (what a move of experts packs at)."""
    bench = _gemm_bench(ACC, gemm_shapes(quick=True)) | {"memory": {"gb_per_s": 9.0}}
    acc, _ = fit_accelerator(bench, BASE.accelerator)
    assert acc.hbm_gb_per_s == pytest.approx(18.0, rel=1e-3) and acc.hbm_efficiency == 1.0
    assert acc.copy_gb_per_s == 9.0 and acc.copy_rate_gb_per_s == 9.0
    without, _ = fit_accelerator(_gemm_bench(ACC, gemm_shapes(quick=True)), BASE.accelerator)
    assert without.copy_gb_per_s is None and without.copy_rate_gb_per_s == without.hbm_gb_per_s * without.hbm_efficiency


def test_roofline_fit_is_robust_to_noise():
    rng = np.random.default_rng(1)
    pts = [GemmPoint(m=m, n=n, k=k, seconds=gemm_time(ACC, "bf16", m, n, k) * (1 + 0.04 * rng.standard_normal()))
           for m, n, k in gemm_shapes(quick=False)["bf16"]]
    fit = fit_roofline(pts)
    assert fit.compute_flops_per_s == pytest.approx(1.2e12 * 0.8, rel=0.1)
    assert fit.memory_bytes_per_s == pytest.approx(18e9, rel=0.1)
    assert fit.fit.r2 > 0.98


CALIBRATION = {"machine": {"hostname": "h", "cores": 2}, "date": "2025-01-01T00:00:00+00:00", "ranks": 2, "nodes": 1,
               "command": "piper calibrate --out p.yaml", "benchmarks": {"memory": {"result": {"seconds": 1e-3}}},
               "fits": {"links": {"levels": {}}}, "failures": {}}


def test_profile_round_trip_and_load_cluster(tmp_path):
    cluster = dataclasses.replace(BASE, accelerator=ACC, name="calibrated-test")
    path = tmp_path / "p.yaml"
    text = write_profile(path, cluster, CALIBRATION)
    prof = read_profile(path)
    assert prof.cluster == cluster and prof.calibration == CALIBRATION
    assert profile_text(prof.cluster, prof.calibration) == text  # loads back unchanged
    assert is_profile(path) and load_profile(path) == cluster and load_cluster(str(path)) == cluster
    assert not is_profile(tmp_path / "missing.yaml")


def test_profile_errors_name_the_file_and_the_key(tmp_path):
    path = tmp_path / "p.yaml"
    write_profile(path, BASE, CALIBRATION)
    path.write_text(path.read_text().replace("calibration:", "calibraton:"))
    with pytest.raises(SpecError, match=r"p\.yaml: calibraton='given': is not a key of a calibration profile; "
                                        r"did you mean 'calibration'\?"):
        load_profile(path)
    bare = tmp_path / "bare.yaml"
    bare.write_text("name: x\naccelerator: {}\n")
    with pytest.raises(SpecError, match="is a ClusterSpec YAML, not a calibration profile"):
        load_profile(bare)


def test_cli_takes_a_profile_or_a_cluster_never_both(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    write_profile(path, dataclasses.replace(BASE, name="calibrated-test"), CALIBRATION)
    argv = ["tiny-moe", "--gpus", "2", "--parallel", "ep=2,gbs=8", "--json"]
    assert main(["predict", *argv, "--profile", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "calibrated-test"
    assert main(["predict", *argv, "--profile", str(path), "--cluster", "cpu-local"]) == 2
    assert "--cluster/--profile=" in capsys.readouterr().err
    assert main(["plan", "tiny-moe", "--gpus", "2"]) == 2
    assert "give --cluster" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--emulate", "2x2", "--ranks", "4"], "--ranks=4: cannot be combined with --emulate"),
    (["--inter-node-mbit", "100"], "--inter-node-mbit=100.0: shapes the links of an emulated cluster"),
    (["--emulate", "2"], "--emulate='2': must be NODESxRANKS"),
    (["--ranks", "0"], "--ranks=0: must be >= 1"),
])
def test_calibrate_rejects_bad_flags_before_measuring(tmp_path, capsys, argv, match):
    assert main(["calibrate", "--out", str(tmp_path / "p.yaml"), *argv]) == 2
    assert match in capsys.readouterr().err


def test_calibrate_wants_a_yaml_out(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "p.json")]) == 2
    assert "--out=" in capsys.readouterr().err


def test_calibrate_under_torchrun_says_it_is_not_supported(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    assert main(["calibrate", "--out", str(tmp_path / "p.yaml")]) == 2
    assert "running it under torchrun is not supported yet" in capsys.readouterr().err


def test_points_inside_the_emulated_links_burst_are_left_out_of_its_fit():
    # 2 nodes x 1 rank at 50 Mbit/s: all-to-alls up to 16 KiB per rank ride tbf's 16 KiB bucket at
    # loopback speed (~0.35 ms flat, as measured), larger ones the shaped link
    topo = Topology(nodes=2, ranks_per_node=1, inter_node_mbit=50.0, emulated=True)
    truth = shape_cluster(topo, BASE, [(50.0, 1.0), (60.0, 0.0058)])
    group = Group(name="all", size=2, stride=1)
    # ... and (unlike the model) 64 KiB ones partly: 4x the bucket or less is left out
    points = [{"bytes": n, "seconds": 350e-6 if n <= 16384 else comm.all_to_all_flat(group, n, truth) * (
        0.5 if n <= 65536 else 1.0)} for n in [2 ** e for e in range(10, 23, 2)]]
    cluster, report = fit_links({"alltoall-all": {"group_size": 2, "stride": 1, "points": points}}, topo, BASE)
    inter = report["levels"]["inter-node"]
    # the bandwidth from the shaped points; the per-message latency from the bucket's (their median)
    assert cluster.links[1].bandwidth_gb_per_s == pytest.approx(0.0058, rel=0.02)
    assert cluster.links[1].latency_us == pytest.approx(350.0)
    assert inter["left_out"].startswith("4 points") and "tbf burst (16384 B)" in inter["left_out"]
    # the line through every point, as before: the link priced far too fast for large messages
    every = fit_alpha_beta([LinkSample(peers=1, nbytes=p["bytes"] / 2, seconds=p["seconds"]) for p in points])
    assert every.bandwidth_gb_per_s > 1.2 * 0.0058
    # a real (not emulated) link has no bucket: every point is fitted
    real = Topology(nodes=2, ranks_per_node=1)
    _, report = fit_links({"alltoall-all": {"group_size": 2, "stride": 1, "points": points}}, real, BASE)
    assert "left_out" not in report["levels"]["inter-node"]


E2E_PROFILE = "docs/e2e/profiles/megatron-2x1-50mbit.yaml"


def test_refit_fits_a_stored_profile_again_without_measuring(tmp_path, capsys):
    out = tmp_path / "refit.yaml"
    assert main(["calibrate", "--refit", E2E_PROFILE, "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["refit_of"] == E2E_PROFILE and summary["steps"] == []
    old, new = read_profile(E2E_PROFILE), read_profile(out)
    for key in ("machine", "date", "benchmarks", "nodes", "inter_node_mbit"):
        assert new.calibration[key] == old.calibration[key], key
    assert "(refit of: piper calibrate --out" in new.calibration["command"]
    # measured at 50 Mbit/s through tbf: the fitted link now carries what the shaped link carries
    # (6.25 MB/s less TCP/IP headers, as the emulator prices it), the burst's points left out
    assert new.cluster.links[-1].bandwidth_gb_per_s == pytest.approx(50e6 / 8 * TCP_PAYLOAD_EFFICIENCY / 1e9, rel=0.1)
    assert new.cluster.accelerator.peak_tflops_bf16 == old.cluster.accelerator.peak_tflops_bf16
    again = tmp_path / "again.yaml"
    assert main(["calibrate", "--refit", str(out), "--out", str(again), "--json"]) == 0
    assert read_profile(again).cluster == new.cluster  # nothing left to change


def test_refit_refuses_measuring_flags_and_a_missing_profile(tmp_path, capsys):
    out = str(tmp_path / "r.yaml")
    assert main(["calibrate", "--refit", E2E_PROFILE, "--out", out, "--quick"]) == 2
    assert "--quick='given': measures, and --refit measures nothing" in capsys.readouterr().err
    assert main(["calibrate", "--refit", str(tmp_path / "none.yaml"), "--out", out]) == 2
    err = capsys.readouterr().err
    assert "--refit=" in err and "must be an existing profile YAML" in err
