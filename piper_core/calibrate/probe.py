"""Host-overhead probe: fits the framework time per layer, MoE layer, expert, micro-batch and step.

On CPU ranks (and on any host-bound setup) Megatron-Core spends more time in Python -- module calls,
hooks, the router, the token dispatcher's bookkeeping, the schedule -- than in the GEMMs of a small
model. The roofline cannot see it; :class:`piper_core.specs.cluster.AcceleratorSpec` has six host
overhead terms for it, and this probe fits them on the machine, as part of ``piper calibrate``:

1. :func:`probe_rank` (every rank at once, so ranks share the cores as in a real job) trains small
   models through the framework's registered trainer (:mod:`piper_core.trainers`: Megatron-Core's
   or DeepSpeed-MoE's, as the adapter installs it) -- dense with 1 to 3 layers, MoE with 2
   to 16 experts, 1 to 3 micro-batches of 1 to 4 sequences, at two widths (:data:`BASES` has a
   third, no longer run: :data:`PROBE_FFN`), mostly ep = 1 and twice with the experts spread over
   every rank -- timing training steps and forward-only passes, without data-parallel
   gradient reduction (one rank's own work). They are of the probe's own family,
   :data:`PROBE_MODEL`, which no validation model belongs to (until 2026-12-06 the probe took the
   validation family's widths, so every calibration was fitted on the model it was judged on).
2. :func:`fit_overheads` (pure) subtracts what the calibrated model already predicts for each probe
   run (GEMMs, the all-to-all, the optimizer; host terms zero) and solves two least-squares problems:
   forward-only passes give the element-wise rate as the framework achieves it per byte the model
   counts, and the per-layer, per-MoE-layer, per-expert and per-micro-batch forward terms; training
   steps then give the backward factor, the per-micro-batch and the per-step terms. Fit quality
   (R^2, largest relative residual of the whole predicted step) goes into the profile.

The probe runs are neither validation models nor validation plans (``piper validate`` runs 4-layer
models of other widths and families, with real expert, data and pipeline parallelism, other micro-batch
sizes, experts and top-k), so validation checks the fitted terms on runs they were not fitted to.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

from piper_core.calibrate.fit import quality
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan


PROBE_MODEL = ModelSpec(
    name="probe", num_layers=2, hidden_size=96, num_attention_heads=3, ffn_hidden_size=384, num_experts=8,
    moe_ffn_hidden_size=160, moe_router_topk=2, moe_capacity_factor=1.0, vocab_size=1536, seq_length=96,
    normalization="RMSNorm", gated_linear_unit=False)
"""The probe's own model family (layers and experts vary per probe run, :func:`probe_model`), disjoint
from every validation model (issue 15): width 96 (3 heads of 32), sequence 96, vocabulary 1536, expert
width 160, RMSNorm with plain GeLU MLPs -- no validation family has any of these widths, and none pairs
RMSNorm with ungated MLPs. A user's calibration is fitted on this family whatever they train, so every
validation run checks the fitted terms on a model they were not fitted to
(tests/unit/test_probe_family.py holds the disjointness). Capacity-padded experts (factor 1.0): fixed
GEMM shapes, see piper_core.validate.cases on oneDNN's per-shape cost."""
PROBE_WIDE = dataclasses.replace(PROBE_MODEL, name="probe-wide", hidden_size=192, num_attention_heads=6,
                                 ffn_hidden_size=768, moe_ffn_hidden_size=320)
