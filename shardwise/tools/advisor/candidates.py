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

import torch
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
    cp = int(d.get("cp", 1))
    # Shape's fields; dp counts the cp ranks too: gradients are averaged and state sharded over dp x cp
    common: dict[str, Any] = dict(dp=layout.data_parallel * cp, tp=int(d.get("tp", 1)), pp=int(d.get("pp", 1)))
    if cp > 1:
        common.update(cp=cp, cp_style=str(o.get("cp_style", "ring")))
    if int(o.get("ep", 1) or 1) > 1:
        common["ep"] = int(o["ep"])
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
    in_process = False
    try:
        strategy = get_strategy(candidate.strategy, **dict(candidate.options))
        in_process = world == 1 and not strategy.needs_process_group  # the Trainer runs it in the caller's process
        layout = strategy.plan(world, model=module, batch=Batch(settings.global_batch, settings.accumulate), mesh=dict(candidate.mesh) or None)
    except ConfigError as exc:
        refusal = str(exc)
        layout = _intended_layout(candidate, world)
    threads = fastest_threads(spec, own_threads(cluster), settings.global_batch) if in_process and cluster.device.local else 0
    if world != cluster.nproc or threads:
        nodes = -(-world // cluster.per_node)  # as many nodes as it needs, each as full as the cluster's
        run_cluster = Cluster(cluster.device, world, nodes if world % nodes == 0 else world, threads=threads, load=cluster.load)
    else:
        run_cluster = cluster
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
        "samples_per_s": settings.global_batch / est.time["step_s"] if est.time["step_s"] > 0 else 0.0,
        "threads": est.time["threads"],
        "in_process": in_process,
        "time_breakdown": est.time,
        "notes": est.notes,
    }


def own_threads(cluster: Cluster) -> int:
    """The intra-op threads of a process the Trainer runs itself (``single``): torch's own count (``OMP_NUM_THREADS``, else
    the cores), at most the cores other work leaves free (`Cluster.free_cores`): beside a busy machine a process with more
    threads than free cores waits at every operation for its descheduled threads (docs/planner.md, "One process or many")."""
    return max(1, min(torch.get_num_threads(), cluster.free_cores())) if cluster.device.cores else torch.get_num_threads()


def planned_threads(cluster: Cluster, one_process: bool = True) -> tuple[int, ...]:
    """Every intra-op thread count the planned processes run on ``cluster``: a single process's own
    (`own_threads`; not with ``one_process`` False: ``--validate --only`` without single), and each launched
    process's at ``cluster.nproc`` and at `fewer_processes`' counts: the counts the model's step is timed at
    (`shardwise.tools.advisor.models.thread_counts`)."""
    from shardwise.tools.advisor.models import thread_counts

    launched = (cluster.per_node, *(c.world_size or cluster.nproc for c in fewer_processes(cluster))) if cluster.nproc > 1 else ()
    counts = [min(n, cluster.per_node) for n in launched]  # one process alone is single's (the Trainer runs it itself)
    if one_process:
        return thread_counts(cluster.device.cores, counts, own_threads(cluster))
    return tuple(sorted({max(1, cluster.device.cores // n) if cluster.device.cores else 1 for n in counts}))


def fastest_threads(spec: ModelSpec, most: int, samples: int) -> int:
    """Of the thread counts up to ``most`` the model's step was timed at, the one whose step of ``samples`` samples
    was fastest: on a busy machine more threads time slower (they wait on each other), and the timing shows it
    even where the load average does not; ``most`` when none was timed."""
    fits = [f for f in (spec.step_fit, *spec.step_fits) if f is not None and f.threads <= most]
    return min(fits, key=lambda f: (f.seconds(samples), f.threads)).threads if fits else most


FEWER_ALGORITHMS = ("native", "tree")
"""The allreduce algorithms `fewer_processes` proposes at each smaller process count (the library's and the
measured profile's fastest of shardwise's own on two processes)."""


def fewer_processes(cluster: Cluster) -> list[Candidate]:
    """Replicas (ddp) at every power of two from 2 below ``cluster.nproc`` (those that fill whole nodes or fit in one):
    fewer processes than asked, each with more of the cores (or of the links) to itself. ``single`` is the one-process candidate."""
    counts = [n for n in (2**k for k in range(1, cluster.nproc.bit_length())) if n < cluster.nproc and (n <= cluster.per_node or n % cluster.per_node == 0)]
    return [Candidate("ddp", {"allreduce": alg}, world_size=n) for n in counts for alg in FEWER_ALGORITHMS]


def plan_all(spec: ModelSpec, cluster: Cluster, settings: Settings, module: nn.Module | None = None) -> list[dict[str, Any]]:
    """Every candidate's record, in enumeration order, then `memory_savers`' variants of those that do not fit."""
    candidates = enumerate_candidates(cluster, spec, settings.global_batch, settings.accumulate)
    records = [evaluate(c, spec, cluster, settings, module) for c in candidates]
    if any(r["fits"] and r["world_size"] == 1 for r in records):  # the model fits on one device: fewer processes may too
        extra = [evaluate(c, spec, cluster, settings, module) for c in fewer_processes(cluster)]
        records += [r for r in extra if r["fits"]]
    return records + memory_savers(candidates, records[: len(candidates)], spec, cluster, settings, module)


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


__all__ = [
    "Candidate",
    "enumerate_candidates",
    "evaluate",
    "fastest_threads",
    "fewer_processes",
    "memory_savers",
    "own_threads",
    "pipeline_microbatches",
    "plan_all",
    "planned_threads",
    "shape_of",
]
