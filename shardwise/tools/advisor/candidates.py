"""Every candidate layout for a world size, each planned by its own strategy and costed.

`enumerate_candidates` lists the strategies with the options that change their cost (each
allreduce algorithm and codec for ddp, each pipeline schedule, the mesh shapes ``dp x tp``,
``dp x pp``, ``pp x tp`` and 3D, parameter servers sync and async with ``k`` servers, local SGD
and DiLoCo with ``H``). `evaluate` calls each strategy's own ``plan`` (the contract in
`shardwise.strategies.contract`): its `Layout` gives the degrees the cost model uses and its
`ConfigError` is the candidate's reason for ``fits: false``, so the planner and the launcher
never disagree. The cost is `shardwise.strategies.cost.estimate.estimate`. A candidate its strategy accepts but
that does not fit in memory is tried again with activation checkpointing and, for the FSDP family,
CPU offload (`memory_savers`); the variants that fit join the records, so ``shardwise plan``
proposes them only where a plain layout does not fit, with what they cost in step time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from shardwise.comm.traffic import ALGORITHMS
from shardwise.errors import ConfigError
from shardwise.strategies import Batch, Layout, get_strategy
from shardwise.strategies.cost.cluster import Cluster
from shardwise.strategies.cost.estimate import Settings, Shape, estimate
from shardwise.strategies.cost.model_spec import ModelSpec

CODECS = ("fp16", "bf16", "int8", "sign", "topk:0.01", "powersgd:4")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
SYNC_EVERY = (8, 32)


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
        return (f"{self.strategy}({extra})" if extra else self.strategy) + ac


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_microbatches(per_rank: int, pp: int) -> int:
    """The micro-batches a pipeline candidate uses: the largest divisor of the rank's samples up to
    ``4 pp`` (enough to keep the bubble ``(p-1)/(m+p-1)`` small, Narayanan et al. 2021, section 3.3)."""
    divs = [d for d in _divisors(max(1, per_rank)) if d <= 4 * pp]
    return max(divs) if divs else 1


def enumerate_candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """The candidates for ``cluster.nproc`` processes (see the module docstring)."""
    n, per_node = cluster.nproc, cluster.per_node
    out = [Candidate("single", world_size=1)]
    if n == 1:
        return out
    for alg in ALGORITHMS:
        out.append(Candidate("ddp", {"allreduce": alg}))
    for codec in CODECS:
        out.append(Candidate("ddp", {"compression": codec}))
    out += [Candidate("zero1"), Candidate("zero2"), Candidate("zero3"), Candidate("fsdp")]
    hsdp = {"replicate": cluster.nodes, "shard": per_node} if cluster.nodes > 1 else {}
    out.append(Candidate("hsdp", hsdp))
    tps = [d for d in _divisors(n) if 1 < d <= max(per_node, 2)]
    pps = [d for d in _divisors(n) if 1 < d <= max(2, spec.layers)]
    for tp in tps:
        out.append(Candidate("tp", {"tp": tp}))
    for pp in pps:
        for tp in [1, *tps]:
            if pp * tp > n:
                continue
            dp = n // (pp * tp)
            per_rank = max(1, global_batch // (dp * accumulate))
            m = pipeline_microbatches(per_rank, pp)
            for schedule in SCHEDULES:
                opts: dict[str, Any] = {"pp": pp, "tp": tp, "schedule": schedule, "microbatches": m}
                if schedule == "interleaved":
                    opts["virtual_stages"] = 2
                    if m % pp:  # torch's interleaved schedule needs micro-batches in multiples of pp
                        opts["microbatches"] = pp * max(1, m // pp)
                out.append(Candidate("pipeline", opts))
    for k in (1, 2):
        if k < n:
            for mode in ("sync", "async"):
                out.append(Candidate("ps", {"servers": k, "mode": mode}))
    for h in SYNC_EVERY:
        out.append(Candidate("local-sgd", {"sync_every": h}))
        out.append(Candidate("diloco", {"sync_every": h}))
    return out


def shape_of(candidate: Candidate, layout: Layout) -> Shape:
    """The cost-model view of a planned candidate: the layout's degrees and the options that cost."""
    o = dict(candidate.options)
    d = layout.degrees
    fam = candidate.strategy
    common: dict[str, Any] = {"dp": layout.data_parallel, "tp": int(d.get("tp", 1)), "pp": int(d.get("pp", 1))}
    mode, _, every = candidate.activation_checkpointing.partition(":")
    common["recompute_every"] = int(every or 1) if mode == "blocks" else 0
    common["offload"] = bool(o.get("offload"))
    if fam == "ddp":
        return Shape("ddp", algorithm=o.get("allreduce", "native"), codec=o.get("compression"), **common)
    if layout.units is not None:
        common["units"] = len(layout.units)  # what the plan wraps (FSDP) or splits (tp) one by one
    if fam == "hsdp":
        r, s = (o.get("replicate"), o.get("shard"))
        if r is None:
            r = 2 if layout.data_parallel >= 4 and layout.data_parallel % 2 == 0 else 1
        s = s or layout.data_parallel // r
        return Shape("hsdp", replicate=int(r), shard=int(s), **common)
    if fam == "pipeline":
        return Shape(
            "pipeline",
            schedule=o.get("schedule", "1f1b"),
            microbatches=int(o.get("microbatches") or 1),
            virtual=int(o.get("virtual_stages") or 1),
            dp_strategy=o.get("dp_strategy", "ddp"),
            **common,
        )
    if fam == "tp":
        return Shape("tp", sequence_parallel=bool(o.get("sequence_parallel")), dp_strategy=o.get("dp_strategy", "ddp"), **common)
    if fam == "ps":
        return Shape("ps", servers=int(o.get("servers", 1)), mode=o.get("mode", "sync"), **common)
    if fam in ("local-sgd", "diloco"):
        return Shape(fam, sync_every=int(o.get("sync_every", 8)), **common)
    return Shape(fam, **common)


