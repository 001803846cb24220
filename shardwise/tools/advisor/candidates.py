"""Every candidate layout for a world size, each planned by its own strategy and costed.

`enumerate_candidates` asks every strategy family's ``cost.py`` for the candidates it proposes
(`shardwise.strategies.cost.families.propose`: each allreduce algorithm and codec for ddp, each
pipeline schedule, the mesh shapes ``dp x tp``, ``dp x pp``, ``pp x tp`` and 3D, parameter servers
sync and async with ``k`` servers, local SGD and DiLoCo with ``H``). `evaluate` calls each strategy's
own ``plan`` (the contract in `shardwise.strategies.contract`): its `Layout` gives the degrees the
cost model uses and its `ConfigError` is the candidate's reason for ``fits: false``, so the planner
and the launcher never disagree. The cost is `shardwise.strategies.cost.estimate.estimate`. A
candidate its strategy accepts but that does not fit in memory is tried again with activation
checkpointing and, for the strategies with an ``offload`` option, CPU offload (`memory_savers`); the
variants that fit join the records, so ``shardwise plan`` proposes them only where a plain layout does
not fit, with what they cost in step time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies import Batch, Layout, get_strategy
from shardwise.strategies.cost.cluster import Cluster
from shardwise.strategies.cost.estimate import Settings, Shape, estimate
from shardwise.strategies.cost.families import cost_of, propose
from shardwise.strategies.cost.family import Candidate
from shardwise.strategies.cost.model_spec import ModelSpec
from shardwise.strategies.pipeline.cost import pipeline_microbatches


def enumerate_candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """The candidates for ``cluster.nproc`` processes (see the module docstring)."""
    return propose(cluster, spec, global_batch, accumulate)


def shape_of(candidate: Candidate, layout: Layout) -> Shape:
    """The cost-model view of a planned candidate: the layout's degrees and the options that cost
    (its family's `StrategyCost.shape`)."""
    o = dict(candidate.options)
    d = layout.degrees
    common: dict[str, Any] = dict(dp=layout.data_parallel, tp=int(d.get("tp", 1)), pp=int(d.get("pp", 1)))  # Shape's fields
    mode, _, every = candidate.activation_checkpointing.partition(":")
    common["recompute_every"] = int(every or 1) if mode == "blocks" else 0
    common["offload"] = bool(o.get("offload"))
    if layout.units is not None:
        common["units"] = len(layout.units)  # what the plan wraps (FSDP) or splits (tp) one by one
    return cost_of(candidate.strategy).shape(o, layout, common)


def _intended_layout(candidate: Candidate, world: int) -> Layout:
    """The layout a refused candidate asked for, so its cost can still be shown next to the refusal."""
    o = candidate.options
    tp = int(o.get("tp") or 1)
    pp = int(o.get("pp") or 1)
    servers = int(o.get("servers") or 0)
    trainers = world - servers
    dp = max(1, trainers // (tp * pp))
    return Layout(candidate.strategy, world, dict(dp=dp, pp=pp, tp=tp), trainers, dp)  # the mesh's dimensions


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


def memory_savers(
    candidates: Sequence[Candidate], records: Sequence[dict[str, Any]], spec: ModelSpec, cluster: Cluster, settings: Settings, module: nn.Module | None
) -> list[dict[str, Any]]:
    """For each candidate that its strategy accepts but that does not fit in memory: the same layout with
    activation checkpointing (``blocks``: activations down to each block's inputs, for one more forward of
    the blocks a step), with CPU offload (the strategies whose cost says they offload, on a device with a host link: model state in
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
        off = replace(candidate, options={**candidate.options, "offload": True}) if host and cost_of(candidate.strategy).offloads else None
        singles = [evaluate(v, spec, cluster, settings, module) for v in (ac, off) if v is not None]
        fitting = [r for r in singles if r["fits"]]
        if not fitting and ac is not None and off is not None:
            both = evaluate(replace(off, activation_checkpointing="blocks"), spec, cluster, settings, module)
            fitting = [both] if both["fits"] else []
        out += fitting
    return out


__all__ = ["Candidate", "enumerate_candidates", "evaluate", "memory_savers", "pipeline_microbatches", "plan_all", "shape_of"]
