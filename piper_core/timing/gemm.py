"""How a GEMM's compute efficiency falls with its shape (pure arithmetic; used by
:func:`piper_core.timing.compute.gemm_time` and fitted by :mod:`piper_core.calibrate.fit`).

A GEMM ``[m, k] x [k, n]`` runs on the compute side at

    efficiency(m, n, k) = gemm_efficiency x s / (s + knee),   s = 3 / (1/m + 1/n + 1/k)

where ``s``, the harmonic mean of the three dimensions, is three times the GEMM's arithmetic
intensity (``2 m n k`` FLOP over ``2 (m k + k n + m n)`` bytes) and is set by its smallest
dimension; ``knee`` is the accelerator's ``gemm_half_size`` for bf16 (the ``s`` at which the
efficiency is half its large-GEMM value) and ``gemm_half_size x peak(precision) / peak(bf16)`` for
another precision. Why the smallest dimension: a GPU computes the output in tiles (128 x 128 or so)
that step through ``k``; a dimension shorter than a tile wastes the tile's unused rows (tile
quantization), few output tiles leave SMs idle (wave quantization), and a short ``k`` loop does not
amortise loading the first operand tiles and writing the result (NVIDIA, "Matrix Multiplication
Background User's Guide", sections "GPU Implementation" and "Dimension Quantization Effects").

Written as time, ``flops / (peak x efficiency) = flops / (peak x gemm_efficiency) + knee x flops /
(s x peak x gemm_efficiency)`` and ``flops / s = bytes / 3``: the compute side pays the tile
pipeline a fixed time per byte moved on top of its arithmetic -- the rounded corner of the roofline
(Williams et al., CACM 2009), the same per byte for every precision, which is why the knee scales
with the precision's peak. ``gemm_half_size = 0`` is the flat efficiency of earlier versions.
"""

from __future__ import annotations

from piper_core.specs.cluster import AcceleratorSpec, Precision


def shape_size(m: float, n: float, k: float) -> float:
    """``3 / (1/m + 1/n + 1/k)``: the harmonic mean of a GEMM's dimensions (elements)."""
    return 3.0 / (1.0 / m + 1.0 / n + 1.0 / k)


def shape_factor(half_size: float, m: float, n: float, k: float) -> float:
    """``s / (s + half_size)`` (1.0 when ``half_size`` is 0): the share of the large-GEMM
    efficiency a GEMM of this shape reaches."""
    if half_size <= 0:
        return 1.0
    s = shape_size(m, n, k)
    return s / (s + half_size)


def gemm_efficiency(acc: AcceleratorSpec, precision: Precision, m: float, n: float, k: float) -> float:
    """Compute-side efficiency of one ``[m, k] x [k, n]`` GEMM in ``precision`` (see the module doc)."""
    if acc.gemm_half_size <= 0:
        return acc.gemm_efficiency
    knee = acc.gemm_half_size * acc.peak_flops(precision) / acc.peak_flops("bf16")
    return acc.gemm_efficiency * shape_factor(knee, m, n, k)
