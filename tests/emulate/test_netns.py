"""The emulated cluster: namespaces come up with their addresses, gloo collectives cross them, the
tbf shaping is in effect, and teardown leaves nothing behind after success, a failing or hanging
rank, Ctrl-C/SIGTERM, or a launcher killed outright (stale-namespace cleanup).

Needs root, ``ip`` and ``tc``; elsewhere these tests skip with the reason
:func:`piper_core.emulate.emulation_available` gives (CI runs as root, so they run there).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from piper_core.emulate import (
    NAME_PREFIX,
    SUBNET,
    EmulatedCluster,
    RankFailure,
    cleanup_stale,
    emulated_cluster_spec,
    emulation_available,
    list_namespaces,
    run_emulated,
)
from piper_core.emulate import netns as netns_mod
from piper_core.presets import load_cluster

REASON = emulation_available()
needs_emulation = pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
REPO = Path(__file__).resolve().parents[2]


def _ours(prefix: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(prefix)]


def _prefix(cluster: EmulatedCluster) -> str:
    return cluster.bridge_netns.removesuffix("-br")


def _gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _pids_inside(names: list[str]) -> list[int]:
    out = []
    for name in names:
        proc = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        out += [int(p) for p in proc.stdout.split()]
    return out


# ---- without root -------------------------------------------------------------------------------

def test_unavailable_without_root_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert emulation_available() == "network namespaces need root (running as uid 1000)"


def test_bad_arguments_are_rejected_with_the_rule() -> None:
    with pytest.raises(ValueError, match=r"nodes=0: must be 1\.\.200"):
        EmulatedCluster(nodes=0, ranks_per_node=1, inter_node_mbit=None)
    with pytest.raises(ValueError, match=r"inter_node_mbit=0: must be between"):
        EmulatedCluster(nodes=2, ranks_per_node=1, inter_node_mbit=0)
    from piper_core.emulate.launch import check_target
    with pytest.raises(ValueError, match="must be 'package.module:function'"):
        check_target("tests.emulate.ranks")
    with pytest.raises(ValueError, match="module no_such_module cannot be imported"):
        check_target("no_such_module:f")


def test_cluster_spec_shares_the_node_link_among_its_ranks() -> None:
    spec = emulated_cluster_spec(nodes=2, ranks_per_node=4, inter_node_mbit=80,
                                 accelerator=load_cluster("cpu-local").accelerator, intra_node_gb_per_s=1.0,
                                 intra_node_latency_us=100, inter_node_latency_us=300, efficiency=1.0)
    assert spec.gpus_per_node == 4
    assert [lvl.domain_gpus for lvl in spec.links] == [4, None]
    assert spec.links[1].bandwidth_gb_per_s == pytest.approx(80e6 / 8 / 4 / 1e9)


def test_addresses_stay_inside_the_project_subnet() -> None:
    cluster = EmulatedCluster(nodes=200, ranks_per_node=1, inter_node_mbit=None)
    assert all(ipaddress.ip_address(n.address) in SUBNET for n in cluster.nodes)
    assert len({n.address for n in cluster.nodes}) == 200


# ---- on the emulated cluster -------------------------------------------------------------------

@needs_emulation
def test_cluster_comes_up_and_goes_away() -> None:
    with EmulatedCluster(nodes=2, ranks_per_node=1, inter_node_mbit=100) as cluster:
        assert sorted(_ours(_prefix(cluster))) == sorted(cluster.namespaces)
        for node in cluster.nodes:
            addr = subprocess.run(["ip", "-n", node.netns, "-4", "-o", "addr", "show", "emu0"],
                                  capture_output=True, text=True, check=True).stdout
            assert f"{node.address}/24" in addr
            qdisc = subprocess.run(["tc", "-n", node.netns, "qdisc", "show", "dev", "emu0"],
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
    assert _ours(_prefix(cluster)) == []
    cluster.teardown()  # idempotent


@needs_emulation
def test_all_to_all_single_across_namespaces_2x2() -> None:
    splits = [[1, 0, 3, 2], [2, 2, 0, 1], [0, 4, 1, 1], [3, 0, 0, 0]]  # zeros in both directions
    out = run_emulated(2, 2, 200, "tests.emulate.ranks:all_to_all", [splits], timeout_s=60)
    for rank, got in enumerate(out):
        assert (got["node"], got["local_rank"]) == divmod(rank, 2)
        assert got["address"] == str(SUBNET[10 + rank // 2])
        want = [float(1000 * src + rank) for src in range(4) for _ in range(splits[src][rank])]
        assert got["recv"] == want


@needs_emulation
def test_inter_node_link_is_shaped_and_intra_node_is_not() -> None:
    mbit, nbytes = 40, 1_000_000
    times = run_emulated(2, 2, mbit, "tests.emulate.ranks:send_times", [nbytes, [1, 2]], timeout_s=60)[0]
    intra, inter = times["1"], times["2"]
    shaped = nbytes / (mbit * 1e6 / 8)  # 0.2 s at the tbf rate
    assert 0.5 * shaped < inter < 3 * shaped, (inter, shaped)
    assert inter > 5 * intra, (inter, intra)


@needs_emulation
def test_failing_rank_is_named_and_nothing_is_left_behind() -> None:
    with EmulatedCluster(nodes=2, ranks_per_node=2, inter_node_mbit=200) as cluster:
        with pytest.raises(RankFailure, match=r"(?s)first rank 1:.*ValueError: rank 1 fails on purpose") as err:
            cluster.run("tests.emulate.ranks:fail_on", [1], timeout_s=60)
        assert 1 in err.value.failed
        assert _pids_inside(list(cluster.namespaces)) == []
    assert _ours(_prefix(cluster)) == []
    veths = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    assert "emu0" not in veths  # nothing was ever created in the root namespace


@needs_emulation
def test_missing_peer_times_out_naming_the_rank() -> None:
    with pytest.raises(RankFailure, match=r"(?s)rank\(s\) \[0, 1, 2\] failed.*Timed out.*"
                       r"rank\(s\) \[3\] were still running") as err:
        run_emulated(2, 2, None, "tests.emulate.ranks:hang_on", [3], timeout_s=30, collective_timeout_s=2)
    assert err.value.failed == (0, 1, 2, 3)


_OWNER = """
from piper_core.emulate import EmulatedCluster
with EmulatedCluster(nodes=2, ranks_per_node=1, inter_node_mbit=100) as cluster:
    print(cluster.bridge_netns.removesuffix("-br"), flush=True)
    cluster.run("tests.emulate.ranks:sleep", [600], timeout_s=600)
