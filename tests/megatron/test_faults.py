"""A rank killed during ``--piper`` training ends every other rank within 60 s, with an error that
names the operation and the ranks; what sets the deadline on NCCL.

gloo: one spawn per case (tests/megatron/fault_ranks.py) trains a tiny GPT-MoE with Piper's
dispatcher under Megatron-Core's DDP (overlap_grad_reduce, as ``--piper`` sets) and SIGKILLs one rank
in step 1, inside a Piper exchange or just before Megatron's gradient all-reduce. Every process
group has Megatron's default 10-minute timeout, so a survivor that ends within 60 s ended because
gloo noticed the closed connection, not because a timeout ran out. The launcher here (not
tests/gloo.py's, which kills the other ranks as soon as one dies) lets each survivor run into its
own error and reports it with its time; a survivor still running 60 s after the kill has its stack
dumped (SIGUSR1, faulthandler) into the failure message and is killed.

NCCL (no GPU here): the code path Piper takes, checked on CPU with process-group creation recorded.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from piper_core.runtime.timeouts import kind_of
from tests.megatron.fault_ranks import Fault, rank_main

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

BOUND_S = 60.0  # from the kill to the last survivor's exit
START_S = 300.0  # spawn, Megatron import, model build and one step, on a loaded 2-core machine


# ---- launcher ---------------------------------------------------------------------------------------

def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else f"({path.name} not written)"


def run_fault(fault: Fault, out: Path) -> dict[str, Any]:
    """Run ``fault`` and return: ``fault`` (when and
    where the victim was signalled), ``reports`` (what ended each rank, None where nothing was
    written), ``exit_s`` (each survivor's exit, seconds after the signal) and ``hung`` (the stack of
    each survivor still running :data:`BOUND_S` after it). Every wait is bounded; every process
    is gone when it returns."""
    import multiprocessing as mp

    from piper_core.emulate.launch import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, fault, port, str(out)), daemon=True) for r in range(fault.world)]
    survivors = [r for r in range(fault.world) if r != fault.victim]
    exited: dict[int, float] = {}
    hung: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + START_S
        while not (out / "fault").exists() and all(p.exitcode is None for p in procs) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        struck = _read(out / "fault")
        if struck is None:
            reports = {r: _read(out / f"rank{r}.json") for r in range(fault.world)}
            raise AssertionError(f"{fault.id}: rank {fault.victim} did not reach its fault point (waited up to "
                                 f"{START_S:g} s; exit codes {[p.exitcode for p in procs]}); reports: {reports}")

        def note_exits() -> None:
            for r in survivors:
                if procs[r].exitcode is not None and r not in exited:
                    exited[r] = time.time() - struck["t"]

        while time.time() < struck["t"] + BOUND_S and len(exited) < len(survivors):
            note_exits()
            time.sleep(0.1)
        note_exits()
        late = [r for r in survivors if r not in exited]
        for r in late:
            os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler: where is it stuck?
        time.sleep(1.0 if late else 0.0)
        hung = {r: _text(out / f"stack{r}.txt") for r in late}
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
            if p.pid is not None:
                p.join(10)
    return {"fault": struck, "reports": {r: _read(out / f"rank{r}.json") for r in range(fault.world)},
            "exit_s": exited, "hung": hung}


def _ended_in_time(fault: Fault, result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every survivor exited within BOUND_S of the fault, with an error report; the reports."""
    hung = "".join(f"\n--- rank {r}, still running:\n{stack}" for r, stack in result["hung"].items())
    assert not result["hung"], f"{fault.id}: {BOUND_S:g} s after the {fault.signal} at {result['fault']}:{hung}"
    reports = {}
    for r, seconds in result["exit_s"].items():
        report = result["reports"][r]
        assert report is not None and report["error"], f"{fault.id}: rank {r} exited without an error: {report}"
        assert seconds <= BOUND_S and report["t_error"] - result["fault"]["t"] <= BOUND_S, (r, seconds, report)
        reports[r] = report
    return reports


