"""The guard around plain ``deepspeed.initialize`` (:mod:`piper_deepspeed.guard`): a config with an
active ``"piper"`` block is refused there, never silently run as stock DeepSpeed.

* every way DeepSpeed reads a config (a dict, a JSON path, base64, ``config_params``,
  ``args.deepspeed_config``, ``args.deepscale_config``, positional arguments) is refused with Piper's
  message before DeepSpeed does anything (its ``init_distributed`` fails the test if reached), and
  the arguments are left as they were;
* on a real gloo rank: no block and ``"enabled": false`` build stock engines through the guard,
  an active block is refused there too, and ``piper_deepspeed.initialize`` passes the guard with
  ``engine.config["piper"]`` showing the block that ran;
* ``install`` is idempotent (twice, and after a reload of the module) and ``uninstall`` restores
  DeepSpeed's own function;
* a fresh interpreter that imports only ``piper_deepspeed.config`` is guarded.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import importlib
import inspect
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.deepspeed import deepspeed_comm
from tests.gloo import run_ranks

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

import deepspeed  # noqa: E402

import piper_deepspeed  # noqa: E402
from piper_core.errors import SpecError  # noqa: E402
from piper_deepspeed import guard  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BLOCK = {"cluster": "cpu-local", "model": "tiny-moe"}
CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
REFUSED = (r"^piper=\{'cluster': 'cpu-local', 'model': 'tiny-moe'\}: deepspeed\.initialize ignores the \"piper\" "
           r"block \(DeepSpeed keeps unknown config keys silently\): the model would run stock, without Piper's plan "
           r"or all-to-all; call piper_deepspeed\.initialize\(\.\.\.\) with the same arguments, or set "
           r"\"piper\": \{\"enabled\": false\} to run stock DeepSpeed$")


def _forbidden(*args, **kwargs):
    raise AssertionError("DeepSpeed must not be reached: the guard lets the block through")


@pytest.mark.parametrize("how", ["dict", "path", "base64", "config_params", "args.deepspeed_config",
                                 "args.deepscale_config", "positional"])
def test_plain_initialize_refuses_an_active_block(how, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(deepspeed.comm, "init_distributed", _forbidden)
    config = CONFIG | {"piper": BLOCK}
    snapshot = copy.deepcopy(config)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = argparse.Namespace(local_rank=0)
    kwargs: dict = {"model": torch.nn.Linear(2, 2)}
    if how == "dict":
        kwargs["config"] = config
    elif how == "path":
        kwargs["config"] = str(path)
    elif how == "base64":
        kwargs["config"] = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    elif how == "config_params":
        kwargs["config_params"] = config
    elif how.startswith("args."):
        setattr(args, how.removeprefix("args."), str(path))
    args_before = dict(vars(args))
    with pytest.raises(SpecError, match=REFUSED):
        if how == "positional":  # args, model, optimizer, params, data, scheduler, port, mpu, dist, collate, config
            deepspeed.initialize(args, kwargs["model"], None, None, None, None, 29500, None, None, None, config)
        else:
            deepspeed.initialize(args=args, **kwargs)
    assert config == snapshot and vars(args) == args_before


def _on_one_rank(rank: int, world: int) -> dict:
    from piper_core.presets import load_model
    from piper_core.specs.parallel import ParallelPlan
    from piper_deepspeed.builder import build_model

    deepspeed_comm()
    out: dict = {}
    disabled = CONFIG | {"piper": {"enabled": False, "cluster": "cpu-local"}}
    for name, config in (("no block", CONFIG), ("disabled", disabled)):
        engine, _, _, _ = deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
        out[name] = (type(engine).__name__, engine.config.get("piper"))
    try:
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config=CONFIG | {"piper": BLOCK})
    except SpecError as exc:
        out["refused"] = str(exc)
    model = build_model(load_model("tiny-moe"), ParallelPlan(gpus=world, global_batch_size=world))
    with contextlib.redirect_stdout(io.StringIO()):  # rank 0's plan report
        engine, _, _, _ = piper_deepspeed.initialize(model=model, config=CONFIG | {"piper": BLOCK})
    out["piper"] = (type(engine).__name__, engine.config["piper"], engine._config._param_dict is engine.config)
    out["guarded"] = guard.installed()
    return out


def test_on_a_gloo_rank_stock_runs_piper_passes_and_the_block_is_refused() -> None:
    [out] = run_ranks(1, _on_one_rank, timeout_s=180)
    assert out["guarded"]
    assert out["no block"] == ("DeepSpeedEngine", None)
    assert out["disabled"] == ("DeepSpeedEngine", {"enabled": False, "cluster": "cpu-local"})  # DeepSpeed untouched
    assert "deepspeed.initialize ignores the \"piper\" block" in out["refused"]
    name, block, same = out["piper"]
    assert name == "DeepSpeedEngine" and same, "engine.config must be the dict DeepSpeed's config reads"
    assert block["plan"]["ep"] == 1 and block["cluster"] == "cpu-local" and "predicted" in block


def test_install_is_idempotent_and_uninstall_restores_deepspeed(monkeypatch) -> None:
    stock = inspect.unwrap(deepspeed.initialize)
    assert stock.__module__ == "deepspeed" and not getattr(stock, guard.MARK, False)
    monkeypatch.setattr(deepspeed, "initialize", deepspeed.initialize)  # restored after the test, whatever happens
    assert guard.installed() and deepspeed.initialize.__wrapped__ is stock, "importing piper_deepspeed installs it"
    guard.install()
    importlib.reload(guard)  # a second import of the module's code
    guard.install()
    assert deepspeed.initialize.__wrapped__ is stock, "wrapped twice"
    guard.uninstall()
    assert deepspeed.initialize is stock and not guard.installed()
    guard.uninstall()
    assert deepspeed.initialize is stock
    guard.install()
    assert guard.installed() and deepspeed.initialize.__wrapped__ is stock
    assert inspect.signature(deepspeed.initialize) == inspect.signature(stock)


def test_importing_any_piper_deepspeed_module_installs_the_guard() -> None:
    code = ("import deepspeed, torch\n"
            "import piper_deepspeed.config  # nothing else of Piper\n"
            "try:\n"
            f"    deepspeed.initialize(model=torch.nn.Linear(2, 2), config={CONFIG | {'piper': BLOCK}!r})\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SpecError piper={'cluster': 'cpu-local', 'model': 'tiny-moe'}: deepspeed.initialize ignores" \
        in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
