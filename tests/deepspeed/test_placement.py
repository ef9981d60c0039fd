"""Any expert placement runs on DeepSpeed: Piper's MoE layer sends each logical expert's tokens (the
gate's pick) to its physical slot (issue 17, deliverable 2).

On 2 gloo processes (ep 2), one spawn:

* layer: DeepSpeed's own ``MoE`` (default placement, stock ``MOELayer``) against the same layer swapped
  to :class:`~piper_deepspeed.moe.PiperMOELayer` with a placement that moves every expert off its slot
  and half of them off their rank, each slot initialised with its logical expert's weights
  (``builder.init_experts(placement=...)``): output, ``l_aux``, ``exp_counts``, input gradient, gate
  gradient and each logical expert's weight gradients (gathered from whichever rank holds it) within
  1e-6 (absolute, or relative to the largest reference value where that exceeds 1), fp32, top-1 and
  top-2, with and without token dropping, flat and hierarchical, unpipelined and in 2 chunks;
* the whole path: ``builder.build_model(placement=...)`` and ``piper_deepspeed.initialize`` with the
  block's ``"placement"`` (a file) against the same model and config without it: the loss and every
  gradient (experts by logical id) after one forward and backward through the engine, within 1e-6;
* controls: the placement applied with the default weights left in the slots must change the output.

Wrong placements (file or inline) are refused by ``plan_for`` with errors naming ``piper.placement``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from piper_core.errors import SpecError
from tests.gloo import run_ranks

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")

HIDDEN, FFN, EXPERTS, SEED = 16, 32, 8, 7
RANKS = ((5, 2, 7, 0), (3, 6, 1, 4))  # logical expert ids of each ep rank
TOL = 1e-6
BLOCK = {"cluster": "cpu-local", "model": "tiny-moe", "plan": {"ep": 2, "mbs": 1}}
CONFIG = {"train_batch_size": 2, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}


def _error(ref: Any, got: Any) -> float:
    """max |ref - got|, relative to max |ref| where that exceeds 1 (as tests/deepspeed/test_moe_layer.py)."""
    ref, got = ref.double(), got.double()
    if ref.numel() == 0:
        return 0.0
    return ((ref - got).abs().max() / max(1.0, ref.abs().max().item())).item()


def _gather(obj: Any, world: int) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)  # the default group: run_ranks' timeout
    return out


def _slot_grads(experts: Any, world: int) -> list[dict[str, Any]]:
    """Each physical slot's expert gradients, in slot order over the expert-parallel group (ep == world)."""
    mine = [{n: p.grad.clone() for n, p in e.named_parameters()} for e in experts]
    return [g for rank in _gather(mine, world) for g in rank]


