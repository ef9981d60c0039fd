"""The DeepSpeed adapter groups Piper's exchange by the cluster's NVLink domain (issue 16).

On GB200 NVL72 a node is a 4-GPU tray but NVLink spans 64 GPUs; the resource model prices the
hierarchical and deduplicated exchanges' first stage inside that domain, so the adapter's rank
topology must hold 64 ranks per domain, not 4 (``ClusterSpec.exchange_domain_ranks``).
"""

from __future__ import annotations

import pytest

from piper_core.errors import SpecError
from piper_core.presets import load_cluster

pytest.importorskip("deepspeed", reason="the DeepSpeed tier needs deepspeed installed")


def test_node_topology_follows_the_nvlink_domain():
    from piper_deepspeed.initialize import node_topology

    nvl72 = load_cluster("gb200-nvl72")
    topology = node_topology(nvl72, 128)
    assert [len(n) for n in topology.nodes] == [64, 64] and topology.nodes[1][0] == 64
    h100 = node_topology(load_cluster("dgx-h100"), 16)
    assert [len(n) for n in h100.nodes] == [8, 8]
    assert [len(n) for n in node_topology(nvl72, 32).nodes] == [32]  # a job smaller than the domain: one domain
    with pytest.raises(SpecError, match=r"world size=96: is not a whole number of gb200-nvl72 nvlink domains "
                                        r"\(64 GPUs each\)"):
        node_topology(nvl72, 96)