"""The same family twice as wide (6 heads of 32, ffn 768, experts 320): about half the probe runs
train it, so that what grows with the tensors (GEMMs, element-wise bytes) and what does not (the
per-layer, per-micro-batch and per-step host terms) separate by width as well as by token count. With
one width the fitted terms traded weight (a probe at width 96 alone fitted DeepSpeed's terms so that
its width-128 runs came out 20-28 % too fast, 2026-12-06)."""
PROBE_FFN = dataclasses.replace(PROBE_MODEL, name="probe-ffn", moe_ffn_hidden_size=1280)
"""The family's width-96 model with experts 8x as wide (1280). Two runs on it (``"ffn"``) were in
:data:`PROBES` from fa02f3f to 2026-12-07 (sixth session) and are not now. They were meant to pin the
element-wise rate (four calibrations within half an hour had fitted 1.28-3.47 GB/s), and they did
steady a 2-rank placement step whose experts are 1024 wide (predicted 0.56-0.58 s by three
calibrations, against 0.42-0.74 s before). But the declared validation run with them
(docs/validation/fp32/rounds3-probe2/1) scored step MAPE 32.0 % against 9.6-17.3 % for the three
runs without them: every Megatron-Core case over-predicted, local-4 by 54-84 %. The wide runs take
longer than the model's terms explain (the per-MoE-layer term on 4 ranks came out 17,480 us against
7,405-10,240 us without them), and the fit put that into host terms the narrow cases then pay.
Kept for the records that ran it (a profile refits from each run's recorded ``base``) and for a
probe that prices what the wide runs pay."""
BASES = {"": PROBE_MODEL, "wide": PROBE_WIDE, "ffn": PROBE_FFN}
"""A probe run's base model by its key (the last field of a :data:`PROBES` entry; "" the narrow one)."""
FAMILY_FIELDS = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size",
                 "moe_router_topk", "moe_capacity_factor", "vocab_size", "seq_length", "normalization",
                 "gated_linear_unit")
"""The fields a probe run records of its model (``"base"``), so a refit prices it on the model it ran."""
_LEGACY_BASE = ModelSpec(
    name="probe", num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, num_experts=8,
    moe_ffn_hidden_size=256, moe_router_topk=2, moe_capacity_factor=1.0, vocab_size=1024, seq_length=128,
    normalization="LayerNorm", gated_linear_unit=False)
"""The model probe runs recorded before 2026-12-06 trained (the val-moe widths; they record no base)."""
PROBE_MBS = 2
# (layers, experts (None: dense), micro-batches, micro-batch size, experts spread over every rank,
# base (:data:`BASES`)): structure and token counts spread so that per-layer, per-MoE-layer,
# per-expert, per-micro-batch and per-byte terms separate; runs with ep = ranks, so that ranks
# synchronise at every MoE layer as in expert-parallel jobs (their all-to-all is priced by the fitted
# links, not by these terms); dense, MoE and spread runs each at both widths (:data:`PROBE_FFN` says
# why no run has wide experts)
Probe = tuple[int, "int | None", int, int, bool, str]
PROBES: tuple[Probe, ...] = (
    (1, None, 1, 1, False, ""), (1, None, 1, 4, False, "wide"), (3, None, 1, 2, False, ""),
    (3, None, 3, 2, False, "wide"), (2, None, 2, 1, False, ""), (2, 2, 1, 2, False, "wide"),
    (2, 8, 1, 2, False, ""), (2, 8, 3, 2, False, "wide"), (1, 4, 2, 4, False, ""),
    (1, 8, 1, 1, False, "wide"), (1, 16, 1, 2, False, ""), (2, 8, 1, 2, True, "wide"), (2, 16, 2, 2, True, ""),
)


def probe_label(layers: int, experts: int | None, m: int, mbs: int, spread: bool = False, base: str = "") -> str:
    return (f"{'dense' if experts is None else f'moe{experts}'}-L{layers}-m{m}-mbs{mbs}" + ("-epall" if spread else "")
            + (f"-{base}" if base else ""))


FIELDS = ("layer_overhead_us", "moe_overhead_us", "expert_overhead_us", "backward_overhead_factor",
          "microbatch_overhead_us", "step_overhead_us")
"""The host terms of :class:`~piper_core.specs.cluster.AcceleratorSpec` this probe fits."""


