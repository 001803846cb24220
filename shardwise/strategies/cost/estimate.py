"""Memory, traffic and step time of one candidate layout: pure arithmetic over a `ModelSpec` and a `Cluster`.

A candidate is a `Shape`: the strategy family, its mesh degrees (``dp x pp x tp``) and the few
options that change its cost. `estimate` returns an `Estimate`: memory per rank by category,
every collective one rank takes part in during one step (bytes sent and seconds), and the step
time split into compute, bubble, optimizer, exposed communication and fixed overhead.

**Memory** (bytes per rank). Model state is `shardwise.strategies.cost.memory.model_state_bytes` (ZeRO,
Rajbhandari et al. 2020, figure 1) over the parameters this rank's model-parallel slice holds
(``Psi / (tp pp)``) with the ZeRO shard degree of the strategy (``dp`` for zero1-3, the shard
group for hsdp, 1 otherwise). Activations are `ModelSpec.layer_activation_bytes` (Korthikanti
et al. 2023, eq. 1, 2 and 4) times the layers this rank holds times the micro-batches in flight:
one for data parallelism, ``m`` for GPipe, ``min(p, m)`` for 1F1B on the first stage (Narayanan
et al. 2021, section 2.2.1) and ``p (1 + (p-1)/(p v))`` layers' worth for interleaved 1F1B
(Korthikanti et al. 2023, section 4.2.3). Buffers: DDP's gradient buckets (a copy of the
gradients: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
VLDB 2020, section 3.2.3), FSDP's two gathered units (current and prefetched), pipeline send and
receive buffers, error-feedback residuals of lossy codecs. With activation checkpointing
(``Shape.recompute_every``) a checkpointed block keeps its inputs only (`ModelSpec.kept_layer_bytes`),
and a backward holds one block's recomputed activations at a time on top (one micro-batch's); the
recompute costs one more forward of those blocks, a third of their forward and backward (Chen et al.
2016; Korthikanti et al. 2023, section 5). With CPU offload (``Shape.offload``, FSDP2's
``CPUOffloadPolicy``) the sharded model state is in host memory (``memory["host"]``) and each step
copies every unit's parameter shard in for the forward's and the backward's gathers and its gradient
shard out, over the profile's ``host`` link, on the critical path; the optimizer's step on the CPU is
not costed (noted).

**Traffic** (bytes sent by the busiest rank per step). Library collectives count the
bandwidth-optimal figures (`shardwise.comm.recorder.wire_bytes`: an allreduce of ``N`` bytes
over ``p`` ranks sends ``2(p-1)/p N``, an all-gather or reduce-scatter ``(p-1)/p N``); our own
algorithms count exactly `shardwise.comm.traffic.allreduce_traffic`. Per family:

- ddp: one allreduce of the gradients; zero1: the same plus each rank's updated shard to the
  others (``(p-1)/p`` of the parameters); zero2: reduce-scatter of the gradients and all-gather
  of the parameters; zero3/fsdp: all-gather in forward and again in backward, reduce-scatter of
  the gradients, ``3 (p-1)/p Psi`` in all (ZeRO paper, section 7.2.2: 1.5 times DDP's).
- hsdp: zero3 inside a shard group of ``s``, then an allreduce of each ``1/s`` gradient shard
  over the ``r`` replicas.
- tp: Megatron-LM's two allreduces of the ``b s h`` activations per layer in forward and two in
  backward (Shoeybi et al., "Megatron-LM", 2019, section 3 and figure 4; with sequence
  parallelism each becomes a reduce-scatter and an all-gather of the same total volume,
  Korthikanti et al. 2023, section 4.2.2), plus the dp allreduce of ``Psi / tp`` gradients.
- pipeline: one send of a micro-batch's ``b s h`` activations forward and one of its gradient
  backward per micro-batch per stage boundary (``v`` times with ``v`` chunks per rank).
- ps: each worker pushes its gradients and pulls the parameters; each of ``k`` servers sends
  ``W Psi / k`` parameters back to the ``W`` workers.
- local SGD and DiLoCo: one allreduce of the parameters every ``H`` steps, ``1/H`` per step; their
  own per-round work (the calibrated framework cost) is spread over the ``H`` steps as ``1 / sqrt(H)`` (`framework_scale`).

**Time** (Hockney 1994; Thakur et al. 2005): a collective of ``r`` rounds sending ``N`` bytes
from one rank takes ``r alpha + N beta`` on the link its group spans (the inter-node link as
soon as the group crosses nodes: the ring's slowest hop bounds it). Compute is FLOPs per rank
(``ModelSpec.flops_per_sample`` times the rank's samples, over ``tp pp``) at the device's
sustained FLOP/s; the pipeline bubble stretches it by ``1 / (1 - bubble)`` (`bubble.py`).
Gradient reductions of data parallelism overlap backward (two thirds of compute, Narayanan et
al. 2021, section 5.1) up to the profile's ``overlap`` share; tensor-parallel allreduces,
pipeline sends, parameter-server pushes and pulls and zero1's parameter broadcast are on the
critical path. The optimizer step reads and writes its state once (memory bandwidth bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shardwise.comm.recorder import wire_bytes
from shardwise.comm.traffic import allreduce_traffic
from shardwise.strategies.cost.bubble import predicted_bubble
from shardwise.strategies.cost.cluster import Cluster
from shardwise.strategies.cost.memory import MIXED_ADAM, STAGE_OF, BytesPerParam, model_state_bytes, plain
from shardwise.strategies.cost.model_spec import ModelSpec, StepFit

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
    """single, ddp, zero1, zero2, zero3, fsdp, hsdp, tp, pipeline, ps, local-sgd, diloco."""
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


FSDP_FAMILIES = ("zero2", "zero3", "fsdp", "hsdp")


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


def _rounds(op: str, p: int) -> int:
    """Rounds of the bandwidth-optimal library schedule (ring; Thakur et al. 2005, section 4)."""
    if p <= 1:
        return 0
    return {"all_reduce": 2 * (p - 1), "all_gather": p - 1, "reduce_scatter": p - 1, "broadcast": p - 1, "send": 1}.get(op, 1)


def _allreduce(spec_bytes: float, p: int, algorithm: str) -> tuple[float, int]:
    """(bytes sent by the busiest rank, rounds) for one allreduce of ``spec_bytes`` over ``p``."""
    if p <= 1:
        return 0.0, 0
    if algorithm == "native":
        return float(wire_bytes("all_reduce", int(spec_bytes), p)[0]), _rounds("all_reduce", p)
    # exact traffic of our algorithm, in 4-byte elements; the busiest rank (the tree root, the master)
    n = max(1, int(spec_bytes) // 4)
    ranks = range(p) if p <= 64 else (0, 1, p - 1)
    worst = max((allreduce_traffic(algorithm, n, 4, p, r) for r in ranks), key=lambda t: (t.sent, t.steps))
    return float(worst.sent), worst.steps


def local_compute(fit: StepFit, micro: float, passes: float, tp: int, pp: int) -> float:
    """Seconds of compute per rank per step from a step timed here: ``passes`` forward-backward
    passes of ``micro`` samples (micro-batches times accumulation), each costing the timed step's
    fixed part (per-operation overhead: every rank runs every operation of its layers) plus the
    per-sample part split ``tp`` ways, over ``pp`` stages (each holds ``1/pp`` of the layers)."""
    return passes * (fit.fixed_s + fit.per_sample_s * micro / tp) / pp


def framework_key(shape: Shape) -> str:
    """The profile's `Framework` entry for ``shape``: the family, with the variant that changes its per-step
    work (``pipeline/1f1b``, ``ps/async``, ``ddp/algorithm/<name>`` for each of shardwise's own allreduce
    algorithms: their Python loops differ, ring and Rabenseifner step through chunks where a tree or
    recursive doubling sends whole buffers; ``ddp/codec/<name>`` for compressed gradients: each codec's
    encode and decode cost differ, from a cast (fp16) to a top-k selection or a low-rank factorisation).
    `estimate` falls back along `framework_keys`."""
    if shape.family == "pipeline":
        return f"pipeline/{shape.schedule}"
    if shape.family == "ps":
        return f"ps/{shape.mode}"
    if shape.family == "ddp" and shape.codec:
        return f"ddp/codec/{shape.codec.partition(':')[0]}"
    if shape.family == "ddp" and shape.algorithm != "native":
        return f"ddp/algorithm/{shape.algorithm}"
    return shape.family


def framework_keys(shape: Shape) -> list[str]:
    """The entries `estimate` tries, most specific first: a codec's or an algorithm's own, then any
    codec's or algorithm's (``ddp/codec``, ``ddp/algorithm``: what profiles measured before each had its
    own), then the family's."""
    key = framework_key(shape)
    keys = [key]
    for shared in ("ddp/codec", "ddp/algorithm"):
        if key.startswith(shared + "/"):
            keys.append(shared)
    if key != shape.family:
        keys.append(shape.family)
    return keys