def _by_logical(slots: list[dict[str, Any]], logical_at: tuple[int, ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{}] * len(slots)
    for slot, logical in enumerate(logical_at):
        out[logical] = slots[slot]
    return out


def _expert_error(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> float:
    return max(_error(r[name], g[name]) for r, g in zip(ref, got) for name in r)


# ---- the layer --------------------------------------------------------------------------------------

def _moe(k: int, drop: bool, placement: Any = None) -> Any:
    import torch
    from deepspeed.moe.layer import MoE

    from piper_deepspeed.builder import MLP, init_experts

    torch.manual_seed(SEED)
    moe = MoE(HIDDEN, MLP(HIDDEN, FFN, gated=True, bias=True), num_experts=EXPERTS, ep_size=2, k=k,
              capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=2, drop_tokens=drop)
    init_experts(moe, seed=SEED, layer=0, placement=placement)
    return moe


def _step(moe: Any, x: Any, w: Any, world: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(100)  # the gate's random draws, alike in every run
    x = x.clone().requires_grad_(True)
    out, l_aux, counts = moe(x)
    ((out * w).sum() + l_aux).backward()
    got = {"out": out.detach(), "l_aux": l_aux.detach(), "exp_counts": counts.detach(), "x.grad": x.grad,
           "gate.grad": moe.deepspeed_moe.gate.wg.weight.grad.clone()}
    got["experts"] = _slot_grads(moe.deepspeed_moe.experts.deepspeed_experts, world)
    return got


def _layer_cases(rank: int, world: int) -> dict[str, dict[str, float]]:
    import torch

    from piper_core.runtime import Algorithm, NodeTopology
    from piper_core.runtime.placement import ExpertPlacement
    from piper_deepspeed.moe import A2ASettings, attach_comm, swap_moe_layers

    placement = ExpertPlacement(num_experts=EXPERTS, ep=2, ranks=RANKS)
    topology = NodeTopology.uniform(world_size=world, ranks_per_node=1)
    rows, comm = {}, None
    for k in (1, 2):
        for drop in (True, False):
            stock = _moe(k, drop)
            stock.set_deepspeed_parallelism()
            g = torch.Generator().manual_seed(1000 * rank + 10 * k + drop)
            x, w = torch.randn(2, 12, HIDDEN, generator=g), torch.randn(2, 12, HIDDEN, generator=g)
            ref = _step(stock, x, w, world)
            placed, control = _moe(k, drop, placement), _moe(k, drop)
            for moe in (placed, control):
                swap_moe_layers(moe, A2ASettings(algorithm=Algorithm.FLAT, chunks=1), placement=placement)
                moe.set_deepspeed_parallelism()
            if comm is None:
                comm = attach_comm(placed, topology)  # collective, once
            attach_comm_to(control, comm)
            for alg, chunks in ((Algorithm.FLAT, 1), (Algorithm.FLAT, 2), (Algorithm.HIERARCHICAL, 2)):
                placed.deepspeed_moe.configure(A2ASettings(algorithm=alg, chunks=chunks), comm=comm, name="moe")
                got = _step(placed, x, w, world)
                errors = {key: _error(ref[key], got[key]) for key in ref if key != "experts"}
                errors["experts"] = _expert_error(ref["experts"], _by_logical(got["experts"], placement.logical_at))
                rows[f"top{k}-drop{int(drop)}-{alg.value}-chunks{chunks}"] = errors
                placed.zero_grad(set_to_none=True)
            rows[f"top{k}-drop{int(drop)}-control"] = {"out": _error(ref["out"], _step(control, x, w, world)["out"])}
    return rows


def attach_comm_to(moe: Any, comm: Any) -> None:
    """Give an already swapped layer the comm made for another (same ep group)."""
    moe.deepspeed_moe.piper_comm = comm


# ---- the engine ------------------------------------------------------------------------------------

def _engine_grads(rank: int, world: int, placement_file: str | None) -> dict[str, Any]:
    """Loss and gradients (experts by logical id) of one forward and backward through the engine."""
    import contextlib
    import io

    import torch

    import piper_deepspeed
    from piper_core.runtime.placement import read_placement
    from piper_deepspeed.builder import build_model, lm_loss
    from piper_deepspeed.initialize import plan_for

    block = BLOCK | ({"placement": placement_file} if placement_file else {})
    config = CONFIG | {"piper": block}
    choice = plan_for(config, world)
    placement = read_placement(placement_file) if placement_file else None
    net = build_model(choice.prediction.model, choice.plan, seed=SEED, aux_loss_coeff=0.0, placement=placement)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        engine, _, _, _ = piper_deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(SEED + rank)
    spec = choice.prediction.model
    batch = torch.randint(0, spec.vocab_size, (1, 33), generator=g)
    torch.manual_seed(100)
    loss = lm_loss(engine(batch[:, :-1]), batch[:, 1:], aux_loss_coeff=0.0)
    engine.backward(loss)
    logical_at = placement.logical_at if placement else tuple(range(spec.num_experts))
    experts, dense = {}, {}
    for name, module in engine.module.named_modules():
        if hasattr(module, "deepspeed_experts"):
            experts[name] = _by_logical(_slot_grads(module.deepspeed_experts, world), logical_at)
    for name, p in engine.module.named_parameters():
        if "deepspeed_experts" not in name:
            dense[name] = p.grad.clone()
    layers = [m for m in engine.module.modules() if type(m).__name__ == "PiperMOELayer"]
    return {"loss": loss.detach(), "experts": experts, "dense": dense, "printed": printed.getvalue(),
            "placed": [m.piper_placement is not None and not m.piper_placement.is_default for m in layers]}


def _engine_cases(rank: int, world: int, placement_file: str) -> dict[str, Any]:
    ref = _engine_grads(rank, world, None)
    got = _engine_grads(rank, world, placement_file)
    return {"loss": _error(ref["loss"], got["loss"]),
            "dense": max(_error(ref["dense"][n], got["dense"][n]) for n in ref["dense"]),
            "experts": max(_expert_error(ref["experts"][n], got["experts"][n]) for n in ref["experts"]),
            "moe_layers": len(ref["experts"]), "placed": got["placed"], "default_placed": ref["placed"],
            "printed": got["printed"] if rank == 0 else ""}


def _run(rank: int, world: int, placement_file: str) -> dict[str, Any]:
    import warnings

    import piper_core
    from tests.deepspeed import deepspeed_comm

    warnings.filterwarnings("ignore")
    deepspeed_comm()
    return {"layer": _layer_cases(rank, world), "engine": _engine_cases(rank, world, placement_file),
            "piper_core": piper_core.__file__}


_RESULTS: list[dict[str, Any]] = []


def _results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not _RESULTS:
        path = tmp_path_factory.mktemp("placement") / "placement.json"
        path.write_text(json.dumps({"num_experts": EXPERTS, "ep": 2, "ranks": [list(r) for r in RANKS]}))
        _RESULTS.extend(run_ranks(2, _run, str(path), timeout_s=400))
    return _RESULTS


def test_a_placed_layer_equals_deepspeeds_default_placement(tmp_path_factory):
    for rank, result in enumerate(_results(tmp_path_factory)):
        assert result["piper_core"].startswith(str(Path(__file__).resolve().parents[2]))
        layer = result["layer"]
        assert len(layer) == 2 * 2 * 4
        for case, errors in layer.items():
            if case.endswith("control"):
                assert errors["out"] > 1e-2, f"rank {rank} {case}: the placement without its weights changed nothing"
                continue
            bad = {key: err for key, err in errors.items() if not err <= TOL}
            assert not bad, f"rank {rank} {case}: differs from the default placement above {TOL}: {bad}"


def test_the_block_placement_runs_through_initialize_like_the_default(tmp_path_factory):
    for rank, result in enumerate(_results(tmp_path_factory)):
        engine = result["engine"]
        assert engine["moe_layers"] == 4 and engine["placed"] == [True] * 4 and engine["default_placed"] == [False] * 4
        for what in ("loss", "dense", "experts"):
            assert engine[what] <= TOL, f"rank {rank}: {what} differs from the default placement by {engine[what]:.3g}"
        if rank == 0:
            assert "experts placed as piper.placement says: 4 of 8 experts off their default rank" in engine["printed"]


# ---- wrong placements (planning; no ranks) -------------------------------------------------------------

PLAN_CONFIG = CONFIG | {"train_batch_size": 8}  # 4 ranks


def _plan(placement: Any, **block: Any) -> Any:
    from piper_deepspeed.initialize import plan_for

    return plan_for(PLAN_CONFIG | {"piper": {"cluster": "cpu-local", "model": "tiny-moe", "placement": placement}
                                   | block}, 4)


def test_the_placement_sets_ep_when_piper_searches():
    choice = _plan({"num_experts": 8, "ep": 4, "ranks": [[1, 0], [3, 2], [5, 4], [7, 6]]})
    assert choice.plan.ep == 4 and all(p.plan.ep == 4 for p in choice.top)


@pytest.mark.parametrize("placement, block, match", [
    ([{"num_experts": 16, "ep": 2, "ranks": [list(range(8)), list(range(8, 16))]}], {},
     r"^piper\.placement='.*placement\.json': places 16 experts, the model has 8"),
    ({"num_experts": 8, "ep": 2, "ranks": [[0, 1, 2, 3], [4, 5, 6, 7]]}, {"plan": {"ep": 4, "mbs": 1}},
     r"^piper\.placement='\"piper\" block': is for ep=2, the job runs ep=4; write a placement for ep=4, or pin "
     r"\"plan\": \{\"ep\": 2, \.\.\.\}"),
    ({"num_experts": 8, "ep": 8, "ranks": [[e] for e in range(8)]}, {},
     r"^piper\.placement='\"piper\" block': is for ep=8, which this job cannot run \(expert-parallel sizes "
     r"DeepSpeed can run here: \[1, 2, 4\]\)"),
    ({"num_experts": 8, "ep": 2, "ranks": [[0, 1, 2, 3], [4, 5, 6, 3]]}, {},
     r"^\"piper\" block: piper\.placement\.ranks\[1\]=\[4, 5, 6, 3\]: holds expert 3, which rank 0 holds too"),
    ({"num_experts": 8, "ep": 2, "rank": [[0, 1, 2, 3], [4, 5, 6, 7]]}, {},
     r"piper\.placement\.rank=.*is not a key of a placement; did you mean 'ranks'"),
    ({"num_experts": 8, "ep": 1, "ranks": [[7, 6, 5, 4, 3, 2, 1, 0]]}, {"plan": {"ep": 1, "mbs": 1}},
     r"^piper\.placement='\"piper\" block': reorders the experts of an ep=1 job"),
    ("missing.json", {}, r"^piper\.placement='missing\.json': cannot be read"),
    ([{"num_experts": 8, "ep": 2, "layers": {"1": [[0, 1, 2, 3], [4, 5, 6, 7]]}}], {},
     r"^piper\.placement='.*placement\.json': holds one placement per MoE layer \(layers\); this input takes one "
     r"placement for every layer \(ranks\); write one with piper placement \.\.\. --shared --out FILE"),
    ({"num_experts": 8, "ep": 2, "layers": {"1": [[0, 1, 2, 3], [4, 5, 6, 7]]}}, {},
     r"^\"piper\" block: piper\.placement\.layers=.*holds one placement per MoE layer"),
    (3, {}, r"^piper\.placement=3: must be the path of a placement JSON file or the placement object itself"),
])
def test_a_wrong_placement_is_refused_naming_the_key(tmp_path, placement, block, match):
    if isinstance(placement, list):  # a file
        placement = placement[0]
        path = tmp_path / "placement.json"
        path.write_text(json.dumps(placement))
        placement = str(path)
    with pytest.raises(SpecError, match=match):
        _plan(placement, **block)


# ---- "routing" in the block: the scheduler prices the measured load --------------------------------

def _routing_file(tmp_path, counts) -> str:
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"num_experts": len(counts), "default": counts}))
    return str(path)


