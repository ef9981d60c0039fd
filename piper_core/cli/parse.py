"""Parse ``--parallel "tp=2,pp=4,ep=8,..."`` into a ParallelPlan and the model overrides
``--seq-length``/``--capacity-factor`` (CLI convenience only; specs and files use YAML keys)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from piper_core.errors import SpecError, nearest
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan

# short CLI key -> ParallelPlan field
KEYS: dict[str, str] = {
    "tp": "tp", "pp": "pp", "vpp": "vpp", "ep": "ep", "etp": "etp", "cp": "cp",
    "sp": "sequence_parallel", "mbs": "micro_batch_size", "gbs": "global_batch_size",
    "recompute": "recompute", "recompute_method": "recompute_method",
    "recompute_layers": "recompute_num_layers", "dist_opt": "distributed_optimizer",
    "grad_bf16": "grad_reduce_in_bf16", "offload": "optimizer_offload_fraction",
    "precision": "precision", "fp8": "fp8", "fp8_recipe": "fp8_recipe", "fp8_param": "fp8_param",
    "attention": "attention_backend", "a2a": "a2a", "chunks": "a2a_chunks",
    "shx": "shared_expert_overlap", "epov": "ep_comm_overlap", "dwg": "defer_wgrad",
    "p2pov": "overlap_p2p_comm", "grouped_gemm": "moe_grouped_gemm",
    "first_stage_layers": "num_layers_in_first_pipeline_stage",
    "last_stage_layers": "num_layers_in_last_pipeline_stage",
    "layout": "pipeline_layout",
}
_INTS = {"tp", "pp", "vpp", "ep", "etp", "cp", "mbs", "gbs", "recompute_layers", "chunks",
         "first_stage_layers", "last_stage_layers"}
_BOOLS = {"sp", "dist_opt", "grad_bf16", "shx", "epov", "dwg", "p2pov", "grouped_gemm", "fp8_param"}
_FLOATS = {"offload"}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _value(key: str, raw: str) -> Any:
    if key in _INTS:
        try:
            return int(raw)
        except ValueError:
            raise SpecError(f"--parallel {key}", raw, "must be an integer", f"write {key}=<n>") from None
    if key in _FLOATS:
        try:
            return float(raw)
        except ValueError:
            raise SpecError(f"--parallel {key}", raw, "must be a number", f"write {key}=0.5") from None
    if key in _BOOLS:
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise SpecError(f"--parallel {key}", raw, "must be a boolean", f"write {key}=1 or {key}=0")
    if key == "fp8" and raw.lower() in {"none", "off", "0"}:
        return None
    return raw


def parse_parallel(text: str, gpus: int, **defaults: Any) -> ParallelPlan:
    """``"tp=2,pp=4,mbs=1,gbs=256"`` -> ParallelPlan. ``defaults`` (field names) fill unset keys.

    With MoE and tp > 1 Megatron requires sequence parallelism; ``sp`` must then be given explicitly
    (nothing is switched on silently).
    """
    fields: dict[str, Any] = dict(defaults)
    key = None
    for item in filter(None, (p.strip() for p in text.split(","))):
        if key == "layout" and "=" not in item:  # a layout's cosmetic comma: "layout=Ett|(tt|)*29,tL"
            fields["pipeline_layout"] += item
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise SpecError("--parallel", item, "each item must be key=value", "write e.g. tp=2")
        if key not in KEYS:
            guess = nearest(key, KEYS)
            raise SpecError(f"--parallel {key}", raw, "is not a parallel key",
                            f"did you mean '{guess}'?" if guess else f"use one of {sorted(KEYS)}")
        fields[KEYS[key]] = _value(key, raw.strip())
    if "global_batch_size" not in fields:
        raise SpecError("--parallel gbs", None, "the global batch size is required",
                        "add gbs=<sequences per step>, e.g. gbs=1024")
    return ParallelPlan(gpus=gpus, **ParallelPlan.read_legacy(fields, "--parallel"))


def add_target_args(p: argparse.ArgumentParser, model_help: str = "model preset name or ModelSpec YAML path") -> None:
    """The positional MODEL, the hardware (--cluster or --profile) and --gpus every planning command takes."""
    p.add_argument("model", help=model_help)
    p.add_argument("--cluster", help="cluster preset name or ClusterSpec YAML path")
    p.add_argument("--profile", metavar="PROFILE.yaml",
                   help="calibrated profile written by `piper calibrate` (instead of --cluster)")
    p.add_argument("--gpus", type=int, required=True, help="world size (number of GPUs)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model settings a run chooses rather than the architecture: the sequence length and the
    capacity factor (Megatron ``--seq-length``, ``--moe-expert-capacity-factor``)."""
    p.add_argument("--seq-length", "--seq", dest="seq_length", metavar="N",
                   help="sequence length in tokens (default: the model's)")
    p.add_argument("--capacity-factor", metavar="F",
                   help="MoE expert capacity factor, or 'none' for dropless (default: the model's)")
    p.add_argument("--expert-load-skew", metavar="S",
                   help="busiest expert's tokens over the mean, >= 1 (the model's moe_expert_load_skew; default: "
                        "the model's); a measured distribution: --routing FILE (docs/routing.md)")