def _names_piper_exchange(report: dict[str, Any], op: str, ranks: list[int], rank: int, gone: int) -> None:
    """A CollectiveError naming the exchange, the stage, the group, this rank and the lost peer."""
    message = report["error"]
    assert report["type"] == "CollectiveError", report["traceback"]
    assert f"{op}, stage 1/1 (flat), on global ranks {ranks}: rank {rank} lost a peer in it (RuntimeError: " \
        in message, message
    assert f"A peer is gone: one of ranks {[gone]} exited, crashed or was killed" in message, message
    assert report["cause"].startswith("RuntimeError: ") and kind_of(RuntimeError(report["cause"])) == "peer gone"


# ---- a killed rank (gloo) ------------------------------------------------------------------------------

def test_killed_rank_in_a_flat_dispatch_ends_its_peer(tmp_path: Path) -> None:
    fault = Fault(world=2, a2a="flat", chunks=1, victim=1, op="dispatch chunk 1/1 (forward)")
    reports = _ended_in_time(fault, run_fault(fault, tmp_path))
    _names_piper_exchange(reports[0], "flat dispatch chunk 1/1 (forward)", [0, 1], 0, 1)


def test_killed_rank_in_a_pipelined_backward_ends_its_peer(tmp_path: Path) -> None:
    fault = Fault(world=2, a2a="pipelined", chunks=2, victim=0, op="combine chunk 1/2 (backward)")
    reports = _ended_in_time(fault, run_fault(fault, tmp_path))
    _names_piper_exchange(reports[1], "flat combine chunk 1/2 (backward)", [0, 1], 1, 0)


def test_killed_rank_before_the_ddp_gradient_reduce_ends_its_peer(tmp_path: Path) -> None:
    """Megatron's collective, not Piper's: gloo's own error, raised where Megatron waits for it."""
    fault = Fault(world=2, a2a="flat", chunks=1, victim=1, op="grad reduce")
    report = _ended_in_time(fault, run_fault(fault, tmp_path))[0]
    assert report["type"] == "RuntimeError" and kind_of(RuntimeError(report["error"])) == "peer gone", report
    assert "in finish_grad_sync" in report["traceback"], report["traceback"]


def test_killed_rank_ends_every_rank_of_a_pipeline_parallel_job(tmp_path: Path) -> None:
    """4 ranks, pp 2 x ep 2: rank 3 dies in its first pipelined dispatch of step 1. Its expert-
    parallel peer (rank 2) loses it inside Piper's exchange; the first stage (ranks 0 and 1) loses
    a peer in Megatron's pipeline send/receive or, once a peer that failed has exited, in its own
    exchanges: either way an error that says a peer's connection is gone."""
    fault = Fault(world=4, a2a="pipelined", chunks=2, victim=3, op="dispatch chunk 1/2 (forward)")
    reports = _ended_in_time(fault, run_fault(fault, tmp_path))
    _names_piper_exchange(reports[2], "flat dispatch chunk 1/2 (forward)", [2, 3], 2, 3)
    for r in (0, 1):
        report = reports[r]
        assert kind_of(RuntimeError(report["error"])) == "peer gone", report
        assert report["type"] == "CollectiveError" and "on global ranks [0, 1]" in report["error"] \
            or report["type"] == "RuntimeError" and "megatron/core" in report["traceback"], report


# ---- a hung rank (gloo): Piper's deadline --------------------------------------------------------------

def test_stopped_rank_ends_its_peer_at_the_deadline_piper_was_given(tmp_path: Path) -> None:
    """A rank that hangs (SIGSTOP: alive, connections open) is noticed only by a deadline; inside
    Piper's exchange that is the timeout ``--piper`` passes to its groups (here 0.25 min where
    Megatron's own groups keep 10), both on the group and on each wait of the host."""
    fault = Fault(world=2, a2a="flat", chunks=1, victim=1, op="dispatch chunk 1/1 (forward)", signal="SIGSTOP",
                  piper_timeout_minutes=0.25)
    result = run_fault(fault, tmp_path)
    report = _ended_in_time(fault, result)[0]
    message = report["error"]
    assert report["type"] == "CollectiveError", report["traceback"]
    assert "flat dispatch chunk 1/1 (forward), stage 1/1 (flat), on global ranks [0, 1]: rank 0 did not " \
        "complete it within 15 s" in message, message
    assert "A peer is missing: one of ranks [1] skipped this call" in message, message
    assert 14.0 <= report["t_error"] - result["fault"]["t"] <= BOUND_S, report


