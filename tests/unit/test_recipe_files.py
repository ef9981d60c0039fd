"""The switch-1t recipe's files are present, load, and are what their generators write today.

``recipes/switch-1t/regenerate.sh`` writes every generated file and every output the README quotes.
Here each is produced again in-process and compared with the committed copy, so a change to the
model, the resource model, the scheduler or an exporter that is not followed by a regeneration
fails: the Megatron args files (``piper plan --export-megatron``, through the CLI itself), the
DeepSpeed configs (``deepspeed_plan.py``: the adapter's own plan, written by Piper's exporter), the
outputs of every command, and the README, whose marked blocks and summary table ``readme.py`` fills
from those outputs. Search time and rate, the only run-to-run variation, are masked. The model flags in ``megatron.sh`` must be the exporter's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from piper_core.cli.main import main as piper_main
from piper_core.export import model_flags
from piper_core.presets import load_model

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "switch-1t"
GENERATED = RECIPE / "generated"
FEASIBLE_MEGATRON = ("dgx-h100-64", "dgx-h100-1024", "frontier-256", "frontier-1024")
FEASIBLE_DEEPSPEED = ("dgx-h100-1024", "frontier-1024")
TARGETS = ("dgx-h100-64", "dgx-h100-1024", "frontier-64", "frontier-256", "frontier-1024")
TIMING = re.compile(r"searched ([\d,]+) plans in [\d.]+ s \([\d,]+ plans/s\)")


def _split(target: str) -> tuple[str, int]:
    cluster, gpus = target.rsplit("-", 1)
    return cluster, int(gpus)


def _masked(text: str) -> list[str]:
    """Output lines with the search time masked and trailing blanks dropped."""
    return [TIMING.sub(r"searched \1 plans in T s (R plans/s)", line).rstrip() for line in text.splitlines()]


@cache
def _deepspeed_plan():
    return _recipe_module("deepspeed_plan")


@cache
def _piper_plan(target: str, tmp: str) -> tuple[str, str | None, int]:
    """(stdout, the Megatron args file or None, exit status) of regenerate.sh's `piper plan`."""
    cluster, gpus = _split(target)
    out = Path(tmp) / f"{target}.sh"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = piper_main(["plan", "switch-1t", "--cluster", cluster, "--gpus", str(gpus), "--gbs", "2048",
                             "--detail", "--export-megatron", str(out)])
    return buf.getvalue(), (out.read_text() if out.exists() else None), status


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("recipe"))