def framework_units(shape: Shape, spec: ModelSpec) -> float:
    """What a strategy's per-step cost scales with: its micro-batches for a pipeline (a send, a receive
    and a schedule action each); FSDP's parameter groups (each gathers, frees and reduces on its own:
    the units its plan wraps, and the root); the linears tensor parallelism splits (each a DTensor
    redistribution and, for row-wise ones, an allreduce; without a module, 4 a transformer layer and
    2 a layer otherwise); the model's parameter tensors otherwise (`ModelSpec.parameter_tensors`: DDP's
    gradient hooks, a codec's encode, ZeRO-1's and the parameter server's per-parameter work, each
    repeats per tensor: digits has 6 in 3 layers, charlm 69 in 4). The calibration fits against
    the same function (`shardwise.tools.advisor.calibrate_framework`), so both count alike."""
    if shape.family == "pipeline":
        return float(shape.microbatches)
    if shape.family in FSDP_FAMILIES:
        return float((spec.layers if shape.units is None else shape.units) + 1)
    if shape.family == "tp":
        return float((4 if spec.transformer else 2) * spec.layers if shape.units is None else shape.units)
    return float(spec.parameter_tensors())


def framework_period(shape: Shape) -> int:
    """Steps between the rounds of a strategy's own work: ``sync_every`` for local SGD and DiLoCo (their
    averaging round), 1 (every step) otherwise."""
    return shape.sync_every if shape.family in ("local-sgd", "diloco") else 1


