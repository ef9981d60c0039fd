"""Launch one gloo process per rank inside the emulated nodes and collect what each returns.

Rank ``r`` runs in node ``r // ranks_per_node`` (``ip netns exec <node> python -m
piper_core.emulate.rank ...``), binds gloo to the node's interface and meets its peers through a
TCP store on node 0's address. The target is a function ``fn(info: RankInfo, *args)`` named
``"package.module:function"`` or ``"/path/to/file.py:function"``; it runs with the default
process group initialised and returns something JSON can encode. A rank that raises, dies or
overruns fails the whole call with :class:`RankFailure` naming the ranks; the others are stopped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from piper_core.emulate.netns import NODE_IFNAME, EmulatedCluster, EmulationError
from piper_core.errors import SpecError

STORE_PORTS = range(20000, 30000)
"""TCP store port on node 0, drawn per run (node 0's namespace is private to the cluster, so no
clash with the host; a fresh port per run avoids a previous run's socket in TIME_WAIT). A
:class:`LocalCluster` takes a free port of the host instead."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalNode:
    """This host as one node: no namespace, loopback address."""

    index: int = 0
    netns: None = None
    address: str = "127.0.0.1"


class LocalCluster:
    """``world_size`` ranks on this host (one node, gloo over loopback): the same launcher and
    rank protocol as the emulated cluster, without namespaces or root."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        self.nodes = (LocalNode(),)
        self.ranks_per_node = world_size

    @property
    def world_size(self) -> int:
        return self.ranks_per_node


def run_local(world_size: int, target: str, args: Sequence[Any] = (), timeout_s: float = 120.0, *,
              threads_per_rank: int | None = None, collective_timeout_s: float | None = None,
              realtime: bool = False) -> list[Any]:
    """:func:`launch` on ``world_size`` local ranks (no root needed, except for ``realtime``)."""
    return launch(LocalCluster(world_size), target, args, timeout_s=timeout_s, threads_per_rank=threads_per_rank,
                  collective_timeout_s=collective_timeout_s, realtime=realtime)


REALTIME_PRIORITY = 10


def check_realtime() -> None:
    """Raise a clear error when this process may not start SCHED_FIFO ranks."""
    try:
        param = os.sched_param(REALTIME_PRIORITY)
        old_policy, old_param = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, param)
        os.sched_setscheduler(0, old_policy, old_param)
    except (PermissionError, AttributeError, OSError) as exc:
        raise SpecError("--realtime", True, f"the ranks cannot run under SCHED_FIFO here ({exc})",
                        "run as root (or with CAP_SYS_NICE), or measure without --realtime") from None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a store or rendezvous on this host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
FAILURE_GRACE_S = 3.0
"""After the first rank fails, how long the others get to report (they usually fail too, naming
the broken connection) before they are stopped."""


class RankFailure(EmulationError):
    """One or more ranks raised, died or ran past the deadline. ``failed`` lists them; ``logs``
    holds each failed rank's error text or the tail of its output."""

    def __init__(self, message: str, *, failed: Sequence[int], logs: dict[int, str]):
        super().__init__(message)
        self.failed = tuple(failed)
        self.logs = logs


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInfo:
    """What a rank knows about its place in the emulated cluster (passed to the target)."""

    rank: int
    world_size: int
    node: int
    local_rank: int
    nodes: int
    ranks_per_node: int
    address: str
    master_address: str
    port: int
    collective_timeout_s: float


def check_target(target: str) -> None:
    """Fail fast, in the launching process, on a target the ranks could not load."""
    where, sep, func = target.rpartition(":")
    if not sep or not where or not func.isidentifier():
        raise ValueError(f"target={target!r}: must be 'package.module:function' or '/path/file.py:function'")
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise ValueError(f"target={target!r}: file {where} does not exist")
        return
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"target={target!r}: module {where} cannot be imported from this environment")