@pytest.fixture(scope="module")
def plan_only_runs() -> dict[str, subprocess.Popen]:
    """regenerate.sh's `megatron.sh C N --plan-only` for every target, started together (bash, then
    python -m piper_megatron; each searches, so they overlap the in-process tests' searches)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    runs = {t: subprocess.Popen(["bash", str(RECIPE / "megatron.sh"), *map(str, _split(t)), "--plan-only"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for t in TARGETS}
    yield runs
    for run in runs.values():
        run.kill()


def test_start_plan_only_runs(plan_only_runs):
    """Starts the subprocesses early (tests run in file order); the checks are below."""
    assert set(plan_only_runs) == set(TARGETS)


def test_files_exist():
    for name in ("README.md", "regenerate.sh", "readme.py", "megatron.sh", "deepspeed.sh", "deepspeed_plan.py"):
        assert (RECIPE / name).is_file(), name
    for target in TARGETS:
        for kind in ("plan", "megatron", "deepspeed"):
            assert (GENERATED / "outputs" / f"{kind}-{target}.txt").is_file(), f"{kind}-{target}.txt"
    assert sorted(p.stem for p in (GENERATED / "megatron").glob("*.sh")) == sorted(FEASIBLE_MEGATRON)
    assert sorted(p.stem for p in (GENERATED / "deepspeed").glob("*.json")) == sorted(FEASIBLE_DEEPSPEED)
    for target in FEASIBLE_DEEPSPEED:
        assert (GENERATED / "outputs" / f"predict-deepspeed-{target}.txt").is_file()
    for target in FEASIBLE_MEGATRON:
        assert {p.name for p in (GENERATED / "figures" / target).iterdir()} == {"timeline.png", "memory.png",
                                                                                "pareto.png"}


@pytest.mark.parametrize("target", TARGETS)
def test_megatron_args_and_plan_output_are_current(target: str, plan_dir: str):
    stdout, args_file, status = _piper_plan(target, plan_dir)
    committed = GENERATED / "megatron" / f"{target}.sh"
    assert (status == 0) == (target in FEASIBLE_MEGATRON)
    if args_file is None:
        assert not committed.exists()
    else:
        assert committed.read_text() == args_file, f"{committed} is stale: run recipes/switch-1t/regenerate.sh"
    assert _masked((GENERATED / "outputs" / f"plan-{target}.txt").read_text()) == _masked(stdout)


@pytest.mark.parametrize("target", TARGETS)
def test_deepspeed_config_is_current_and_valid(target: str):
    from piper_core.errors import Infeasible
    from piper_deepspeed.config import read_block
    from piper_deepspeed.initialize import plan_for

    cluster, gpus = _split(target)
    module = _deepspeed_plan()
    committed = GENERATED / "deepspeed" / f"{target}.json"
    printed = (GENERATED / "outputs" / f"deepspeed-{target}.txt").read_text()
    if target not in FEASIBLE_DEEPSPEED:
        with pytest.raises(Infeasible, match="no plan DeepSpeed can run fits switch-1t"):
            module.plan(cluster, gpus)
        assert not committed.exists() and printed.startswith("piper_deepspeed: infeasible:")
        return
    config, report = module.plan(cluster, gpus)
    assert committed.read_text() == module.render(config), f"{committed} is stale: run regenerate.sh"
    assert _masked(printed) == _masked(report + "\n")
    loaded = json.loads(committed.read_text())
    block = read_block(loaded)
    assert block.cluster == cluster and block.model == "switch-1t" and block.plan is not None
    # What initialize will run on GPUS ranks: the pinned plan, feasible, batch triple consistent.
    choice = plan_for(loaded, gpus)
    assert choice.search is None and choice.prediction.feasible
    pin = block.plan
    plan = choice.plan
    assert (plan.tp, plan.pp, plan.ep, plan.micro_batch_size, plan.recompute) == (pin.tp, pin.pp, pin.ep, pin.mbs,
                                                                                  pin.recompute)
    assert loaded["train_batch_size"] == (loaded["train_micro_batch_size_per_gpu"] *
                                          loaded["gradient_accumulation_steps"] * plan.dp)


def _bash_array(text: str, name: str) -> list[str]:
    body = re.search(rf"^{name}=\(\n(.*?)^\)", text, re.S | re.M)
    assert body, f"no {name}=( ... ) in megatron.sh"
    return shlex.split(body.group(1), comments=True)


def test_megatron_sh_model_flags_are_the_exporters():
    want: list[str] = []
    for flag, value in model_flags(load_model("switch-1t")):
        want += [flag] if value is None else [flag, str(value)]
    got = _bash_array((RECIPE / "megatron.sh").read_text(), "MODEL_ARGS")
    assert got == want + ["--global-batch-size", "2048", "--bf16"]


@pytest.mark.parametrize("target", TARGETS)
def test_megatron_plan_only_output_is_current(target: str, plan_only_runs):
    stdout, _ = plan_only_runs[target].communicate(timeout=120)
    assert plan_only_runs[target].returncode == (0 if target in FEASIBLE_MEGATRON else 1), stdout
    committed = (GENERATED / "outputs" / f"megatron-{target}.txt").read_text()
    assert _masked(committed) == _masked(stdout)


def _recipe_module(name: str):
    spec = importlib.util.spec_from_file_location(f"switch_1t_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("target", FEASIBLE_DEEPSPEED)
def test_deepspeed_memory_output_is_current(target: str):
    cluster, gpus = _split(target)
    config = json.loads((GENERATED / "deepspeed" / f"{target}.json").read_text())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = piper_main(["predict", "switch-1t", "--cluster", cluster, "--gpus", str(gpus),
                             "--parallel", _deepspeed_plan().parallel(config)])
    assert status == 0
    assert (GENERATED / "outputs" / f"predict-deepspeed-{target}.txt").read_text() == buf.getvalue()


def test_readme_is_filled_from_the_outputs():
    """Every output is quoted in a marked block, and refilling the blocks changes nothing."""
    readme = (RECIPE / "README.md").read_text()
    quoted = set(re.findall(r"<!-- begin output: ([\w.-]+) -->", readme))
    assert quoted == {p.name for p in (GENERATED / "outputs").glob("*.txt")}
    assert _recipe_module("readme").render(readme) == readme, "README.md is stale: run recipes/switch-1t/regenerate.sh"
