"""What pipeline costs the planner, and the candidates it proposes (docs/planner.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardwise.strategies.cost.bubble import SCHEDULES, predicted_bubble
from shardwise.strategies.cost.family import CALIBRATION_MICROBATCHES, PIPELINE, SPLIT_LAYERS, Candidate, Point, Step, StrategyCost, divisors
from shardwise.strategies.cost.terms import Shape
from shardwise.strategies.tensor_parallel.cost import (
    COSTS as TENSOR_PARALLEL,
)
from shardwise.strategies.tensor_parallel.cost import (
    activation_allreduces,
    data_parallel_buffers,
    data_parallel_collectives,
    split_linears,
    tp_degrees,
)

if TYPE_CHECKING:
    from shardwise.strategies.contract import Layout
    from shardwise.strategies.cost.cluster import Cluster, Framework
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 40


def pipeline_microbatches(per_rank: int, pp: int) -> int:
    """The micro-batches a pipeline candidate uses: the largest divisor of the rank's samples up to
    ``4 pp`` (enough to keep the bubble ``(p-1)/(m+p-1)`` small, Narayanan et al. 2021, section 3.3)."""
    divs = [d for d in divisors(max(1, per_rank)) if d <= 4 * pp]
    return max(divs) if divs else 1


class PipelineCost(StrategyCost):
    """Stages over ``pp`` (each a tensor-parallel group over ``tp``), data parallelism over ``dp``; one send
    of a micro-batch's activations forward and one of its gradient backward per stage boundary."""

    advised_for = (SPLIT_LAYERS, PIPELINE)
    fit_against = "per_compute"
    unit = "microbatch"

    def microbatches(self, shape: Shape) -> int:
        return shape.microbatches

    def sharding(self, shape: Shape) -> tuple[int, int]:
        return (3 if shape.dp_strategy == "fsdp" else self.stage), shape.dp

    def in_flight(self, shape: Shape, m: int) -> tuple[float, float]:
        """The first stage's micro-batches in flight: ``m`` for GPipe, ``min(p, m)`` for 1F1B (Narayanan et al.
        2021, section 2.2.1), ``p (1 + (p-1)/(p v))`` layers' worth for interleaved 1F1B (Korthikanti et al.
        2023, section 4.2.3); outside the blocks GPipe's last stage keeps every micro-batch's, 1F1B frees each in turn."""
        pp = shape.pp
        in_flight: float
        if shape.schedule == "gpipe":
            in_flight = m
        elif shape.schedule == "interleaved":
            in_flight = pp * (1 + (pp - 1) / (pp * shape.virtual))
        else:
            in_flight = min(pp, m)
        return in_flight, m if shape.schedule == "gpipe" else 1

    def buffers(self, s: Step) -> float:
        send = 2 * s.micro * s.spec.seq * s.spec.hidden / s.shape.tp * s.spec.act_bytes
        return data_parallel_buffers(s) + send

    def bubble_fraction(self, shape: Shape, m: int) -> float:
        return predicted_bubble(shape.schedule, shape.pp, m, shape.virtual) if shape.pp > 1 else 0.0

    def collectives(self, s: Step) -> None:
        data_parallel_collectives(s)
        shape = s.shape
        if shape.tp > 1:
            activation_allreduces(s)
        if shape.pp > 1:
            act = s.micro * s.spec.seq * s.spec.hidden / shape.tp * s.spec.act_bytes
            sends = 2 * s.m * shape.virtual if shape.virtual > 1 else 2 * s.m  # forward activation and backward gradient per micro-batch
            s.add("send", "pp", shape.pp, sends, act, act, 1, shape.tp)

    def framework_key(self, shape: Shape) -> str:
        return f"{shape.family}/{shape.schedule}"

    def framework_units(self, shape: Shape, spec: ModelSpec) -> float:
        """Its micro-batches: a send, a receive and a schedule action each."""
        return float(shape.microbatches)

    def extra_overhead(self, s: Step, framework: Mapping[str, Framework]) -> float:
        """Each stage repeats tensor parallelism's per-linear work (its `framework_units`) per micro-batch."""
        (tp_key,) = TENSOR_PARALLEL
        if s.shape.tp <= 1 or tp_key not in framework:
            return 0.0
        return framework[tp_key].per_unit_s * split_linears(s.shape, s.spec) / s.shape.pp * s.m

    def shape(self, options: Mapping[str, Any], layout: Layout, common: dict[str, Any]) -> Shape:
        return Shape(
            self.name,
            schedule=options.get("schedule", "1f1b"),
            microbatches=int(options.get("microbatches") or 1),
            virtual=int(options.get("virtual_stages") or 1),
            dp_strategy=options.get("dp_strategy", "ddp"),
            **common,
        )

    def calibration_points(self) -> dict[str, Point]:
        points: dict[str, Point] = {}
        for schedule in SCHEDULES:
            options: dict[str, Any] = {"pp": 2, "schedule": schedule, **({"virtual_stages": 2} if schedule == "interleaved" else {})}
            points[f"{self.name}/{schedule}"] = (self.name, options, "microbatches", CALIBRATION_MICROBATCHES)
        return points


COSTS: dict[str, StrategyCost] = {"pipeline": PipelineCost("pipeline")}


def candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """pipeline at each ``pp`` (a divisor of the world size, up to the layers) with each tensor-parallel
    degree that fits, each schedule, `pipeline_microbatches` micro-batches (interleaved: 2 chunks a rank)."""
    n = cluster.nproc
    tps = tp_degrees(cluster)
    out = []
    for pp in [d for d in divisors(n) if 1 < d <= max(2, spec.layers)]:
        for tp in [1, *tps]:
            if pp * tp > n:
                continue
            dp = n // (pp * tp)
            m = pipeline_microbatches(max(1, global_batch // (dp * accumulate)), pp)
            for schedule in SCHEDULES:
                opts: dict[str, Any] = {"pp": pp, "tp": tp, "schedule": schedule, "microbatches": m}
                if schedule == "interleaved":
                    opts["virtual_stages"] = 2
                    if m % pp:  # torch's interleaved schedule needs micro-batches in multiples of pp
                        opts["microbatches"] = pp * max(1, m // pp)
                out.append(Candidate("pipeline", opts))
    return out
