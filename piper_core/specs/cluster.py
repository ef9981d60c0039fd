"""ClusterSpec: the accelerator, the link levels of the network, and the memory envelope.

Units are in the names (GiB, GB/s, us, TFLOPS); bandwidths are per GPU and per direction.
Link levels are ordered from the fastest, smallest domain (inside a node) outwards; each
level says how many GPUs share that domain (``domain_gpus``), the outermost covering the system.
The fastest level spans a node or whole nodes: an NVLink domain may hold several nodes (GB200
NVL72: 18 trays of 4 GPUs, ``presets/clusters/gb200-nvl72.yaml``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from piper_core.errors import SpecError
from piper_core.specs._check import freeze_hash, fraction, non_negative, positive

Precision = Literal["bf16", "fp16", "fp32", "fp8"]
"""What a GEMM runs in: a plan's precision, or ``fp8`` for the GEMMs an FP8 plan runs in FP8."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AcceleratorSpec:
    """One GPU (or GCD): dense peak throughput per dtype, HBM size and bandwidth.

    The efficiency terms drive the roofline time model: a GEMM runs at
    ``max(flops / (peak * efficiency), bytes / (hbm * hbm_efficiency)) + kernel_latency_us``,
    so skinny expert GEMMs fall to the memory-bound side. Presets carry planning defaults;
    ``piper calibrate`` fits them on the real machine.

    ``efficiency`` is ``gemm_efficiency`` (that of large GEMMs) times ``s / (s + gemm_half_size)``,
    ``s = 3 / (1/m + 1/n + 1/k)`` the harmonic mean of the GEMM's dimensions, so GEMMs with a small
    dimension (few tokens per expert, a small expert hidden size) run below it: tile and wave
    quantization (:mod:`piper_core.timing.gemm`; for fp32 the knee scales with its peak).
    ``gemm_half_size`` (elements; the ``s`` at which bf16 efficiency halves) 0 keeps the efficiency
    flat, as profiles and presets without the key had it.

    Element-wise kernels (norms, activations, softmax, permutation) stream at
    ``elementwise_gb_per_s`` (bytes read + written per second) when it is set -- ``piper calibrate``
    measures it where such kernels run well below the copy rate (bf16 on CPU: 3-9 GB/s against a
    37 GB/s copy) -- and at ``hbm_gb_per_s x hbm_efficiency`` otherwise (the GPU presets).
    ``copy_gb_per_s`` (bytes read + written per second) prices copies of large buffers of state that
    no kernel touched just before (packing and unpacking a move of experts): the calibration's copy
    benchmark where it ran; None: ``hbm_gb_per_s x hbm_efficiency``. Calibration raises ``hbm_gb_per_s``
    to the GEMMs' streaming rate where that beats the copy (cache-resident weights), which such a copy
    does not get: 19.8 GB/s against 13.8 GB/s measured for the copy on 2 CPU ranks (2026-12-07,
    docs/migration/profiles/local-2-fp32.yaml).

    Host overheads (microseconds of framework time no kernel term covers: Python dispatch, module
    hooks, the token dispatcher's bookkeeping; 0 in the GPU presets, where the host runs ahead of the
    device, and fitted by ``piper calibrate`` where it does not, as on CPU ranks): per transformer
    layer forward (``layer_overhead_us``), extra per MoE layer forward (``moe_overhead_us``), per
    local expert forward call (``expert_overhead_us``, once per chunk when pipelined; one call for
    all local experts with grouped GEMM), backward =
    ``backward_overhead_factor`` x forward; per micro-batch (``microbatch_overhead_us``: embedding,
    output layer and loss, the schedule's bookkeeping; shared by the pipeline stages, 1/pp each) and
    per step (``step_overhead_us``: gradient-buffer and optimizer bookkeeping).

    ``moe_sync_us``: device idle time per MoE layer forward (a recomputed forward pays it again) while
    the host waits for the routed token counts: Megatron-Core's alltoall dispatcher copies them to
    the host and synchronises once per layer (``cuda_sync_point``, ``MoEAlltoAllTokenDispatcher.
    preprocess``, transformer/moe/token_dispatcher.py; every setting but drop-and-pad, which the model
    does not express) and Piper's dispatcher reads them on the host as well. The queue drains, so
    the device idles for at least a device-to-host round trip: 26 us measured on bare-metal Linux
    (jingyaogong/minimind pull request 837, 2 x RTX 3090, ``cudaMemcpy`` D2H after a launch), the GPU
    presets' planning value until a device calibration measures it. 0 where host and device are one
    (CPU ranks).

    ``core_share``: the share of a core each rank runs on when every rank of the host is busy, where
    ranks outnumber the cores (``piper calibrate`` writes cores / ranks: 0.5 for 4 CPU ranks on 2
    cores); 1, a device per rank, in the GPU presets. The calibrated rates are those of a full host,
    yet a rank that waits gives its core away: in a pipeline's fill and drain only some stages run,
    at up to a full core each, so the bubble costs less than its calibrated time
    (:func:`piper_core.timing.step.shared_cores`).

    ``grouped_gemm``: whether Megatron runs a plan's local experts as one grouped GEMM per expert
    linear by default here (``--moe-grouped-gemm``: ``TEGroupedMLP``/``GroupedMLP``, CUDA/ROCm
    kernels; the GPU presets, as Megatron-Bridge's MoE recipes set it) or one GEMM per expert
    (``SequentialMLP``: Megatron's own default, and the only choice on CPU ranks). A plan's
    ``moe_grouped_gemm`` overrides it.

    ``kernels``: which kernels the framework's layers run, for what they keep for backward
    (:func:`piper_core.resource.activations.kernels_for`): ``cuda`` (the default: Megatron's fused
    CUDA kernels) or ``cpu`` (Piper's CPU trainers: torch's host decompositions, e.g. RMSNorm keeping
    two fp32 copies of its input, and SwiGLU unfused).
    """

    name: str
    peak_tflops_bf16: float
    peak_tflops_fp16: float
    peak_tflops_fp32: float
    peak_tflops_fp8: float | None = None
    hbm_gib: float
    hbm_gb_per_s: float
    gemm_efficiency: float = 0.7
    gemm_half_size: float = 0.0
    hbm_efficiency: float = 0.8
    kernel_latency_us: float = 4.0
    elementwise_gb_per_s: float | None = None
    copy_gb_per_s: float | None = None
    layer_overhead_us: float = 0.0
    moe_overhead_us: float = 0.0
    expert_overhead_us: float = 0.0
    moe_sync_us: float = 0.0
    backward_overhead_factor: float = 2.0
    microbatch_overhead_us: float = 0.0
    step_overhead_us: float = 0.0
    core_share: float = 1.0
    grouped_gemm: bool = False
    kernels: Literal["cuda", "cpu"] = "cuda"

    def __post_init__(self) -> None:
        for key in ("layer_overhead_us", "moe_overhead_us", "expert_overhead_us", "moe_sync_us", "backward_overhead_factor",
                    "microbatch_overhead_us", "step_overhead_us"):
            non_negative(f"accelerator.{key}", getattr(self, key))
        for key in ("peak_tflops_bf16", "peak_tflops_fp16", "peak_tflops_fp32", "hbm_gib", "hbm_gb_per_s"):
            positive(f"accelerator.{key}", getattr(self, key))
        positive("accelerator.elementwise_gb_per_s", self.elementwise_gb_per_s, allow_none=True)
        positive("accelerator.copy_gb_per_s", self.copy_gb_per_s, allow_none=True)
        positive("accelerator.peak_tflops_fp8", self.peak_tflops_fp8, allow_none=True)
        fraction("accelerator.core_share", self.core_share)
        fraction("accelerator.gemm_efficiency", self.gemm_efficiency)
        if isinstance(self.gemm_half_size, bool) or not 0.0 <= self.gemm_half_size < math.inf:
            raise SpecError("accelerator.gemm_half_size", self.gemm_half_size,
                            "must be a finite number >= 0 (the harmonic-mean GEMM dimension at which efficiency "
                            "halves)", "set it to 0 for a flat efficiency, or to a size such as 500 (H100, bf16)")
        fraction("accelerator.hbm_efficiency", self.hbm_efficiency)
        non_negative("accelerator.kernel_latency_us", self.kernel_latency_us)

    @property
    def copy_rate_gb_per_s(self) -> float:
        """Bytes read + written per second by a copy of large cold buffers (``copy_gb_per_s``, else HBM's)."""
        return self.copy_gb_per_s if self.copy_gb_per_s is not None else self.hbm_gb_per_s * self.hbm_efficiency

    def peak_flops(self, precision: Precision) -> float:
        """Dense peak in FLOP/s for ``precision`` (MFU is measured against the plan's precision's,
        bf16 for an FP8 plan as Megatron-Bridge reports it; never a sparse peak)."""
        if precision == "fp8":
            if self.peak_tflops_fp8 is None:
                raise SpecError("accelerator.peak_tflops_fp8", None, f"{self.name} has no FP8 peak, so an fp8 plan "
                                "cannot be priced on it (A100 and MI250X have no FP8 tensor cores)",
                                "train in bf16 (drop --fp8, or fp8=none in --parallel), or give the cluster's dense FP8 peak")
            return self.peak_tflops_fp8 * 1e12
        return {"bf16": self.peak_tflops_bf16, "fp16": self.peak_tflops_fp16,
                "fp32": self.peak_tflops_fp32}[precision] * 1e12


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkLevel:
    """One level of the network. ``domain_gpus`` None means the level spans the whole system.

    ``bulk_gb_per_s``: the rate per direction of a bulk two-way exchange between two ranks across the
    level (both send and receive tens of MiB at once, as a move of experts does); None: the level's
    ``bandwidth_gb_per_s``. ``piper calibrate`` measures it where the all-to-all's rate does not hold
    for such messages: on CPU ranks over loopback a 32 MiB exchange runs at 1.6 GB/s each way where
    the all-to-all sweep (up to 4 MiB) fits 2.5 GB/s (2026-12-07, docs/migration.md)."""

    name: str
    domain_gpus: int | None
    bandwidth_gb_per_s: float
    latency_us: float
    bulk_gb_per_s: float | None = None

    def __post_init__(self) -> None:
        positive(f"links[{self.name}].domain_gpus", self.domain_gpus, allow_none=True)
        positive(f"links[{self.name}].bandwidth_gb_per_s", self.bandwidth_gb_per_s)
        non_negative(f"links[{self.name}].latency_us", self.latency_us)
        positive(f"links[{self.name}].bulk_gb_per_s", self.bulk_gb_per_s, allow_none=True)

    @property
    def bulk_rate_gb_per_s(self) -> float:
        """The rate a bulk two-way exchange gets per direction (``bulk_gb_per_s``, else the bandwidth)."""
        return self.bulk_gb_per_s if self.bulk_gb_per_s is not None else self.bandwidth_gb_per_s


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """A described cluster. ``memory_overhead_gib`` is per-GPU memory no model term accounts for
    (CUDA/NCCL context, communication buffers, allocator fragmentation); ``usable_memory_fraction``
    is the share of HBM (and of host memory) a job may plan to fill. The host fields serve optimizer
    offload: host memory per node (0: offload not possible), the GPU<->host link per GPU and the
    host memory bandwidth a node's CPU optimizer streams through.

    ``reduce_scatter_factor``: the bytes a reduce-scatter moves per link over a ring's ((n-1)/n of
    the buffer): 1 for a bandwidth-optimal ring (NCCL's, as the GPU presets assume); ``piper
    calibrate`` fits it from its reduce-scatter benchmark. Over gloo (CPU ranks) a reduce-scatter
    measured as slow as an all-reduce of the same buffer: 726.7 ms against 717.2 ms for 16 MiB over
    the emulated 200 Mbit/s link, factor 2.0 (docs/validation/fp32/rounds3-dopt/2/profiles), so the
    distributed optimizer's gradient reduce-scatter plus parameter all-gather costs 1.5 all-reduces
    there, not one."""

    name: str
    accelerator: AcceleratorSpec
    gpus_per_node: int
    links: tuple[LinkLevel, ...]
    memory_overhead_gib: float = 0.0
    usable_memory_fraction: float = 1.0
    host_memory_gib_per_node: float = 0.0
    host_link_gb_per_s: float = 25.0
    host_memory_gb_per_s: float = 100.0
    reduce_scatter_factor: float = 1.0

    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:  # specs key many caches; hash the fields once
        return self._hash

    def __post_init__(self) -> None:
        freeze_hash(self)
        positive("gpus_per_node", self.gpus_per_node)
        non_negative("memory_overhead_gib", self.memory_overhead_gib)
        fraction("usable_memory_fraction", self.usable_memory_fraction)
        non_negative("host_memory_gib_per_node", self.host_memory_gib_per_node)
        positive("host_link_gb_per_s", self.host_link_gb_per_s)
        positive("host_memory_gb_per_s", self.host_memory_gb_per_s)
        positive("reduce_scatter_factor", self.reduce_scatter_factor)
        if not 1 <= len(self.links) <= 3:
            raise SpecError("links", len(self.links), "needs 1 to 3 link levels (intra-node, inter-node, "
                            "optionally a group level)", "list the levels from fastest to slowest")
        first = self.links[0].domain_gpus
        if len(self.links) > 1 and (first < self.gpus_per_node or first % self.gpus_per_node):
            raise SpecError(f"links[{self.links[0].name}].domain_gpus", first,
                            f"the first (fastest) level must span whole nodes: gpus_per_node ({self.gpus_per_node}) "
                            "or a multiple of it (an NVLink domain across nodes, e.g. GB200 NVL72's)",
                            f"set it to {self.gpus_per_node} or a multiple of it")
        if self.links[-1].domain_gpus is not None:
            raise SpecError(f"links[{self.links[-1].name}].domain_gpus", self.links[-1].domain_gpus,
                            "the last level must span the whole system", "set it to null")
        sizes = [lvl.domain_gpus for lvl in self.links[:-1]]
        for inner, outer in zip(sizes, sizes[1:]):
            if outer % inner:
                raise SpecError("links.domain_gpus", sizes, "each level's domain must be a multiple of the "
                                "one inside it", "order levels fastest first with growing domains")

    @property
    def fast_domain_gpus(self) -> int | None:
        """GPUs in one domain of the fastest link level (None: one level spans the system). The node
        (``gpus_per_node``) on an 8-GPU NVLink server; more than a node where NVLink spans nodes, as
        in GB200 NVL72, where 18 trays of 4 GPUs share one NVLink domain. Piper's hierarchical and
        deduplicated exchanges group ranks by this domain, not by node."""
        return self.links[0].domain_gpus

    def exchange_domain_ranks(self, ranks_per_node: int | None = None) -> int:
        """Consecutive ranks Piper's hierarchical and deduplicated exchanges treat as one domain (their
        first stage stays inside it), as the model prices them: the fastest link's domain where it
        spans nodes (GB200 NVL72), else a node -- ``ranks_per_node`` as the launcher states it, or
        ``gpus_per_node``."""
        fast = self.fast_domain_gpus
        if fast is not None and fast > self.gpus_per_node:
            return fast
        return ranks_per_node or self.gpus_per_node

    @property
    def host_capacity_gib(self) -> float:
        """Host memory per node a plan may fill with offloaded optimizer state."""
        return self.host_memory_gib_per_node * self.usable_memory_fraction

    @property
    def capacity_gib(self) -> float:
        """Memory a plan may use per GPU: HBM x usable fraction (the fixed overhead is a memory term)."""
        return self.accelerator.hbm_gib * self.usable_memory_fraction
