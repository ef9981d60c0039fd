"""Built-in model and cluster presets, loadable by name; each YAML file cites its sources."""

from __future__ import annotations

from pathlib import Path

from piper_core.errors import SpecError, nearest
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.yamlio import load_yaml

_HERE = Path(__file__).parent


def model_names() -> list[str]:
    return sorted(p.stem for p in (_HERE / "models").glob("*.yaml"))


def cluster_names() -> list[str]:
    return sorted(p.stem for p in (_HERE / "clusters").glob("*.yaml"))


def _resolve(kind: str, ref: str, names: list[str]) -> Path:
    if ref in names:
        return _HERE / f"{kind}s" / f"{ref}.yaml"
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    guess = nearest(ref, names)
    fix = f"did you mean '{guess}'?" if guess else f"use one of {names} or a YAML path"
    raise SpecError(kind, ref, f"is neither a {kind} preset nor a YAML file", fix)


def load_model(ref: str) -> ModelSpec:
    """A model preset by name (see :func:`model_names`) or a ModelSpec YAML path."""
    return load_yaml(ModelSpec, _resolve("model", ref, model_names()))


def load_cluster(ref: str) -> ClusterSpec:
    """A cluster preset by name (see :func:`cluster_names`), a ClusterSpec YAML path, or a
    calibration profile written by ``piper calibrate`` (its calibrated cluster)."""
    from piper_core.calibrate.profile import is_profile, load_profile

    path = _resolve("cluster", ref, cluster_names())
    if is_profile(path):
        return load_profile(path)
    return load_yaml(ClusterSpec, path)
