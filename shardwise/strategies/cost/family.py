"""What a strategy family tells the planner about its cost: `StrategyCost`, one per registered name.

Each family folder's ``cost.py`` (``shardwise/strategies/<family>/cost.py``) holds ``COSTS`` (a
`StrategyCost` per strategy name it costs), ``candidates(...)`` (the `Candidate` s it proposes for a
model and a cluster) and ``PLAN_ORDER`` (where its candidates come in the planner's list);
`shardwise.strategies.cost.families` finds them through the strategy registry. Every hook of
`StrategyCost` has the default of a plain replica (one device's model state, no collective), so a
family overrides only what differs. `Step` is what the hooks read and write while `estimate` runs.
The formulas and their sources are in docs/planner.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardwise.comm.recorder import wire_bytes
from shardwise.strategies.cost.memory import BytesPerParam, model_state_bytes
from shardwise.strategies.cost.terms import Collective, Settings, Shape, allreduce_sent, codec_ratio, rounds

if TYPE_CHECKING:
    from shardwise.strategies.contract import Layout
    from shardwise.strategies.cost.cluster import Cluster, Framework
    from shardwise.strategies.cost.model_spec import ModelSpec

# The steps of the guide `shardwise.tools.advisor.recommend` follows (the keys of its ``rule``); a
# family names the steps under which its candidates are recommended (`StrategyCost.advised_for`).
REPLICATE = "ddp"
SHARD_STATE = "zero12"
SHARD_ALL = "zero3"
SPLIT_LAYERS = "tp"
PIPELINE = "pipeline"
UNRELIABLE = "unreliable"
REFERENCE = "reference"
"""Not a step: the one-device layout whose model state the guide's figures read."""
ONE_PROCESS = "one-process"
"""Before the guide: one process predicted faster than every multi-process candidate that fits (stay on one)."""

CALIBRATION_LAYERS = (1, 4, 8)
"""The calibration network's depths: 8, 20 and 36 parameter tensors (digits has 6, charlm 69)."""
CALIBRATION_MICROBATCHES = (2, 4, 8)
"""A pipeline's calibration points: its micro-batches."""

Point = tuple[str, dict[str, Any], str, tuple[int, ...]]
"""A calibration point: (strategy, options, what varies: "layers" or "microbatches", its values)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Candidate:
    """One strategy with options and an optional mesh request, before planning."""

    strategy: str
    options: Mapping[str, Any] = field(default_factory=dict)
    mesh: Mapping[str, int] = field(default_factory=dict)
    world_size: int | None = None
    """Planned at this world size instead of the cluster's (``single``: the one-device reference)."""
    activation_checkpointing: str = "off"
    """The Trainer's ``activation_checkpointing`` (`memory_savers` proposes ``blocks``)."""

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items() if v is not None)
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        extra = ";".join(x for x in (opts, mesh) if x)
        ac = f" +ac={self.activation_checkpointing}" if self.activation_checkpointing != "off" else ""
        on = f" on {self.world_size}" if self.world_size is not None and self.world_size > 1 else ""  # fewer processes than the cluster's
        return (f"{self.strategy}({extra})" if extra else self.strategy) + on + ac