def framework_scale(shape: Shape) -> float:
    """The share of a strategy's calibrated round cost each step carries: 1, or ``1 / sqrt(H)`` for a
    round every ``H`` steps (`framework_period`). Between rounds a replica trains alone, as ``single``
    does; the round's own cost here is mostly the wait for the slower replica, and that wait grows as
    the square root of the steps since the last round (each replica's time is a sum of ``H`` noisy
    steps: the expected larger of two such sums is ``sigma sqrt(H / pi)`` above their mean), so that
    spread over the ``H`` steps it falls as ``1 / sqrt(H)``. On digits (2 processes) the measured extra
    over the single step was 0.6 ms a step at H = 8, 0.3 at H = 32 and 0.07 at H = 1000 (``1 / H`` would
    give 0.15 and 0.005). The round's allreduce is costed apart (alpha-beta, ``1 / H`` a step). The
    calibration divides its measured extra by this (`shardwise.tools.advisor.calibrate_framework.measure_point`)."""
    return framework_period(shape) ** -0.5


def estimate(spec: ModelSpec, cluster: Cluster, settings: Settings, shape: Shape) -> Estimate:
    """Memory, collectives and time of ``shape`` for ``spec`` on ``cluster`` (see the module docstring)."""
    dev = cluster.device
    per = settings.per_param
    if shape.family == "zero2" and "mixed" not in settings.precision:
        # shardwise's zero2 (FSDP2, parameters kept gathered) steps a separate shard: a master copy (memory.py)
        per = plain(8 if settings.precision == "64" else 4, OPTIMIZER_SLOTS[settings.optimizer], master_copy=True)
    spec = spec.with_act_bytes(settings.act_bytes)
    tp, pp, dp = shape.tp, shape.pp, shape.dp
    fam = shape.family
    psi = spec.tp_rank_params(tp) / pp
    samples = settings.global_batch / dp  # per rank per step
    m = shape.microbatches if fam == "pipeline" else 1
    micro = samples / m / settings.accumulate

    # -- memory ---------------------------------------------------------------------------------
    stage = STAGE_OF.get(fam, 0)
    shard = shape.shard if fam == "hsdp" else dp
    if fam in ("tp", "pipeline") and shape.dp_strategy == "fsdp":
        stage, shard = 3, dp
    state = model_state_bytes(stage, psi, shard if stage else 1, per)
    notes: list[str] = []
    server_bytes = 0.0
    if fam == "ps":
        state = {"params": per.params * psi, "grads": per.grads * psi, "optimizer": 0.0}
        server_bytes = (per.params + per.optimizer) * psi / max(1, shape.servers)
        notes.append(f"each of {shape.servers} server(s) holds {server_bytes / 1e9:.3g} GB (parameters and optimizer state)")
    if fam == "diloco":
        state["optimizer"] += 8 * psi  # the outer anchor copy and outer momentum, fp32 (Douillard et al. 2023)
    layers = spec.layers / pp
    in_flight = 1.0
    if fam == "pipeline":
        if shape.schedule == "gpipe":
            in_flight = m
        elif shape.schedule == "interleaved":
            in_flight = pp * (1 + (pp - 1) / (pp * shape.virtual))
        else:
            in_flight = min(pp, m)
    # outside the blocks (the embeddings; the head and the loss, on a pipeline's last stage): GPipe's
    # last stage keeps every micro-batch's until the backward passes start, a 1F1B one frees each in turn
    other_in_flight = m if fam == "pipeline" and shape.schedule == "gpipe" else 1
    other = spec.act_bytes_other_sample * micro * other_in_flight / (tp if spec.transformer else 1)
    full_layer = spec.layer_activation_bytes(micro, tp, shape.sequence_parallel)
    # activation checkpointing: a checkpointed block keeps its inputs, and in backward one block at a time
    # holds its recomputed activations again (for one micro-batch)
    recomputed = min(layers, math.ceil(layers / shape.recompute_every)) if shape.recompute_every else 0
    kept_layer = spec.kept_layer_bytes(micro, tp, shape.sequence_parallel)
    activations = (full_layer * (layers - recomputed) + kept_layer * recomputed) * in_flight + other + (full_layer if recomputed else 0.0)
    grad_bytes = per.grads * psi
    buffers = 0.0
    if fam in ("ddp", "zero1") or (fam in ("tp", "pipeline") and shape.dp_strategy == "ddp" and dp > 1):
        buffers += grad_bytes  # DDP's bucket copies of the gradients
    if fam in ("zero2", "zero3", "fsdp", "hsdp"):
        buffers += 2 * per.params * spec.layer_params / tp
    if fam == "pipeline":
        buffers += 2 * micro * spec.seq * spec.hidden / tp * spec.act_bytes
    if shape.codec and shape.codec not in ("fp16", "bf16"):
        buffers += grad_bytes  # error-feedback residual
    memory = {**{k: state[k] for k in ("params", "grads", "optimizer")}, "activations": activations, "buffers": buffers}
    memory["model_state"] = memory["params"] + memory["grads"] + memory["optimizer"]
    offloaded = shape.offload and fam in FSDP_FAMILIES
    if offloaded:  # the sharded state lives in host memory; the device holds the gathered units and activations
        memory["host"] = memory["model_state"]
        memory["params"] = memory["grads"] = memory["optimizer"] = memory["model_state"] = 0.0
        notes.append(f"CPU offload: {memory['host'] / 1e9:.3g} GB of model state per rank in host memory; the optimizer steps on the CPU")
    memory["total"] = max(memory["model_state"] + activations + buffers, server_bytes)
    if server_bytes:
        memory["server"] = server_bytes

    # -- compute --------------------------------------------------------------------------------
    timed = spec.step_fit if dev.local else None
    if timed is not None:
        # the model's whole step timed here (forward, backward, optimizer): per-operation overhead
        # stays whole on each rank, the per-sample part splits over tp and pp (see `local_compute`)
        compute = local_compute(timed, micro, settings.accumulate * m, tp, pp)
        optimizer = 0.0
    else:
        rate = dev.flops_for(settings.precision) * dev.efficiency
        compute = spec.flops_per_sample * samples / (tp * pp) / rate
        # the step reads and writes the stepped shard's parameters, gradients and optimizer state once
        stepped = per.optimizer * psi / (shard if stage >= 1 else 1) + (per.params + per.grads) * psi / (shard if stage >= 1 else 1)
        optimizer = 2 * stepped / dev.memory_bandwidth
    # recompute: one more forward (a third of forward and backward) of the checkpointed blocks
    recompute = compute / 3 * recomputed / layers if recomputed else 0.0
    compute += recompute
    backward = compute * 2 / 3
    bubble_frac = predicted_bubble(shape.schedule, pp, m, shape.virtual) if fam == "pipeline" and pp > 1 else 0.0
    bubble = compute * bubble_frac / (1 - bubble_frac) if bubble_frac < 1 else 0.0

    # -- communication --------------------------------------------------------------------------
    colls: list[Collective] = []
    overlap_budget = {"backward": backward * dev.overlap, "forward": compute / 3 * dev.overlap}

    def add(op: str, group: str, size: int, count: float, payload: float, sent: float, rounds: float, stride: int, hide: str | None = None) -> None:
        if size <= 1 or count == 0:
            return
        link = dev.link(f"{op}/{shape.algorithm}" if op == "all_reduce" else op, cluster.spans_nodes(size, stride))
        seconds = link.time(rounds * count, sent * count)
        hidden = 0.0
        if hide:
            hidden = min(seconds, overlap_budget[hide])
            overlap_budget[hide] -= hidden
        colls.append(Collective(op, group, size, count, payload, sent * count, seconds, seconds - hidden))

    ratio = codec_ratio(shape.codec, spec.hidden)
    grad_wire = 4 * psi * ratio if shape.codec else grad_bytes
    dp_stride = tp * pp
    if fam in ("ddp", "zero1", "tp", "pipeline") and not (fam in ("tp", "pipeline") and shape.dp_strategy == "fsdp"):
        sent, rounds = _allreduce(grad_wire, dp, shape.algorithm if fam == "ddp" else "native")
        add("all_reduce", "dp", dp, 1, grad_wire, sent, rounds, dp_stride, "backward")
    if fam == "zero1":
        add("broadcast", "dp", dp, 1, per.params * psi, (dp - 1) / dp * per.params * psi, _rounds("broadcast", dp), dp_stride)

    def add_library(op: str, group: str, size: int, count: float, payload: float, stride: int, hide: str | None = None) -> None:
        """A library collective of ``payload`` bytes: its bandwidth-optimal bytes and ring rounds."""
        add(op, group, size, count, payload, wire_bytes(op, int(payload), size)[0], _rounds(op, size), stride, hide)

    if fam == "zero2":
        add_library("reduce_scatter", "dp", dp, 1, grad_bytes, dp_stride, "backward")
        add_library("all_gather", "dp", dp, 1, per.params * psi, dp_stride, "forward")
    if fam in ("zero3", "fsdp") or (fam in ("tp", "pipeline") and shape.dp_strategy == "fsdp"):
        add_library("all_gather", "dp", dp, 2, per.params * psi, dp_stride, "forward")
        add_library("reduce_scatter", "dp", dp, 1, grad_bytes, dp_stride, "backward")
    if fam == "hsdp":
        s, r = shape.shard, shape.replicate
        add_library("all_gather", "shard", s, 2, per.params * psi, 1, "forward")
        add_library("reduce_scatter", "shard", s, 1, grad_bytes, 1, "backward")
        add_library("all_reduce", "replicate", r, 1, grad_bytes / s, s, "backward")
    if tp > 1:
        act = micro * spec.seq * spec.hidden * spec.act_bytes
        # Shoeybi et al. 2019: 2 in forward, 2 in backward per transformer layer; given the plan, one per
        # split linear (a row-wise output in forward, a column-wise input's gradient in backward)
        count = (4 * spec.layers if shape.units is None else shape.units) / pp * m
        add_library("all_reduce", "tp", tp, count, act, 1)
    if fam == "pipeline" and pp > 1:
        act = micro * spec.seq * spec.hidden / tp * spec.act_bytes
        sends = 2 * m * shape.virtual if shape.virtual > 1 else 2 * m  # forward activation and backward gradient per micro-batch
        add("send", "pp", pp, sends, act, act, 1, tp)
    if fam == "ps":
        workers, k = dp, max(1, shape.servers)
        link = dev.link("send", cluster.nodes > 1)
        worker_sent = grad_bytes * ratio if shape.codec else grad_bytes
        server_sent = workers * per.params * psi / k
        # the server's link carries every worker's push in and every pull out: the bottleneck
        seconds = link.time(2 * workers / k, max(worker_sent * workers / k, server_sent))
        if shape.mode != "sync":
            seconds = max(link.time(2, worker_sent + per.params * psi), seconds - compute)  # async: workers do not wait for each other
        colls.append(Collective("push_pull", "ps", workers + k, 1, per.params * psi, max(worker_sent, server_sent), seconds, seconds))
    if fam in ("local-sgd", "diloco"):
        pbytes = 4 * spec.params
        sent, rounds = _allreduce(pbytes, dp, "native")
        link = dev.link("all_reduce/native", cluster.spans_nodes(dp))
        seconds = link.time(rounds, sent) / shape.sync_every
        colls.append(Collective("all_reduce", "dp", dp, 1 / shape.sync_every, pbytes, sent / shape.sync_every, seconds, seconds))

    offload = 0.0
    if offloaded:
        # each unit's parameter shard in for the forward's gather and the backward's, its gradient shard out,
        # on the critical path (FSDP2 copies before the gather); a CPU device's host is itself: nothing moves
        host = dev.host
        moved = (2 * per.params + per.grads) * psi / (shape.shard if fam == "hsdp" else dp)
        offload = host.time(2 * (spec.layers / pp + 1), moved) if host is not None else 0.0
    exposed = sum(c.exposed_s for c in colls)
    total_comm = sum(c.seconds for c in colls)
    framework = next((dev.framework[k] for k in framework_keys(shape) if k in dev.framework), None)
    units = framework_units(shape, spec)
    scale = framework_scale(shape)
    overhead = framework.seconds(units, compute, psi) * scale if framework is not None else dev.step_overhead_s
    if fam == "pipeline" and tp > 1 and "tp" in dev.framework:
        # each stage repeats tensor parallelism's per-linear work (`framework_units` of tp) per micro-batch
        linears = shape.units if shape.units is not None else (4 if spec.transformer else 2) * spec.layers
        overhead += dev.framework["tp"].per_unit_s * linears / pp * m
    step = compute + bubble + optimizer + exposed + overhead + offload
    shared = cluster.per_node / dev.cores if dev.cores and cluster.per_node > dev.cores else 1.0
    if shared > 1:  # more processes than cores: each runs a core's share of the time
        compute, bubble, optimizer, exposed, overhead, total_comm, step, recompute, offload = (
            x * shared for x in (compute, bubble, optimizer, exposed, overhead, total_comm, step, recompute, offload)
        )
        notes.append(f"{cluster.per_node} processes share {dev.cores} cores: every part of the step takes {shared:g} times as long")
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
        "overhead_params": psi,
        "overhead_scale": scale,
        "overhead_period": framework_period(shape),
        "recompute_s": recompute,
        "offload_s": offload,
        "step_s": step,
    }
    fits = memory["total"] <= dev.memory_bytes
    reason = "" if fits else f"needs {memory['total'] / 1e9:.3g} GB per rank; {dev.name} has {dev.memory_bytes / 1e9:.3g} GB"
    return Estimate(memory=memory, collectives=colls, time=time, fits=fits, reason=reason, notes=notes)
