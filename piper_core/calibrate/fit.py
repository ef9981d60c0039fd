"""Fit the resource model's hardware terms to measured medians (pure numpy; no torch).

* **Links** (alpha-beta, Hockney): a flat all-to-all of ``nbytes`` per rank over a group that
  reaches ``peers`` ranks over one level costs ``peers x latency + peers x nbytes/size / bandwidth``
  (:func:`piper_core.timing.comm.all_to_all_flat`). The features come from the same
  :func:`~piper_core.timing.topology.level_shares` the model uses, so feeding the fitted numbers back
  reproduces the measured curve up to the residuals reported.
* **GEMMs** (roofline, :func:`piper_core.timing.compute.gemm_time`):
  ``t = max(flops / R_c x (1 + h / s), bytes / R_m) + latency``, ``s`` the GEMM's harmonic-mean
  dimension and ``h`` the shape knee (:mod:`piper_core.timing.gemm`); the unknowns are fitted
  together by enumerating where the curve turns from the memory side to the compute side (the
  points sorted by arithmetic intensity) and solving a non-negative least-squares problem per split
  (``flops / R_c + (h / R_c) flops / s`` is linear in ``1/R_c`` and ``h/R_c``). The knee is fitted
  beside the flat roofline (``h = 0``) and kept only where the data identify it: enough
  compute-bound shapes of different sizes, the knee among them, and a clearly better fit
  (:data:`KNEE_MIN_GAIN`); otherwise the fit says why it stayed flat.

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
from piper_core.timing.gemm import shape_factor, shape_size

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
    element_bytes: int = BYTES  # 4 for an fp32 GEMM

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def nbytes(self) -> float:
        return float(self.element_bytes * (self.m * self.k + self.k * self.n + self.m * self.n))


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmFit:
    """Roofline of one precision: compute rate ``R_c`` (FLOP/s; that of large GEMMs), memory rate
    ``R_m`` (B/s; 0 when no point was memory-bound), per-kernel latency (s), the best measured rate
    (FLOP/s), the shape knee ``half_size`` (0: flat, :mod:`piper_core.timing.gemm`) and why it is
    what it is (``knee``: fitted, or why the data left it flat)."""

    compute_flops_per_s: float
    memory_bytes_per_s: float
    latency_s: float
    best_rate: float
    fit: Quality
    half_size: float = 0.0
    knee: str = "not fitted"

    def predict(self, p: GemmPoint) -> float:
        mem = p.nbytes / self.memory_bytes_per_s if self.memory_bytes_per_s > 0 else 0.0
        compute = p.flops / self.compute_flops_per_s / shape_factor(self.half_size, p.m, p.n, p.k)
        return max(compute, mem) + self.latency_s


KNEE_MIN_RMS = 0.02
"""A flat roofline within this relative residual (Huber RMS) leaves no knee to fit."""
KNEE_MIN_GAIN = 0.25
"""The knee is kept only if it cuts the flat fit's relative residual (Huber RMS) by this share:
one more parameter fitted to noise alone cuts it by about 1 / (2 (points - 4)), a few per cent for
the sweeps' 11-41 bf16 shapes."""
KNEE_MIN_SPAN = 4.0
"""The compute-bound points' shape sizes ``s`` must span this ratio for a knee to be told apart
from a lower flat efficiency."""


def _features(points: Sequence[GemmPoint]) -> np.ndarray:
    """Per point: flops F, flops / s (the knee's feature) and bytes B (rows)."""
    return np.array([[p.flops, p.flops / shape_size(p.m, p.n, p.k), p.nbytes] for p in points])


def _roofline_cost(points: Sequence[GemmPoint], theta: np.ndarray) -> np.ndarray:
    """``max(a F + c F / s, b B) + L`` per point, theta = (a, c, b, L)."""
    f = _features(points)
    a, c, b, lat = theta
    return np.maximum(a * f[:, 0] + c * f[:, 1], b * f[:, 2]) + lat


def _fit_split(pts: Sequence[GemmPoint], t: np.ndarray, *, shaped: bool, iterations: int) -> tuple[np.ndarray, int]:
    """(theta = (a, c, b, L), split): the best split of ``pts`` (sorted by arithmetic intensity) into
    a memory-bound head and a compute-bound tail, each split solved by NNLS, Huber-reweighted.
    Without ``shaped`` the knee's column c is left out (c = 0)."""
    f = _features(pts)
    weights = np.ones(len(pts))
    theta, best_split = np.zeros(4), 0
    for _ in range(iterations + 1):
        best_cost = float("inf")
        for split in range(len(pts) + 1):  # pts[:split] memory-bound, the rest compute-bound
            x = np.zeros((len(pts), 4))
            x[split:, :2], x[:split, 2], x[:, 3] = f[split:, :2], f[:split, 2], 1.0
            sol = nnls_relative(x if shaped else x[:, [0, 2, 3]], t, weights)
            cand = sol if shaped else np.array([sol[0], 0.0, sol[1], sol[2]])
            pred = np.maximum(cand[0] * f[:, 0] + cand[1] * f[:, 1], cand[2] * f[:, 2]) + cand[3]
            cost = float(np.sum(weights * ((pred - t) / t) ** 2))
            if cost < best_cost:
                theta, best_split, best_cost = cand, split, cost
        weights = huber_weights((_roofline_cost(pts, theta) - t) / t)
    return theta, best_split


