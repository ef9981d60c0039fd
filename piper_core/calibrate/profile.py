"""Calibration profiles: a ClusterSpec fitted to a machine, with the measurements behind it.

A profile is one YAML document::

    cluster:        # a ClusterSpec, exactly as a cluster YAML (strict keys; loads on its own)
      name: ...
      accelerator: {...}
      links: [...]
    calibration:
      machine: {hostname, cpu, cores, python, torch}
      date: 2025-01-01T12:00:00+00:00
      ranks: 2                 # world size measured
      nodes: 1
      ranks_per_node: 2
      inter_node_mbit: null    # the emulated link rate, if any
      precision: bf16          # the training precision it is for (GEMM curve, probe runs)
      base: cpu-local          # the preset whose unmeasured terms (memory envelope, host) were kept
      command: piper calibrate --out ...
      benchmarks: {...}        # raw medians per benchmark (seconds, bytes)
      failures: {...}          # benchmark -> error, for those that failed or were skipped
      fits: {...}              # per fitted curve: values, R^2, largest relative residual, points

:func:`load_profile` returns the ClusterSpec (``piper predict/plan/capacity --profile``,
``--piper-profile``, the DeepSpeed block's ``profile``); :func:`piper_core.presets.load_cluster`
accepts a profile path too. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from piper_core.errors import SpecError, nearest
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.yamlio import from_dict, to_dict

TOP_KEYS = ("cluster", "calibration")
REQUIRED = ("machine", "date", "ranks", "nodes", "command", "benchmarks", "fits")
CALIBRATION_KEYS = REQUIRED + ("ranks_per_node", "inter_node_mbit", "base", "failures", "precision",
                                "probe_interleaved")
HEADER = "# Piper calibration profile, written by `piper calibrate`; use it with --profile (or as a cluster YAML).\n"


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """A loaded profile: the cluster to plan with and the calibration record (plain data)."""

    cluster: ClusterSpec
    calibration: dict[str, Any]


def profile_text(cluster: ClusterSpec, calibration: dict[str, Any]) -> str:
    """The YAML text of a profile (field order kept; reads back to an equal Profile)."""
    _check_calibration(calibration, where="<calibration>")
    body = yaml.safe_dump({"cluster": to_dict(cluster), "calibration": calibration}, sort_keys=False,
                          default_flow_style=False, width=110)
    return HEADER + body


def write_profile(path: str | Path, cluster: ClusterSpec, calibration: dict[str, Any]) -> str:
    """Write the profile to ``path`` (atomically: an interrupted write leaves the old file); returns the text."""
    path = Path(path)
    text = profile_text(cluster, calibration)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return text


def _load(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError("profile", str(path), "file does not exist",
                        "give the path `piper calibrate --out` wrote") from None
    except yaml.YAMLError as exc:
        raise SpecError("yaml", str(path), f"is not valid YAML ({exc})", "fix the syntax", where=str(path)) from None


def is_profile(path: str | Path) -> bool:
    """True when ``path`` is a readable YAML mapping with a ``calibration`` key (a profile, not a
    bare ClusterSpec)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return False
    return isinstance(data, dict) and "calibration" in data


def _unknown(keys: Any, valid: tuple[str, ...], prefix: str, what: str, where: str) -> None:
    for key in keys:
        if key not in valid:
            guess = nearest(str(key), valid)
            fix = f"did you mean '{prefix}{guess}'?" if guess else f"valid keys: {', '.join(valid)}"
            raise SpecError(f"{prefix}{key}", "given", f"is not a key of {what}", fix, where=where)


def _check_calibration(cal: Any, *, where: str) -> None:
    if not isinstance(cal, dict):
        raise SpecError("calibration", type(cal).__name__, "must be a mapping", "write piper calibrate's record",
                        where=where)
    _unknown(cal, CALIBRATION_KEYS, "calibration.", "a profile's calibration record", where)
    for key in REQUIRED:
        if key not in cal:
            raise SpecError(f"calibration.{key}", None, "is required in a profile",
                            "write the profile with `piper calibrate --out`", where=where)


def read_profile(path: str | Path) -> Profile:
    """Load and check a profile; errors name the file and the key (strict keys, as every spec YAML)."""
    path = Path(path)
    where = str(path)
    data = _load(path)
    if not isinstance(data, dict):
        raise SpecError("document", type(data).__name__, "a profile's top level must be a mapping",
                        "write 'cluster:' and 'calibration:' at top level", where=where)
    if "calibration" not in data and "accelerator" in data:
        raise SpecError("profile", where, "is a ClusterSpec YAML, not a calibration profile",
                        "pass it as a cluster (--cluster, --piper-cluster, the DeepSpeed block's cluster), or write "
                        "a profile with `piper calibrate --out`")
    _unknown(data, TOP_KEYS, "", "a calibration profile", where)
    for key in TOP_KEYS:
        if key not in data:
            raise SpecError(key, None, "is required in a profile", "write the profile with `piper calibrate --out`",
                            where=where)
    if not isinstance(data["cluster"], dict):
        raise SpecError("cluster", data["cluster"], "must be a mapping (a ClusterSpec)", "write the cluster's keys",
                        where=where)
    cluster = from_dict(ClusterSpec, data["cluster"], where=where, prefix="cluster.")
    _check_calibration(data["calibration"], where=where)
    return Profile(cluster=cluster, calibration=data["calibration"])


def load_profile(path: str | Path) -> ClusterSpec:
    """The calibrated ClusterSpec of the profile at ``path``."""
    return read_profile(path).cluster
