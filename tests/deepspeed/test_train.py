"""``deepspeed.initialize`` vs ``piper_deepspeed.initialize``: the same training, step for step.

Each pair trains tiny-moe (4 MoE layers, 8 experts, top-2, no token dropping) for 5 steps with
Adam (``torch_adam``) from the same seed and data, once with stock DeepSpeed (the model built with
``ep=2``) and once through the ``"piper"`` block, pinned to the same layout so that Piper's config
rewrite is the identity; the only difference is Piper's all-to-all inside every MoE layer. The
losses must agree to fp32 rounding (rtol 1e-5), and the engine must hold PiperMOELayers.

* 2 processes, ep 2: ZeRO 0 (flat all-to-all pipelined in 2 chunks), ZeRO 1 (hierarchical), ZeRO 2
  (flat, 4 chunks), ZeRO 0 with ``"chunks": "tune"`` (7 steps: every layer measures 1/2/4/8
  chunks in 12 micro-batches, then keeps one, the same on both ranks), ZeRO 2 hierarchical in 2
  chunks with ``"defer_wgrad": true`` (its trace shows each chunk's weight gradients computed after
  its dispatch gradient was posted); plus, on the same processes: a searched (unpinned) plan, whose config
  rewrite, engine settings and rank-0 printout are checked against ``plan_for``/``report``, and its
  ``trace`` files (plan.json, one dispatch post per chunk per MoE layer per micro-batch); a model
  built with a conflicting ep_size (an error naming the layer); ``plan_only`` (PlanOnly on every rank).
* 4 processes ("2 nodes x 2"): ZeRO 2 with ep 4 (hierarchical, so one exchange stage crosses nodes),
  ZeRO 1 with ep 4 hierarchical in 2 pipelined chunks (``"a2a": "hierarchical", "chunks": 2``: each
  chunk's exchange has both stages), and a 2-stage PipelineModule with ep 2 (ZeRO 1, flat/2;
  DeepSpeed's pipeline engine runs ZeRO 0-1 only), all pinned.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

from tests.deepspeed import deepspeed_comm
from tests.gloo import run_ranks

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

STEPS = 5
BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}}}
BLOCK = {"cluster": "cpu-local", "model": "tiny-moe"}


def _config(stage: int, **block) -> dict:
    cfg = BASE | {"zero_optimization": {"stage": stage}}
    return cfg | ({"piper": BLOCK | block} if block else {})


def _pair(stage: int, a2a: str, chunks: int | str, *, ep: int, pipeline: bool = False, steps: int = STEPS,
          **block) -> dict:
    from piper_deepspeed.train import TrainArgs, train

    world = torch.distributed.get_world_size()
    stages = 2 if pipeline else 1
    mbs = BASE["train_micro_batch_size_per_gpu"]
    gas = BASE["train_batch_size"] // (mbs * world // stages)
    stock_cfg = _config(stage) | {"gradient_accumulation_steps": gas}
    piper_cfg = _config(stage, a2a=a2a, chunks=chunks, plan={"pp": stages, "ep": ep, "mbs": mbs}, **block) \
        | {"gradient_accumulation_steps": gas}
    common = dict(model="tiny-moe", steps=steps, pipeline=pipeline, quiet=True)
    with contextlib.redirect_stdout(io.StringIO()):
        stock = train(TrainArgs(config=stock_cfg, ep=ep, stages=stages, **common))
        piper = train(TrainArgs(config=piper_cfg, **common))
    changed = {k: piper.engine_config[k] for k in stock_cfg if k != "piper" and piper.engine_config[k] != stock_cfg[k]}
    return {"case": f"ZeRO {stage} ep={ep} pp={stages} {a2a}/{chunks}", "stock": [s.loss for s in stock.steps],
            "piper": [s.loss for s in piper.steps], "stock_moe": stock.moe_classes, "piper_moe": piper.moe_classes,
            "config_changed": changed, "steps": steps, "tuned": piper.tuned, "exchanges": piper.exchanges}


def _searched(trace: str) -> dict:
    """An unpinned block: the engine runs the plan plan_for picks, rank 0 prints report(), every
    rank traces its all-to-all schedule."""
    from piper_deepspeed.initialize import node_topology, plan_for, report, rewrite_config
    from piper_deepspeed.train import TrainArgs, train

    world = torch.distributed.get_world_size()
    config = {"train_batch_size": 8, "optimizer": BASE["optimizer"], "zero_optimization": {"stage": 0},
              "piper": BLOCK | {"chunks": 2, "trace": trace}}
    choice = plan_for(config, world)
    rewritten, changes = rewrite_config(config, choice)
    expected = report(choice, changes, config, topology=node_topology(choice.prediction.cluster, world))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run = train(TrainArgs(config=config, model="tiny-moe", steps=2, quiet=True))
    cfg = run.engine_config
    return {"plan": choice.plan, "built": run.plan, "expected_report": expected, "stdout": out.getvalue(),
            "engine": {k: cfg[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                           "gradient_accumulation_steps", "zero_optimization", "piper")},
            "rewritten": {k: rewritten[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                    "gradient_accumulation_steps", "zero_optimization", "piper")},
            "moe": run.moe_classes}


def _conflict_and_plan_only() -> dict:
    """A model built with ep_size 1 under a plan with ep 2; then plan_only."""
    import piper_deepspeed
    from piper_core.errors import SpecError
    from piper_core.presets import load_model
    from piper_core.specs.parallel import ParallelPlan
    from piper_deepspeed.builder import build_model

    world = torch.distributed.get_world_size()
    spec = load_model("tiny-moe")
    model = build_model(spec, ParallelPlan(gpus=world, ep=1, global_batch_size=world))
    out: dict = {}
    config = _config(0, plan={"ep": 2, "mbs": 2})
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            piper_deepspeed.initialize(model=model, config=config)
        except SpecError as exc:
            out["conflict"] = str(exc)
        try:
            piper_deepspeed.initialize(model=model, config=_config(0, plan_only=True))
        except piper_deepspeed.PlanOnly as exc:
            out["plan_only"] = (exc.code, exc.choice.plan.ep)
    return out


def _two_ranks(rank: int, world: int, trace: str) -> dict:
    deepspeed_comm()
    pairs = [_pair(0, "flat", 2, ep=2), _pair(1, "hierarchical", 1, ep=2), _pair(2, "flat", 4, ep=2),
             _pair(0, "flat", "tune", ep=2, steps=7),
             _pair(2, "hierarchical", 2, ep=2, defer_wgrad=True, trace=f"{trace}/defer")]
    return {"pairs": pairs, "searched": _searched(trace), "errors": _conflict_and_plan_only()}


def _four_ranks(rank: int, world: int) -> dict:
    deepspeed_comm()
    # Order matters: DeepSpeed keeps groups.mpu and its expert groups (by ep size) in module globals,
    # so the pipeline engine, which sets groups.mpu, comes last, and the two use different ep sizes.
    return {"pairs": [_pair(2, "hierarchical", 1, ep=4), _pair(1, "hierarchical", 2, ep=4),
                      _pair(1, "flat", 2, ep=2, pipeline=True)]}


def _check_pairs(pairs: list[dict]) -> None:
    for p in pairs:
        assert len(p["stock"]) == len(p["piper"]) == p["steps"], p["case"]
        assert p["config_changed"] == {}, f"{p['case']}: the pinned plan must not rewrite the config"
        assert p["stock_moe"] and set(p["stock_moe"]) == {"MOELayer"}, p["case"]
        assert p["piper_moe"] and set(p["piper_moe"]) == {"PiperMOELayer"}, p["case"]
        torch.testing.assert_close(torch.tensor(p["piper"]), torch.tensor(p["stock"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, p=p: f"{p['case']}: losses differ: {m}")
        assert len(set(p["stock"])) > 1, f"{p['case']}: the loss never changed; nothing trained"


def _untimed(text: str) -> str:
    """The report without the search's wall-clock time, the one part that differs between calls."""
    return re.sub(r"in [0-9.]+ s \([0-9,]+ plans/s\)", "in <time>", text)


