"""Blackwell presets and an NVLink domain that spans nodes (issue 16: DGX B200, GB200 NVL72).

GB200 NVL72 joins 18 trays of 4 GPUs in one NVLink domain; Piper describes it as nodes of 4 GPUs
whose fastest link level spans 64 of them (a 16-tray segment, as large jobs are placed). What the
domain changes is where expert parallelism can live: these tests hold that the model, the search and
the runtime's exchange domains all see the domain, not the tray.
"""

from __future__ import annotations

import dataclasses

import pytest

from piper_core.errors import SpecError
from piper_core.presets import load_cluster, load_model
from piper_core.resource.predict import predict, to_json
from piper_core.scheduler.search import search
from piper_core.scheduler.space import tp_limit
from piper_core.specs.cluster import ClusterSpec, LinkLevel
from piper_core.timing.topology import Group, level_shares

NVL72 = load_cluster("gb200-nvl72")
B200 = load_cluster("dgx-b200")


def _tray_only(cluster: ClusterSpec) -> ClusterSpec:
    """The same cluster with NVLink ending at the tray (GB200 NVL4-like): the counterfactual."""
    nvlink = dataclasses.replace(cluster.links[0], domain_gpus=cluster.gpus_per_node)
    return dataclasses.replace(cluster, name=f"{cluster.name}-tray", links=(nvlink, *cluster.links[1:]))


def test_the_presets_load_with_their_shapes():
    assert (NVL72.gpus_per_node, NVL72.fast_domain_gpus, NVL72.links[-1].domain_gpus) == (4, 64, None)
    assert (B200.gpus_per_node, B200.fast_domain_gpus) == (8, 8)
    assert NVL72.accelerator.peak_tflops_bf16 == 2500.0 and B200.accelerator.peak_tflops_bf16 == 2250.0
    assert NVL72.links[0].bandwidth_gb_per_s == B200.links[0].bandwidth_gb_per_s == 740.0


def test_a_fast_domain_must_hold_whole_nodes():
    def cluster(domain: int) -> ClusterSpec:
        return dataclasses.replace(NVL72, links=(dataclasses.replace(NVL72.links[0], domain_gpus=domain), NVL72.links[1]))

    assert cluster(8).fast_domain_gpus == 8 and cluster(72).fast_domain_gpus == 72
    for bad in (2, 6, 70):
        with pytest.raises(SpecError, match=r"links\[nvlink\]\.domain_gpus.*must span whole nodes.*multiple of it"):
            cluster(bad)
    one_level = dataclasses.replace(NVL72, links=(LinkLevel(name="all", domain_gpus=None, bandwidth_gb_per_s=1.0,
                                                            latency_us=1.0),))
    assert one_level.fast_domain_gpus is None and one_level.exchange_domain_ranks(4) == 4


def test_expert_parallel_peers_sit_behind_nvlink_across_trays():
    ep64 = Group(name="ep", size=64, stride=1)
    assert [(s.link.name, s.peers) for s in level_shares(ep64, NVL72)] == [("nvlink", 63)]
    assert [(s.link.name, s.peers) for s in level_shares(ep64, B200)] == [("nvlink", 7), ("infiniband", 56)]
    assert [(s.link.name, s.peers) for s in level_shares(ep64, _tray_only(NVL72))] == [("nvlink", 3), ("infiniband", 60)]


def test_the_exchange_domains_are_the_nvlink_domain_not_the_tray():
    """Piper's hierarchical and deduplicated exchanges group ranks as the model prices them: by the
    NVLink domain where it spans trays, whatever the launcher's ranks per node; by node elsewhere."""
    assert NVL72.exchange_domain_ranks(4) == 64 and NVL72.exchange_domain_ranks() == 64
    assert B200.exchange_domain_ranks(8) == 8 and B200.exchange_domain_ranks() == 8
    assert _tray_only(NVL72).exchange_domain_ranks(4) == 4


def test_tp_is_searched_up_to_8_across_trays():
    assert tp_limit(NVL72) == 8 and tp_limit(B200) == 8 and tp_limit(_tray_only(NVL72)) == 4
    assert tp_limit(load_cluster("cpu-local")) == load_cluster("cpu-local").gpus_per_node


@pytest.mark.parametrize("name, gbs", [("deepseek-v3", 8192), ("switch-1t", 2048)])
def test_the_search_puts_expert_parallelism_in_the_domain_and_the_exchange_shrinks(name, gbs):
    """On 1024 GPUs of GB200 NVL72 the pick's expert side fills an NVLink domain (ep peers behind
    NVLink times their stride -- etp, which Megatron lays out fastest -- is the domain, or the whole
    group where it is smaller), and its exposed all-to-all is shorter than the best plan's on the same
    cluster with NVLink ending at the tray (switch-1t: ep 64 x etp 4, 15 ep peers over NVLink;
    deepseek-v3: ep 128, 63)."""
    model = load_model(name)
    picks = {}
    for cluster in (NVL72, _tray_only(NVL72)):
        best = search(model, cluster, 1024, gbs).best(1)[0].plan
        picks[cluster.name] = predict(model, cluster, best)
    nvl, tray = picks[NVL72.name], picks[f"{NVL72.name}-tray"]
    place = nvl.expert_placement()
    assert place is not None and place["links"][0]["link"] == "nvlink"
    assert (place["links"][0]["peers"] + 1) * place["stride"] == min(place["ep"] * place["stride"], 64)
    assert nvl.time.exposed_a2a < tray.time.exposed_a2a and nvl.time.step < tray.time.step
    assert to_json(nvl)["expert_placement"] == place


def test_predict_reports_where_the_experts_are():
    from piper_core.cli.predict import render
    from piper_core.cli.parse import parse_parallel

    plan = parse_parallel("tp=1,pp=1,cp=2,ep=128,mbs=1,gbs=8192,dist_opt=1,a2a=dedup,epov=1", 1024)
    text = render(predict(load_model("deepseek-v3"), NVL72, plan))
    assert "expert parallelism: ep=128 (ranks 1 apart), across 2 nvlink domains of 64 GPUs; peers per rank: " \
           "63 over nvlink (740 GB/s), 64 over infiniband (47 GB/s)" in text
    dense = predict(load_model("deepseek-v3"), NVL72, parse_parallel("tp=8,sp=1,pp=16,last_stage_layers=1,ep=1,mbs=1,gbs=8192", 1024))
    assert dense.expert_placement() is None and "expert parallelism:" not in render(dense)
