"""Fit the resource model's hardware terms to measured medians (pure numpy; no torch).

* **Links** (alpha-beta, Hockney): a flat all-to-all of ``nbytes`` per rank over a group that
  reaches ``peers`` ranks over one level costs ``peers x latency + peers x nbytes/size / bandwidth``
  (:func:`piper_core.timing.comm.all_to_all_flat`). The features come from the same
  :func:`~piper_core.timing.topology.level_shares` the model uses, so feeding the fitted numbers back
  reproduces the measured curve up to the residuals reported.
* **GEMMs** (roofline, :func:`piper_core.timing.compute.gemm_time`):
  ``t = max(flops / R_c, bytes / R_m) + latency``; the three unknowns are fitted together by
  enumerating where the curve turns from the memory side to the compute side (the points sorted by
  arithmetic intensity) and solving a non-negative least-squares problem per split.

Every fit minimises *relative* residuals (times span decades; a 16-row GEMM matters as much as a
4096-row one), with Huber weights (a noisy shared machine: one disturbed median must not drag the
fit) and reports R^2 (on the times) and the largest relative residual over all points.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from piper_core.timing.compute import BYTES

HUBER_DELTA = 0.15
"""Relative residual beyond which a point's weight falls off (Huber): 15 % is well outside the
run-to-run spread of a median on a quiet machine and well inside what a disturbed one shows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Quality:
    """How well a fitted curve reproduces the measured one: R^2 of the times, the largest
    |predicted - measured| / measured, and how many points."""

    r2: float
    max_rel_residual: float
    points: int

    def as_dict(self) -> dict[str, float | int]:
        return {"r2": round(self.r2, 6), "max_rel_residual": round(self.max_rel_residual, 6), "points": self.points}


