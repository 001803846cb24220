"""The cost model's vocabulary: what a run asks for (`Settings`), one candidate's layout (`Shape`), one
collective a rank takes part in (`Collective`), and the byte and round counts they are costed with.

`estimate` and every family's ``cost.py`` share these; the reasoning is in docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.comm.recorder import wire_bytes
from shardwise.comm.traffic import allreduce_traffic
from shardwise.strategies.cost.memory import MIXED_ADAM, BytesPerParam, plain

PRECISIONS = ("32", "64", "bf16-mixed", "16-mixed")
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "sgd": 0, "momentum": 1}


def bytes_per_param(precision: str, optimizer: str) -> BytesPerParam:
    """ZeRO's per-parameter bytes: mixed precision keeps 16-bit parameters and gradients and an fp32
    master copy with the optimizer's fp32 slots (``K = 4 + 4 slots``, 12 for Adam, Rajbhandari et al.
    2020, section 3.1); fp32 and fp64 keep the optimizer's slots only (`memory.plain`)."""
    slots = OPTIMIZER_SLOTS[optimizer]
    if precision in ("bf16-mixed", "16-mixed"):
        return MIXED_ADAM if slots == 2 else BytesPerParam(params=2, grads=2, optimizer=4 + 4 * slots)
    return plain(8 if precision == "64" else 4, slots)


@dataclass(frozen=True)
class Settings:
    """What the run asks for besides the model and the cluster."""

    global_batch: int
    precision: str = "32"
    optimizer: str = "adam"
    accumulate: int = 1
    """Loader micro-batches each rank accumulates per step (activations are kept for one at a time)."""

    @property
    def per_param(self) -> BytesPerParam:
        return bytes_per_param(self.precision, self.optimizer)

    @property
    def act_bytes(self) -> int:
        return 2 if "mixed" in self.precision else 8 if self.precision == "64" else 4


@dataclass(frozen=True)
class Shape:
    """One candidate's cost-relevant layout (from its strategy's `plan` and options)."""

    family: str
    """The strategy's registered name (its family's ``cost.py`` costs it)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1
    dp_strategy: str = "ddp"
    sequence_parallel: bool = False
    replicate: int = 1
    shard: int = 1
    servers: int = 0
    mode: str = "sync"
    sync_every: int = 1
    algorithm: str = "native"
    codec: str | None = None
    units: int | None = None
    """The submodules the strategy's plan wraps or splits one by one, given a real module (FSDP's
    units, the root not counted; tensor parallelism's split linears); None when not known."""
    recompute_every: int = 0
    """Activation checkpointing (``activation_checkpointing='blocks:K'``): every this many blocks one is
    checkpointed whole; 0: none."""
    offload: bool = False
    """FSDP2's CPU offload (zero2, zero3, fsdp, hsdp ``offload=True``): parameters, gradients and optimizer
    state in host memory, each unit's parameters copied in for its gathers and its gradients copied out."""
    cp: int = 1
    """Context parallelism (``cp`` of ddp, the sharded strategies and tp): each sequence over this many ranks, which share
    their samples; ``dp`` counts them too (gradients are averaged, and state sharded, over ``dp x cp``)."""
    cp_style: str = "ring"
    """Context-parallel attention: ``ring`` or ``ulysses``."""
    ep: int = 1
    """Expert parallelism (``ep`` of ddp and the sharded strategies): each MoE layer's experts over groups of this many
    data-parallel ranks, tokens exchanged by all-to-all."""


@dataclass
class Collective:
    """One kind of collective a rank takes part in during a step."""

    op: str
    group: str
    size: int
    count: float
    """Times per step (fractions for every-H-steps rounds)."""
    payload_bytes: float
    sent_bytes: float
    """Bytes this rank sends per step for all ``count`` calls."""
    seconds: float
    exposed_s: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def codec_ratio(codec: str | None, hidden: int) -> float:
    """Wire bytes over the fp32 gradient bytes for a compression codec (`shardwise.comm.codecs`):
    16-bit casts 1/2, int8 1/4, sign 1/32, top-k / random-k values and int32 indices ``2 r``,
    PowerSGD of rank ``q`` about ``2 q / h`` on ``h x h`` matrices (Vogels et al. 2019, section 3)."""
    if not codec:
        return 1.0
    name, _, arg = codec.partition(":")
    if name in ("fp16", "bf16"):
        return 0.5
    if name == "int8":
        return 0.25
    if name == "sign":
        return 1 / 32
    if name in ("topk", "randomk"):
        return min(1.0, 2 * float(arg or 0.01))
    if name == "powersgd":
        return min(1.0, 2 * int(arg or 1) / max(1, hidden))
    return 1.0


def rounds(op: str, p: int) -> int:
    """Rounds of the bandwidth-optimal library schedule (ring; Thakur et al. 2005, section 4)."""
    if p <= 1:
        return 0
    return {"all_reduce": 2 * (p - 1), "all_gather": p - 1, "reduce_scatter": p - 1, "broadcast": p - 1, "send": 1}.get(op, 1)


def allreduce_sent(spec_bytes: float, p: int, algorithm: str) -> tuple[float, int]:
    """(bytes sent by the busiest rank, rounds) for one allreduce of ``spec_bytes`` over ``p``."""
    if p <= 1:
        return 0.0, 0
    if algorithm == "native":
        return float(wire_bytes("all_reduce", int(spec_bytes), p)[0]), rounds("all_reduce", p)
    # exact traffic of our algorithm, in 4-byte elements; the busiest rank (the tree root, the master)
    n = max(1, int(spec_bytes) // 4)
    ranks = range(p) if p <= 64 else (0, 1, p - 1)
    worst = max((allreduce_traffic(algorithm, n, 4, p, r) for r in ranks), key=lambda t: (t.sent, t.steps))
    return float(worst.sent), worst.steps