def _huber_rms(rel: np.ndarray, delta: float = HUBER_DELTA) -> float:
    """The RMS a set of relative residuals has under the Huber loss (their RMS when all are within delta)."""
    a = np.abs(rel)
    rho = np.where(a <= delta, a ** 2 / 2, delta * (a - delta / 2))
    return float(np.sqrt(2 * np.mean(rho)))


def _knee_unidentified(pts: Sequence[GemmPoint], t: np.ndarray, flat: np.ndarray, shaped: np.ndarray,
                       split: int) -> str | None:
    """Why the data do not identify the knee of ``shaped`` (None: they do)."""
    a, c = shaped[0], shaped[1]
    rms_flat = _huber_rms((_roofline_cost(pts, flat) - t) / t)
    rms_shaped = _huber_rms((_roofline_cost(pts, shaped) - t) / t)
    sizes = [shape_size(p.m, p.n, p.k) for p in pts[split:]]
    if c <= 0 or a <= 0:
        return "the fit put no knee inside the data (efficiency flat, or falling over every compute-bound shape)"
    if len(sizes) < 3 or max(sizes) < KNEE_MIN_SPAN * min(sizes):
        return (f"{len(sizes)} compute-bound shapes, sizes s {min(sizes, default=0):.0f}-{max(sizes, default=0):.0f}: "
                f"too few or too alike (need 3 spanning {KNEE_MIN_SPAN:g}x) to tell a knee from a lower efficiency")
    if c / a > max(sizes):
        return (f"the fitted knee (s = {c / a:.0f}) lies beyond the largest compute-bound shape "
                f"(s = {max(sizes):.0f}): the large-GEMM rate would be extrapolated")
    if rms_flat < KNEE_MIN_RMS:
        return f"the flat roofline already fits within {100 * rms_flat:.1f} % (< {100 * KNEE_MIN_RMS:g} %)"
    if rms_shaped > (1 - KNEE_MIN_GAIN) * rms_flat:
        return (f"the knee cuts the relative residual only from {100 * rms_flat:.1f} % to {100 * rms_shaped:.1f} % "
                f"(< {100 * KNEE_MIN_GAIN:g} % better)")
    return None


def fit_roofline(points: Sequence[GemmPoint], *, iterations: int = 5, knee: bool = True) -> GemmFit:
    """Fit ``t = max(a F (1 + h / s), b B) + L`` (a = 1/R_c, b = 1/R_m, h the shape knee,
    :mod:`piper_core.timing.gemm`) to ``points``: ``a F + (a h) F / s`` is linear in ``a`` and
    ``a h``, so each split is one NNLS problem (see the module doc). The knee is kept only where the
    data identify it (:func:`_knee_unidentified`); otherwise, or without ``knee``, the flat roofline."""
    if len(points) < 3:
        raise ValueError(f"the GEMM roofline needs at least 3 shapes, got {len(points)}")
    pts = sorted(points, key=lambda p: p.flops / p.nbytes)
    t = np.array([p.seconds for p in pts])
    theta, _ = _fit_split(pts, t, shaped=False, iterations=iterations)
    why = "not fitted (knee=False)"
    if knee:
        shaped, split = _fit_split(pts, t, shaped=True, iterations=iterations)
        why = _knee_unidentified(pts, t, theta, shaped, split)
        if why is None:
            theta, why = shaped, "fitted"
        else:
            why = "flat: " + why
    a, c, b, lat = theta
    best_rate = max(p.flops / p.seconds for p in pts)
    if a <= 0:  # no compute-bound point: the best measured rate is the least R_c can be
        a = 1.0 / best_rate
    return GemmFit(compute_flops_per_s=1.0 / a, memory_bytes_per_s=1.0 / b if b > 0 else 0.0, latency_s=float(lat),
                   best_rate=best_rate, fit=quality(t, _roofline_cost(pts, np.array([a, c, b, lat]))),
                   half_size=float(c / a), knee=why)


def fit_compute_rate(points: Sequence[GemmPoint], base: GemmFit) -> float | None:
    """R_c of another precision with ``base``'s memory rate, latency and knee kept: the median of
    ``flops / (t - latency - knee time)`` over the points the compute side explains (None when none
    does). The knee's time per byte is the same for every precision (:mod:`piper_core.timing.gemm`):
    ``base.half_size x flops / (s x base R_c)``."""
    rates = []
    for p in points:
        busy = p.seconds - base.latency_s
        mem = p.nbytes / base.memory_bytes_per_s if base.memory_bytes_per_s > 0 else 0.0
        arithmetic = busy - base.half_size * p.flops / (shape_size(p.m, p.n, p.k) * base.compute_flops_per_s)
        if busy > 1.2 * mem and arithmetic > 0:
            rates.append(p.flops / arithmetic)
    return float(np.median(rates)) if rates else None