def test_the_block_routing_prices_the_measured_load(tmp_path):
    """Experts 0 and 1 (rank 0's under DeepSpeed's contiguous placement at ep 4) take 4x the others'
    tokens: the pinned plan is predicted slower than under even routing (busiest rank 800 of a mean
    350 tokens), and a placement that gives them a rank each (busiest 500) faster than that."""
    hot = _routing_file(tmp_path, [400, 400] + [100] * 6)
    pin = {"plan": {"ep": 4, "mbs": 1}}
    even = _plan(None, **pin)
    skewed = _plan(None, routing=hot, **pin)
    assert skewed.prediction.time.step > 1.2 * even.prediction.time.step
    assert any("piper.routing" in n for n in skewed.notes) or skewed.search is None
    spread = _plan({"num_experts": 8, "ep": 4, "ranks": [[0, 2], [1, 3], [4, 5], [6, 7]]}, routing=hot, **pin)
    assert even.prediction.time.step < spread.prediction.time.step < skewed.prediction.time.step
    searched = _plan(None, routing=hot)
    assert searched.search is not None and any("piper.routing" in n for n in searched.notes)


def test_a_wrong_routing_is_refused_naming_the_key(tmp_path):
    with pytest.raises(SpecError, match=r"routing\.json: piper\.routing=4: must equal the model's num_experts \(8"):
        _plan(None, routing=_routing_file(tmp_path, [1, 2, 3, 4]))
    with pytest.raises(SpecError, match=r"^piper\.routing="):
        _plan(None, routing=str(tmp_path / "missing.yaml"))
