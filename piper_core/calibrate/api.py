"""Calibrate one named topology, for tools that keep a profile per topology (``piper validate``).

Names: ``local-<ranks>`` (local gloo ranks on this host) and ``emu-<nodes>x<ranks>-<rate>mbit``
(the emulated cluster, links shaped to ``rate``; needs root); then ``-deepspeed``: the host
overheads are probed through DeepSpeed-MoE instead of Megatron-Core; ``-fp32`` at the end: the
profile is for fp32 training (GEMM curve, element-wise kernels and probe runs in fp32).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

from piper_core.calibrate.run import Calibration, CalibrateOptions, calibrate
from piper_core.calibrate.steps import FULL_TIMEOUT_S, QUICK_TIMEOUT_S, Topology
from piper_core.errors import SpecError


def split_precision(name: str) -> tuple[str, str]:
    """``local-2-fp32`` -> (``local-2``, ``fp32``); ``local-2`` -> (``local-2``, ``bf16``)."""
    return (name[:-len("-fp32")], "fp32") if name.endswith("-fp32") else (name, "bf16")


def split_framework(name: str) -> tuple[str, str]:
    """``local-2-deepspeed`` -> (``local-2``, ``deepspeed``); ``local-2`` -> (``local-2``, ``megatron``)
    (a ``-fp32`` suffix is dropped first)."""
    name = split_precision(name)[0]
    return (name[:-len("-deepspeed")], "deepspeed") if name.endswith("-deepspeed") else (name, "megatron")


def parse_topology(name: str) -> Topology:
    """``local-2`` -> 1 node x 2 ranks; ``emu-2x1-200mbit`` -> 2 emulated nodes x 1 rank at 200 Mbit/s."""
    name = split_framework(name)[0]
    local = re.fullmatch(r"local-(\d+)", name)
    if local and int(local[1]) >= 1:
        return Topology(nodes=1, ranks_per_node=int(local[1]))
    emu = re.fullmatch(r"emu-(\d+)x(\d+)-(\d+(?:\.\d+)?)mbit", name)
    if emu and int(emu[1]) >= 2 and int(emu[2]) >= 1:
        return Topology(nodes=int(emu[1]), ranks_per_node=int(emu[2]), inter_node_mbit=float(emu[3]), emulated=True)
    raise SpecError("topology", name, "is not a calibration topology",
                    "write local-<ranks> (e.g. local-2) or emu-<nodes>x<ranks>-<rate>mbit (e.g. emu-2x1-200mbit), "
                    "optionally followed by -deepspeed and/or -fp32")


def calibrate_topology(name: str, out: Path, *, quick: bool, base: str = "cpu-local",
                       timeout_per_bench_s: float | None = None, realtime: bool = False,
                       fresh: bool = False, probe_rounds: int = 1) -> Calibration:
    """Run ``piper calibrate`` for topology ``name`` and write the profile to ``out`` (cache next to it).
    ``fresh``: measure everything again (the cache next to ``out`` is removed first): a cached
    benchmark from an earlier hour describes the machine of that hour. ``probe_rounds``: the
    host-overhead probe's rounds (``piper calibrate --probe-rounds``)."""
    topology = dataclasses.replace(parse_topology(name), realtime=realtime)
    emulate = (f"--emulate {topology.nodes}x{topology.ranks_per_node} --inter-node-mbit {topology.inter_node_mbit:g}"
               if topology.emulated else f"--ranks {topology.ranks_per_node}")
    timeout = timeout_per_bench_s or (QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S)
    framework, precision = split_framework(name)[1], split_precision(name)[1]
    command = (f"piper calibrate --out {out} {emulate} --base {base}" + (" --quick" if quick else "")
               + (" --realtime" if realtime else "") + (f" --framework {framework}" if framework != "megatron" else "")
               + (f" --precision {precision}" if precision != "bf16" else "")
               + (f" --probe-rounds {probe_rounds}" if probe_rounds > 1 else ""))
    options = CalibrateOptions(out=Path(out), topology=topology, base=base, quick=quick,
                               timeout_per_bench_s=timeout, command=command, framework=framework, precision=precision,
                               probe_rounds=probe_rounds)
    if fresh and options.cache_dir.is_dir():
        shutil.rmtree(options.cache_dir)
    return calibrate(options)
