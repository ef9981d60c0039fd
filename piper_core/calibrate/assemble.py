"""From the ranks' raw results to a calibrated :class:`ClusterSpec` and its fit report (pure).

Raw results are reduced to medians here: a collective's repetition takes as long as its slowest
rank, so each repetition's time is the maximum over ranks and the curve point is the median over
repetitions; GEMM and copy points are the median over ranks of each rank's median. The fits
(:mod:`piper_core.calibrate.fit`) then set:

* ``accelerator``: ``peak_tflops_bf16`` = the larger of the best measured bf16 rate and the fitted
  compute rate ``R_c`` (that of large GEMMs); ``gemm_efficiency`` = ``R_c / peak``;
  ``gemm_half_size`` = the fitted shape knee where the bf16 GEMMs identify one, else 0 (flat; the
  report says why); fp32 and fp16 peaks = their fitted compute rates / that efficiency;
  ``kernel_latency_us`` = the fitted latency;
  ``hbm_gb_per_s`` = the measured copy bandwidth (read + write), ``hbm_efficiency`` = the GEMM fit's
  memory rate / it (both raised to the memory rate, efficiency 1, if the GEMMs stream faster than
  the copy, as cache-resident weights do); ``copy_gb_per_s`` = the measured copy bandwidth, kept
  (what a copy of cold state gets);
* ``links``: one level (the node) for local ranks, two for an emulated cluster; each level's
  latency and bandwidth from the flat all-to-all curves that cross it (:func:`fit_links`);
* everything else (HBM size, memory envelope, host terms) from the base preset.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from piper_core.calibrate.fit import GemmFit, GemmPoint, LinkSample, fit_alpha_beta, fit_compute_rate, \
    fit_roofline, quality
from piper_core.calibrate.steps import Outcome, Topology
from piper_core.emulate.netns import tbf_burst_bytes
from piper_core.emulate.spec import TCP_PAYLOAD_EFFICIENCY
from piper_core.specs.cluster import AcceleratorSpec, ClusterSpec, LinkLevel
from piper_core.timing import comm
from piper_core.timing.compute import element_bytes, gemm_time
from piper_core.timing.topology import Group, level_shares

DOMINATES = 0.7
"""A point of a curve that crosses several levels informs an outer level's fit only where the
inner levels, as already fitted, explain less than this share of its time."""


def _sig(x: float, digits: int = 5) -> float:
    return float(f"{x:.{digits}g}")


# ---- raw results -> medians ------------------------------------------------------------------------

def reduce_outcomes(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Name -> the medians of each successful step (the profile's ``benchmarks``)."""
    out: dict[str, Any] = {}
    for o in outcomes:
        if o.status != "ok":
            continue
        kind = o.name.split("-")[0]
        if o.name == "gemm":
            out["gemm"] = _gemm_medians(o.results)
            out["gemm_operands"] = _gemm_operands(o.results[0].get("gemm_pool_mib", 0))
        elif o.name == "memory":
            seconds = statistics.median(r["seconds"] for r in o.results)
            out["memory"] = {"bytes": o.results[0]["bytes"], "seconds": seconds,
                             "gb_per_s": _sig(o.results[0]["bytes"] / seconds / 1e9)}
            ops = [op for r in o.results for op in r.get("elementwise", [])]
            if ops:  # per op: the median rate over ranks
                names = sorted({op["op"] for op in ops})
                out["memory"]["elementwise_gb_per_s"] = {
                    name: _sig(statistics.median(op["bytes"] / op["seconds"] / 1e9 for op in ops if op["op"] == name))
                    for name in names}
        elif kind in ("alltoall", "allreduce", "allgather", "reducescatter", "p2p", "exchange"):
            out[o.name] = _curve_medians(o.results, half=kind == "p2p")
        else:
            out[o.name] = {"ranks": list(o.results)}  # e.g. the host-overhead probe: kept as returned
    return out


def _gemm_operands(pool_mib: int) -> dict[str, Any]:
    """How the sweep fed its GEMMs (:func:`piper_core.calibrate.bench.operand_pool`), for the profile's reader."""
    if pool_mib:
        return {"pool_mib": pool_mib, "timed": f"each call on the next operand pair of a {pool_mib} MiB pool (out of cache)"}
    return {"pool_mib": 0, "timed": "one operand pair repeated (in cache; profiles measured before 2026-12-08)"}


