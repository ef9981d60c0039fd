"""The emulated cluster as the resource model sees it: a :class:`ClusterSpec` with two link levels.

Level 1 is the node's loopback (ranks of one node, unshaped); level 2 the tbf-shaped veth. The
model's bandwidths are per GPU (here: per rank) and per direction, and the ``ranks_per_node``
ranks of a node share its one shaped link, so level 2 gets ``rate x efficiency / ranks_per_node``.
``efficiency`` is the share of the tbf rate TCP payload achieves (measured 0.96 at 20 and
200 Mbit/s on the development machine: Ethernet/IP/TCP headers are ~3 % of a 1500-byte frame).
Latencies are per message, mostly gloo's software path: tbf adds no delay of its own.
"""

from __future__ import annotations

from piper_core.specs.cluster import AcceleratorSpec, ClusterSpec, LinkLevel

TCP_PAYLOAD_EFFICIENCY = 0.96


def emulated_cluster_spec(*, nodes: int, ranks_per_node: int, inter_node_mbit: float,
                          accelerator: AcceleratorSpec, intra_node_gb_per_s: float, intra_node_latency_us: float,
                          inter_node_latency_us: float,
                          efficiency: float = TCP_PAYLOAD_EFFICIENCY) -> ClusterSpec:
    """A ClusterSpec for ``nodes`` x ``ranks_per_node`` ranks with links shaped to ``inter_node_mbit``.

    ``intra_node_*`` and ``inter_node_latency_us`` are measured on the machine (gloo over the
    namespace's loopback / over the veth); ``accelerator`` supplies the copy bandwidth the
    hierarchical algorithm's regrouping costs.
    """
    inter_gb_per_s = inter_node_mbit * 1e6 / 8 * efficiency / ranks_per_node / 1e9
    return ClusterSpec(
        name=f"emulated-{nodes}x{ranks_per_node}-{inter_node_mbit:g}mbit",
        accelerator=accelerator,
        gpus_per_node=ranks_per_node,
        links=(
            LinkLevel(name="loopback", domain_gpus=ranks_per_node, bandwidth_gb_per_s=intra_node_gb_per_s,
                      latency_us=intra_node_latency_us),
            LinkLevel(name="tbf-veth", domain_gpus=None, bandwidth_gb_per_s=inter_gb_per_s,
                      latency_us=inter_node_latency_us),
        ),
    )