def _intended_layout(candidate: Candidate, world: int) -> Layout:
    """The layout a refused candidate asked for, so its cost can still be shown next to the refusal."""
    o = candidate.options
    tp = int(o.get("tp") or 1)
    pp = int(o.get("pp") or 1)
    servers = int(o.get("servers") or 0)
    trainers = world - servers
    dp = max(1, trainers // (tp * pp))
    return Layout(candidate.strategy, world, {"dp": dp, "pp": pp, "tp": tp}, trainers, dp)


def evaluate(candidate: Candidate, spec: ModelSpec, cluster: Cluster, settings: Settings, module: nn.Module | None = None) -> dict[str, Any]:
    """Plan ``candidate`` with its strategy's own ``plan`` and cost it: one JSON-ready record."""
    world = candidate.world_size or cluster.nproc
    refusal = ""
    try:
        strategy = get_strategy(candidate.strategy, **dict(candidate.options))
        layout = strategy.plan(world, model=module, batch=Batch(settings.global_batch, settings.accumulate), mesh=dict(candidate.mesh) or None)
    except ConfigError as exc:
        refusal = str(exc)
        layout = _intended_layout(candidate, world)
    run_cluster = cluster if world == cluster.nproc else Cluster(cluster.device, world, 1)
    shape = shape_of(candidate, layout)
    est = estimate(spec, run_cluster, settings, shape)
    fits = est.fits and not refusal
    return {
        "strategy": candidate.strategy,
        "label": candidate.label,
        "options": dict(candidate.options),
        "activation_checkpointing": candidate.activation_checkpointing,
        "world_size": world,
        "mesh": {k: int(v) for k, v in layout.degrees.items()},
        "data_parallel": layout.data_parallel,
        "servers": len(layout.servers) if not refusal else int(candidate.options.get("servers", 0) or 0),
        "fits": fits,
        "reason": refusal or est.reason,
        "refused_by_plan": bool(refusal),
        "memory_per_rank_bytes": est.memory["total"],
        "memory_breakdown": est.memory,
        "comm_bytes_per_step": est.comm_bytes_per_step,
        "comm_breakdown": [c.to_json() for c in est.collectives],
        "step_time_s": est.time["step_s"],
        "time_breakdown": est.time,
        "notes": est.notes,
    }


def plan_all(spec: ModelSpec, cluster: Cluster, settings: Settings, module: nn.Module | None = None) -> list[dict[str, Any]]:
    """Every candidate's record, in enumeration order, then `memory_savers`' variants of those that do not fit."""
    candidates = enumerate_candidates(cluster, spec, settings.global_batch, settings.accumulate)
    records = [evaluate(c, spec, cluster, settings, module) for c in candidates]
    return records + memory_savers(candidates, records, spec, cluster, settings, module)


OFFLOADS = ("zero2", "zero3", "fsdp", "hsdp")
"""The strategies with an ``offload`` option (FSDP2's ``CPUOffloadPolicy``)."""


def memory_savers(
    candidates: Sequence[Candidate], records: Sequence[dict[str, Any]], spec: ModelSpec, cluster: Cluster, settings: Settings, module: nn.Module | None
) -> list[dict[str, Any]]:
    """For each candidate that its strategy accepts but that does not fit in memory: the same layout with
    activation checkpointing (``blocks``: activations down to each block's inputs, for one more forward of
    the blocks a step), with CPU offload (zero2/zero3/fsdp/hsdp on a device with a host link: model state in
    host memory, for its copies over that link), or with both, each variant's record kept when it fits (the
    cheapest ones first: both are proposed only where neither alone fits). The recommendation sees them as any
    other candidate, so one is proposed only where a plain layout does not fit; the records' ``time_breakdown``
    says what each costs (``recompute_s``, ``offload_s``)."""
    from shardwise.strategies.checkpointing import find_block_list

    blocks = True
    if module is not None:
        try:
            find_block_list(module)
        except ConfigError:
            blocks = False  # no block list to checkpoint: `Trainer` would refuse the variant
    host = cluster.device.host is not None
    out: list[dict[str, Any]] = []
    for candidate, record in zip(candidates, records, strict=True):
        if record["fits"] or record["refused_by_plan"]:
            continue
        ac = replace(candidate, activation_checkpointing="blocks") if blocks else None
        off = replace(candidate, options={**candidate.options, "offload": True}) if host and candidate.strategy in OFFLOADS else None
        singles = [evaluate(v, spec, cluster, settings, module) for v in (ac, off) if v is not None]
        fitting = [r for r in singles if r["fits"]]
        if not fitting and ac is not None and off is not None:
            both = evaluate(replace(off, activation_checkpointing="blocks"), spec, cluster, settings, module)
            fitting = [both] if both["fits"] else []
        out += fitting
    return out
