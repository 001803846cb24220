"""What ps costs the planner, and the candidates it proposes (docs/planner.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardwise.strategies.cost.family import CALIBRATION_LAYERS, UNRELIABLE, Candidate, Point, Step, StrategyCost
from shardwise.strategies.cost.terms import Collective, Shape, codec_ratio

if TYPE_CHECKING:
    from shardwise.strategies.contract import Layout
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 50
MODES = ("sync", "async")


class ParameterServerCost(StrategyCost):
    """Each worker pushes its gradients and pulls the parameters; each of ``k`` servers holds ``1/k`` of the
    parameters and the optimizer state and sends ``W Psi / k`` parameters back to the ``W`` workers."""

    advised_for = (UNRELIABLE,)

    def model_state(self, s: Step, stage: int, shard: int) -> dict[str, float]:
        return {"params": s.per.params * s.psi, "grads": s.per.grads * s.psi, "optimizer": 0.0}

    def servers(self, s: Step) -> tuple[float, list[str]]:
        servers = s.shape.servers
        held = (s.per.params + s.per.optimizer) * s.psi / max(1, servers)
        return held, [f"each of {servers} server(s) holds {held / 1e9:.3g} GB (parameters and optimizer state)"]

    def collectives(self, s: Step) -> None:
        shape, dev = s.shape, s.cluster.device
        workers, k = shape.dp, max(1, shape.servers)
        link = dev.link("send", s.cluster.nodes > 1)
        params = s.per.params * s.psi
        worker_sent = s.grad_bytes * codec_ratio(shape.codec, s.spec.hidden) if shape.codec else s.grad_bytes
        server_sent = workers * params / k
        # the server's link carries every worker's push in and every pull out: the bottleneck
        seconds = link.time(2 * workers / k, max(worker_sent * workers / k, server_sent))
        if shape.mode != "sync":
            seconds = max(link.time(2, worker_sent + params), seconds - s.compute)  # async: workers do not wait for each other
        s.collectives.append(Collective("push_pull", "ps", workers + k, 1, params, max(worker_sent, server_sent), seconds, seconds))

    def framework_key(self, shape: Shape) -> str:
        return f"{shape.family}/{shape.mode}"

    def shape(self, options: Mapping[str, Any], layout: Layout, common: dict[str, Any]) -> Shape:
        return Shape(self.name, servers=int(options.get("servers", 1)), mode=options.get("mode", "sync"), **common)

    def calibration_points(self) -> dict[str, Point]:
        return {f"{self.name}/{mode}": (self.name, {"servers": 1, "mode": mode}, "layers", CALIBRATION_LAYERS) for mode in MODES}


COSTS: dict[str, StrategyCost] = {"ps": ParameterServerCost("ps")}


def candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """ps with 1 and 2 servers (fewer than the processes), synchronous and asynchronous."""
    return [Candidate("ps", {"servers": k, "mode": mode}) for k in (1, 2) if k < cluster.nproc for mode in MODES]