def _gemm_medians(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, float]]]:
    out = {}
    for dtype, rows in results[0]["gemm"].items():
        points = []
        for i, (m, n, k, _) in enumerate(rows):
            seconds = statistics.median(r["gemm"][dtype][i][3] for r in results)
            points.append({"m": m, "n": n, "k": k, "seconds": seconds})
        out[dtype] = points
    return out


def _curve_medians(results: Sequence[dict[str, Any]], *, half: bool) -> dict[str, Any]:
    """Per size: the slowest taking part rank per repetition, then the median (halved for a ping-pong)."""
    ranks = [r for r in results if r.get("paired", True)]
    points = []
    for i in range(min(len(r["points"]) for r in ranks)):
        reps = min(len(r["points"][i]["times"]) for r in ranks)
        slowest = [max(r["points"][i]["times"][j] for r in ranks) for j in range(reps)]
        points.append({"bytes": ranks[0]["points"][i]["bytes"],
                       "seconds": statistics.median(slowest) / (2 if half else 1)})
    return {"group_size": ranks[0]["group_size"], "stride": ranks[0]["stride"], "points": points}


# ---- links -----------------------------------------------------------------------------------------

def shape_cluster(topology: Topology, base: ClusterSpec,
                  links: Sequence[tuple[float, float]] | None = None) -> ClusterSpec:
    """The calibrated cluster's layout (one level per node and one across nodes), with
    ``links`` = [(latency_us, bandwidth_gb_per_s)] per level (placeholders when None)."""
    names = ["intra-node"] if topology.nodes == 1 else ["intra-node", "inter-node"]
    domains: list[int | None] = [None] if topology.nodes == 1 else [topology.ranks_per_node, None]
    values = links or [(1.0, 1.0)] * len(names)
    levels = tuple(LinkLevel(name=n, domain_gpus=d, latency_us=lat, bandwidth_gb_per_s=bw)
                   for n, d, (lat, bw) in zip(names, domains, values))
    return dataclasses.replace(base, gpus_per_node=topology.ranks_per_node, links=levels)


FITTED_CURVES = ("alltoall-all", "alltoall-intra", "alltoall-inter")
"""The flat all-to-all curves the links are fitted to (the hierarchical one is a check)."""


def _a2a_curves(benchmarks: dict[str, Any]) -> list[tuple[str, Group, list[dict[str, float]]]]:
    return [(name, Group(name=name, size=b["group_size"], stride=b["stride"]), b["points"])
            for name, b in benchmarks.items() if name in FITTED_CURVES]


def _fallback_link(level: int, topology: Topology, base: ClusterSpec) -> tuple[tuple[float, float], str]:
    if level == 1 and topology.inter_node_mbit is not None:  # the shaped rate, as emulate.spec prices it
        bw = topology.inter_node_mbit * 1e6 / 8 * TCP_PAYLOAD_EFFICIENCY / topology.ranks_per_node / 1e9
        return (base.links[-1].latency_us, bw), "base latency; bandwidth from the tbf rate (not measured)"
    link = base.links[min(level, len(base.links) - 1)]
    return (link.latency_us, link.bandwidth_gb_per_s), f"base preset {base.name} (not measured)"


BURST_MARGIN = 4
"""Points whose bytes through a node's link are within this many tbf bursts are left out of the
inter-node fit: up to 1/BURST_MARGIN of such a message can pass unshaped from a full bucket.
Measured (docs/e2e/profiles): at 1000 Mbit/s (125 kB bucket) 128 KiB messages ran at 3x the shaped
rate, 512 KiB ones at it; at 50 Mbit/s (16 KiB) 8 KiB ones at 6x, 32 KiB ones at it."""


def _shaper_burst(topology: Topology, level: int, levels: int) -> int | None:
    """Bytes the emulated inter-node link's token bucket passes unshaped (None: not a shaped level).

    Measured on a 50 Mbit/s link (docs/e2e.md, 2026-12-04): all-to-alls of <= 16 KiB per rank ran in
    0.3-0.4 ms, as on loopback, and larger ones at the shaped rate; one alpha-beta line through both
    regimes put the link at 8.7 MB/s (it carries 6.25) and priced every large message 29-35 % fast."""
    if not topology.emulated or topology.inter_node_mbit is None or level != levels - 1 or levels < 2:
        return None
    return tbf_burst_bytes(topology.inter_node_mbit)


