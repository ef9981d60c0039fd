"""Frozen, validated specs: the model, the cluster, the parallel plan; strict YAML I/O."""

from piper_core.specs.cluster import AcceleratorSpec, ClusterSpec, LinkLevel
from piper_core.specs.compat import check_plan, stage_layers
from piper_core.specs.model import MLASpec, ModelSpec
from piper_core.specs.parallel import ParallelPlan

__all__ = ["AcceleratorSpec", "ClusterSpec", "LinkLevel", "MLASpec", "ModelSpec", "ParallelPlan",
           "check_plan", "stage_layers"]
