"""What tp costs the planner, and the candidates it proposes (docs/planner.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardwise.strategies.cost.family import CALIBRATION_LAYERS, SPLIT_LAYERS, Candidate, Point, Step, StrategyCost, divisors
from shardwise.strategies.cost.terms import Shape

if TYPE_CHECKING:
    from shardwise.strategies.contract import Layout
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 30


def tp_degrees(cluster: Cluster) -> list[int]:
    """The tensor-parallel degrees the planner tries: the world size's divisors within a node (2 at least)."""
    return [d for d in divisors(cluster.nproc) if 1 < d <= max(cluster.per_node, 2)]


def split_linears(shape: Shape, spec: ModelSpec) -> int:
    """The linears tensor parallelism splits: the plan's, or without a module 4 a transformer layer and 2 a layer otherwise."""
    return (4 if spec.transformer else 2) * spec.layers if shape.units is None else shape.units


def data_parallel_buffers(s: Step) -> float:
    """DDP's bucket copies of the gradients when a model-parallel layout replicates over ``dp`` with ddp."""
    return s.grad_bytes if s.shape.dp_strategy == "ddp" and s.shape.dp > 1 else 0.0


def data_parallel_collectives(s: Step) -> None:
    """The ``dp`` dimension of a model-parallel layout: FSDP's gathers and reduce-scatter, or DDP's allreduce."""
    if s.shape.dp_strategy == "fsdp":
        s.shard_gradients()
    else:
        s.reduce_gradients()


def activation_allreduces(s: Step) -> None:
    """Megatron-LM's two allreduces of the ``b s h`` activations per layer in forward and two in backward
    (Shoeybi et al. 2019, section 3); given the plan, one per split linear (a row-wise output in forward, a
    column-wise input's gradient in backward)."""
    spec, shape = s.spec, s.shape
    act = s.micro * spec.seq * spec.hidden * spec.act_bytes
    count = (4 * spec.layers if shape.units is None else shape.units) / shape.pp * s.m
    s.add_library("all_reduce", "tp", shape.tp, count, act, 1)


class TensorParallelCost(StrategyCost):
    """Tensor parallelism over ``tp``, data parallelism (ddp or fsdp) over ``dp``."""

    advised_for = (SPLIT_LAYERS,)
    fit_against = "per_compute"
    unit = "unit"

    def sharding(self, shape: Shape) -> tuple[int, int]:
        return (3 if shape.dp_strategy == "fsdp" else self.stage), shape.dp

    def buffers(self, s: Step) -> float:
        return data_parallel_buffers(s)

    def collectives(self, s: Step) -> None:
        data_parallel_collectives(s)
        if s.shape.tp > 1:
            activation_allreduces(s)

    def framework_units(self, shape: Shape, spec: ModelSpec) -> float:
        """The linears it splits: each a DTensor redistribution and, for row-wise ones, an allreduce."""
        return float(split_linears(shape, spec))

    def shape(self, options: Mapping[str, Any], layout: Layout, common: dict[str, Any]) -> Shape:
        return Shape(self.name, sequence_parallel=bool(options.get("sequence_parallel")), dp_strategy=options.get("dp_strategy", "ddp"), **common)

    def calibration_points(self) -> dict[str, Point]:
        return {self.name: (self.name, {"tp": 2}, "layers", CALIBRATION_LAYERS)}


COSTS: dict[str, StrategyCost] = {"tp": TensorParallelCost("tp")}


def candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """tp at each degree of `tp_degrees`."""
    return [Candidate("tp", {"tp": tp}) for tp in tp_degrees(cluster)]