@dataclass
class Step:
    """One candidate's step while `estimate` costs it: the figures every hook reads, and the collectives
    the family's `StrategyCost.collectives` adds (`add`, `add_library`)."""

    spec: ModelSpec
    cluster: Cluster
    settings: Settings
    shape: Shape
    per: BytesPerParam
    psi: float
    """Parameters this rank's model-parallel slice holds (``Psi / (tp pp)``)."""
    m: int
    """Micro-batches per step (a pipeline's; 1 otherwise)."""
    micro: float
    """Samples per micro-batch."""
    compute: float = 0.0
    overlap_budget: dict[str, float] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)

    @property
    def grad_bytes(self) -> float:
        return self.per.grads * self.psi

    @property
    def grad_wire(self) -> float:
        """Gradient bytes on the wire (a codec's share of their fp32 bytes)."""
        return 4 * self.psi * codec_ratio(self.shape.codec, self.spec.hidden) if self.shape.codec else self.grad_bytes

    def add(self, op: str, group: str, size: int, count: float, payload: float, sent: float, n_rounds: float, stride: int, hide: str | None = None) -> None:
        """A collective of ``count`` calls a step on the link its group spans, hidden behind ``hide``
        (``backward`` or ``forward``) up to what is left of the profile's overlap."""
        if size <= 1 or count == 0:
            return
        dev = self.cluster.device
        link = dev.link(f"{op}/{self.shape.algorithm}" if op == "all_reduce" else op, self.cluster.spans_nodes(size, stride))
        seconds = link.time(n_rounds * count, sent * count)
        hidden = 0.0
        if hide:
            hidden = min(seconds, self.overlap_budget[hide])
            self.overlap_budget[hide] -= hidden
        self.collectives.append(Collective(op, group, size, count, payload, sent * count, seconds, seconds - hidden))

    def add_library(self, op: str, group: str, size: int, count: float, payload: float, stride: int, hide: str | None = None) -> None:
        """A library collective of ``payload`` bytes: its bandwidth-optimal bytes and ring rounds."""
        self.add(op, group, size, count, payload, wire_bytes(op, int(payload), size)[0], rounds(op, size), stride, hide)

    def reduce_gradients(self, algorithm: str = "native") -> None:
        """Data parallelism's allreduce of the gradients over ``dp``, behind the backward. ``hierarchical``
        (`shardwise.comm.hierarchical`): a reduce inside each node, the leaders' allreduce across nodes, a
        broadcast back (binomial trees in the node: ``ceil(lg L)`` rounds of the whole vector each)."""
        shape = self.shape
        if algorithm == "hierarchical":
            local, w = min(self.cluster.per_node, shape.dp), self.grad_wire
            self.add("reduce", "node", local, 1, w, w, (local - 1).bit_length(), 1, "backward")
            sent, n = allreduce_sent(w, shape.dp // local, "native")
            self.add("all_reduce", "leaders", shape.dp // local, 1, w, sent, n, local, "backward")
            self.add("broadcast", "node", local, 1, w, w, (local - 1).bit_length(), 1, "backward")
            return
        sent, n = allreduce_sent(self.grad_wire, shape.dp, algorithm)
        self.add("all_reduce", "dp", shape.dp, 1, self.grad_wire, sent, n, shape.tp * shape.pp, "backward")

    def shard_gradients(self) -> None:
        """ZeRO-3's all-gathers of the parameters in forward and backward and reduce-scatter of the gradients over ``dp``."""
        dp, stride = self.shape.dp, self.shape.tp * self.shape.pp
        self.add_library("all_gather", "dp", dp, 2, self.per.params * self.psi, stride, "forward")
        self.add_library("reduce_scatter", "dp", dp, 1, self.grad_bytes, stride, "backward")


class StrategyCost:
    """The cost hooks of one strategy name; each default is a plain replica's (see the module docstring)."""

    stage = 0
    """The ZeRO stage it implements (`shardwise.strategies.cost.memory.model_state_bytes`)."""
    offloads = False
    """Whether it has an ``offload`` option (FSDP2's ``CPUOffloadPolicy``) the planner may propose."""
    advised_for: tuple[str, ...] = ()
    """The guide's steps (`REPLICATE` ... `UNRELIABLE`, `REFERENCE`) under which it is recommended."""
    fit_against = "per_param_s"
    """The calibration's third term: ``per_param_s`` (its own work goes over gradients and weights once a
    step) or ``per_compute`` (its own work runs beside the compute and grows with it)."""
    unit = "tensor"
    """What `framework_units` counts, as the calibration prints it."""
    world_size: int | None = None
    """The world size its candidates are planned at (None: the cluster's)."""
    timed_whole = False
    """Its step on a profile measured here is the model's timed step itself (the `Trainer`'s one-process step at the
    same thread count, `shardwise.tools.advisor.models.time_step`): nothing to add, nothing to calibrate."""

    def __init__(self, name: str) -> None:
        self.name = name

    def bytes_per_param(self, settings: Settings) -> BytesPerParam:
        """Model-state bytes per parameter before sharding."""
        return settings.per_param

    def microbatches(self, shape: Shape) -> int:
        """Micro-batches a step runs through the model (a pipeline's)."""
        return 1

    def sharding(self, shape: Shape) -> tuple[int, int]:
        """(ZeRO stage, shard degree) of the model state."""
        return self.stage, shape.dp

    def model_state(self, s: Step, stage: int, shard: int) -> dict[str, float]:
        """Bytes per rank of parameters, gradients and optimizer state."""
        return model_state_bytes(stage, s.psi, shard if stage else 1, s.per)

    def servers(self, s: Step) -> tuple[float, list[str]]:
        """Bytes each server process holds (0: none), and what to note about them."""
        return 0.0, []

    def in_flight(self, shape: Shape, m: int) -> tuple[float, float]:
        """Micro-batches whose activations are held at once: the blocks', and those outside the blocks."""
        return 1.0, 1

    def buffers(self, s: Step) -> float:
        """Bytes of communication buffers (bucket copies, gathered units, send buffers)."""
        return 0.0

    def bubble_fraction(self, shape: Shape, m: int) -> float:
        """The share of the step the pipeline bubble idles."""
        return 0.0

    def collectives(self, s: Step) -> None:
        """Add the step's collectives to ``s`` (`Step.add`, `Step.add_library`)."""
        return None

    def framework_key(self, shape: Shape) -> str:
        """The profile's `Framework` entry for ``shape``: the name, with the variant that changes its per-step work."""
        return shape.family

    def framework_keys(self, shape: Shape) -> list[str]:
        """The entries `estimate` tries, most specific first, then the name's own."""
        key = self.framework_key(shape)
        return [key] if key == shape.family else [key, shape.family]

    def framework_units(self, shape: Shape, spec: ModelSpec) -> float:
        """What its per-step cost scales with: the model's parameter tensors (hooks, encodes, per-parameter work)."""
        return float(spec.parameter_tensors())

    def framework_period(self, shape: Shape) -> int:
        """Steps between the rounds of its own work (1: every step)."""
        return 1

    def extra_overhead(self, s: Step, framework: Mapping[str, Framework]) -> float:
        """Per-step work beyond its own `Framework` entry (a pipeline's tensor-parallel stages)."""
        return 0.0

    def shape(self, options: Mapping[str, Any], layout: Layout, common: dict[str, Any]) -> Shape:
        """The cost-model view of a planned candidate: ``common`` (degrees, recompute, offload, units) and its options that cost."""
        return Shape(self.name, **common)

    def calibration_points(self) -> dict[str, Point]:
        """The profile keys `shardwise.tools.advisor.calibrate_framework` measures for it, and how."""
        return {self.name: (self.name, {}, "layers", CALIBRATION_LAYERS)}


class OptionCost:
    """An option several strategies share that changes their cost (context parallelism's ``cp``, expert parallelism's
    ``ep``): a family's ``cost.py`` lists its own in ``OPTIONS``; `estimate` asks each that `applies` to a candidate,
    after the strategy's own hooks (docs/planner.md, "Context and expert parallelism")."""

    def applies(self, shape: Shape) -> bool:
        """Whether ``shape`` uses the option."""
        return False

    def held_params(self, spec: ModelSpec, shape: Shape, psi: float) -> float:
        """Of the ``psi`` parameters a rank's model-parallel slice holds, those the strategy's own hooks see (shard,
        reduce): all of them, or those the option does not place itself (ep's experts)."""
        return psi

    def memory(self, s: Step, memory: dict[str, float]) -> None:
        """Change ``memory``'s ``params``, ``grads``, ``optimizer``, ``activations`` or ``buffers`` (bytes per rank)."""
        return None

    def collectives(self, s: Step) -> None:
        """Add the option's own collectives to ``s``."""
        return None