# ---- NCCL: what sets the deadline (no GPU: the code path, with process-group creation recorded) ------

class _Work:
    """A work handle that records how it was waited for."""

    def __init__(self, waits: list[timedelta | None]):
        self.waits = waits

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        return True


class _Group:
    def __init__(self, ranks: list[int], kwargs: dict[str, Any]):
        self.ranks, self.kwargs = ranks, kwargs


@pytest.fixture
def recorded_groups(monkeypatch: pytest.MonkeyPatch) -> tuple[list[_Group], list[timedelta | None]]:
    """torch.distributed as rank 1 of 4 sees it, with ``new_group`` recorded and every work
    handle recording its wait; no process group exists."""
    import torch.distributed as dist

    groups: list[_Group] = []
    waits: list[timedelta | None] = []

    def new_group(ranks: list[int], **kwargs: Any) -> _Group:
        groups.append(_Group(list(ranks), kwargs))
        return groups[-1]

    def all_gather(parts: list[Any], t: Any, group: Any = None, async_op: bool = False) -> _Work:
        for part in parts:
            part.copy_(t)
        return _Work(waits)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "barrier", lambda group=None, async_op=False: _Work(waits))
    monkeypatch.setattr(dist, "all_gather", all_gather)
    return groups, waits


def test_every_group_piper_creates_gets_the_timeout_it_is_given(recorded_groups) -> None:
    """The timeout ``create_comm`` is given is every one of its groups' timeout (NCCL's watchdog
    enforces it), each group says it is Piper's (``group_desc``, printed by NCCL's watchdog), the
    set-up barrier is waited for with it; with ``host_timeout=False`` (NCCL) an exchange's wait
    leaves the deadline to the group, with True it also bounds the host's wait."""
    from piper_core.runtime import NodeTopology, create_comm, exchange_counts

    groups, waits = recorded_groups
    timeout = timedelta(minutes=7)
    comm = create_comm(NodeTopology.uniform(world_size=4, ranks_per_node=2), parents=((0, 2), (1, 3)),
                       timeout=timeout, host_timeout=False)
    assert [g.ranks for g in groups] == [[0, 2], [0], [2], [0, 2], [1, 3], [1], [3], [1, 3]]
    assert all(g.kwargs["timeout"] == timeout for g in groups)
    assert [g.kwargs["group_desc"] for g in groups[4:]] == [
        "PIPER_A2A[1,3]", "PIPER_A2A_INTRA_NODE[1]", "PIPER_A2A_INTRA_NODE[3]", "PIPER_A2A_INTER_NODE[1,3]"]
    assert comm.group is groups[4] and comm.timeout == timeout and comm.host_timeout is False
    assert waits == [timeout]  # create_comm's barrier: bounded on every backend
    exchange_counts([1, 2, 3, 4], comm=comm)
    assert waits == [timeout, None]
    host = create_comm(NodeTopology.uniform(world_size=4, ranks_per_node=2), timeout=timeout, host_timeout=True)
    waits.clear()
    exchange_counts([1, 2, 3, 4], comm=host)
    assert waits == [timeout]


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_piper_install_passes_megatrons_timeout_and_leaves_nccl_waits_to_the_watchdog(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``initialize_model_parallel`` hook of ``--piper`` creates Piper's groups with the
    request's timeout (Megatron's ``--distributed-timeout-minutes``) and host deadlines on every
    backend but NCCL."""
    import io

    import torch.distributed as dist
    from megatron.core import parallel_state

    from piper_megatron import dispatcher
    from piper_megatron.install import DispatchRequest, Installation
    from piper_megatron.versions import installed_release

    made: list[dict[str, Any]] = []

    class Installed:
        def restore(self) -> None:
            pass

    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda *args, **kwargs: None)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dispatcher, "create_ep_comm", lambda topology, **kwargs: made.append(kwargs) or "comm")
    monkeypatch.setattr(dispatcher, "install_dispatcher", lambda comm, settings, tracer=None: Installed())
    installation = Installation(installed_release(), [], io.StringIO())
    installation.hook_model_parallel(DispatchRequest(a2a="flat", chunks=1, ranks_per_node=2, timeout_minutes=7))
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    finally:
        installation.restore()
    assert made == [{"timeout": timedelta(minutes=7), "host_timeout": backend != "nccl"}]


@pytest.mark.parametrize("minutes", [None, 3])
def test_piper_takes_its_timeout_from_distributed_timeout_minutes(minutes: int | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--piper`` plans, then asks for its groups with Megatron's ``--distributed-timeout-minutes``
    (as Megatron's parser leaves it; 10, Megatron's default, if the namespace lacks it)."""
    import argparse
    import io

    from piper_megatron.args import add_piper_arguments, parse_megatron_args
    from piper_megatron.install import Installation
    from piper_megatron.versions import installed_release

    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "1024",
            "--seq-length", "512", "--max-position-embeddings", "512", "--num-experts", "8",
            "--moe-ffn-hidden-size", "256", "--moe-router-topk", "2", "--vocab-size", "32000",
            "--global-batch-size", "16", "--bf16", "--piper", "--piper-cluster", "dgx-h100"]
    ns = parse_megatron_args(argv)
    add_piper_arguments(argparse.ArgumentParser()).parse_known_args(argv, namespace=ns)
    if minutes is not None:
        ns.distributed_timeout_minutes = minutes
    ns.world_size, ns.rank = 8, 1
    requests: list[Any] = []
    monkeypatch.setattr(Installation, "hook_model_parallel", lambda self, request: requests.append(request))
    Installation(installed_release(), argv, io.StringIO()).prepare(ns, {})
    assert [r.timeout_minutes for r in requests] == [10 if minutes is None else minutes]


