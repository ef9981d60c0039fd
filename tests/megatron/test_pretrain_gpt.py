"""Megatron-LM's own ``pretrain_gpt.py`` (core_v0.16.1), launched as users launch it, trains a tiny
MoE on 2 gloo CPU ranks with ``--piper`` and gets the losses of the same script run without it.

Every run is ``torchrun --standalone --nproc-per-node 2 -m piper_megatron.cpu_launch pretrain_gpt.py
ARGS`` (:mod:`piper_megatron.cpu_run`): Megatron's argument parsing and validation, initialisation,
model builder, DDP, optimizer, schedule and logging, with :mod:`piper_megatron.cpu_training`'s
shims; fp32; mock data with a NullTokenizer. Variants, each against a stock run (no ``--piper``)
of the plan the Piper run validated (shared between variants whose plans agree):

* ``flat``, ``hierarchical``, ``flat2`` and ``hierarchical2`` (pipelined in 2 chunks), ``tune``
  (``--piper-chunks tune``: each MoE layer runs 1/2/4/8 chunks for 3 calls each, then decides; 4
  micro-batches per iteration, so the decision falls in iteration 4 of 5): ep 2 and micro batch 2
  pinned, the rest as ``--piper`` sets it (distributed optimizer, overlapped gradient reduction and
  parameter gathering, alltoall);
* ``plan``: nothing pinned, ``--piper`` chooses every size.

Checked: the per-iteration ``lm loss`` of Megatron's log (7 significant digits) within 1e-5
relative of the stock run's; the arguments Megatron validated are the plan Piper printed; Piper's
dispatcher really ran the variant's all-to-all (``--piper-trace``); the tuner decided inside the run.

The checkout comes from ``PIPER_MEGATRON_LM`` or ``../shared/third_party/megatron-lm-core_v0.16.1``
beside the repository; without it the tier skips with the reason, and fails in CI (``CI=true``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")

from piper_megatron.cpu_launch import CPU_FLAGS  # noqa: E402
from piper_megatron.cpu_run import Run, RunFailed, default_checkout, find_script, run_script  # noqa: E402

pytestmark = pytest.mark.megatron

REPO = Path(__file__).resolve().parents[2]
ENV_VAR = "PIPER_MEGATRON_LM"
RANKS, ITERS, TOL = 2, 5, 1e-5
TIMEOUT_S = 480.0  # one run takes ~15 s on a quiet 2-core machine, minutes on a loaded one
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--num-experts", "4", "--moe-router-topk", "2",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--global-batch-size", "16"]
CPU = [word for flag, _ in CPU_FLAGS for word in flag]
TRAIN = ["--train-iters", str(ITERS), "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "128", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
         "--seed", "1234", "--distributed-timeout-minutes", "3"]
PIPER = ["--piper", "--piper-cluster", "cpu-local"]
SIZES = ["--expert-model-parallel-size", "2", "--micro-batch-size", "2"]
VARIANTS: dict[str, list[str]] = {
    "flat": SIZES + ["--piper-a2a", "flat"],
    "hierarchical": SIZES + ["--piper-a2a", "hierarchical"],
    "flat2": SIZES + ["--piper-a2a", "flat", "--piper-chunks", "2"],
    "hierarchical2": SIZES + ["--piper-a2a", "hierarchical", "--piper-chunks", "2"],
    "tune": SIZES + ["--piper-chunks", "tune"],
    "plan": [],
}
# What the plan decides, as Megatron's validated arguments name it.
SIZE_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "micro_batch_size")
SWITCH_ARGS = ("sequence_parallel", "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather")
OPTIONAL_ARGS = ("num_layers_per_virtual_pipeline_stage", "decoder_last_pipeline_num_layers", "recompute_granularity",
                 "recompute_method", "recompute_num_layers", "moe_token_dispatcher_type")
PLAN_ARGS = SIZE_ARGS + SWITCH_ARGS + OPTIONAL_ARGS + ("data_parallel_size", "global_batch_size")
MICRO_BATCHES = 16 // (2 * 2)  # global batch / (micro batch x data parallel) with the pinned sizes
WORK: dict[str, Path] = {}


@pytest.fixture(scope="module")
def script() -> Path:
    given = os.environ.get(ENV_VAR)
    checkout = Path(given) if given else default_checkout(REPO)
    found = find_script(checkout)
    if found is None:
        why = (f"no Megatron-LM checkout with pretrain_gpt.py at {checkout} (set {ENV_VAR} to a core_v0.16.1 "
               "checkout)")
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real-script tier must run in CI: {why}")
        pytest.skip(why)
    return found


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def plan_flags(args: dict[str, Any]) -> list[str]:
    """Megatron flags that reproduce the plan of a run's validated ``args`` without Piper."""
    flags = [word for dest in SIZE_ARGS for word in (_flag(dest), str(args[dest]))]
    flags += [_flag(dest) for dest in SWITCH_ARGS if args[dest]]
    flags += [word for dest in OPTIONAL_ARGS if args[dest] is not None for word in (_flag(dest), str(args[dest]))]
    return flags


