"""Shared fixtures of the Megatron tier."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def piper_ranks(tmp_path_factory: pytest.TempPathFactory):
    """world size -> per-rank results of :func:`tests.megatron.piper_ranks.run_rank` (the Piper
    dispatcher cases, the traced case and the training runs), one gloo spawn per world size."""
    from tests.gloo import run_ranks
    from tests.megatron.piper_ranks import run_rank

    cache: dict[int, list[dict[str, Any]]] = {}

    def get(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            trace_dir = tmp_path_factory.mktemp(f"piper-trace-w{world}")
            cache[world] = run_ranks(world, run_rank, str(trace_dir), timeout_s=400)
        return cache[world]

    return get
