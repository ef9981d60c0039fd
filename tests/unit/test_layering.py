"""The core does not name an adapter, and one adapter does not import the other: the adapters
register their trainers (piper_core/trainers.py) and the core finds them by framework name."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from piper_core import trainers

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = ("piper_megatron", "piper_deepspeed")
# a dotted module or "module:attribute" target, as importlib or a launcher would take it
TARGET = re.compile(r"^(piper_megatron|piper_deepspeed)(\.\w+)*(:\w+)?$")


def _imports_and_targets(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every import of a module and every string constant shaped like a module
    target in ``path``; docstrings are prose and are skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and TARGET.match(node.value):
            out.append((node.lineno, node.value))
    return out


def _offences(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, name in _imports_and_targets(path):
            if name.split(".")[0].split(":")[0] in forbidden:
                found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    return found


def test_no_core_module_names_an_adapter_module():
    assert _offences("piper_core", ADAPTERS) == []


@pytest.mark.parametrize("adapter,other", [("piper_megatron", "piper_deepspeed"), ("piper_deepspeed", "piper_megatron")])
def test_an_adapter_does_not_import_the_other(adapter, other):
    assert _offences(adapter, (other,)) == []


def test_the_scan_finds_what_it_forbids(tmp_path):
    """The scan can fail: an import, a from-import and a launcher target are each found; a docstring
    mentioning the module is not."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""Uses :mod:`piper_megatron.train`."""\nimport piper_megatron.train\n'
                   "from piper_deepspeed.measure import run\nT = 'piper_megatron.train:rank_main'\n")
    assert [name for _, name in _imports_and_targets(bad)] == \
        ["piper_megatron.train", "piper_deepspeed.measure", "piper_megatron.train:rank_main"]


def test_both_adapters_register_their_trainers():
    for name in ("megatron", "deepspeed"):
        assert name in trainers.registered(), name
    megatron = trainers.get("megatron")
    assert megatron.name == "megatron" and megatron.rank_target.endswith(":rank_main") and megatron.check is not None
    assert megatron.gradients_after_step and not trainers.get("deepspeed").gradients_after_step
    assert trainers.unavailable("megatron") is None


def test_an_unknown_framework_is_refused_with_what_is_registered():
    with pytest.raises(trainers.TrainerUnavailable, match=r"trainer 'tutel': no adapter registers it under the "
                                                          r"entry-point group 'piper.trainers' \(registered: .*megatron"):
        trainers.get("tutel")
    assert "registered:" in trainers.unavailable("tutel")


FAKE = trainers.Trainer(name="fake", rank_target="nowhere:main", probe_setup=lambda info: None,
                        requires=("piper_no_such_module_for_tests",))
WRONG = object()


def test_a_trainer_whose_requirements_are_missing_is_unavailable(monkeypatch):
    from importlib import metadata

    points = {"fake": metadata.EntryPoint("fake", "tests.unit.test_layering:FAKE", trainers.GROUP),
              "wrong": metadata.EntryPoint("wrong", "tests.unit.test_layering:WRONG", trainers.GROUP),
              "broken": metadata.EntryPoint("broken", "piper_no_such_module_for_tests:X", trainers.GROUP)}
    monkeypatch.setattr(trainers, "registered", lambda: points)
    assert trainers.get("fake").rank_target == FAKE.rank_target  # loaded from its entry point
    assert trainers.unavailable("fake") == ("trainer 'fake': piper_no_such_module_for_tests is not installed "
                                            "(pip install -e '.[fake]')")
    assert "is not a Trainer named 'wrong'" in trainers.unavailable("wrong")
    assert "cannot be imported (ModuleNotFoundError" in trainers.unavailable("broken")


def test_calibration_skips_the_probe_and_says_why_when_no_trainer_is_registered(monkeypatch):
    from piper_core.calibrate.steps import Topology, overhead_probe_available, plan_steps

    monkeypatch.setattr(trainers, "registered", lambda: {})
    why = overhead_probe_available("megatron")
    assert why.startswith("trainer 'megatron': no adapter registers it")
    names = [s.name for s in plan_steps(Topology(nodes=1, ranks_per_node=2), quick=True, timeout_s=30,
                                        overhead_probe=why is None)]
    assert "overheads" not in names


def test_the_core_imports_without_any_adapter():
    """Planning, prediction, calibration's launcher side and validation import with both adapter
    packages made unimportable."""
    code = ("import sys\nfor name in ('piper_megatron', 'piper_deepspeed'): sys.modules[name] = None\n"
            "import piper_core.cli.main, piper_core.calibrate.run, piper_core.calibrate.probe, piper_core.validate.run, "
            "piper_core.bench.e2e\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