@pytest.fixture(scope="module")
def runs(script: Path, tmp_path_factory: pytest.TempPathFactory):
    """name -> Run, each made once: ``piper:<variant>`` and ``stock:<plan flags>`` (its folder in
    ``WORK[name]``)."""
    made: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in made:
            kind, _, rest = name.partition(":")
            work = WORK[name] = tmp_path_factory.mktemp(kind)
            args = MODEL + CPU + TRAIN
            if kind == "piper":
                args += PIPER + VARIANTS[rest] + ["--piper-trace", str(work / "trace.jsonl")]
            else:
                args += rest.split()
            try:
                made[name] = run_script(script, args, ranks=RANKS, timeout_s=TIMEOUT_S, cwd=work)
            except RunFailed as exc:
                pytest.fail(f"{name}: {exc}", pytrace=False)
        return made[name]

    return get


def _stock_for(runs, piper: Run) -> Run:
    return runs("stock:" + " ".join(plan_flags(piper.args)))


def _shown(value: str) -> Any:
    """A value as ``Change.describe`` shows it (on/off/unset or as written)."""
    if value in ("on", "off", "unset"):
        return {"on": True, "off": False, "unset": None}[value]
    return int(value) if value.isdigit() else value


def _trace(variant: str) -> list[dict[str, Any]]:
    """Every rank's ``--piper-trace`` records of a Piper run."""
    records = []
    for path in sorted(WORK[f"piper:{variant}"].glob("trace.rank*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_piper_run_has_the_losses_of_the_stock_run_of_its_plan(runs, variant):
    piper = runs(f"piper:{variant}")
    stock = _stock_for(runs, piper)
    assert "piper: CPU shims installed" in piper.stdout and "piper: CPU shims installed" in stock.stdout
    assert [it.iteration for it in piper.iterations] == list(range(1, ITERS + 1)), piper.stdout[-3000:]
    assert len(piper.losses) == len(stock.losses) == ITERS, (piper.losses, stock.losses)
    worst = max(abs(a - b) / abs(b) for a, b in zip(piper.losses, stock.losses))
    assert worst <= TOL, (f"{variant}: --piper losses {piper.losses} vs stock {stock.losses} (worst relative "
                          f"difference {worst:.2e})")
    assert not any(line.startswith("piper") for line in stock.stdout.splitlines()
                   if not line.startswith("piper: CPU shims installed"))  # stock: Piper did nothing
    assert {k: stock.args[k] for k in PLAN_ARGS} == {k: piper.args[k] for k in PLAN_ARGS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_validated_the_plan_piper_printed(runs, variant):
    piper = runs(f"piper:{variant}")
    assert piper.args["piper"] is True and piper.args["fp16"] is False and piper.args["bf16"] is False
    assert any(line.startswith("piper: note: this job trains in fp32") for line in piper.lines("piper: note:"))
    changes = [re.match(r"piper:   --([\w-]+) (.+) \(was .*\)$", line) for line in piper.lines("piper:   --")]
    assert changes and all(changes), piper.lines("piper:")
    for m in changes:
        dest = m[1].replace("-", "_")
        assert piper.args[dest] == _shown(m[2]), f"--{m[1]}: Piper set {m[2]}, Megatron validated {piper.args[dest]}"
    if variant != "plan":
        assert (piper.args["expert_model_parallel_size"], piper.args["micro_batch_size"]) == (2, 2)
    assert piper.args["overlap_grad_reduce"] is True  # as --piper sets it (the step-time model assumes it)


# variant -> (the report's dispatcher line, the trace's algorithm and chunk counts); a pipelined
# all-to-all runs the plan's algorithm per chunk
EXPECTED_DISPATCH = {"flat": ("Piper flat all-to-all", "flat", {1}),
                     "hierarchical": ("Piper hierarchical all-to-all", "hierarchical", {1}),
                     "flat2": ("Piper pipelined all-to-all, 2 chunks of flat exchanges", "flat", {2}),
                     "hierarchical2": ("Piper pipelined all-to-all, 2 chunks of hierarchical", "hierarchical", {2})}


@pytest.mark.parametrize("variant", list(EXPECTED_DISPATCH))
def test_piper_dispatcher_ran_the_variants_all_to_all(runs, variant):
    piper = runs(f"piper:{variant}")
    records = _trace(variant)
    calls = ITERS * MICRO_BATCHES * 2  # iterations x micro-batches x MoE layers, per rank
    assert len(records) == RANKS * calls, len(records)
    described, algorithm, chunks = EXPECTED_DISPATCH[variant]
    assert {r["algorithm"] for r in records} == {algorithm} and {r["chunks"] for r in records} == chunks
    (line,) = piper.lines("piper: token dispatcher:")
    assert described in line


def test_tune_measures_each_chunk_count_then_decides_inside_the_run(runs):
    piper = runs("piper:tune")
    (line,) = piper.lines("piper: token dispatcher:")
    assert "chunk count measured per MoE layer at run time" in line
    records = _trace("tune")
    assert records
    for rank in range(RANKS):
        for layer in sorted({r["layer"] for r in records}):
            chunks = [r["chunks"] for r in sorted((r for r in records if (r["rank"], r["layer"]) == (rank, layer)),
                                                  key=lambda r: r["call"])]
            assert len(chunks) == ITERS * MICRO_BATCHES  # 20 calls: 12 measured, the decision at call 13
            assert chunks[:12] == [1] * 3 + [2] * 3 + [4] * 3 + [8] * 3, chunks
            decided = chunks[12:]
            assert len(set(decided)) == 1 and decided[0] in (1, 2, 4, 8), chunks


def test_losses_are_logged_with_seven_significant_digits(runs):
    stock = _stock_for(runs, runs("piper:flat"))
    logged = re.findall(r"lm loss: (\S+) \|", stock.stdout)
    assert len(logged) == ITERS and all(re.fullmatch(r"\d\.\d{6}E[+-]\d\d", x) for x in logged), logged


def _cpu_launch(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "piper_megatron.cpu_launch", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_cpu_launch_names_the_cpu_flags_it_needs(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("raise SystemExit('must not run')\n")
    proc = _cpu_launch(["pretrain_gpt.py", *MODEL, *TRAIN, "--distributed-backend", "nccl"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "CPU flags='missing'" in proc.stderr and "add --distributed-backend gloo --transformer-impl local" \
        in proc.stderr and "must not run" not in proc.stderr


def test_cpu_launch_needs_megatron_training(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("raise SystemExit('must not run')\n")
    proc = _cpu_launch(["pretrain_gpt.py", *MODEL, *CPU, *TRAIN], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "megatron.training='not importable'" in proc.stderr and "Megatron-LM checkout" in proc.stderr
