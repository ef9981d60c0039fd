"""Expert migration while DeepSpeed trains: the ``"piper"`` block's ``"migrate_every": N`` (issue 17).

``piper_deepspeed.initialize`` installs :class:`LiveMigration` on the engine it returns when the block
sets ``migrate_every`` (ep > 1): it wraps ``engine.step`` so that after every ``N``-th optimizer step
(a gradient-accumulation boundary, ``engine.global_steps``), every rank runs the decision of
:mod:`piper_core.runtime.live`:

1. the tokens each MoE layer's gate routed to each **logical** expert since the last decision
   (:meth:`~piper_deepspeed.moe.PiperMOELayer.take_routed_tokens`, counted before the layer maps
   logical experts to slots), summed over the job (one all-reduce, bounded by the job's timeout);
2. the candidates priced on the block's cluster over ``migrate_horizon`` steps (default ``N``), the
   same on every rank;
3. only when the gain exceeds the move: :func:`piper_deepspeed.migrate.migrate` moves the experts
   (weights, gradients, optimizer state) and the layers route by the new placement.

Rank 0 prints each decision (the line Megatron's ``--piper-migrate-every`` prints); every decision is
kept in ``engine.piper_migration.outcomes``. MoE layers are numbered as the model spec numbers them
(Megatron's ``layer_number``). The placements of the whole job start from the block's ``placement``
(else DeepSpeed's default) and follow the decisions. Save a checkpoint's placement with
:func:`piper_deepspeed.migrate.save_placements` and route a resumed model by it with
:func:`~piper_deepspeed.migrate.load_placements` (pass ``numbers=engine.piper_migration.numbers``).

Not with DeepSpeed's pipeline engine (``PipelineModule``: its ``train_batch`` steps the optimizer
itself), refused at initialisation; nor with an optimizer whose state migration does not move
(:func:`piper_deepspeed.migrate.optimizer_state`), refused before the first step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from piper_core.errors import SpecError
from piper_core.runtime.live import LiveSettings, Outcome, check_in_force, collective_device, price, routed_tokens
from piper_core.runtime.placement import ExpertPlacement
from piper_core.specs.routing import moe_layer_numbers
from piper_deepspeed import migrate as mig

KEY = "piper.migrate_every"


@dataclass(kw_only=True, slots=True)
class LiveMigration:
    """The decisions of one engine (module docstring): ``placements`` of every MoE layer in force,
    ``since`` the step of the last decision, every :class:`Outcome` in ``outcomes``."""

    settings: LiveSettings
    numbers: tuple[int, ...]
    placements: dict[int, ExpertPlacement]
    since: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    log: Callable[[str], None] = print

    def decide(self, engine: Any, step: int) -> Outcome:
        """The decision after ``step`` (collective: every rank calls it)."""
        import torch.distributed as dist

        model = engine.module
        check_in_force(mig.current_placements(model, self.numbers), self.placements, f"{KEY}")
        mine = {n: layer.take_routed_tokens() for n, layer in mig.moe_layers(model, self.numbers).items()}
        counts = routed_tokens(mine, self.numbers, self.settings.model.num_experts, self.settings.timeout,
                               collective_device())
        choice, target = price(self.settings, counts, self.placements, iteration=step, since=self.since)
        report = None
        if target is not None:
            report = mig.migrate(model, engine.optimizer, target, timeout=self.settings.timeout, numbers=self.numbers)
        outcome = Outcome(iteration=step, since=self.since, choice=choice, report=report,
                          placements=self.placements | (target or {}))
        self.placements, self.since = outcome.placements, step
        self.outcomes.append(outcome)
        if dist.get_rank() == 0:
            self.log(outcome.line())
        return outcome


def install(engine: Any, settings: LiveSettings, start: ExpertPlacement | None) -> LiveMigration:
    """Count the routed tokens in every MoE layer of ``engine`` and decide after every ``settings.every``-th
    optimizer step (module docstring); the decisions' record, also ``engine.piper_migration``."""
    if type(engine).__name__ == "PipelineEngine":
        raise SpecError(KEY, settings.every, "needs the engine's step between two batches; DeepSpeed's pipeline "
                        "engine steps the optimizer inside train_batch", "remove migrate_every, or train without "
                        "PipelineModule")
    try:  # refused now, not at the first decision
        mig.optimizer_state(engine.optimizer)
    except SpecError as exc:
        raise SpecError(KEY, settings.every, f"cannot move the state of the engine's optimizer {exc.value}: it "
                        f"{exc.rule}", exc.fix) from None
    numbers = moe_layer_numbers(settings.model)
    layers = mig.moe_layers(engine.module, numbers)
    for layer in layers.values():
        layer.piper_count = True
    default = ExpertPlacement.default(settings.model.num_experts, settings.plan.ep)
    live = LiveMigration(settings=settings, numbers=numbers, placements={n: start or default for n in numbers})
    original = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        before = engine.global_steps
        out = original(*args, **kwargs)
        if engine.global_steps != before and engine.global_steps % settings.every == 0:
            live.decide(engine, engine.global_steps)
        return out

    engine.step = step
    engine.piper_migration = live
    return live