def probe_model(layers: int, experts: int | None, base: ModelSpec = PROBE_MODEL) -> ModelSpec:
    # capacity-padded experts (the base's capacity factor): fixed GEMM shapes, see
    # piper_core.validate.cases on oneDNN's per-shape cost
    moe = {"num_experts": 0, "moe_capacity_factor": None, "moe_router_topk": 1} if experts is None \
        else {"num_experts": experts}
    return dataclasses.replace(base, name=f"{base.name}-{'dense' if experts is None else f'moe{experts}'}-L{layers}",
                               num_layers=layers, **moe)


def base_of(run: dict[str, Any]) -> ModelSpec:
    """The base model a recorded probe run trained: its ``"base"`` fields, or (records made before
    2026-12-06, which have none) the val-moe widths the probe used then."""
    if "base" not in run:
        return _LEGACY_BASE
    return dataclasses.replace(PROBE_MODEL, name="probe", **{k: run["base"][k] for k in FAMILY_FIELDS})


def probe_plan(world: int, micro_batches: int, mbs: int = PROBE_MBS, spread: bool = False,
               attention: str = "unfused", precision: str = "bf16") -> ParallelPlan:
    return ParallelPlan(gpus=world, ep=world if spread else 1, micro_batch_size=mbs,
                        global_batch_size=world * micro_batches * mbs, distributed_optimizer=False,
                        attention_backend=attention, precision=precision)


def probes_for(framework: str) -> tuple[Probe, ...]:
    """:data:`PROBES` for Megatron-Core; for DeepSpeed every MoE run spreads its experts over all
    ranks, since DeepSpeed keeps its own MoE layer at ep = 1 and Piper's layer (the one whose host
    cost is wanted) runs only at ep > 1."""
    if framework != "deepspeed":
        return PROBES
    return tuple((layers, e, m, mbs, e is not None, base) for layers, e, m, mbs, spread, base in PROBES if not spread)


# What each framework's model runs for attention: Megatron-Core's local layers on CPU the unfused
# path; Piper's DeepSpeed builder torch's scaled_dot_product_attention (no score matrix kept)
ATTENTION = {"megatron": "unfused", "deepspeed": "flash"}


