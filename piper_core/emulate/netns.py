"""Cluster nodes as Linux network namespaces, joined by veth pairs to a bridge, links shaped by tbf.

Layout of one cluster (``<p>`` is ``piperemu-<owner pid>-<6 random hex digits>``)::

    netns <p>-br:  bridge br0 -- v0 -- v1 -- ... (the switch; no address)
                          |      |
    netns <p>-n0:      emu0 10.213.0.10/24        netns <p>-n1: emu0 10.213.0.11/24  ...

Every namespace is created by this module and nothing is added to the root namespace: the veth
pairs are created inside the bridge namespace with their node end moved straight into the node's
namespace, so deleting the namespaces removes every device. Addresses come only from
:data:`SUBNET`. Ranks of one node talk over the node's own address (the kernel delivers that
locally over the namespace's loopback, unshaped); traffic between nodes crosses the bridge.

Shaping: a token-bucket filter (``tc qdisc ... tbf``; netem is not available on the hosts we
target) on both ends of each node's veth, i.e. on the node's egress and on the bridge's egress
towards the node, so every node has a full-duplex "NIC" of ``inter_node_mbit`` in each direction,
shared by its ranks. tbf adds no latency of its own beyond queueing.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

SUBNET = ipaddress.IPv4Network("10.213.0.0/24")
"""The only addresses the emulation ever assigns or targets: node ``i`` is ``SUBNET[FIRST_HOST + i]``."""
FIRST_HOST = 10
MAX_NODES = 200
NAME_PREFIX = "piperemu-"
"""Every namespace this module creates is ``piperemu-<owner pid>-<6 hex>-{br,n<i>}``."""
NODE_IFNAME = "emu0"
"""The node's interface inside its namespace (what gloo binds to: ``GLOO_SOCKET_IFNAME``)."""
TBF_LATENCY_MS = 100.0
"""tbf queue limit expressed as time; long enough that TCP sees few drops at tens of Mbit/s."""