def fit_links(benchmarks: dict[str, Any], topology: Topology, base: ClusterSpec) -> tuple[ClusterSpec, dict[str, Any]]:
    """Fit each level, innermost first, from the all-to-all curves whose outermost level it is;
    returns the cluster with the fitted links and, per level and per curve, the fit report."""
    curves = _a2a_curves(benchmarks)
    shape = shape_cluster(topology, base)
    fitted: list[tuple[float, float]] = []
    report: dict[str, Any] = {"levels": {}, "curves": {}}
    for li, level in enumerate(shape.links):
        samples, in_burst = [], []
        burst = _shaper_burst(topology, li, len(shape.links))
        for _, group, points in curves:
            shares = level_shares(group, shape)
            if not shares or shares[-1].link.name != level.name:
                continue
            inner = shape_cluster(topology, base, fitted + [(0.0, 1e30)] * (len(shape.links) - li))
            last = shares[-1]
            for p in points:
                if comm.all_to_all_flat(group, p["bytes"], inner) > DOMINATES * p["seconds"]:
                    continue  # an inner level explains this point: no evidence about this one
                sample = LinkSample(peers=last.peers, nbytes=last.peers * p["bytes"] / group.size,
                                    seconds=p["seconds"])
                # the node's link carries every one of its ranks' bytes through one token bucket
                node_bytes = sample.nbytes * topology.ranks_per_node
                (in_burst if burst is not None and node_bytes <= BURST_MARGIN * burst else samples).append(sample)
        if len(samples) < 2:  # too few points beyond the burst: fit them all rather than not at all
            samples, in_burst = samples + in_burst, []
        if len(samples) >= 2:
            # the bucket's points still measure the per-message cost (their bytes go unshaped): the
            # latency is theirs (median per peer), the bandwidth the shaped points' given it
            latency = statistics.median(s.seconds / s.peers for s in in_burst) if in_burst else None
            fit = fit_alpha_beta(samples, latency_s=latency)
            fitted.append((_sig(fit.latency_us), _sig(fit.bandwidth_gb_per_s)))
            report["levels"][level.name] = {"latency_us": fitted[-1][0], "bandwidth_gb_per_s": fitted[-1][1],
                                            "source": "fitted to the flat all-to-all", **fit.fit.as_dict()}
            if in_burst:
                report["levels"][level.name]["left_out"] = (
                    f"{len(in_burst)} points whose bytes through a node's link ({_sig(max(s.nbytes for s in in_burst))}"
                    f" B per rank at most) are within {BURST_MARGIN}x the emulated link's tbf burst ({burst} B): "
                    "a large part of each passes unshaped, so they give the latency (their median per peer), "
                    "not the bandwidth, which the others give")
        else:
            value, why = _fallback_link(li, topology, base)
            fitted.append(value)
            report["levels"][level.name] = {"latency_us": value[0], "bandwidth_gb_per_s": value[1], "source": why}
    cluster = shape_cluster(topology, base, fitted)
    for name, group, points in curves:
        report["curves"][name] = _curve_report(points, lambda b, g=group: comm.all_to_all_flat(g, b, cluster))
    return cluster, report


def _curve_report(points: Sequence[dict[str, float]], model: Callable[[float], float]) -> dict[str, Any]:
    measured = [p["seconds"] for p in points]
    predicted = [model(p["bytes"]) for p in points]
    return {**quality(measured, predicted).as_dict(),
            "curve": [{"bytes": p["bytes"], "measured_us": _sig(m * 1e6), "predicted_us": _sig(q * 1e6)}
                       for p, m, q in zip(points, measured, predicted)]}