def probe_rank(info: Any, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank side: every probe run, timed (median seconds of training steps and forward passes).
    ``settings["framework"]``: the registered trainer that trains them, ``"megatron"`` (default;
    Megatron-Core) or ``"deepspeed"`` (DeepSpeed-MoE with Piper's layer); ``settings["rounds"]``
    (default 1): the whole list runs that many times in turn, and each run's figures are the
    median over rounds of each round's median (a slow stretch of a shared machine then moves one
    round of every probe run, not one probe run; each round's medians are kept in ``"rounds"``)."""
    import warnings

    warnings.filterwarnings("ignore")
    from piper_core.validate.instrument import TrainJob

    from piper_core import trainers

    settings = settings or {}
    framework = settings.get("framework", "megatron")
    precision = settings.get("precision", "bf16")  # the training precision the profile is for
    train = trainers.get(framework).probe_setup(info)
    # --quick: 3 timed training steps (of 5) and 3 forward passes per probe run instead of 5 and 5
    quick = bool(settings.get("quick", False))
    warmup = 2 if quick else 3
    steps = int(settings.get("steps", 5 if quick else 8))
    forward = int(settings.get("forward_steps", 3 if quick else 5))
    rounds = int(settings.get("rounds", 1))
    runs = [p for p in probes_for(framework) if not (p[4] and (info.world_size == 1 or p[1] % info.world_size))]
    timed: list[list[tuple[float, float]]] = [[] for _ in runs]
    with tempfile.TemporaryDirectory(prefix="piper-probe-") as tmp:
        for _ in range(rounds):
            for i, (layers, experts, m, mbs, spread, key) in enumerate(runs):
                plan = probe_plan(info.world_size, m, mbs, spread, ATTENTION[framework], precision)
                base = BASES[key]
                job = TrainJob(model=probe_model(layers, experts, base), plan=plan, steps=steps, warmup=warmup,
                               forward_steps=forward, sync_grads=False)
                r = train(job, Path(tmp))
                timed[i].append((statistics.median(r["step_s"][warmup:]), statistics.median(r["forward_s"])))
    out = []
    for (layers, experts, m, mbs, spread, key), medians in zip(runs, timed):
        base = BASES[key]
        out.append({"label": probe_label(layers, experts, m, mbs, spread, key), "layers": layers, "experts": experts,
                    "micro_batches": m, "micro_batch_size": mbs, "spread": spread,
                    "base": {k: getattr(base, k) for k in FAMILY_FIELDS},
                    "attention_backend": ATTENTION[framework], "precision": precision,
                    "step_s": statistics.median(s for s, _ in medians), "forward_s": statistics.median(f for _, f in medians)}
                   | ({"rounds": [[round(s, 6), round(f, 6)] for s, f in medians]} if rounds > 1 else {}))
    return {"rank": info.rank, "runs": out}


# ---- fit (pure) -----------------------------------------------------------------------------------

def _lstsq(rows: list[list[float]], ys: list[float], scale: list[float]) -> list[float]:
    """Least squares of the residuals relative to ``scale`` (each run's measured time: the
    validation judges relative errors), every coefficient >= 0 (drop a negative one and refit)."""
    import numpy as np

    w = np.ones(len(scale))  # unweighted: relative weights overfit the smallest runs (tried)
    active = list(range(len(rows[0])))
    while True:
        a = np.array([[r[i] for i in active] for r in rows], dtype=float) * w[:, None]
        coef, *_ = np.linalg.lstsq(a, np.array(ys, dtype=float) * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            full = [0.0] * len(rows[0])
            for i, c in zip(active, coef):
                full[i] = max(0.0, float(c))
            return full
        active.pop(int(np.argmin(coef)))


FAST = 1e6  # GB/s: an element-wise rate at which the model's element-wise terms vanish


def with_accelerator(cluster: ClusterSpec, **fields: Any) -> ClusterSpec:
    """``cluster`` with these accelerator fields replaced."""
    return dataclasses.replace(cluster, accelerator=dataclasses.replace(cluster.accelerator, **fields))


def _base(cluster: ClusterSpec, run: dict[str, Any], world: int) -> tuple[float, float]:
    """(training step without data-parallel reduction, forward-only pass) the model predicts for a
    probe run on ``cluster`` (the probe does not reduce gradients: it times one rank's own work, so
    a slow link between the ranks cannot leak into the host terms)."""
    from piper_core.timing.layer import layer_cost, shape_of
    from piper_core.timing.step import _logits, step_time

    layers, experts, m = run["layers"], run["experts"], run["micro_batches"]
    model = probe_model(layers, experts, base_of(run))
    plan = probe_plan(world, m, run.get("micro_batch_size", PROBE_MBS), run.get("spread", False),
                      run.get("attention_backend", "unfused"), run.get("precision", "bf16"))
    cost = layer_cost(model, shape_of(plan), cluster, model.is_moe)
    forward = m * (layers * cost.fwd + _logits(model, plan, cluster) / 3)
    t = step_time(model, plan, cluster)
    return t.step - t.data_parallel, forward


def _parts(cluster: ClusterSpec, run: dict[str, Any], world: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """The model's (step, forward) split into what is not element-wise, and the element-wise bytes
    in GB (the time at 1 GB/s), with every host overhead at zero."""
    fast = _base(with_accelerator(cluster, elementwise_gb_per_s=FAST), run, world)
    slow = _base(with_accelerator(cluster, elementwise_gb_per_s=1.0), run, world)
    gbytes = tuple((s - f) / (1 - 1 / FAST) for s, f in zip(slow, fast))
    rest = tuple(f - g / FAST for f, g in zip(fast, gbytes))
    return (rest[0], gbytes[0]), (rest[1], gbytes[1])


def slowest_rank(probe_results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float, float]]:
    """Per probe run (as rank 0 recorded it): the slowest rank's (run, training step s, forward pass s)."""
    return [(run, max(r["runs"][i]["step_s"] for r in probe_results), max(r["runs"][i]["forward_s"] for r in probe_results))
            for i, run in enumerate(probe_results[0]["runs"])]


def fit_overheads(cluster: ClusterSpec, probe_results: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any]]:
    """The host-overhead fields and the in-situ element-wise rate fitted to the probe runs (slowest
    rank per run), and fit info. ``cluster`` carries the already-fitted kernel and link terms.

    Forward passes: ``y - G = k B + m (L a + L_moe b + L_moe E c + d_f)`` gives the element-wise rate
    ``1/k`` (per byte the model counts, as the framework runs it) and the per-layer terms; training
    steps: ``y - G - k B = (1 + f) H + m d + s`` the backward factor, micro-batch and step terms
    (``G``: the model's kernels, communication and optimizer; ``B``: its element-wise GB; ``H``: the
    fitted forward overheads of the run's layers).
    """
    world = len(probe_results)
    runs = slowest_rank(probe_results)
    zero = with_accelerator(cluster, **{f: (2.0 if f == "backward_overhead_factor" else 0.0) for f in FIELDS})
    parts = [_parts(zero, run, world) for run, _, _ in runs]
    f_rows, f_ys, counts = [], [], []
    for (run, _, fwd), (_, (g_f, b_f)) in zip(runs, parts):
        L, E, m = run["layers"], run["experts"], run["micro_batches"]
        moe = L if E else 0
        local = (E or 0) // (world if run.get("spread") else 1)  # experts on one rank
        counts.append((m * L, m * moe, m * moe * local))
        f_rows.append([b_f, m * L, m * moe, m * moe * local, m])  # k: us per GB
        f_ys.append((fwd - g_f) * 1e6)
    k, a, b, c, d_f = _lstsq(f_rows, f_ys, [fwd for _, _, fwd in runs])
    t_rows, t_ys = [], []
    for (run, step, _), ((g_t, b_t), _), n in zip(runs, parts, counts):
        h = a * n[0] + b * n[1] + c * n[2]
        t_rows.append([h, run["micro_batches"], 1.0])
        t_ys.append((step - g_t) * 1e6 - k * b_t - h)
    f, d, s = _lstsq(t_rows, t_ys, [step for _, step, _ in runs])
    fields = {"layer_overhead_us": a, "moe_overhead_us": b, "expert_overhead_us": c, "backward_overhead_factor": f,
              "microbatch_overhead_us": d, "step_overhead_us": s}
    fields = {key: round(v, 3) for key, v in fields.items()}
    if k > 0:
        fields["elementwise_gb_per_s"] = float(f"{1e6 / k:.5g}")  # us per GB -> GB/s
    fitted = with_accelerator(cluster, **fields)
    measured, predicted, points = [], [], []
    for run, step, fwd in runs:
        p, pf = _base(fitted, run, world)
        pf += d_f * 1e-6 * run["micro_batches"]  # the forward fit's own per-micro-batch term (no model field)
        measured.append(step)
        predicted.append(p)
        points.append({"label": run["label"], "measured_s": round(step, 6), "predicted_s": round(p, 6),
                       "forward_measured_s": round(fwd, 6), "forward_predicted_s": round(pf, 6)})
    forward = quality([pt["forward_measured_s"] for pt in points], [pt["forward_predicted_s"] for pt in points])
    return fields, {"runs": points, **quality(measured, predicted).as_dict(),
                    "forward_microbatch_overhead_us": round(d_f, 3),
                    "forward": {k: v for k, v in forward.as_dict().items() if k != "points"}}

