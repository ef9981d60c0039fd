"""One prediction for (model, cluster, plan): parameters, FLOPs and memory, as a frozen record
and as the JSON object ``piper predict --json`` prints (later issues add keys; none are removed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from piper_core.resource.flops import StepFlops, step_flops
from piper_core.resource.memory import GIB, StageMemory, stage_memory
from piper_core.resource.params import active_params, total_params
from piper_core.specs.cluster import ClusterSpec
from piper_core.specs.compat import check_plan
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from piper_core.specs.yamlio import to_dict
from piper_core.timing.step import StepTime, Throughput, step_time, throughput
from piper_core.timing.topology import expert_groups, level_shares, members_per_domain


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    model: ModelSpec
    cluster: ClusterSpec
    plan: ParallelPlan
    params_total: int
    params_active: int  # per token, the input embedding included
    params_active_without_input_embedding: int  # per token, without the input-embedding lookups
    flops: StepFlops
    stages: tuple[StageMemory, ...]
    time: StepTime
    rate: Throughput

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def capacity_bytes(self) -> int:
        return round(self.cluster.capacity_gib * GIB)

    @property
    def host_bytes_per_node(self) -> int:
        """Offloaded optimizer state on one node's host memory (the busiest stage's GPUs)."""
        return max(s.host for s in self.stages) * self.cluster.gpus_per_node

    @property
    def host_fits(self) -> bool:
        return self.host_bytes_per_node <= self.cluster.host_capacity_gib * GIB

    @property
    def feasible(self) -> bool:
        return self.peak_stage.total <= self.capacity_bytes and self.host_fits

    @property
    def headroom_bytes(self) -> int:
        """Capacity minus the peak stage (negative: short by that much)."""
        return self.capacity_bytes - self.peak_stage.total

    def expert_placement(self) -> dict[str, Any] | None:
        """Where the expert-parallel group lands on the cluster (None without expert parallelism):
        its size and stride in Megatron's rank order, each link level a rank's ep peers are reached
        over (and how many), and the domains of the fastest level the group spans."""
        if self.plan.ep == 1:
            return None
        group = expert_groups(self.plan)["ep"]
        domains = group.size // members_per_domain(group, self.cluster.fast_domain_gpus)  # as hierarchical_stages
        return {"ep": group.size, "stride": group.stride, "fast_domains": domains,
                "links": [{"link": s.link.name, "peers": s.peers, "bandwidth_gb_per_s": s.link.bandwidth_gb_per_s}
                          for s in level_shares(group, self.cluster)]}


def predict(model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan) -> Prediction:
    """Validate ``plan`` against ``model`` (SpecError on a broken rule) and evaluate it."""
    check_plan(model, plan)
    t = step_time(model, plan, cluster)
    return Prediction(model=model, cluster=cluster, plan=plan, params_total=total_params(model),
                      params_active=active_params(model),
                      params_active_without_input_embedding=active_params(model, input_embedding=False),
                      flops=step_flops(model, plan),
                      stages=stage_memory(model, plan, cluster), time=t, rate=throughput(model, plan, cluster, t))


def _gib(n: float) -> float:
    return round(n / GIB, 4)


def stage_json(s: StageMemory) -> dict[str, Any]:
    return {"stage": s.stage, "layers": s.layers,
            "params": {"dense": s.params.dense, "expert": s.params.expert, "total": s.params.total},
            "weights": _gib(s.weights), "gradients": _gib(s.gradients), "optimizer": _gib(s.optimizer),
            "activations": _gib(s.activations), "buffers": _gib(s.buffers), "overhead": _gib(s.overhead),
            "step_gradients": _gib(s.step_gradients), "workspace": _gib(s.workspace), "total": _gib(s.total),
            "host_optimizer": _gib(s.host)}


def to_json(p: Prediction) -> dict[str, Any]:
    """The ``--json`` object. Memory in GiB (2**30 bytes), FLOPs per step over all GPUs. A stage's
    ``total`` is its state, overhead and ``workspace`` (framework buffers kept through the step) plus
    the larger of activations + buffers and ``step_gradients``
    (:func:`piper_core.resource.memory.peak_bytes`); ``params.active`` counts the input embedding,
    ``params.active_without_input_embedding`` does not."""
    plan = to_dict(p.plan) | {"dp": p.plan.dp, "edp": p.plan.edp, "etp": p.plan.etp_size,
                              "num_microbatches": p.plan.num_microbatches}
    return {
        "model": p.model.name, "cluster": p.cluster.name, "gpus": p.plan.gpus, "plan": plan,
        "params": {"total": p.params_total, "active": p.params_active,
                   "active_without_input_embedding": p.params_active_without_input_embedding,
                   "per_gpu": [s.params.total for s in p.stages]},
        "flops_per_step": {"model": p.flops.model, "hardware": p.flops.hardware, "tokens": p.flops.tokens},
        "memory_gib": {"peak": _gib(p.peak_stage.total), "peak_stage": p.peak_stage.stage,
                       "capacity": _gib(p.capacity_bytes), "headroom": _gib(p.headroom_bytes),
                       "host_per_node": _gib(p.host_bytes_per_node),
                       "host_capacity_per_node": round(p.cluster.host_capacity_gib, 4),
                       "stages": [stage_json(s) for s in p.stages]},
        "feasible": p.feasible,
        "time_s": {"step": p.time.step, "breakdown": p.time.breakdown(),
                   "stages": [{"stage": s.stage, "compute": s.compute, "exposed_a2a": s.a2a, "other_comm": s.comm,
                               "p2p": s.p2p, "total": s.total} for s in p.time.stages],
                   "slowest_stage": p.time.slowest_stage, "a2a_one_way": p.time.a2a_one_way},
        "mfu": p.rate.mfu, "tflops_per_gpu": p.rate.tflops_per_gpu, "tokens_per_s": p.rate.tokens_per_s,
        "bottleneck": p.rate.bottleneck, "expert_placement": p.expert_placement(),
    }
