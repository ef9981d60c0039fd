"""Parse ``--parallel "tp=2,pp=4,ep=8,..."`` into a ParallelPlan (CLI convenience only; specs and
files use YAML keys)."""

from __future__ import annotations

import argparse
from typing import Any

from piper_core.errors import SpecError, nearest
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.parallel import ParallelPlan

# short CLI key -> ParallelPlan field
KEYS: dict[str, str] = {
    "tp": "tp", "pp": "pp", "vpp": "vpp", "ep": "ep", "etp": "etp", "cp": "cp",
    "sp": "sequence_parallel", "mbs": "micro_batch_size", "gbs": "global_batch_size",
    "recompute": "recompute", "recompute_method": "recompute_method",
    "recompute_layers": "recompute_num_layers", "dist_opt": "distributed_optimizer",
    "grad_bf16": "grad_reduce_in_bf16", "offload": "optimizer_offload_fraction",
    "precision": "precision", "attention": "attention_backend", "a2a": "a2a", "chunks": "a2a_chunks",
    "shx": "shared_expert_overlap", "epov": "ep_comm_overlap", "dwg": "defer_wgrad",
    "first_stage_layers": "num_layers_in_first_pipeline_stage",
    "last_stage_layers": "num_layers_in_last_pipeline_stage",
}
_INTS = {"tp", "pp", "vpp", "ep", "etp", "cp", "mbs", "gbs", "recompute_layers", "chunks",
         "first_stage_layers", "last_stage_layers"}
_BOOLS = {"sp", "dist_opt", "grad_bf16", "shx", "epov", "dwg"}
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
    return raw


def parse_parallel(text: str, gpus: int, **defaults: Any) -> ParallelPlan:
    """``"tp=2,pp=4,mbs=1,gbs=256"`` -> ParallelPlan. ``defaults`` (field names) fill unset keys.

    With MoE and tp > 1 Megatron requires sequence parallelism; ``sp`` must then be given explicitly
    (nothing is switched on silently).
    """
    fields: dict[str, Any] = dict(defaults)
    for item in filter(None, (p.strip() for p in text.split(","))):
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