def target_model(args: argparse.Namespace) -> ModelSpec:
    """The model of the positional MODEL with ``--seq-length``/``--capacity-factor`` applied."""
    from piper_core.presets import load_model

    model = load_model(args.model)
    changes: dict[str, Any] = {}
    if args.seq_length is not None:
        changes["seq_length"] = _positive_int("--seq-length", args.seq_length, "write e.g. --seq-length 4096")
    if args.capacity_factor is not None:
        changes["moe_capacity_factor"] = _capacity_factor(model, args.capacity_factor)
    if getattr(args, "expert_load_skew", None) is not None:
        changes["moe_expert_load_skew"] = _load_skew(model, args)
    return dataclasses.replace(model, **changes) if changes else model


def _positive_int(key: str, raw: str, fix: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise SpecError(key, raw, "must be a whole number of tokens", fix) from None
    if value <= 0:
        raise SpecError(key, value, "must be positive", fix)
    return value


def _capacity_factor(model: ModelSpec, raw: str) -> float | None:
    """A positive number (each expert takes at most ``cf x tokens x topk / experts`` tokens,
    Megatron ``get_capacity``) or ``none`` (dropless)."""
    if not model.is_moe:
        raise SpecError("--capacity-factor", raw, f"applies to MoE models; {model.name} has no routed experts",
                        "drop --capacity-factor")
    if raw.strip().lower() in {"none", "dropless"}:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise SpecError("--capacity-factor", raw, "must be a number or 'none' (dropless)",
                        "write e.g. --capacity-factor 1.25, or --capacity-factor none") from None
    if not (math.isfinite(value) and value > 0):
        raise SpecError("--capacity-factor", value, "must be a finite positive number (tokens per expert = cf x "
                        "tokens x topk / experts)", "write e.g. --capacity-factor 1.0, or none for dropless")
    return value


def _load_skew(model: ModelSpec, args: argparse.Namespace) -> float:
    """``--expert-load-skew S``: today's scalar skew; a routing file replaces it, so not both."""
    raw = args.expert_load_skew
    if getattr(args, "routing", None):
        raise SpecError("--expert-load-skew", raw, "is replaced by the distribution of --routing",
                        "give one of --expert-load-skew and --routing")
    if not model.is_moe:
        raise SpecError("--expert-load-skew", raw, f"applies to MoE models; {model.name} has no routed experts",
                        "drop --expert-load-skew")
    try:
        value = float(raw)
    except ValueError:
        raise SpecError("--expert-load-skew", raw, "must be a number (max/mean tokens per expert)",
                        "write e.g. --expert-load-skew 2") from None
    if not (math.isfinite(value) and value >= 1.0):
        raise SpecError("--expert-load-skew", value, "is max/mean tokens per expert and must be >= 1",
                        "use 1 for even routing")
    return value


def target_cluster(args: argparse.Namespace) -> ClusterSpec:
    """The cluster of --cluster or --profile: exactly one of them must be given."""
    from piper_core.calibrate.profile import load_profile
    from piper_core.presets import cluster_names, load_cluster

    if args.cluster is not None and args.profile is not None:
        raise SpecError("--cluster/--profile", f"{args.cluster} / {args.profile}", "give one of them: a profile "
                        "holds its own calibrated cluster", f"drop --cluster {args.cluster} (or --profile)")
    if args.profile is not None:
        return load_profile(args.profile)
    if args.cluster is None:
        raise SpecError("--cluster/--profile", None, "the hardware is required", "give --cluster (a preset: "
                        f"{', '.join(cluster_names())}, or a YAML path) or --profile PROFILE.yaml from piper calibrate")
    return load_cluster(args.cluster)
