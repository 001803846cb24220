"""What zero1, zero2, zero3, fsdp and hsdp cost the planner, and the candidates they propose (docs/planner.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardwise.strategies.cost.family import SHARD_ALL, SHARD_STATE, Candidate, Step, StrategyCost
from shardwise.strategies.cost.memory import BytesPerParam, plain
from shardwise.strategies.cost.terms import OPTIMIZER_SLOTS, Settings, Shape, rounds

if TYPE_CHECKING:
    from shardwise.strategies.contract import Layout
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 20


class Zero1Cost(StrategyCost):
    """ZeRO-1: DDP's allreduce, then each rank's updated shard of the parameters to the others."""

    stage = 1
    advised_for = (SHARD_STATE,)

    def buffers(self, s: Step) -> float:
        return s.grad_bytes  # DDP's bucket copies of the gradients

    def collectives(self, s: Step) -> None:
        s.reduce_gradients()
        dp, params = s.shape.dp, s.per.params * s.psi
        s.add("broadcast", "dp", dp, 1, params, (dp - 1) / dp * params, rounds("broadcast", dp), s.shape.tp * s.shape.pp)


class FSDPCost(StrategyCost):
    """FSDP2 (zero3, fsdp): all-gather in forward and again in backward, reduce-scatter of the gradients,
    two gathered units in flight; its own work interleaves with every unit's compute."""

    stage = 3
    offloads = True
    advised_for = (SHARD_ALL,)
    fit_against = "per_compute"
    unit = "unit"

    def buffers(self, s: Step) -> float:
        return 2 * s.per.params * s.spec.layer_params / s.shape.tp

    def collectives(self, s: Step) -> None:
        s.shard_gradients()

    def framework_units(self, shape: Shape, spec: ModelSpec) -> float:
        """FSDP's parameter groups: each gathers, frees and reduces on its own (the units its plan wraps, and the root)."""
        return float((spec.layers if shape.units is None else shape.units) + 1)


class Zero2Cost(FSDPCost):
    """zero2 on FSDP2: parameters kept gathered; reduce-scatter of the gradients, all-gather of the parameters once."""

    stage = 2
    advised_for = (SHARD_STATE,)

    def bytes_per_param(self, settings: Settings) -> BytesPerParam:
        if "mixed" in settings.precision:
            return settings.per_param
        # shardwise's zero2 (FSDP2, parameters kept gathered) steps a separate shard: a master copy (memory.py)
        return plain(8 if settings.precision == "64" else 4, OPTIMIZER_SLOTS[settings.optimizer], master_copy=True)

    def collectives(self, s: Step) -> None:
        dp, stride = s.shape.dp, s.shape.tp * s.shape.pp
        s.add_library("reduce_scatter", "dp", dp, 1, s.grad_bytes, stride, "backward")
        s.add_library("all_gather", "dp", dp, 1, s.per.params * s.psi, stride, "forward")


class HSDPCost(FSDPCost):
    """zero3 inside a shard group of ``s``, then an allreduce of each ``1/s`` gradient shard over the ``r`` replicas."""

    def sharding(self, shape: Shape) -> tuple[int, int]:
        return self.stage, shape.shard

    def collectives(self, s: Step) -> None:
        shard, r = s.shape.shard, s.shape.replicate
        s.add_library("all_gather", "shard", shard, 2, s.per.params * s.psi, 1, "forward")
        s.add_library("reduce_scatter", "shard", shard, 1, s.grad_bytes, 1, "backward")
        s.add_library("all_reduce", "replicate", r, 1, s.grad_bytes / shard, shard, "backward")

    def shape(self, options: Mapping[str, Any], layout: Layout, common: dict[str, Any]) -> Shape:
        r, s = (options.get("replicate"), options.get("shard"))
        if r is None:
            r = 2 if layout.data_parallel >= 4 and layout.data_parallel % 2 == 0 else 1
        s = s or layout.data_parallel // r
        return Shape(self.name, replicate=int(r), shard=int(s), **common)


COSTS: dict[str, StrategyCost] = {
    "zero1": Zero1Cost("zero1"),
    "zero2": Zero2Cost("zero2"),
    "zero3": FSDPCost("zero3"),
    "fsdp": FSDPCost("fsdp"),
    "hsdp": HSDPCost("hsdp"),
}


def candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """zero1, zero2, zero3, fsdp, and hsdp (a shard group per node across nodes)."""
    if cluster.nproc == 1:
        return []
    hsdp = {"replicate": cluster.nodes, "shard": cluster.per_node} if cluster.nodes > 1 else {}
    return [Candidate("zero1"), Candidate("zero2"), Candidate("zero3"), Candidate("fsdp"), Candidate("hsdp", hsdp)]
