"""Run a function on ``world_size`` local gloo processes and collect what each rank returns.

``run_ranks(2, fn, x)`` spawns two processes, joins them into one gloo group on a free localhost
port and returns ``[fn(0, 2, x), fn(1, 2, x)]``. A rank that raises, dies or overruns the deadline
fails the call with an error naming the function and the ranks; it never hangs, and stragglers
(usually peers blocked in a collective) are killed. ``fn`` and its arguments and results must be
picklable, so ``fn`` lives at module level in an importable module.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from piper_core.emulate.launch import free_port


class RankError(RuntimeError):
    """A rank raised, died without reporting, or did not finish in time."""


def _worker(rank: int, world_size: int, port: int, timeout_s: float, out: Any,
            fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    # Ranks share the host's cores; more threads per rank than that only adds contention.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        out.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each rank in its own process.

    ``timeout_s`` bounds the whole call (spawn, process-group set-up and ``fn``) and each collective.
    """
    what = f"{getattr(fn, '__qualname__', fn)} on {world_size} gloo ranks"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, out, fn, args), daemon=True)
             for r in range(world_size)]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s

    def died() -> dict[int, int]:
        """Ranks that exited non-zero without reporting (a crash), with their exit codes."""
        return {r: p.exitcode for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)}

    try:
        for p in procs:
            p.start()
        while len(results) < world_size:
            try:
                rank, ok, payload = out.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if died():
                    raise RankError(f"{what}: rank(s) {sorted(died())} died without reporting "
                                    f"(exit codes {died()})") from None
                if time.monotonic() >= deadline:
                    waiting = sorted(set(range(world_size)) - set(results))
                    raise RankError(f"{what}: timed out after {timeout_s:g} s waiting for rank(s) {waiting}") from None
                continue
            if not ok:
                time.sleep(0.2)  # a peer's crash often shows first as this rank's broken connection
                crashed = f" (rank(s) {sorted(died())} died: exit codes {died()})" if died() else ""
                raise RankError(f"{what}: rank {rank} raised{crashed}:\n{payload}")
            results[rank] = payload
    finally:
        _stop(procs)
        out.close()
    return [results[r] for r in range(world_size)]
