"""What local-sgd and diloco cost the planner, and the candidates they propose (docs/planner.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardwise.strategies.cost.family import CALIBRATION_LAYERS, UNRELIABLE, Candidate, Point, Step, StrategyCost
from shardwise.strategies.cost.terms import Collective, Shape, allreduce_sent

if TYPE_CHECKING:
    from shardwise.strategies.contract import Layout
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 60
SYNC_EVERY = (8, 32)
"""The averaging periods ``H`` the planner tries."""


class LocalSGDCost(StrategyCost):
    """Replicas that train alone and average their parameters every ``H`` steps: one allreduce of the
    parameters, ``1/H`` a step; their own per-round work is spread over the ``H`` steps (`framework_period`)."""

    advised_for = (UNRELIABLE,)

    def collectives(self, s: Step) -> None:
        shape, dp = s.shape, s.shape.dp
        pbytes = 4 * s.spec.params
        sent, n = allreduce_sent(pbytes, dp, "native")
        link = s.cluster.device.link("all_reduce/native", s.cluster.spans_nodes(dp))
        seconds = link.time(n, sent) / shape.sync_every
        s.collectives.append(Collective("all_reduce", "dp", dp, 1 / shape.sync_every, pbytes, sent / shape.sync_every, seconds, seconds))

    def framework_period(self, shape: Shape) -> int:
        """``sync_every``: the averaging round's."""
        return shape.sync_every

    def shape(self, options: Mapping[str, Any], layout: Layout, common: dict[str, Any]) -> Shape:
        return Shape(self.name, sync_every=int(options.get("sync_every", 8)), **common)

    def calibration_points(self) -> dict[str, Point]:
        return {self.name: (self.name, {"sync_every": 8}, "layers", CALIBRATION_LAYERS)}


class DiLoCoCost(LocalSGDCost):
    """Local SGD with an outer optimizer: the outer anchor copy and outer momentum, fp32 (Douillard et al. 2023)."""

    def model_state(self, s: Step, stage: int, shard: int) -> dict[str, float]:
        state = super().model_state(s, stage, shard)
        state["optimizer"] += 8 * s.psi
        return state


COSTS: dict[str, StrategyCost] = {"local-sgd": LocalSGDCost("local-sgd"), "diloco": DiLoCoCost("diloco")}


def candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """local-sgd and diloco at each ``H`` of `SYNC_EVERY`."""
    if cluster.nproc == 1:
        return []
    return [Candidate(name, {"sync_every": h}) for h in SYNC_EVERY for name in COSTS]
