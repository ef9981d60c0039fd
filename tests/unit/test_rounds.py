"""Interleaved rounds (piper_core/validate/rounds.py), shared by piper validate and the scheduler's check."""

from __future__ import annotations

import pytest

from piper_core.validate.rounds import in_rounds


def test_every_item_once_per_round_in_order_or_rotated():
    seen = []
    out, failed = in_rounds(3, 2, lambda i: seen.append(i) or 10 * i, before_round=lambda r: seen.append(f"r{r}"))
    assert seen == ["r0", 0, 1, 2, "r1", 0, 1, 2] and out == [[0, 0], [10, 10], [20, 20]] and failed == {}
    seen.clear()
    in_rounds(3, 3, seen.append, rotate=True)
    assert seen == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_a_failed_item_is_recorded_and_not_run_again_or_propagates():
    calls, ticks = [], []

    def measure(i):
        calls.append(i)
        if i == 1:
            raise ValueError("rank 1 died")
        return i

    out, failed = in_rounds(2, 3, measure, keep_going=True, tick=lambda: ticks.append(1))
    assert calls == [0, 1, 0, 0] and out == [[0, 0, 0], []] and failed == {1: "ValueError: rank 1 died"}
    assert len(ticks) == 6  # progress counts every slot, a skipped one too
    with pytest.raises(ValueError, match="rank 1 died"):
        in_rounds(2, 3, measure)