"""


def _start_owner() -> tuple[subprocess.Popen[str], str, list[int]]:
    """A launcher process with a 2-node cluster whose ranks are running; its prefix and rank pids."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    prefix = owner.stdout.readline().strip()
    deadline = time.monotonic() + 30
    while len(pids := _pids_inside(_ours(prefix))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert prefix.startswith(NAME_PREFIX) and len(pids) == 2, (prefix, pids)
    return owner, prefix, pids


@needs_emulation
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_tears_down(sig: signal.Signals) -> None:
    owner, prefix, pids = _start_owner()
    owner.send_signal(sig)
    owner.wait(30)
    assert _ours(prefix) == []
    assert all(_gone(p) for p in pids)


@needs_emulation
def test_stale_namespaces_of_a_killed_launcher_are_cleaned_up() -> None:
    with EmulatedCluster(nodes=1, ranks_per_node=1, inter_node_mbit=None) as live:
        owner, prefix, pids = _start_owner()
        owner.kill()  # no handler runs: its namespaces and ranks stay behind
        owner.wait(30)
        stale = _ours(prefix)
        assert len(stale) == 3
        assert sorted(cleanup_stale()) == sorted(stale)
        assert _ours(prefix) == []
        assert sorted(_ours(_prefix(live))) == sorted(live.namespaces)  # a live owner's are kept
    assert all(_gone(p) for p in pids)


def test_stale_name_parsing() -> None:
    assert netns_mod._owner_alive(f"{NAME_PREFIX}{os.getpid()}-0-br")
    assert not netns_mod._owner_alive(f"{NAME_PREFIX}notapid-0-br")


@needs_emulation
def test_launcher_deadline_stops_the_ranks() -> None:
    with pytest.raises(RankFailure, match=r"timed out after 3 s with rank\(s\) \[0, 1\] still running"):
        run_emulated(2, 1, None, "tests.emulate.ranks:sleep", [600], timeout_s=3)
