"""The planner's prediction for one layout, as a plain function: `predict_step` (and `planned_model` to load a model once).

For a caller that runs layouts and wants the planner's figure beside each (``shardwise bench scaling``): the
same record ``shardwise plan`` prints for a candidate (`shardwise.tools.advisor.candidates.evaluate`), at any
process count, with the thread count each process runs and the machine's load (`machine_load`) taken as the
planner takes them.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import ConfigError
from shardwise.strategies.cost.cluster import Cluster, DeviceProfile, load_profile
from shardwise.strategies.cost.estimate import Settings
from shardwise.strategies.cost.family import Candidate
from shardwise.tools.advisor.models import PlannedModel


def runnable_now(samples: int = 10, interval_s: float = 0.05, path: str = "/proc/stat") -> float | None:
    """Other work's runnable threads right now: the median of ``samples`` readings of ``procs_running`` in
    ``path`` (``/proc/stat``: every thread on a run queue, this reading one among them, so one less),
    ``interval_s`` apart; None where the file is missing (not Linux). The 1-minute load average lags a minute behind in
    both directions (after other work ends it still counts it, and it misses work that just began)."""
    counts: list[int] = []
    for i in range(samples):
        try:
            with open(path, encoding="ascii") as f:
                counts += [int(line.split()[1]) for line in f if line.startswith("procs_running")]
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(interval_s)
    return float(max(0, statistics.median(counts) - 1)) if counts else None


def load_method(given: float | None) -> str:
    """How `machine_load` reads the load, in words for the plan's ``cores:`` line."""
    if given is not None:
        return "--load"
    return "sampled now, over 0.5 s" if os.path.exists("/proc/stat") else "the 1-minute load average"


def machine_load(given: float | None, device: DeviceProfile) -> float:
    """Other work's runnable threads on this machine: ``given`` (``--load``), else `runnable_now` (the
    1-minute load average where there is no ``/proc/stat``) on a profile measured here (``local``), else 0
    (a datasheet device is not this machine)."""
    if given is not None:
        if not (math.isfinite(given) and given >= 0):
            raise ConfigError(f"--load must be a number >= 0 (other work's runnable threads, e.g. --load 0 for a quiet machine); got {given}")
        return float(given)
    if not device.local:
        return 0.0
    now = runnable_now()
    if now is not None:
        return now
    try:
        return float(os.getloadavg()[0])
    except OSError:  # pragma: no cover - a platform without a load average
        return 0.0


def planned_model(
    model: str, *, global_batch: int | None = None, nprocs: Sequence[int] = (1, 2, 4), device: str = "cpu", data: str | None = None, best: bool = True
) -> PlannedModel:
    """``model`` (a recipe name or ``module:factory``) loaded as ``shardwise plan --model`` loads it; on a profile
    measured here its step is timed at ``global_batch`` (None: the recipe's own, 512 for a factory) with every
    thread count ``nprocs`` processes run (`shardwise.tools.advisor.models.thread_counts`), each count a few times,
    keeping the fastest run (``best``: the model's capability, which the load planned then stretches; one timing
    that other work slowed would otherwise move every prediction). ``data``: a factory's ``--data``, whose first
    sample is the example input when the factory returns the module alone."""
    from shardwise.tools.advisor.candidates import own_threads
    from shardwise.tools.advisor.models import load_model, thread_counts
    from shardwise.tools.recipes import available, get_recipe

    profile = load_profile(device)
    batch = global_batch or (int(get_recipe(model).trainer_defaults["global_batch_size"]) if model in available() else 512)
    if not profile.local:
        return load_model(model, data=data)
    threads = thread_counts(profile.cores, list(nprocs), own_threads(Cluster(profile, 1, load=machine_load(None, profile))))
    return load_model(model, timed_batch=batch, threads=threads, best=best, data=data)


@dataclass(frozen=True)
class Prediction:
    """One layout's predicted step (`predict_step`)."""

    strategy: str
    label: str
    nproc: int
    threads: int
    """Intra-op threads each process is costed with."""
    load: float
    step_s: float
    """Predicted seconds per optimizer step."""
    samples_per_s: float
    global_batch: int
    fits: bool
    reason: str
    record: dict[str, Any] = field(repr=False)
    """The whole plan record (`shardwise plan --json`'s ``candidates`` entries)."""


def predict_step(
    model: PlannedModel,
    strategy: str,
    nproc: int,
    *,
    options: Mapping[str, Any] | None = None,
    global_batch: int | None = None,
    device: str = "cpu",
    precision: str | None = None,
    optimizer: str = "adam",
    accumulate: int = 1,
    load: float | None = None,
) -> Prediction:
    """The planner's cost of ``strategy`` (with ``options``, as the Trainer's ``strategy_options``) on ``nproc`` processes
    of one node of ``device``, for ``model`` (`planned_model`). ``load``: other work's runnable threads (None: `machine_load`'s)."""
    from shardwise.tools.advisor.candidates import evaluate
    from shardwise.tools.recipes import available, get_recipe

    profile = load_profile(device)
    batch = global_batch or (int(get_recipe(model.recipe).trainer_defaults["global_batch_size"]) if model.recipe in available() else 512)
    cluster = Cluster(profile, nproc, load=machine_load(load, profile))
    settings = Settings(batch, precision or ("32" if profile.name.startswith("cpu") else "bf16-mixed"), optimizer, accumulate)
    record = evaluate(Candidate(strategy, dict(options or {}), world_size=nproc), model.spec, cluster, settings, model.module)
    return Prediction(
        strategy=strategy,
        label=record["label"],
        nproc=nproc,
        threads=int(record["threads"]),
        load=cluster.load,
        step_s=record["step_time_s"],
        samples_per_s=record["samples_per_s"],
        global_batch=batch,
        fits=bool(record["fits"]),
        reason=record["reason"],
        record=record,
    )


__all__ = ["Prediction", "machine_load", "planned_model", "predict_step"]
