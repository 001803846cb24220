"""What single and ddp cost the planner, and the candidates they propose (docs/planner.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardwise.comm.traffic import ALGORITHMS
from shardwise.strategies.cost.family import CALIBRATION_LAYERS, ONE_PROCESS, REFERENCE, REPLICATE, Candidate, Point, Step, StrategyCost
from shardwise.strategies.cost.terms import Shape

if TYPE_CHECKING:
    from shardwise.strategies.contract import Layout
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 10
CODECS = ("fp16", "bf16", "int8", "sign", "topk:0.01", "powersgd:4")
"""The compression codecs the planner proposes for ddp."""
CALIBRATION_CODECS = ("fp16", "bf16", "int8", "sign", "topk:0.01", "randomk:0.2", "powersgd:4")
"""Each codec is its own calibration point: their encode and decode costs differ by several times;
so is each of shardwise's allreduce algorithms (`ALGORITHMS`)."""


class SingleCost(StrategyCost):
    """One process: the reference layout the guide's figures read, and the recommendation where it is the fastest
    (`ONE_PROCESS`). Its step is the model's step timed with its own thread count; what a profile's framework cost
    adds is nothing (`timed_whole`): the timing is the Trainer's own one-process step (docs/planner.md, "One process or many")."""

    advised_for = (REFERENCE, ONE_PROCESS)
    world_size = 1
    timed_whole = True

    def calibration_points(self) -> dict[str, Point]:
        return {}  # its step is the timing itself (`timed_whole`)


class DDPCost(StrategyCost):
    """Replicas that allreduce their gradients (Li et al., VLDB 2020), with shardwise's own allreduce
    algorithms and compression codecs as variants."""

    advised_for = (REPLICATE,)

    def buffers(self, s: Step) -> float:
        return s.grad_bytes  # DDP's bucket copies of the gradients

    def collectives(self, s: Step) -> None:
        s.reduce_gradients(s.shape.algorithm)

    def framework_key(self, shape: Shape) -> str:
        """``ddp/codec/<name>`` for compressed gradients (each codec's encode and decode cost differ, from a
        cast to a top-k selection or a low-rank factorisation); ``ddp/algorithm/<name>`` for each of
        shardwise's own allreduce algorithms (their Python loops differ: ring and Rabenseifner step through
        chunks where a tree or recursive doubling sends whole buffers)."""
        if shape.codec:
            return f"{shape.family}/codec/{shape.codec.partition(':')[0]}"
        if shape.algorithm != "native":
            return f"{shape.family}/algorithm/{shape.algorithm}"
        return shape.family

    def framework_keys(self, shape: Shape) -> list[str]:
        """A codec's or an algorithm's own entry, then any codec's or algorithm's (what profiles measured
        before each had its own), then ddp's."""
        key = self.framework_key(shape)
        return [key] if key == shape.family else [key, key.rsplit("/", 1)[0], shape.family]

    def shape(self, options: Mapping[str, Any], layout: Layout, common: dict[str, Any]) -> Shape:
        common = {k: v for k, v in common.items() if k != "units"}
        return Shape(self.name, algorithm=options.get("allreduce", "native"), codec=options.get("compression"), **common)

    def calibration_points(self) -> dict[str, Point]:
        return {
            self.name: (self.name, {}, "layers", CALIBRATION_LAYERS),
            **{f"{self.name}/algorithm/{a}": (self.name, {"allreduce": a}, "layers", CALIBRATION_LAYERS) for a in ALGORITHMS if a != "native"},
            **{f"{self.name}/codec/{c.partition(':')[0]}": (self.name, {"compression": c}, "layers", CALIBRATION_LAYERS) for c in CALIBRATION_CODECS},
        }


COSTS: dict[str, StrategyCost] = {"single": SingleCost("single"), "ddp": DDPCost("ddp")}


def candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """single (on one device, whatever the cluster), then ddp with each allreduce algorithm and each codec."""
    out = [Candidate("single", world_size=1)]
    if cluster.nproc == 1:
        return out
    out += [Candidate("ddp", {"allreduce": alg}) for alg in (*ALGORITHMS, *(("hierarchical",) if cluster.nodes > 1 else ()))]
    out += [Candidate("ddp", {"compression": codec}) for codec in CODECS]
    return out