# ---- the launcher's line for a collective of Megatron's ---------------------------------------------

_FAKE_DDP = '''
def finish_grad_sync():
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1759: "
                       "Connection reset by peer. This is typically caused by a remote worker crashing. GLHF!")
'''


def _script(tmp_path: Path, body: str) -> str:
    """A script that calls ``body`` from a module whose path lies under a ``megatron/`` folder."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "fake_ddp.py").write_text(_FAKE_DDP)
    script = tmp_path / "train.py"
    script.write_text("import importlib.util, pathlib\n"
                      "spec = importlib.util.spec_from_file_location('fake_ddp', pathlib.Path(__file__).parent / "
                      "'megatron' / 'fake_ddp.py')\n"
                      "ddp = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(ddp)\n" + body)
    return str(script)


def test_launcher_names_the_rank_and_megatron_operation_of_a_lost_peer(tmp_path: Path, capsys,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a rank stops in Megatron's own collective (gloo's bare error), ``python -m piper_megatron``
    prints which rank, which Megatron function and what the backend said, then the traceback."""
    from piper_megatron.__main__ import main

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("sys.argv", list(__import__("sys").argv))  # run_script sets argv and path[0]
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        main([_script(tmp_path, "ddp.finish_grad_sync()\n")])
    line = capsys.readouterr().err.strip()
    assert line == ("piper_megatron: rank 1 of 2 stopped in finish_grad_sync (megatron/fake_ddp.py:3), a collective "
                    "of Megatron's: it lost a peer (a rank exited, crashed or was killed; the first error in the "
                    "job's logs names it): RuntimeError: Read error [127.0.0.1]:1759: Connection reset by peer"), line


def test_launcher_adds_nothing_to_other_errors(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    from piper_megatron.__main__ import main

    monkeypatch.setattr("sys.argv", list(__import__("sys").argv))  # run_script sets argv and path[0]
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main([_script(tmp_path, "raise RuntimeError('shape mismatch')\n")])
    assert capsys.readouterr().err == ""