class EmulationError(RuntimeError):
    """The emulated cluster could not be built, shaped or torn down (the message says which command)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One emulated node: its namespace and its address inside :data:`SUBNET`."""

    index: int
    netns: str
    address: str


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise EmulationError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Bucket size: 1 ms of traffic at ``rate_mbit``, at least 16 KiB. A larger bucket lets the
    first bytes of each message through unshaped (4 ms at 1 Gbit/s let a 200 KB message pass at
    3x the rate); a smaller one undershoots at high rates (16 KiB at 1 Gbit/s gave 89 MB/s, not 120)."""
    return max(16 * 1024, int(rate_mbit * 1e6 / 8 * 0.001))


def list_namespaces() -> list[str]:
    """Names of all network namespaces known to ``ip netns`` (first word of each line)."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _owner_alive(name: str) -> bool:
    try:
        pid = int(name[len(NAME_PREFIX):].split("-")[0])
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str) -> None:
    """SIGKILL the processes still running in ``netns`` (ranks this module launched there)."""
    out = _run(["ip", "netns", "pids", netns], check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def delete_namespaces(names: Sequence[str]) -> None:
    """Kill what runs inside, then delete each namespace (idempotent: absent ones are skipped)."""
    present = set(list_namespaces())
    for name in names:
        if name in present:
            _kill_inside(name)
    for name in names:
        if name in present:
            proc = _run(["ip", "netns", "del", name], check=False)
            if proc.returncode != 0 and name in list_namespaces():
                raise EmulationError(f"could not delete network namespace {name}: {proc.stderr.strip()}")


def cleanup_stale() -> list[str]:
    """Delete namespaces left by earlier runs whose owning process is gone (a crash, SIGKILL).

    Clusters of live processes (another test run on this machine) are left alone. Returns the
    names deleted.
    """
    stale = [n for n in list_namespaces() if n.startswith(NAME_PREFIX) and not _owner_alive(n)]
    delete_namespaces(stale)
    return stale


def _probe() -> str | None:
    """Build and remove a one-veth namespace with a tbf qdisc; the error text if any step fails."""
    name = f"{NAME_PREFIX}{os.getpid()}-probe"
    try:
        delete_namespaces([name])
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        _run(["tc", "-n", name, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "10mbit",
              "burst", "16kb", "latency", f"{TBF_LATENCY_MS:g}ms"])
    except (EmulationError, OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces with veth and tbf are not permitted here: {exc}"
    finally:
        try:
            delete_namespaces([name])
        except EmulationError:
            pass
    return None


def emulation_available() -> str | None:
    """None when this machine can build an emulated cluster, else the reason it cannot.

    Needs Linux, root, ``ip`` and ``tc`` on PATH, and permission to create namespaces, veth
    pairs, bridges and tbf qdiscs (probed by building and deleting a throw-away namespace).
    """
    if not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH (install iproute2)"
    return _probe()


class EmulatedCluster:
    """``nodes`` namespaces on one bridge, inter-node links shaped to ``inter_node_mbit`` (None: unshaped).

    Use as a context manager: entering removes stale clusters of dead processes and builds this
    one; leaving (normally, on an exception, on Ctrl-C, SIGTERM or SIGHUP, or at interpreter exit)
    kills the ranks still running inside and deletes every namespace. :meth:`teardown` is
    idempotent. Ranks are launched with :meth:`run` (see :mod:`piper_core.emulate.launch`).
    """

    def __init__(self, *, nodes: int, ranks_per_node: int, inter_node_mbit: float | None):
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes!r}: must be 1..{MAX_NODES} (one address each in {SUBNET}); "
                             f"choose fewer nodes")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node!r}: must be >= 1")
        _check_rate(inter_node_mbit)
        self.ranks_per_node = ranks_per_node
        self.inter_node_mbit = inter_node_mbit
        base = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_netns = f"{base}-br"
        self.nodes = tuple(Node(index=i, netns=f"{base}-n{i}", address=str(SUBNET[FIRST_HOST + i]))
                           for i in range(nodes))
        self._up = False
        self._old_handlers: dict[int, Any] = {}

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace this cluster owns (bridge first)."""
        return (self.bridge_netns, *(n.netns for n in self.nodes))

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node

    def __enter__(self) -> EmulatedCluster:
        reason = emulation_available()
        if reason is not None:
            raise EmulationError(f"cannot build an emulated cluster: {reason}")
        cleanup_stale()
        self._install_handlers()
        atexit.register(self.teardown)
        self._up = True  # from here on teardown has work to do, even if the build fails half-way
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _build(self) -> None:
        br = self.bridge_netns
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for node in self.nodes:
            ns, port = node.netns, f"v{node.index}"
            _run(["ip", "netns", "add", ns])
            # gloo binds to the first address of the interface: keep it the IPv4 one
            _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                  "net.ipv6.conf.default.disable_ipv6=1"], check=False)
            _run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns])
            _run(["ip", "-n", br, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", br, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{node.address}/{SUBNET.prefixlen}", "dev", NODE_IFNAME])
            _run(["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self.set_inter_node_mbit(self.inter_node_mbit)

    def set_inter_node_mbit(self, mbit: float | None) -> None:
        """(Re)shape every node's link to ``mbit`` in each direction; None removes the shaping."""
        _check_rate(mbit)
        for node in self.nodes:
            for ns, dev in ((node.netns, NODE_IFNAME), (self.bridge_netns, f"v{node.index}")):
                if mbit is None:
                    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                          f"{mbit * 1000:.0f}kbit", "burst", str(tbf_burst_bytes(mbit)),
                          "latency", f"{TBF_LATENCY_MS:g}ms"])
        self.inter_node_mbit = mbit

    def run(self, target: str, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
            threads_per_rank: int | None = None, collective_timeout_s: float | None = None,
            realtime: bool = False) -> list[Any]:
        """Run ``target`` on every rank of this cluster; see :func:`piper_core.emulate.launch.launch`."""
        from piper_core.emulate.launch import launch
        if not self._up:
            raise EmulationError("the cluster is not up: use `with EmulatedCluster(...) as cluster:`")
        return launch(self, target, args, timeout_s=timeout_s, threads_per_rank=threads_per_rank,
                      collective_timeout_s=collective_timeout_s, realtime=realtime)

    def teardown(self) -> None:
        """Kill the ranks still inside and delete this cluster's namespaces (safe to call twice)."""
        if not self._up:
            return
        self._up = False
        try:
            delete_namespaces(self.namespaces)
        finally:
            atexit.unregister(self.teardown)
            self._restore_handlers()

    def _install_handlers(self) -> None:
        """Turn SIGTERM/SIGHUP into SystemExit so ``__exit__`` runs (SIGINT already raises
        KeyboardInterrupt). Only the main thread may set handlers; elsewhere atexit remains."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _exit_on_signal)

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(sig, handler)
        self._old_handlers.clear()


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _check_rate(mbit: float | None) -> None:
    if mbit is not None and not 0.1 <= mbit <= 100_000:
        raise ValueError(f"inter_node_mbit={mbit!r}: must be between 0.1 and 100000 Mbit/s, or None "
                         f"for an unshaped link")

