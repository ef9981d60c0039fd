"""ParallelPlan: how one training job is split over ``gpus`` accelerators.

Sizes follow Megatron-Core's names (tp, pp, vpp, ep, etp, cp; dp derived). The expert side uses
MoE parallel folding: the tp*cp*dp ranks of one pipeline stage are refolded as etp*ep*edp.
Rules and messages here are the plan-only ones; rules that need the model live in
:mod:`piper_core.specs.compat`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from piper_core.errors import SpecError
from piper_core.specs._check import freeze_hash, literals, divides, positive

if TYPE_CHECKING:
    from piper_core.specs.cluster import AcceleratorSpec

Recompute = Literal["none", "selective", "full"]
Fp8Format = Literal["e4m3", "hybrid"]
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
A2AAlgorithm = Literal["flat", "hierarchical", "dedup"]
LEGACY_PIPELINED = "pipelined"


def read_a2a(a2a: str, chunks: int | str | None, *, where: str) -> tuple[str, int | str | None, str | None]:
    """Read an exchange setting written before the algorithm and the chunk count were independent.

    ``a2a="pipelined"`` meant flat exchanges in ``chunks`` (>= 2) pipelined chunks; it is read as
    ``a2a="flat"`` with the same chunks, and the returned note (None for current settings) says so,
    naming ``where`` the setting came from. Chunks may be an int, ``"tune"``/``"auto"`` (adapters) or None.
    """
    if a2a != LEGACY_PIPELINED:
        return a2a, chunks, None
    note = (f"{where}: a2a 'pipelined' is read as a2a 'flat' with {chunks if chunks is not None else 'its'} "
            "chunks; the exchange algorithm (flat|hierarchical) and the chunk count are independent now, so "
            "write the algorithm and the chunks separately (a hierarchical exchange can be pipelined too)")
    warnings.warn(note, FutureWarning, stacklevel=3)
    return "flat", chunks, note


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    """One parallel configuration. ``etp`` None means "same as tp" (Megatron's default).

    Memory savers, as in Megatron-Core: ``grad_reduce_in_bf16`` keeps and reduces gradients in bf16
    (``--grad-reduce-in-bf16``; default fp32 accumulation); ``optimizer_offload_fraction`` moves that
    share of the optimizer state and step to the host (``--optimizer-cpu-offload``,
    ``--optimizer-offload-fraction``).

    ``overlap_p2p_comm``: Megatron's ``--overlap-p2p-communication`` (on unless
    ``--no-overlap-p2p-communication``; ``validate_args`` turns it off without interleaving, so it
    matters only with ``vpp``). ``moe_grouped_gemm``: Megatron's ``--moe-grouped-gemm`` (one grouped
    GEMM for all local experts, ``TEGroupedMLP``/``GroupedMLP``); None takes the accelerator's
    default (``AcceleratorSpec.grouped_gemm``: on for the GPU presets, off for CPU ranks, which run
    ``SequentialMLP``).

    ``fp8``: FP8 GEMMs through Transformer Engine (Megatron ``--fp8-format``: ``e4m3``, or ``hybrid``
    with e5m2 gradients), on a bf16 plan; ``fp8_recipe`` its scaling (``--fp8-recipe``, Megatron's
    default ``delayed``; ``mxfp8`` is Blackwell's); ``fp8_param`` keeps the GEMM weights in FP8 and
    all-gathers them so (``--fp8-param-gather``, with the distributed optimizer only: Megatron
    ``validate_args``). What runs in FP8 and what stays bf16/fp32: :func:`piper_core.timing.compute.linear_time`
    (time), :data:`piper_core.resource.memory.FP8_WEIGHT_CACHE_BYTES` and
    :data:`piper_core.resource.activations.FP8_SAVED_INPUTS` (memory).

    ``pipeline_layout``: Megatron's ``--pipeline-model-parallel-layout`` (:mod:`piper_core.specs.layout`):
    which layers, and the embedding and loss, each of the ``pp x vpp`` virtual stages holds, for
    splits the even and first/last-stage ones cannot give (DeepSeek-V3's 61 layers over pp 8 x vpp
    4); ``vpp`` must be its stage count over pp, and it replaces the first/last stage counts.

    ``a2a``: the expert exchange. ``flat`` (one all-to-all, Megatron's alltoall dispatcher) and
    ``hierarchical`` (intra-node, then inter-node; Piper's) send a token once per selected expert;
    ``dedup`` sends it across nodes once per destination node and fans it out there (DeepEP or
    HybridEP: Megatron-Core's flex dispatcher, ``--moe-token-dispatcher-type flex``; one chunk, no
    shared-expert overlap, which that dispatcher refuses). Piper's runtime does not run ``dedup``.
    """

    gpus: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    global_batch_size: int
    recompute: Recompute = "none"
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int | None = None
    distributed_optimizer: bool = True
    grad_reduce_in_bf16: bool = False
    optimizer_offload_fraction: float = 0.0
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    fp8: Fp8Format | None = None
    fp8_recipe: Fp8Recipe = "delayed"
    fp8_param: bool = False
    attention_backend: Literal["flash", "unfused"] = "flash"
    a2a: A2AAlgorithm = "flat"
    a2a_chunks: int = 1
    shared_expert_overlap: bool = False
    ep_comm_overlap: bool = False
    defer_wgrad: bool = False  # Piper's runtime: expert weight gradients after the dispatch gradient is posted
    overlap_p2p_comm: bool = True
    moe_grouped_gemm: bool | None = None
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    pipeline_layout: str | None = None

    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:  # specs key many caches; hash the fields once
        return self._hash

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element in the data-parallel buffer: fp32 in fp32 training and in bf16
        (Megatron accumulates and reduces bf16 gradients in fp32 unless --grad-reduce-in-bf16), the
        parameters' 2 bytes otherwise (bf16 reduction; fp16, whose gradients stay fp16)."""
        return 4 if self.precision == "fp32" or (self.precision == "bf16" and not self.grad_reduce_in_bf16) else 2

    def __post_init__(self) -> None:
        freeze_hash(self)
        if self.a2a == LEGACY_PIPELINED:
            raise SpecError("a2a", self.a2a, "is no longer an exchange algorithm: the algorithm (flat|hierarchical) "
                            "and the pipeline chunks (a2a_chunks) are independent",
                            f"write a2a=flat, a2a_chunks={self.a2a_chunks} (or hierarchical), or read old "
                            "settings with piper_core.specs.parallel.read_a2a")
        literals(self)
        for key in ("gpus", "tp", "pp", "ep", "cp", "micro_batch_size", "global_batch_size", "a2a_chunks"):
            positive(key, getattr(self, key))
        for key in ("vpp", "etp", "recompute_num_layers", "num_layers_in_first_pipeline_stage",
                    "num_layers_in_last_pipeline_stage"):
            positive(key, getattr(self, key), allow_none=True)
        model_ranks = self.tp * self.pp * self.cp
        if self.gpus % model_ranks:
            raise SpecError("gpus", self.gpus, f"must be a multiple of tp*pp*cp = {self.tp}*{self.pp}*{self.cp} "
                            f"= {model_ranks} (world = tp*pp*cp*dp)",
                            "change gpus or the model-parallel sizes")
        stage_ranks = self.tp * self.cp * self.dp
        expert_ranks = self.etp_size * self.ep
        if stage_ranks % expert_ranks:
            raise SpecError("ep", self.ep, f"etp*ep = {self.etp_size}*{self.ep} = {expert_ranks} must divide "
                            f"tp*cp*dp = {stage_ranks}, the ranks of one pipeline stage (MoE parallel folding: "
                            "etp*ep*edp = tp*cp*dp)", "lower ep or etp, or add GPUs")
        divides("micro_batch_size*dp", self.micro_batch_size * self.dp, "global_batch_size", self.global_batch_size)
        self._check_options()

    def _check_layout(self) -> None:
        from piper_core.specs.layout import check_layout, parse_layout

        text = self.pipeline_layout
        vpp = check_layout(parse_layout(text), self.pp, text=text)
        if (vpp if vpp > 1 else None) != self.vpp:
            raise SpecError("vpp", self.vpp, f"the pipeline layout has {vpp * self.pp} stages over pp {self.pp}, so vpp "
                            f"is {vpp if vpp > 1 else 'unset'} (Megatron derives it from the layout)",
                            f"set vpp={vpp}" if vpp > 1 else "leave vpp unset")
        if self.num_layers_in_first_pipeline_stage is not None or self.num_layers_in_last_pipeline_stage is not None:
            raise SpecError("pipeline_layout", text, "replaces the first/last pipeline stage layer counts (Megatron "
                            "allows one of them)", "drop num_layers_in_first/last_pipeline_stage, or the layout")

    def _check_options(self) -> None:
        if self.pipeline_layout is not None:
            self._check_layout()
        if self.vpp is not None and self.pp == 1:
            raise SpecError("vpp", self.vpp, "interleaving needs pipeline parallelism (pp > 1)",
                            "remove vpp or raise pp")
        if self.vpp is not None and not self.overlap_p2p_comm and self.pp <= 2:
            raise SpecError("overlap_p2p_comm", False, "interleaving without p2p overlap needs pp > 2 "
                            f"(got pp={self.pp}; Megatron validate_args: multiple sends between the same two ranks "
                            "in one batch)", "keep overlap_p2p_comm on, or raise pp")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("sequence_parallel", True, "has no effect with tp=1 (Megatron turns it off)",
                            "set sequence_parallel to false, or tp > 1")
        if self.recompute == "full" and self.recompute_num_layers is None:
            raise SpecError("recompute_num_layers", None, "full recompute needs a layer count "
                            "(Megatron --recompute-num-layers)", "set recompute_num_layers, e.g. 1 with uniform")
        if self.recompute != "full" and self.recompute_num_layers is not None:
            raise SpecError("recompute_num_layers", self.recompute_num_layers,
                            f"applies only to recompute=full (got recompute={self.recompute})",
                            "remove recompute_num_layers or set recompute=full")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise SpecError("optimizer_offload_fraction", self.optimizer_offload_fraction, "must be in [0, 1]",
                            "use 0 (all on GPU) to 1 (all optimizer state on the host)")
        if self.optimizer_offload_fraction > 0 and not self.distributed_optimizer:
            raise SpecError("optimizer_offload_fraction", self.optimizer_offload_fraction, "Megatron's CPU "
                            "optimizer offload runs inside the distributed optimizer", "set distributed_optimizer")
        if self.optimizer_offload_fraction > 0 and self.precision != "bf16":
            raise SpecError("optimizer_offload_fraction", self.optimizer_offload_fraction, f"prices fp32 master copies "
                            f"of bf16 weights moved to the host, and this plan trains in {self.precision}",
                            "set precision=bf16 or optimizer_offload_fraction=0")
        if self.grad_reduce_in_bf16 and self.precision != "bf16":
            raise SpecError("grad_reduce_in_bf16", True, f"needs precision bf16 (got {self.precision})",
                            "set precision=bf16 or grad_reduce_in_bf16=false")
        if self.fp8 is not None or self.fp8_param or self.fp8_recipe != "delayed":
            self._check_fp8()
        if self.ep_comm_overlap:
            self._check_ep_comm_overlap()
        if self.a2a == "dedup":
            self._check_dedup()
        if self.defer_wgrad and self.ep == 1:
            raise SpecError("defer_wgrad", True, "needs expert parallelism (ep > 1): without an exchange there is "
                            "nothing for the weight gradients to overlap", "set defer_wgrad=false or ep > 1")
        if self.defer_wgrad and self.ep_comm_overlap:
            raise SpecError("defer_wgrad", True, "and ep_comm_overlap both move the experts' weight gradients (Megatron's "
                            "overlap brings its own --delay-wgrad-compute)", "set defer_wgrad=false with ep_comm_overlap")

    def _check_fp8(self) -> None:
        """Megatron-Core 0.16's rules for FP8 (``TransformerConfig``, ``validate_args``)."""
        rules = ((self.fp8 is None, "fp8_recipe" if not self.fp8_param else "fp8_param",
                  self.fp8_param or self.fp8_recipe, "applies only to FP8 training",
                  "set fp8=hybrid (or e4m3), or drop it"),
                 (self.precision != "bf16", "fp8", self.fp8, f"runs on a bf16 plan (got precision {self.precision}): "
                  "Transformer Engine's FP8 GEMMs take bf16 inputs and keep bf16 weights", "set precision=bf16"),
                 (self.fp8_param and not self.distributed_optimizer, "fp8_param", True,
                  "--fp8-param-gather needs the distributed optimizer (Megatron validate_args)",
                  "set distributed_optimizer, or fp8_param=false"))
        for broken, key, value, rule, fix in rules:
            if broken:
                raise SpecError(key, value, rule, fix)

    def _check_dedup(self) -> None:
        """Megatron-Core 0.16's flex dispatcher (MoEFlexTokenDispatcher, token_dispatcher.py)."""
        rules = ((self.a2a_chunks != 1, "a2a_chunks", self.a2a_chunks, "the flex dispatcher exchanges in one piece",
                  "set a2a_chunks=1, or a2a=hierarchical to pipeline Piper's exchange"),
                 (self.shared_expert_overlap, "shared_expert_overlap", True, "is not supported by the flex dispatcher "
                  "(set_shared_experts raises NotImplementedError)", "set shared_expert_overlap=false"),
                 (self.defer_wgrad, "defer_wgrad", True, "is Piper's runtime's, which does not deduplicate",
                  "set defer_wgrad=false, or a2a=hierarchical"))
        for broken, key, value, rule, fix in rules:
            if broken:
                raise SpecError(key, value, f"a2a=dedup (DeepEP/HybridEP, Megatron's flex dispatcher): {rule}", fix)

    def _check_ep_comm_overlap(self) -> None:
        """Megatron-Core 0.16's rules for ``overlap_moe_expert_parallel_comm`` (TransformerConfig)."""
        rules = ((self.ep == 1, "ep", self.ep, "needs expert parallelism (ep > 1)", "raise ep"),
                 (self.pp > 1 and self.vpp is None, "vpp", None, "needs interleaving (vpp) when pp > 1",
                  "set vpp, or pp=1"),
                 (self.recompute == "full", "recompute", "full", "cannot run with full recompute",
                  "use recompute none or selective"),
                 (self.shared_expert_overlap, "shared_expert_overlap", True, "is refused by Megatron together "
                  "with ep_comm_overlap", "set shared_expert_overlap=false"),
                 (self.a2a == "hierarchical" or self.a2a_chunks != 1, "a2a", f"{self.a2a}/{self.a2a_chunks}",
                  "Megatron's overlap runs its own (stock, one-chunk) alltoall or flex dispatcher",
                  "set a2a=flat, a2a_chunks=1, or drop ep_comm_overlap and pipeline with Piper's chunks"))
        for broken, key, value, rule, fix in rules:
            if broken:
                raise SpecError(key, value, f"ep_comm_overlap (--overlap-moe-expert-parallel-comm) {rule}", fix)

    @staticmethod
    def read_legacy(data: dict, where: str) -> dict:
        """``data`` (keys of this class) with a pre-0.x ``a2a: pipelined`` read by :func:`read_a2a`."""
        if data.get("a2a") != LEGACY_PIPELINED:
            return data
        a2a, _, _ = read_a2a(data["a2a"], data.get("a2a_chunks"), where=where)
        return {**data, "a2a": a2a}

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense part: gpus / (tp*pp*cp)."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def etp_size(self) -> int:
        """Expert tensor-parallel size (defaults to tp, as in Megatron)."""
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: tp*cp*dp / (etp*ep)."""
        return self.tp * self.cp * self.dp // (self.etp_size * self.ep)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step per data-parallel rank: gbs / (mbs*dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1

    def grouped_gemm_on(self, accelerator: AcceleratorSpec) -> bool:
        """Whether the local experts run as grouped GEMMs on ``accelerator`` (:func:`grouped_gemm`)."""
        return grouped_gemm(self.moe_grouped_gemm, accelerator)


def grouped_gemm(setting: bool | None, accelerator: AcceleratorSpec) -> bool:
    """A plan's ``moe_grouped_gemm``, or where it is None the accelerator's default."""
    return accelerator.grouped_gemm if setting is None else setting