def launch(cluster: EmulatedCluster | LocalCluster, target: str, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
           threads_per_rank: int | None = None, collective_timeout_s: float | None = None,
           realtime: bool = False) -> list[Any]:
    """``[target(info_r, *args) for every rank r]`` over ``cluster``, each rank its own process.

    ``timeout_s`` bounds the whole call (start-up, process-group set-up, the target).
    Collectives time out after ``collective_timeout_s`` (default 0.8 x ``timeout_s``), so a rank
    blocked on a missing peer reports the operation before the launcher gives up.
    ``threads_per_rank`` sets torch's intra-op threads (default: cores / ranks, at least 1).
    ``realtime``: the ranks run under the SCHED_FIFO policy at priority :data:`REALTIME_PRIORITY`
    (needs root), so that other processes on a shared machine do not steal their cores in the middle
    of a timed step: for measurements (``piper calibrate``, ``piper validate``). The kernel keeps 5 %
    of each second for other processes (``sched_rt_runtime_us``), and every collective keeps its
    deadline, so a stuck rank still fails rather than freezing the machine.
    """
    check_target(target)
    json.dumps(list(args))  # arguments travel as JSON: fail here, not in every rank
    world = cluster.world_size
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world)
    local = isinstance(cluster, LocalCluster)
    kind = "local" if local else "emulated"
    what = f"{target} on {len(cluster.nodes)}x{cluster.ranks_per_node} {kind} ranks"
    work = Path(tempfile.mkdtemp(prefix="piperemu-run-"))
    port = free_port() if local else STORE_PORTS[secrets.randbelow(len(STORE_PORTS))]
    try:
        if realtime:
            check_realtime()
        spec = {"target": target, "args": list(args), "threads": threads, "sys_path": sys.path,
                "out_dir": str(work), "realtime": REALTIME_PRIORITY if realtime else None}
        infos = [asdict(_info(cluster, r, port, collective_timeout_s or 0.8 * timeout_s)) for r in range(world)]
        (work / "spec.json").write_text(json.dumps({**spec, "infos": infos}))
        procs = [_start(cluster, r, work, threads) for r in range(world)]
        exit_order: list[int] = []
        try:
            timed_out = _wait(procs, time.monotonic() + timeout_s, exit_order)
        finally:
            running = [r for r, p in enumerate(procs) if r not in exit_order]
            _stop(procs)
        return _collect(what, work, procs, exit_order, running, timed_out, timeout_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _info(cluster: EmulatedCluster | LocalCluster, rank: int, port: int, collective_timeout_s: float) -> RankInfo:
    node = cluster.nodes[rank // cluster.ranks_per_node]
    return RankInfo(rank=rank, world_size=cluster.world_size, node=node.index,
                    local_rank=rank % cluster.ranks_per_node, nodes=len(cluster.nodes),
                    ranks_per_node=cluster.ranks_per_node, address=node.address,
                    master_address=cluster.nodes[0].address, port=port,
                    collective_timeout_s=collective_timeout_s)


def _start(cluster: EmulatedCluster | LocalCluster, rank: int, work: Path, threads: int) -> subprocess.Popen[bytes]:
    node = cluster.nodes[rank // cluster.ranks_per_node]
    # a node without a namespace is this host (LocalCluster): gloo on loopback, no `ip netns exec`
    ifname, prefix = ("lo", []) if node.netns is None else (NODE_IFNAME, ["ip", "netns", "exec", node.netns])
    env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    log = open(work / f"rank{rank}.log", "wb")  # noqa: SIM115 - the child owns it from here
    try:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "piper_core.emulate.rank", str(work / "spec.json"), str(rank)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        log.close()


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float, exit_order: list[int]) -> bool:
    """Until all exit, or a rank failed and the grace period passed; True when the deadline hit.
    Appends ranks to ``exit_order`` as they are seen to exit (the first failure is the likely cause)."""
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        exit_order.extend(r for r, c in enumerate(codes) if c is not None and r not in exit_order)
        if len(exit_order) == len(procs):
            return False
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return False
        if now >= deadline:
            return True
        time.sleep(0.02)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each still-running rank's process group (each rank has its own session)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _collect(what: str, work: Path, procs: list[subprocess.Popen[bytes]], exit_order: list[int],
             running: list[int], timed_out: bool, timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    for r in exit_order:
        p, report = procs[r], work / f"rank{r}.json"
        if report.is_file():
            payload = json.loads(report.read_text())
            if payload["ok"]:
                results[r] = payload["result"]
                continue
            errors[r], failed_at[r] = payload["error"], payload["failed_at"]
        else:
            tail = (work / f"rank{r}.log").read_text(errors="replace")[-3000:]
            errors[r] = f"exit code {p.returncode} without a report; output tail:\n{tail}"
    if not errors and not running:
        return [results[r] for r in range(len(procs))]
    parts = []
    if timed_out:
        parts.append(f"timed out after {timeout_s:g} s with rank(s) {running} still running")
    elif running:
        parts.append(f"rank(s) {running} were still running {FAILURE_GRACE_S:g} s after the first "
                     f"failure and were stopped")
    if errors:
        # the first to fail is the likely cause; the others usually report its closed connection
        first = min(errors, key=lambda r: failed_at.get(r, float("inf")))
        parts.insert(0, f"rank(s) {sorted(errors)} failed; first rank {first}:\n{errors[first].rstrip()}")
    raise RankFailure(f"{what}: " + "\n".join(parts), failed=sorted(set(errors) | set(running)), logs=errors)


def run_emulated(nodes: int, ranks_per_node: int, inter_node_mbit: float | None, target: str,
                 args: Sequence[Any] = (), timeout_s: float = 120.0, *, threads_per_rank: int | None = None,
                 collective_timeout_s: float | None = None, realtime: bool = False) -> list[Any]:
    """Build a ``nodes`` x ``ranks_per_node`` cluster, run ``target`` on it, tear it down.

    Returns each rank's JSON-decoded return value, in rank order (arguments as for :func:`launch`). Raises :class:`RankFailure`
    naming the ranks that failed, or :class:`EmulationError` when the cluster cannot be built.
    """
    with EmulatedCluster(nodes=nodes, ranks_per_node=ranks_per_node, inter_node_mbit=inter_node_mbit) as cluster:
        return cluster.run(target, args, timeout_s=timeout_s, threads_per_rank=threads_per_rank,
                           collective_timeout_s=collective_timeout_s, realtime=realtime)
