"""Measurements in interleaved rounds: every item once per round, round after round.

A shared machine's speed drifts over minutes, so measuring item A three times and then item B three
times compares two stretches of time, not two items. In rounds (A, B, A, B, A, B) each round meets
one stretch, and an item's figure is its median over rounds. ``piper validate`` measures its cases
this way (:func:`piper_core.validate.run.run_cases`) and the scheduler's check its plans
(:func:`piper_core.validate.scheduler.run_job`, which also rotates the order and goes on past a
failed plan).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_rounds(count: int, rounds: int, measure: Callable[[int], T], *, rotate: bool = False,
              keep_going: bool = False, before_round: Callable[[int], None] | None = None,
              tick: Callable[[], None] | None = None) -> tuple[list[list[T]], dict[int, str]]:
    """``measure(i)`` for every item ``i < count``, once per round, ``rounds`` rounds: each item's
    results in round order, and the items that failed (``keep_going``: the first error of an item is
    recorded, ``"Type: message"``, and the item is not measured again; else it propagates).
    ``rotate``: round ``r`` starts at item ``r`` (no item is always first or last). ``before_round(r)``
    runs before round ``r``; ``tick()`` after each item of each round (progress)."""
    results: list[list[T]] = [[] for _ in range(count)]
    failed: dict[int, str] = {}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for i in [(k + r) % count for k in range(count)] if rotate else range(count):
            if i not in failed:
                try:
                    results[i].append(measure(i))
                except Exception as exc:  # noqa: BLE001 - with keep_going: reported by the caller, never dropped
                    if not keep_going:
                        raise
                    failed[i] = f"{type(exc).__name__}: {exc}"[:500]
            if tick is not None:
                tick()
    return results, failed
