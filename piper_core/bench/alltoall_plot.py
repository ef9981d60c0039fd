"""PNG plots of :mod:`piper_core.bench.alltoall` results (matplotlib, Agg backend)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_a2a(rows: list[dict[str, Any]], path: Path) -> Path:
    """One panel per (cluster, bandwidth): measured median time vs bytes per rank for every
    algorithm (solid), and the resource model's flat and hierarchical predictions (dashed)."""
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.8), squeeze=False)
    for ax, row in zip(axes[0], rows):
        sizes = [int(s) for s in row["sweep"]]
        for alg in next(iter(row["sweep"].values())):
            ms = [statistics.median(row["sweep"][str(s)][alg]) * 1e3 for s in sizes]
            ax.plot(sizes, ms, marker="o", label=f"{alg} (measured)")
        for alg, style in (("flat", "--"), ("hierarchical", ":")):
            ax.plot(sizes, [row["predicted_ms"][str(s)][alg] for s in sizes], linestyle=style, linewidth=2,
                    label=f"{alg} (model)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{row['nodes']}x{row['ranks_per_node']} ranks, {row['inter_node_mbit']:g} Mbit/s")
        ax.set_xlabel("bytes sent per rank")
        ax.set_ylabel("all-to-all time (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_moe(run: dict[str, Any], path: Path) -> Path:
    """Speedup of each pipelined variant over the flat unchunked layer vs the measured
    communication/compute ratio."""
    cases = sorted(run["cases"], key=lambda c: c["summary"]["ratio"])
    ratios = [c["summary"]["ratio"] for c in cases]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for variant in cases[0]["summary"]["speedup"]:
        ax.plot(ratios, [c["summary"]["speedup"][variant] for c in cases], marker="s" if variant == "auto" else "o",
                linestyle=":" if variant == "auto" else "-", linewidth=2.5 if variant == "auto" else 1.5,
                label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.3, color="grey", linewidth=0.8, linestyle="--", label="1.3x target")
    ax.set_xscale("log")
    ax.set_xlabel("communication / compute (measured, flat all-to-all vs expert fwd+bwd)")
    ax.set_ylabel("speedup over flat unchunked (x)")
    ax.set_title(f"MoE layer fwd+bwd, 2 nodes x 1 rank, {run['inter_node_mbit']:g} Mbit/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(result: dict[str, Any], directory: Path) -> list[Path]:
    """The plots of whichever parts ``result`` holds."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    if "a2a" in result:
        out.append(plot_a2a(result["a2a"], directory / "alltoall_sizes.png"))
    if "moe" in result:
        out.append(plot_moe(result["moe"]["shaped"], directory / "moe_pipelined.png"))
    return out