def check_collectives(benchmarks: dict[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    """How well the fitted links price what was measured but not fitted: the hierarchical all-to-all,
    all-reduce, all-gather, reduce-scatter, point-to-point."""
    out = {}
    for name, b in benchmarks.items():
        if not (isinstance(b, dict) and "stride" in b):
            continue
        group = Group(name=name, size=b["group_size"], stride=b["stride"])
        if name == "allreduce":
            out[name] = _curve_report(b["points"], lambda n, g=group: comm.ring(g, n, cluster, passes=2))
        elif name == "allgather":
            out[name] = _curve_report(b["points"], lambda n, g=group: comm.ring(g, n, cluster))
        elif name == "reducescatter":
            out[name] = _curve_report(b["points"], lambda n, g=group: comm.reduce_scatter(g, n, cluster))
        elif name == "alltoall-hier":
            out[name] = _curve_report(b["points"], lambda n, g=group: comm.all_to_all_hierarchical(g, n, cluster))
        elif name.startswith("p2p-"):
            out[name] = _curve_report(b["points"], lambda n, g=group: comm.p2p(g, n, cluster))
    return out


def fit_bulk(benchmarks: dict[str, Any], cluster: ClusterSpec) -> tuple[ClusterSpec, dict[str, Any]]:
    """The innermost level's ``bulk_gb_per_s`` from the bulk exchange (``exchange-intra``): the
    per-direction rate that, after the level's fitted latency, explains the measured exchanges
    (:func:`fit_alpha_beta` with that latency; each point is one message each way)."""
    b = benchmarks.get("exchange-intra")
    level = cluster.links[0]
    if not (isinstance(b, dict) and len(b.get("points", ())) >= 1):
        return cluster, {"bulk_gb_per_s": level.bulk_gb_per_s,
                         "source": "not measured (no bulk exchange benchmark); the level's bandwidth prices bulk moves"}
    samples = [LinkSample(peers=1, nbytes=p["bytes"], seconds=p["seconds"]) for p in b["points"]]
    if len(samples) == 1:  # one size (the rest over the time limit): the rate after the latency
        p = samples[0]
        rate = p.nbytes / max(p.seconds - level.latency_us * 1e-6, 1e-9) / 1e9
    else:
        rate = fit_alpha_beta(samples, latency_s=level.latency_us * 1e-6).bandwidth_gb_per_s
    links = (dataclasses.replace(level, bulk_gb_per_s=_sig(rate)),) + cluster.links[1:]
    fitted = dataclasses.replace(cluster, links=links)
    report = _curve_report(b["points"], lambda n: links[0].latency_us * 1e-6 + n / (links[0].bulk_rate_gb_per_s * 1e9))
    return fitted, {"level": level.name, "bulk_gb_per_s": _sig(rate), "all_to_all_gb_per_s": level.bandwidth_gb_per_s,
                    "source": "fitted to the bulk two-way exchange, latency the level's", **report}


BANDWIDTH_DOMINATES = 4.0
"""A reduce-scatter point informs ``reduce_scatter_factor`` where the ring's bandwidth term is at
least this many times its latency term (below, the per-message cost decides and says nothing about
the bytes moved)."""


def fit_reduce_scatter(benchmarks: dict[str, Any], cluster: ClusterSpec) -> tuple[ClusterSpec, dict[str, Any]]:
    """``reduce_scatter_factor`` from the reduce-scatter curve, given the fitted links: the median over
    the bandwidth-bound points of (measured - the ring's latency) / the ring's bandwidth time."""
    b = benchmarks.get("reducescatter")
    if not (isinstance(b, dict) and "stride" in b):
        return cluster, {"factor": cluster.reduce_scatter_factor,
                         "source": "not measured (no reduce-scatter benchmark); base value kept"}
    group = Group(name="reducescatter", size=b["group_size"], stride=b["stride"])
    ratios = []
    for p in b["points"]:
        latency, bandwidth = comm.ring_parts(group, p["bytes"], cluster)
        if bandwidth > 0 and bandwidth >= BANDWIDTH_DOMINATES * latency:
            ratios.append((p["seconds"] - latency) / bandwidth)
    if len(ratios) < 2 or statistics.median(ratios) <= 0:
        return cluster, {"factor": cluster.reduce_scatter_factor,
                         "source": f"not fitted ({len(ratios)} bandwidth-bound points); base value kept"}
    factor = _sig(statistics.median(ratios), 3)
    return dataclasses.replace(cluster, reduce_scatter_factor=factor), {
        "factor": factor, "points": len(ratios), "ratios": [_sig(r, 3) for r in ratios],
        "source": "fitted to the reduce-scatter curve against the ring over the fitted links"}


# ---- accelerator -------------------------------------------------------------------------------

def _points(rows: Sequence[dict[str, float]], dtype: str = "bf16") -> list[GemmPoint]:
    return [GemmPoint(m=r["m"], n=r["n"], k=r["k"], seconds=r["seconds"], element_bytes=element_bytes(dtype))
            for r in rows]


def fit_accelerator(benchmarks: dict[str, Any], base: AcceleratorSpec,
                    precision: str = "bf16") -> tuple[AcceleratorSpec, dict[str, Any]]:
    """The accelerator's roofline terms from the GEMM and copy benchmarks (see the module doc).
    ``precision``: the dtype of the efficiency curve (the training precision the profile is for);
    the other dtypes' peaks are fitted against it. ``gemm_half_size`` is kept in bf16 terms
    (:mod:`piper_core.timing.gemm` scales it by the precision's peak)."""
    fields: dict[str, float] = {}
    report: dict[str, Any] = {}
    copy = benchmarks.get("memory")
    hbm = copy["gb_per_s"] if copy else base.hbm_gb_per_s
    gemm = benchmarks.get("gemm")
    if gemm is None or len(gemm.get(precision, [])) < 3:
        report["gemm"] = {"source": f"base accelerator {base.name} (GEMMs not measured)"}
        if copy:
            fields["hbm_gb_per_s"] = hbm
        return dataclasses.replace(base, **fields), report
    g = fit_roofline(_points(gemm[precision], precision))
    peak = max(g.best_rate, g.compute_flops_per_s)
    eff = min(1.0, g.compute_flops_per_s / peak)
    fields.update({f"peak_tflops_{precision}": _sig(peak / 1e12)}, gemm_efficiency=_sig(eff, 4),
                  kernel_latency_us=_sig(g.latency_s * 1e6))
    for dtype in ("bf16", "fp32", "fp16"):
        rate = None if dtype == precision else fit_compute_rate(_points(gemm.get(dtype, []), dtype), g)
        if rate is not None:
            fields[f"peak_tflops_{dtype}"] = _sig(rate / fields["gemm_efficiency"] / 1e12)
    bf16_peak = fields.get("peak_tflops_bf16", base.peak_tflops_bf16)
    fields["gemm_half_size"] = _sig(g.half_size * bf16_peak / fields[f"peak_tflops_{precision}"])
    mem_gb = g.memory_bytes_per_s / 1e9
    if copy:
        fields["copy_gb_per_s"] = copy["gb_per_s"]
    if mem_gb <= 0:
        fields.update(hbm_gb_per_s=hbm, hbm_efficiency=1.0)
    elif mem_gb > hbm:
        fields.update(hbm_gb_per_s=_sig(mem_gb), hbm_efficiency=1.0)
    else:
        fields.update(hbm_gb_per_s=hbm, hbm_efficiency=min(1.0, _sig(mem_gb / hbm, 4)))
    elementwise = (copy or {}).get("elementwise_gb_per_s")
    if elementwise:
        # the harmonic mean: the rate at which an equal number of bytes through each op streams
        fields["elementwise_gb_per_s"] = _sig(len(elementwise) / sum(1 / v for v in elementwise.values()))
        report["elementwise"] = {"gb_per_s": dict(elementwise), "fitted": fields["elementwise_gb_per_s"]}
    acc = dataclasses.replace(base, **fields)
    report["gemm"] = _gemm_report(g, acc, gemm, precision)
    report["gemm"]["operands"] = benchmarks.get("gemm_operands", _gemm_operands(0))["timed"]
    return acc, report


def _gemm_report(g: GemmFit, acc: AcceleratorSpec, gemm: dict[str, Any], precision: str) -> dict[str, Any]:
    """Fit quality of the model with the fitted accelerator, per dtype, and ``precision``'s efficiency curve."""
    out: dict[str, Any] = {"compute_tflops": _sig(g.compute_flops_per_s / 1e12),
                           "memory_gb_per_s": _sig(g.memory_bytes_per_s / 1e9),
                           "latency_us": _sig(g.latency_s * 1e6), "best_tflops": _sig(g.best_rate / 1e12),
                           "half_size": _sig(g.half_size), "knee": g.knee}
    peak = acc.peak_flops(precision)  # type: ignore[arg-type]
    for dtype, rows in gemm.items():
        measured = [r["seconds"] for r in rows]
        predicted = [gemm_time(acc, dtype, r["m"], r["n"], r["k"]) for r in rows]
        entry: dict[str, Any] = quality(measured, predicted).as_dict()
        if dtype == precision:  # the efficiency curve: achieved / peak, by GEMM size
            entry["curve"] = [{"m": r["m"], "n": r["n"], "k": r["k"], "measured_us": _sig(t * 1e6),
                               "predicted_us": _sig(p * 1e6), "tflops": _sig(2 * r["m"] * r["n"] * r["k"] / t / 1e12),
                               "efficiency": _sig(2 * r["m"] * r["n"] * r["k"] / t / peak, 4)}
                              for r, t, p in zip(rows, measured, predicted)]
        out[dtype] = entry
    return out
