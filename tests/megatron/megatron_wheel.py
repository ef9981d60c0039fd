"""The real ``megatron.training`` of megatron-core 0.19.2 on this Python 3.11 host, for the tests of
the 0.17-0.19 argument API.

Why a download: pip resolves megatron-core 0.16.1 on Python 3.11 (0.17+ declare Python >= 3.12), and
the 0.16.1 wheel ships only ``megatron/core``; the 0.19.2 wheel also ships ``megatron/training``.
:func:`megatron_tree` downloads it once (``pip download --no-deps --ignore-requires-python``) into a
cache directory (``$PIPER_TEST_CACHE`` or ``~/.cache/piper-tests``), unpacks its ``megatron/``
package there, core and training (0.19.2's training imports core modules 0.16.1 lacks, e.g.
``transformer.cuda_graph_config``), and writes next to it a ``sitecustomize.py`` with what Python
3.11 and a host without a GPU need. Nothing is installed into the environment: subprocesses put the
tree first on PYTHONPATH (:func:`tree_env`), so they import 0.19.2 instead of the installed 0.16.1.

The ``sitecustomize.py`` (each line is a host fact from ../shared/notes/hosts.md or read here):
- ``typing.override`` (Python 3.12), used by ``megatron.training``;
- an import-only ``triton`` stand-in: ``megatron/core/transformer/moe/ops/paged_stash.py`` imports
  triton unguarded. torch probes for triton when its compile stack loads, so that stack is loaded
  first, while triton is absent, and torch never sees the stand-in; guarded importers in Megatron
  read its version 0.0.0 and take their no-triton path;
- ``torch.cuda.get_device_properties`` answering an H100 (compute capability 9.0): ``validate_args``
  asks ``get_device_arch_version()`` when tp or cp > 1, which a CPU-only torch cannot answer
  (the plans under test are for dgx-h100).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.19.2"

SITECUSTOMIZE = '''\
"""Test harness for megatron-core {version} on Python 3.11 without a GPU (tests/megatron/megatron_wheel.py)."""
import sys
import types
import typing

if not hasattr(typing, "override"):
    typing.override = lambda method: method

import torch
import torch._dynamo.repro.after_dynamo  # noqa: F401  torch's triton probes run now, triton absent
import torch._inductor.runtime.triton_compat  # noqa: F401

torch.compile(lambda x: x)  # loads the rest of the compile stack Megatron's jit_fuser decorators use


class _Anything:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self


def _attribute(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything


_language = types.ModuleType("triton.language")
_language.__getattr__ = _attribute
_triton = types.ModuleType("triton")
_triton.__version__ = "0.0.0"
_triton.language = _language
_triton.jit = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
_triton.autotune = lambda *args, **kwargs: (lambda f: f)
_triton.heuristics = lambda *args, **kwargs: (lambda f: f)
_triton.__getattr__ = _attribute
sys.modules.setdefault("triton", _triton)
sys.modules.setdefault("triton.language", _language)

torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(major=9, minor=0, name="H100 (stand-in)")
'''


def cache_dir() -> Path:
    return Path(os.environ.get("PIPER_TEST_CACHE") or Path.home() / ".cache" / "piper-tests")


def megatron_tree() -> tuple[Path | None, str]:
    """(directory holding ``megatron/`` 0.19.2 and ``sitecustomize.py``, "") or (None, why not)."""
    root = cache_dir() / f"megatron-core-{VERSION}"
    tree, done = root / "tree", root / "tree" / ".complete"
    if done.is_file():
        return tree, ""
    wheels = root / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("megatron_core-*.whl")):
        cmd = [sys.executable, "-m", "pip", "download", f"megatron-core=={VERSION}", "--no-deps",
               "--ignore-requires-python", "--only-binary=:all:", "-q", "-d", str(wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0 or not list(wheels.glob("megatron_core-*.whl")):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"`{' '.join(cmd[2:])}` failed: {' | '.join(tail) or 'no wheel'}"
    wheel = sorted(wheels.glob("megatron_core-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tree, [n for n in z.namelist() if n.startswith("megatron/")])
    if not (tree / "megatron" / "training" / "arguments.py").is_file():
        return None, f"{wheel.name} has no megatron/training/arguments.py"
    (tree / "sitecustomize.py").write_text(SITECUSTOMIZE.format(version=VERSION))
    done.write_text(wheel.name + "\n")
    return tree, ""


def tree_env(tree: Path, repo: Path, **extra: str) -> dict[str, str]:
    """Environment for a subprocess importing Megatron from ``tree`` (then the repo, then the venv)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(repo)])
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env | extra