def test_two_ranks_zero_0_1_2_searched_plan_and_errors(tmp_path) -> None:
    results = run_ranks(2, _two_ranks, str(tmp_path), timeout_s=300)
    for r in results:
        _check_pairs(r["pairs"])
    tuned = [r["pairs"][3]["tuned"] for r in results]  # per rank: (chosen, medians) per MoE layer
    assert tuned[0] == tuned[1] and len(tuned[0]) == 4, tuned  # both ranks decide on the slowest's times
    for chosen, medians in tuned[0]:
        assert chosen in (1, 2, 4, 8) and set(medians) == {1, 2, 4, 8} and all(0 < m < 10 for m in medians.values())
    assert all(not r["pairs"][0]["tuned"] for r in results)  # a fixed chunk count measures nothing
    assert all(set(r["pairs"][0]["exchanges"]) == {("flat in 2 pipelined chunks", 1)} for r in results)
    assert all({label for label, _ in r["pairs"][4]["exchanges"]}
               == {"hierarchical in 2 pipelined chunks, expert weight gradients deferred"} for r in results)
    for rank in range(2):  # defer_wgrad: per chunk, post the dispatch gradient, then the weight GEMMs, in every layer
        events = [json.loads(line) for line in (tmp_path / "defer" / f"a2a-rank{rank}.jsonl").read_text().splitlines()]
        back = [(e["layer"], e["action"], e["exchange"], e["chunk"]) for e in events if e["direction"] == "backward"]
        wgrads = [i for i, (_, action, _, _) in enumerate(back) if action == "wgrad"]
        assert len(wgrads) == STEPS * 2 * 4 * 2  # steps x micro-batches per rank (GAS 2) x layers x chunks
        assert all(back[i - 1][1:] == ("post", "dispatch", back[i][3]) and back[i - 1][0] == back[i][0]
                   for i in wgrads)
    searched = results[0]["searched"]
    assert searched["built"] == searched["plan"]
    assert searched["engine"] == searched["rewritten"]
    plan = searched["plan"]
    assert searched["engine"]["train_micro_batch_size_per_gpu"] == plan.micro_batch_size
    assert searched["engine"]["gradient_accumulation_steps"] == plan.num_microbatches
    assert searched["engine"]["zero_optimization"]["stage"] == (1 if plan.distributed_optimizer else 0)
    assert plan.ep == 2 and plan.a2a_chunks == 2, f"the case needs an expert-parallel plan in 2 chunks, got {plan}"
    assert searched["engine"]["piper"]["plan"]["ep"] == plan.ep
    assert set(searched["moe"]) == ({"PiperMOELayer"} if plan.ep > 1 else {"MOELayer"})
    assert _untimed(searched["expected_report"]) in _untimed(searched["stdout"])
    assert "piper:" not in results[1]["searched"]["stdout"], "only rank 0 prints the plan"
    assert json.loads((tmp_path / "plan.json").read_text())["prediction"]["plan"]["ep"] == plan.ep
    for rank in range(2):
        events = [json.loads(line) for line in (tmp_path / f"a2a-rank{rank}.jsonl").read_text().splitlines()]
        posts = [e for e in events if e["direction"] == "forward" and e["action"] == "post" and e["exchange"] == "dispatch"]
        # 2 steps x GAS micro-batches x 4 MoE layers, one dispatch post per chunk
        assert len(posts) == 2 * plan.num_microbatches * 4 * plan.a2a_chunks
        assert {e["layer"] for e in events} == {f"layers.{i}.moe" for i in range(4)}
    for r in results:
        assert "MoE layer 'layers.0.moe' ep_size=1: conflicts with the plan's ep (2)" in r["errors"]["conflict"]
        assert r["errors"]["plan_only"][0] == 0


def test_four_ranks_zero2_ep4_hierarchical_chunks_and_pipeline_module() -> None:
    results = run_ranks(4, _four_ranks, timeout_s=400)
    for r in results:
        _check_pairs(r["pairs"])
        # the hierarchical pairs ran hierarchical exchanges over both nodes, the second in 2 chunks
        assert set(r["pairs"][0]["exchanges"]) == {("hierarchical", 2)}, r["pairs"][0]["exchanges"]
        assert set(r["pairs"][1]["exchanges"]) == {("hierarchical in 2 pipelined chunks", 2)}, r["pairs"][1]
        assert len(r["pairs"][1]["exchanges"]) == 4