def quality(measured: Sequence[float], predicted: Sequence[float]) -> Quality:
    """R^2 = 1 - SS_res / SS_tot over the times (1.0 for a single exact point) and the largest relative residual."""
    y, p = np.asarray(measured, float), np.asarray(predicted, float)
    if y.size == 0:
        return Quality(r2=float("nan"), max_rel_residual=float("nan"), points=0)
    ss_res = float(np.sum((y - p) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res <= 1e-30 else 0.0)
    return Quality(r2=r2, max_rel_residual=float(np.max(np.abs(p - y) / y)), points=int(y.size))


def nnls_relative(x: np.ndarray, t: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """``theta >= 0`` minimising ``sum(w * ((x @ theta - t) / t)^2)``; exact for few columns (every
    subset of free variables is solved, the best feasible one kept)."""
    rows, cols = x.shape
    w = np.sqrt(weights if weights is not None else np.ones(rows)) / t
    a, b = x * w[:, None], t * w
    best, best_cost = np.zeros(cols), float(np.sum(b ** 2))
    for k in range(1, cols + 1):
        for free in itertools.combinations(range(cols), k):
            sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
            if np.any(sol < 0):
                continue
            theta = np.zeros(cols)
            theta[list(free)] = sol
            cost = float(np.sum((a @ theta - b) ** 2))
            if cost < best_cost - 1e-18 * max(best_cost, 1e-300):
                best, best_cost = theta, cost
    return best


def huber_weights(rel: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    a = np.abs(rel)
    return np.where(a <= delta, 1.0, delta / np.maximum(a, 1e-300))


# ---- links ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSample:
    """One measured median for one link level: ``peers`` messages carrying ``nbytes`` in total
    over that level took ``seconds`` (the level's share of a flat all-to-all)."""

    peers: int
    nbytes: float
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkFit:
    """Per-message latency and per-rank bandwidth of one level; ``fit`` is over its own samples."""

    latency_us: float
    bandwidth_gb_per_s: float
    fit: Quality


def fit_alpha_beta(samples: Sequence[LinkSample], *, iterations: int = 5, latency_s: float | None = None) -> LinkFit:
    """Least squares (relative, Huber-weighted, non-negative) of ``t = peers*alpha + bytes*beta``;
    with ``latency_s`` given, alpha is that and only beta is fitted."""
    if len(samples) < 2:
        raise ValueError(f"alpha-beta needs at least 2 samples, got {len(samples)}")
    x = np.array([[s.peers, s.nbytes] for s in samples], float)
    t = np.array([s.seconds for s in samples], float)
    if latency_s is None:
        theta = nnls_relative(x, t)
        for _ in range(iterations):
            theta = nnls_relative(x, t, huber_weights((x @ theta - t) / t))
    else:  # beta alone, on what the fixed latency leaves (relative to the whole time, as above)
        rest = t - x[:, 0] * latency_s
        w = np.ones(len(t))
        for _ in range(iterations + 1):
            a, b = x[:, 1] * np.sqrt(w) / t, rest * np.sqrt(w) / t
            beta = max(0.0, float(a @ b / (a @ a)))
            w = huber_weights((x[:, 0] * latency_s + x[:, 1] * beta - t) / t)
        theta = np.array([latency_s, beta])
    alpha, beta = theta
    # beta = 0 means bandwidth never showed (all points latency-bound): report the fastest the data allow
    bandwidth = 1.0 / beta if beta > 0 else float(np.max(x[:, 1] / t))
    return LinkFit(latency_us=float(alpha * 1e6), bandwidth_gb_per_s=float(bandwidth / 1e9),
                   fit=quality(t, x @ theta))


# ---- GEMMs ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class GemmPoint:
    """A measured median: ``seconds`` for one ``[m, k] x [k, n]`` GEMM."""

    m: int
    n: int
    k: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def nbytes(self) -> float:
        return float(BYTES * (self.m * self.k + self.k * self.n + self.m * self.n))


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmFit:
    """Roofline of one precision: compute rate ``R_c`` (FLOP/s), memory rate ``R_m`` (B/s; 0 when
    no point was memory-bound), per-kernel latency (s), the best measured rate (FLOP/s)."""

    compute_flops_per_s: float
    memory_bytes_per_s: float
    latency_s: float
    best_rate: float
    fit: Quality

    def predict(self, p: GemmPoint) -> float:
        mem = p.nbytes / self.memory_bytes_per_s if self.memory_bytes_per_s > 0 else 0.0
        return max(p.flops / self.compute_flops_per_s, mem) + self.latency_s


def _roofline_cost(points: Sequence[GemmPoint], theta: np.ndarray) -> np.ndarray:
    a, b, lat = theta
    return np.array([max(a * p.flops, b * p.nbytes) + lat for p in points])


def fit_roofline(points: Sequence[GemmPoint], *, iterations: int = 5) -> GemmFit:
    """Fit ``t = max(a F, b B) + L`` (a = 1/R_c, b = 1/R_m) to ``points`` (see the module doc)."""
    if len(points) < 3:
        raise ValueError(f"the GEMM roofline needs at least 3 shapes, got {len(points)}")
    pts = sorted(points, key=lambda p: p.flops / p.nbytes)
    t = np.array([p.seconds for p in pts])
    weights = np.ones(len(pts))
    theta = np.zeros(3)
    for _ in range(iterations + 1):
        best_cost = float("inf")
        for split in range(len(pts) + 1):  # pts[:split] memory-bound, the rest compute-bound
            x = np.array([[0.0, p.nbytes, 1.0] if i < split else [p.flops, 0.0, 1.0] for i, p in enumerate(pts)])
            cand = nnls_relative(x, t, weights)
            cost = float(np.sum(weights * ((_roofline_cost(pts, cand) - t) / t) ** 2))
            if cost < best_cost:
                theta, best_cost = cand, cost
        weights = huber_weights((_roofline_cost(pts, theta) - t) / t)
    a, b, lat = theta
    best_rate = max(p.flops / p.seconds for p in pts)
    if a <= 0:  # no compute-bound point: the best measured rate is the least R_c can be
        a = 1.0 / best_rate
    fit = GemmFit(compute_flops_per_s=1.0 / a, memory_bytes_per_s=1.0 / b if b > 0 else 0.0, latency_s=float(lat),
                  best_rate=best_rate, fit=quality(t, _roofline_cost(pts, np.array([a, b, lat]))))
    return fit


def fit_compute_rate(points: Sequence[GemmPoint], base: GemmFit) -> float | None:
    """R_c of another precision with ``base``'s memory rate and latency kept: the median of
    ``flops / (t - latency)`` over the points the compute side explains (None when none does)."""
    rates = []
    for p in points:
        busy = p.seconds - base.latency_s
        mem = p.nbytes / base.memory_bytes_per_s if base.memory_bytes_per_s > 0 else 0.0
        if busy > 1.2 * mem and busy > 0:
            rates.append(p.flops / busy)
    return float(np.median(rates)) if rates else None
