"""An emulated multi-node cluster on one Linux machine, for tests and benchmarks of the all-to-all.

Nodes are network namespaces joined by veth pairs to a bridge (in a namespace of its own); each
node's link is shaped with ``tc ... tbf`` in both directions; K ranks per node talk to each other
over the node's own address (kernel-local, unshaped) and to other nodes over the shaped link;
gloo binds to the node's interface. Only :data:`SUBNET` (10.213.0.0/24) inside namespaces this
package creates is ever addressed. Needs root, ``ip`` and ``tc``: :func:`emulation_available`
says why not otherwise.

API::

    emulation_available() -> str | None           # None, or why this machine cannot emulate
    run_emulated(nodes, ranks_per_node, inter_node_mbit, target, args=(), timeout_s=120)
        -> list[Any]                               # each rank's JSON result, in rank order
    with EmulatedCluster(nodes=2, ranks_per_node=2, inter_node_mbit=200) as cluster:
        cluster.run(target, args, timeout_s=60)    # several runs on one cluster
        cluster.set_inter_node_mbit(50)            # reshape between runs (None: unshaped)
    emulated_cluster_spec(...)                     # the same cluster as the resource model sees it
    run_local(world_size, target, args=(), timeout_s=120)   # the same on this host's loopback, no root

``target`` is ``"package.module:function"`` or ``"/path/file.py:function"``; the function is
called in every rank as ``fn(info: RankInfo, *args)`` with the default gloo process group set up
and must return something JSON can encode. Failures raise :class:`RankFailure` naming the ranks;
the cluster is torn down on exit, on exceptions, Ctrl-C, SIGTERM and SIGHUP, and namespaces left
by crashed runs (``piperemu-<dead pid>-*``) are removed the next time a cluster is built.

This package imports no torch; only the rank processes (:mod:`piper_core.emulate.rank`) do.
"""

from piper_core.emulate.launch import LocalCluster, RankFailure, RankInfo, launch, run_emulated, run_local
from piper_core.emulate.netns import (
    NAME_PREFIX,
    NODE_IFNAME,
    SUBNET,
    EmulatedCluster,
    EmulationError,
    Node,
    cleanup_stale,
    emulation_available,
    list_namespaces,
    tbf_burst_bytes,
)
from piper_core.emulate.spec import emulated_cluster_spec

__all__ = [
    "NAME_PREFIX", "NODE_IFNAME", "SUBNET", "EmulatedCluster", "EmulationError", "LocalCluster", "Node",
    "RankFailure", "RankInfo", "cleanup_stale", "emulated_cluster_spec", "emulation_available", "launch",
    "list_namespaces", "run_emulated", "run_local", "tbf_burst_bytes",
]
