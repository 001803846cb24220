"""Memory, traffic and step time of one candidate layout: pure arithmetic over a `ModelSpec` and a `Cluster`.

A candidate is a `Shape` (its strategy, mesh degrees ``dp x pp x tp`` and the options that change its
cost); `estimate` returns an `Estimate`: memory per rank by category, every collective one rank takes
part in during one step, and the step time split into compute, bubble, optimizer, exposed
communication and fixed overhead. What differs between strategies is asked of each family's
``cost.py`` (`shardwise.strategies.cost.family.StrategyCost`); the formulas, their sources and the
reasoning behind them are in docs/planner.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardwise.strategies.cost.cluster import Cluster
from shardwise.strategies.cost.families import cost_of, option_costs
from shardwise.strategies.cost.family import OptionCost, Step, StrategyCost
from shardwise.strategies.cost.model_spec import ModelSpec, StepFit
from shardwise.strategies.cost.terms import (
    OPTIMIZER_SLOTS,
    PRECISIONS,
    Collective,
    Settings,
    Shape,
    allreduce_sent,
    bytes_per_param,
    codec_ratio,
    rounds,
)

_rounds, _allreduce = rounds, allreduce_sent  # their names before the families' costs moved out


@dataclass
class Estimate:
    memory: dict[str, float]
    collectives: list[Collective]
    time: dict[str, float]
    fits: bool
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def comm_bytes_per_step(self) -> float:
        return sum(c.sent_bytes for c in self.collectives)


def local_compute(fit: StepFit, micro: float, passes: float, tp: int, pp: int) -> float:
    """Seconds of compute per rank per step from a step timed here: ``passes`` forward-backward
    passes of ``micro`` samples (micro-batches times accumulation), each costing the timed step's
    fixed part (per-operation overhead: every rank runs every operation of its layers) plus the
    per-sample part split ``tp`` ways, over ``pp`` stages (each holds ``1/pp`` of the layers)."""
    return passes * (fit.fixed_s + fit.per_sample_s * micro / tp) / pp


def framework_key(shape: Shape) -> str:
    """The profile's `Framework` entry for ``shape``: its strategy's name, with the variant that changes its
    per-step work (its family's `StrategyCost.framework_key`). `estimate` falls back along `framework_keys`."""
    return cost_of(shape.family).framework_key(shape)


def framework_keys(shape: Shape) -> list[str]:
    """The entries `estimate` tries, most specific first (`StrategyCost.framework_keys`)."""
    return cost_of(shape.family).framework_keys(shape)


def framework_units(shape: Shape, spec: ModelSpec) -> float:
    """What a strategy's per-step cost scales with (`StrategyCost.framework_units`: micro-batches, FSDP's
    groups, split linears, parameter tensors). The calibration fits against the same function
    (`shardwise.tools.advisor.calibrate_framework`), so both count alike."""
    return cost_of(shape.family).framework_units(shape, spec)


def framework_period(shape: Shape) -> int:
    """Steps between the rounds of a strategy's own work (`StrategyCost.framework_period`)."""
    return cost_of(shape.family).framework_period(shape)


def framework_scale(shape: Shape) -> float:
    """The share of a strategy's calibrated round cost each step carries: 1, or ``1 / sqrt(H)`` for a round
    every ``H`` steps (`framework_period`; why the square root: docs/planner.md, "A strategy's own work per step"). The calibration
    divides its measured extra by this (`shardwise.tools.advisor.calibrate_framework.measure_point`)."""
    return framework_period(shape) ** -0.5


@dataclass
class _Memory:
    """`estimate`'s memory figures, and what the time needs of them."""

    memory: dict[str, float]
    stage: int
    shard: int
    layers: float
    recomputed: float
    offloaded: bool
    notes: list[str]


def _memory(cost: StrategyCost, s: Step, options: Sequence[OptionCost] = ()) -> _Memory:
    """Bytes per rank by category (docs/planner.md, "Memory")."""
    spec, shape, micro, m = s.spec, s.shape, s.micro, s.m
    tp, pp = shape.tp, shape.pp
    stage, shard = cost.sharding(shape)
    state = cost.model_state(s, stage, shard)
    server_bytes, notes = cost.servers(s)
    layers = spec.layers / pp
    in_flight, other_in_flight = cost.in_flight(shape, m)
    other = spec.act_bytes_other_sample * micro * other_in_flight / (tp if spec.transformer else 1)
    full_layer = spec.layer_activation_bytes(micro, tp, shape.sequence_parallel)
    # activation checkpointing: a checkpointed block keeps its inputs, and in backward one block at a time
    # holds its recomputed activations again (for one micro-batch)
    recomputed = min(layers, math.ceil(layers / shape.recompute_every)) if shape.recompute_every else 0
    kept_layer = spec.kept_layer_bytes(micro, tp, shape.sequence_parallel)
    activations = (full_layer * (layers - recomputed) + kept_layer * recomputed) * in_flight + other + (full_layer if recomputed else 0.0)
    buffers = cost.buffers(s)
    if shape.codec and shape.codec not in ("fp16", "bf16"):
        buffers += s.grad_bytes  # error-feedback residual
    memory = {**{k: state[k] for k in ("params", "grads", "optimizer")}, "activations": activations, "buffers": buffers}
    for option in options:  # cp's logits kept whole, ep's experts (`OptionCost.memory`)
        option.memory(s, memory)
    memory["model_state"] = memory["params"] + memory["grads"] + memory["optimizer"]
    offloaded = shape.offload and cost.offloads
    if offloaded:  # the sharded state lives in host memory; the device holds the gathered units and activations
        memory["host"] = memory["model_state"]
        memory["params"] = memory["grads"] = memory["optimizer"] = memory["model_state"] = 0.0
        notes.append(f"CPU offload: {memory['host'] / 1e9:.3g} GB of model state per rank in host memory; the optimizer steps on the CPU")
    memory["total"] = max(memory["model_state"] + activations + buffers, server_bytes)
    if server_bytes:
        memory["server"] = server_bytes
    return _Memory(memory, stage, shard, layers, recomputed, bool(offloaded), notes)


def _compute(s: Step, mem: _Memory, samples: float) -> tuple[float, float, float]:
    """(compute, optimizer, recompute) seconds per rank per step (docs/planner.md, "Time")."""
    dev, spec, shape, per, psi, settings = s.cluster.device, s.spec, s.shape, s.per, s.psi, s.settings
    tp, pp, stage, shard = shape.tp, shape.pp, mem.stage, mem.shard
    timed = spec.fit_for(s.cluster.threads_per_process) if dev.local else None
    if timed is not None:
        # the model's whole step timed here (forward, backward, optimizer): per-operation overhead
        # stays whole on each rank, the per-sample part splits over tp and pp (see `local_compute`)
        compute = local_compute(timed, s.micro, settings.accumulate * s.m, tp, pp)
        optimizer = 0.0
    else:
        rate = dev.flops_for(settings.precision) * dev.efficiency
        compute = spec.flops_per_sample * samples / (tp * pp) / rate
        # the step reads and writes the stepped shard's parameters, gradients and optimizer state once
        stepped = per.optimizer * psi / (shard if stage >= 1 else 1) + (per.params + per.grads) * psi / (shard if stage >= 1 else 1)
        optimizer = 2 * stepped / dev.memory_bandwidth
    # recompute: one more forward (a third of forward and backward) of the checkpointed blocks
    recompute = compute / 3 * mem.recomputed / mem.layers if mem.recomputed else 0.0
    return compute + recompute, optimizer, recompute


def _overhead(cost: StrategyCost, s: Step, compute: float) -> tuple[float, float, float]:
    """(overhead, units, scale): the strategy's own calibrated work per step (its profile's `Framework`)."""
    dev, shape = s.cluster.device, s.shape
    units = cost.framework_units(shape, s.spec)
    scale = cost.framework_period(shape) ** -0.5
    if cost.timed_whole and dev.local and s.spec.step_fit is not None:
        return 0.0, units, scale  # the timed step is this strategy's whole step (`StrategyCost.timed_whole`)
    framework = next((dev.framework[k] for k in cost.framework_keys(shape) if k in dev.framework), None)
    overhead = framework.seconds(units, compute, s.psi) * scale if framework is not None else dev.step_overhead_s
    extra = cost.extra_overhead(s, dev.framework)
    if extra:
        overhead += extra
    return overhead, units, scale


def estimate(spec: ModelSpec, cluster: Cluster, settings: Settings, shape: Shape) -> Estimate:
    """Memory, collectives and time of ``shape`` for ``spec`` on ``cluster`` (see docs/planner.md)."""
    dev = cluster.device
    cost = cost_of(shape.family)
    options = [o for o in option_costs() if o.applies(shape)]
    spec = spec.with_act_bytes(settings.act_bytes)
    m = cost.microbatches(shape)
    samples = settings.global_batch / shape.dp  # per rank per step (with cp: a cp rank's tokens, as samples' worth)
    psi = spec.tp_rank_params(shape.tp) / shape.pp
    for option in options:
        psi = option.held_params(spec, shape, psi)
    s = Step(spec, cluster, settings, shape, cost.bytes_per_param(settings), psi, m, samples / m / settings.accumulate)
    mem = _memory(cost, s, options)
    compute, optimizer, recompute = _compute(s, mem, samples)
    bubble_frac = cost.bubble_fraction(shape, m)
    bubble = compute * bubble_frac / (1 - bubble_frac) if bubble_frac < 1 else 0.0

    s.compute = compute
    s.overlap_budget = {"backward": compute * 2 / 3 * dev.overlap, "forward": compute / 3 * dev.overlap}
    cost.collectives(s)
    for option in options:
        option.collectives(s)
    offload = 0.0
    if mem.offloaded:
        # each unit's parameter shard in for the forward's gather and the backward's, its gradient shard out,
        # on the critical path (FSDP2 copies before the gather); a CPU device's host is itself: nothing moves
        moved = (2 * s.per.params + s.per.grads) * s.psi / mem.shard
        offload = dev.host.time(2 * (spec.layers / shape.pp + 1), moved) if dev.host is not None else 0.0
    exposed = sum(c.exposed_s for c in s.collectives)
    total_comm = sum(c.seconds for c in s.collectives)
    overhead, units, scale = _overhead(cost, s, compute)
    step = compute + bubble + optimizer + exposed + overhead + offload
    threads = cluster.threads_per_process
    fit = spec.fit_for(threads) if dev.local else None
    if fit is not None and fit.threads != threads:
        mem.notes.append(f"the model's step was timed with {fit.threads} thread(s), not the {threads} each process runs: costed as timed")
    shared = cluster.shared(fit.threads if fit is not None else 1)
    if shared > 1:  # more runnable threads than cores: each process runs a core's share of the time
        compute, bubble, optimizer, exposed, overhead, total_comm, step, recompute, offload = (
            x * shared for x in (compute, bubble, optimizer, exposed, overhead, total_comm, step, recompute, offload)
        )
        n = cluster.per_node
        who = f"{n} process{'es' if n > 1 else ''}" + (f" of {threads} threads" if threads > 1 else "")
        other = f" and other work's {cluster.load:.2g} runnable threads (load)" if cluster.load else ""
        mem.notes.append(f"{who}{other} share {dev.cores} cores: every part of the step takes {shared:.3g} times as long")
    time = {
        "compute_s": compute,
        "bubble_s": bubble,
        "bubble_fraction": bubble_frac,
        "optimizer_s": optimizer,
        "comm_s": total_comm,
        "exposed_comm_s": exposed,
        "overhead_s": overhead,
        "overhead_units": units,
        "overhead_compute_s": compute,
        "overhead_params": s.psi,
        "overhead_scale": scale,
        "overhead_period": cost.framework_period(shape),
        "recompute_s": recompute,
        "offload_s": offload,
        "step_s": step,
        "threads": threads,
        "load": cluster.load,
        "shared": shared,
    }
    memory = mem.memory
    fits = memory["total"] <= dev.memory_bytes
    reason = "" if fits else f"needs {memory['total'] / 1e9:.3g} GB per rank; {dev.name} has {dev.memory_bytes / 1e9:.3g} GB"
    return Estimate(memory=memory, collectives=s.collectives, time=time, fits=fits, reason=reason, notes=mem.notes)


__all__ = [
    "OPTIMIZER_SLOTS",
    "PRECISIONS",
    "Collective",
    "Estimate",
    "Settings",
    "Shape",
    "bytes_per_param",
    "codec_ratio",
    "estimate",
    "framework_key",
    "framework_keys",
    "framework_period",
    "framework_scale",
    "framework_units",
    "local_compute",
]
