"""``python -m piper_deepspeed.plan``: what rank 0 will print, without a launcher; --json for scripts;
a refused block exits 2 naming the key, a config nothing fits exits 1 with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

from piper_deepspeed.plan import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs" / "deepspeed" / "ds.json"


def test_prints_what_rank_zero_will_print(capsys):
    assert main([str(CONFIG), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("piper: tiny-moe on 4 DeepSpeed ranks of cpu-local")
    assert "  best: " in out and "piper: DeepSpeed config: " in out and "run Piper's all-to-all" in out


def test_json_holds_the_plan_and_the_rewritten_config(capsys):
    assert main([str(CONFIG), "--world-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and data["plan"].startswith("tp1 ")
    cfg = data["config"]
    # every DeepSpeed rank is a data-parallel rank: micro-batch x accumulation x 4 ranks = the batch
    assert cfg["train_batch_size"] == 16 == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 4
    assert {c["key"] for c in data["changes"]} >= {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}


def test_bad_block_exits_2_naming_the_key_and_nothing_fits_exits_1(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(json.loads(CONFIG.read_text()) | {"piper": {"cluster": "cpu-local", "model": "tiny-moe",
                                                                           "a2a": "sideways"}}))
    assert main([str(bad), "--world-size", "4"]) == 2
    assert "a2a" in capsys.readouterr().err
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"train_batch_size": 8, "bf16": {"enabled": True},
                                "piper": {"cluster": "cpu-local", "model": "switch-1t"}}))
    assert main([str(huge), "--world-size", "8"]) == 1
    assert "switch-1t" in capsys.readouterr().err
