"""``shardwise plan --validate``: run candidates here and put the prediction next to the measurement.

Each candidate that fits on this machine is trained for ``--steps`` steps by the `Trainer` on the
recipe's own model, data and optimizer (a ``module:factory``'s model on its example input, with the
loss and optimizer its step was timed with), with the planner's global batch and precision.

- **Step time, measured**: the median of the logged intervals (every 5 steps, or every whole
  number of local SGD's and DiLoCo's rounds, `log_every_for`; the first interval left out as
  warm-up) of ``global_batch / samples_per_s`` from ``metrics.jsonl`` (see `measured_step_s`).
  Each candidate trains ``--steps`` steps; by default at least `MIN_STEPS`, and more when its
  predicted step is short, so that it runs about `TARGET_S` seconds (`steps_for`).
- **Memory, measured** on every rank's tensors (`MemoryProbe`), the largest rank reported:
  the model state (parameters, gradients and optimizer state this rank holds, summed right after
  the first optimizer step, shards counted as shards) and the activations (the peak of what
  autograd holds for backward during the second step, `shardwise.strategies.cost.saved.SavedBytes`, the same
  measure the planner's model spec takes on one forward). Their sum is the measured peak of the
  tensors a rank holds; the planner's ``model_state + activations`` is set against it. Buffers
  (DDP's buckets, FSDP's gathered units) and the allocator's own memory are not in either: on CPU
  they are not separable from the process's other memory.

The table gives each candidate's predicted and measured values and their relative error, and
the median relative error over the candidates.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError, LaunchError
from shardwise.strategies.cost.cluster import Cluster
from shardwise.strategies.cost.estimate import Settings
from shardwise.strategies.cost.model_spec import StepFit
from shardwise.tools.advisor.candidates import plan_all
from shardwise.tools.advisor.models import PlannedModel
from shardwise.trainer.callbacks import Callback

LOG_EVERY = 5
PROBED_STEP = 2
"""The step whose activations are measured (the first may hold one-time work: shape inference, warm-up)."""


class MemoryProbe(Callback):
    """Each rank writes ``memory-rank-N.json`` into ``out``: its model state after the first optimizer
    step and the peak of its saved activations during step `PROBED_STEP` (see the module)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.state: dict[str, int] | None = None
        self.saved: Any = None
        self._hooks: Any = None

    def on_fit_start(self, trainer: Any, engine: Any) -> None:
        from shardwise.strategies.cost.saved import SavedBytes
        from shardwise.strategies.sharded.zero1 import measure_model_states

        module = engine.unwrap(trainer.model)
        run = engine.run_of(trainer.model)
        self.saved = SavedBytes(module.parameters())

        def after_step(opt: Any, args: Any, kwargs: Any) -> None:
            if self.state is None:  # the first step only (a hook removing itself would change torch's dict while it iterates)
                state = measure_model_states(module, opt)
                state["optimizer"] += run.held_state_bytes() if run is not None else 0  # DiLoCo's outer copy and momentum
                self.state = state

        trainer.optimizer.register_step_post_hook(after_step)

    def on_train_step_start(self, trainer: Any, engine: Any, step: int) -> None:
        if step == PROBED_STEP:
            self._hooks = self.saved.hooks()
            self._hooks.__enter__()

    def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: Any) -> None:
        if step != PROBED_STEP or self._hooks is None:
            return
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        row = {"rank": engine.rank, "state": self.state, "activations": self.saved.peak}
        (Path(self.out) / f"memory-rank-{engine.rank}.json").write_text(json.dumps(row))


def measured_memory(out: Path) -> dict[str, Any] | None:
    """The largest rank's tensors (model state plus activations) from the probe's files, with its parts."""
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("memory-rank-*.json"))]
    rows = [r for r in rows if r["state"] is not None]
    if not rows:
        return None
    for r in rows:
        r["model_state"] = sum(r["state"].values())
        r["total"] = r["model_state"] + r["activations"]
    return max(rows, key=lambda r: r["total"])


def measured_step_s(metrics: list[dict[str, Any]], global_batch: int) -> float:
    """Seconds per step: the median of the logged intervals after the first (warm-up).

    The median, not the fastest: with two processes on two cores a millisecond step's intervals
    spread over 3x within one run (the wake-up of a rank blocked in a collective is what varies),
    and the fastest of them is an extreme value: it moved 1.6-1.7x between two runs of the same
    candidate where the median moved 2-6% (digits: ddp tree, ddp sign, zero3; 29 intervals each;
    a fourth, native ddp, moved 41%, hence ``--repeats``). The calibration and the model's own
    timed step measure the same way."""
    rates = [r["samples_per_s"] for r in metrics if "samples_per_s" in r]
    rates = rates[1:] or rates
    if not rates:
        raise ConfigError("the validation run logged no step; give --steps of at least 10")
    return statistics.median(global_batch / r for r in rates)


def timed_fit(
    model: Any,
    data: Any,
    *,
    steps: int,
    batch: int,
    optimizer: Any,
    loss_fn: Any,
    strategy: str = "single",
    options: dict[str, Any] | None = None,
    nproc: int = 1,
    quiet: bool = False,
    log_every: int = LOG_EVERY,
) -> float:
    """Train ``model`` ``steps`` steps with the `Trainer` on CPU in a scratch directory, logged every
    ``log_every`` steps; returns `measured_step_s` of its metrics (``quiet``: the Trainer's printing discarded).
    The model's own timed step (`shardwise.tools.advisor.models.time_step`) and the calibration points run through it."""
    import contextlib
    import io

    from shardwise.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            strategy=strategy,
            strategy_options=options or {},
            nproc=nproc,
            max_steps=steps,
            log_every=log_every,
            global_batch_size=batch,
            accelerator="cpu",
            out=out,
            progress_bar=False,
            model_summary=False,
            on_nonfinite="warn",  # timing, not training: a step that diverges takes as long (a user's lr may be too high for long runs)
            optimizer=optimizer,
            loss_fn=loss_fn,
        )
        # quiet: the log lines go to stderr (shardwise plan printed 256 of them before its table)
        with (
            contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext(),
            contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext(),
        ):
            trainer.fit(model, data)
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return measured_step_s(rows, batch)


TARGET_S = 2.0
"""Seconds of training each validated candidate aims for when ``--steps`` is not given (`steps_for`)."""
MIN_STEPS = 30
MAX_STEPS = 200
MIN_INTERVALS = 3
"""Logged intervals a run needs, after the first, for `log_every_for` to log whole rounds."""


def log_every_for(period: int, steps: int | None = None) -> int:
    """The steps between logged intervals: `LOG_EVERY`, or, for a strategy whose own work runs once a
    round of ``period`` steps (local SGD's and DiLoCo's ``sync_every``, `shardwise.strategies.cost.estimate.framework_period`),
    the fewest whole rounds that make at least `LOG_EVERY` steps, so that every interval holds as many
    rounds as the next. With 5-step intervals the median interval misjudges the round: at H = 32, 27
    intervals in 32 hold none and the median leaves it out; at H = 8, five in eight hold one and the
    median counts a whole round every 5 steps (8/5 of its share). Given ``steps`` too short for
    `MIN_INTERVALS` such intervals after the first, `LOG_EVERY`."""
    every = max(1, period) * math.ceil(LOG_EVERY / max(1, period))
    if steps is not None and steps < (MIN_INTERVALS + 1) * every:
        return LOG_EVERY
    return every


def steps_for(predicted_step_s: float, steps: int | None = None, every: int = LOG_EVERY) -> int:
    """``steps`` when given; else `MIN_STEPS`, or more (a multiple of ``every``, the logging interval,
    at most `MAX_STEPS`) so that a candidate whose predicted step is short still trains about
    `TARGET_S` seconds: enough logged intervals for their median to settle. A long interval
    (`log_every_for`) gets at least ``MIN_INTERVALS + 1`` intervals and may run up to 10."""
    if steps is not None:
        return steps
    lo = max(math.ceil(MIN_STEPS / every), MIN_INTERVALS + 1) * every
    hi = max(MAX_STEPS // every, 10) * every
    want = math.ceil(TARGET_S / max(predicted_step_s, 1e-6) / every) * every
    return max(lo, min(hi, want))


def run_candidate(record: dict[str, Any], model: PlannedModel, settings: Settings, steps: int | None, out: Path) -> dict[str, Any]:
    """Train ``record``'s strategy on ``model`` (`PlannedModel.training`) for ``steps`` steps (None:
    `steps_for` its predicted step), logged every `log_every_for` its rounds; returns the measured step
    time, model state and activations."""
    import torch

    from shardwise.trainer import Trainer

    training = model.training()
    assert training is not None  # validate() refused the model otherwise
    module, data, loss_fn, optimizer = training
    every = log_every_for(record["time_breakdown"]["overhead_period"], steps)
    steps = steps_for(record["step_time_s"], steps, every)
    trainer = Trainer(
        strategy=record["strategy"],
        strategy_options=dict(record["options"]),
        activation_checkpointing=record.get("activation_checkpointing", "off"),
        nproc=record["world_size"],
        max_steps=steps,
        log_every=every,
        global_batch_size=settings.global_batch,
        accumulate=settings.accumulate,
        precision=settings.precision,
        accelerator="cpu",
        out=str(out),
        progress_bar=False,
        model_summary=False,
        on_nonfinite="warn",  # a validation measures time and memory; a diverging step costs the same
        optimizer=optimizer,
        loss_fn=loss_fn,
        callbacks=[MemoryProbe(str(out))],
    )
    before = torch.get_num_threads()
    if record.get("in_process"):  # run in this process: with the threads it was costed with (launched ranks get theirs from the launcher)
        torch.set_num_threads(int(record["threads"]))
    try:
        trainer.fit(module, data)
    finally:
        torch.set_num_threads(before)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    memory = measured_memory(out)
    return {
        "comm_bytes_by_group": measured_comm(out),
        "step_s": measured_step_s(metrics, settings.global_batch),
        "model_state_bytes": memory["model_state"] if memory else None,
        "activation_bytes": memory["activations"] if memory else None,
        "memory_bytes": memory["total"] if memory else None,
    }


def measured_comm(out: Path) -> dict[str, float] | None:
    """Bytes rank 0 sent per step by group (summary.json's ``comm``, the Recorder's ``group/op`` totals over its steps)."""
    path = out / "summary.json"
    if not path.exists():
        return None
    comm = json.loads(path.read_text()).get("comm") or {}
    steps = max(int(comm.get("steps") or 1), 1)
    by_group: dict[str, float] = {}
    for key, totals in (comm.get("by_op") or {}).items():
        group = key.split("/")[0]
        by_group[group] = by_group.get(group, 0.0) + float(totals.get("sent_bytes", 0)) / steps
    return by_group


def predicted_comm(rec: dict[str, Any]) -> dict[str, float]:
    """The plan record's bytes one rank sends per step, by group."""
    by_group: dict[str, float] = {}
    for c in rec.get("comm_breakdown", []):
        by_group[c["group"]] = by_group.get(c["group"], 0.0) + float(c["sent_bytes"])
    return by_group


def _rel(pred: float, meas: float | None) -> float | None:
    return None if meas is None or meas == 0 else abs(pred - meas) / meas


def validate(
    model: PlannedModel,
    cluster: Cluster,
    settings: Settings,
    steps: int | None,
    only: list[str] | None = None,
    repeats: int = 1,
    checks: list[dict[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """Rows of predicted against measured for every candidate that fits here (or the ``only`` ones);
    with ``repeats``, each candidate's step time is the median of that many runs, taken in rounds over
    the candidates (memory is exact: the first run's), and each round after the first times the model's
    own step again: the predictions in the rows use the median of the timings (`replanned`). A run that fails to launch or whose rank dies
    (`LaunchError`) is left out and said so; a candidate none of whose runs finished gets a row with
    its ``error`` and no measurement, and the others still run. Given a ``checks`` list and a profile with
    framework costs (one measured here), each round first runs `machine_check` into it: how far the
    machine's speed has moved since the profile was calibrated."""
    from shardwise.tools.advisor.calibrate_framework import machine_check

    if not model.trainable:
        raise ConfigError(
            "--validate trains the model: give a built-in recipe (--model digits or charlm) or a module:factory returning "
            "(model, example_input); a config .json or --params describes a model's sizes only"
        )
    records = [r for r in plan_all(model.spec, cluster, settings, model.module) if r["fits"]]  # single and fewer processes too
    if only:
        records = [r for r in records if r["label"] in only or r["strategy"] in only]
    if not records:
        raise ConfigError(f"no candidate to validate among {only}; run `shardwise plan` with the same flags to see the candidates' labels")
    runs: list[list[dict[str, Any]]] = [[] for _ in records]
    failed: dict[str, list[str]] = {}
    rows = []
    rounds = max(1, repeats)
    timed = [f for f in (model.spec.step_fit, *model.spec.step_fits) if f is not None] if cluster.device.local else []
    fits = [timed] if timed else []  # each round's timings, one per thread count
    for r in range(rounds):  # in rounds over the candidates: a slow stretch of the machine lands on many once
        if r > 0 and fits:
            fits.append([retimed(model, f) for f in timed])
            for f in fits[-1]:
                threads = f" with {f.threads} threads" if len(timed) > 1 else ""
                print(f"model step timed again{threads}, round {r + 1}: {f.fixed_s * 1e3:.3f} ms + {f.per_sample_s * 1e6:.2f} us a sample", flush=True)
            if r == rounds - 1:
                records = replanned(records, model, [median_fit([t[i] for t in fits]) for i in range(len(timed))], cluster, settings)
        if checks is not None and cluster.device.framework:
            c = machine_check(cluster.device)  # at 2 processes, as calibrated
            checks.append(c)
            print(
                f"machine check, round {r + 1}: ddp on the 4-layer calibration network {c['measured_s'] * 1e3:.2f} ms, "
                f"the profile predicts {c['predicted_s'] * 1e3:.2f} ms ({c['ratio']:.2f}x)",
                flush=True,
            )
        for rec, mine in zip(records, runs, strict=True):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    mine.append(run_candidate(rec, model, settings, steps, Path(tmp)))
                except LaunchError as exc:  # a rank crashed or hung: the other candidates still run
                    failed.setdefault(rec["label"], []).append(str(exc).splitlines()[0])
                    print(f"{rec['label'][:44]:44s} run {r + 1}: failed: {failed[rec['label']][-1]}", flush=True)
                    if r < rounds - 1:
                        continue
            if r < rounds - 1:
                print(f"{rec['label'][:44]:44s} run {r + 1}: {mine[-1]['step_s'] * 1e3:.2f} ms", flush=True)
            elif mine:
                rows.append(_row(rec, dict(mine[0], step_s=statistics.median(x["step_s"] for x in mine))))
                print(format_row(rows[-1]), flush=True)
            else:
                rows.append({**_row(rec, dict.fromkeys(("step_s", "model_state_bytes", "activation_bytes", "memory_bytes"))), "error": failed[rec["label"]][0]})
                print(format_row(rows[-1]), flush=True)
    return rows


def retimed(model: PlannedModel, fit: StepFit) -> StepFit:
    """The model's own step timed again as ``fit`` was (`shardwise.tools.advisor.models.time_step`, at the same two
    sizes and thread count), on what ``--validate`` trains (`PlannedModel.training`)."""
    from shardwise.tools.advisor.models import time_step

    training = model.training()
    assert training is not None  # validate() refused the model otherwise
    module, data, loss_fn, optimizer = training
    return time_step(module, data, loss_fn, optimizer, fit.sizes, fit.threads)


def median_fit(fits: list[StepFit]) -> StepFit:
    """The median of the model's step timings (at one thread count): each part (fixed, per sample) taken apart."""
    fixed, per_sample = statistics.median(f.fixed_s for f in fits), statistics.median(f.per_sample_s for f in fits)
    return StepFit(fixed_s=fixed, per_sample_s=per_sample, sizes=fits[0].sizes, threads=fits[0].threads)


def replanned(records: list[dict[str, Any]], model: PlannedModel, fits: list[StepFit], cluster: Cluster, settings: Settings) -> list[dict[str, Any]]:
    """``records`` planned again with the model's step ``fits`` (at each thread count, the median over the rounds'
    timings, `median_fit`): the prediction's one measured input, timed in every round as the candidates are run
    in every round, so that one slow stretch of the machine moves neither side alone."""
    labels = {r["label"] for r in records}
    again = {r["label"]: r for r in plan_all(model.spec.with_fits(fits), cluster, settings, model.module) if r["label"] in labels}
    return [again[r["label"]] if r["label"] in again and r["world_size"] == again[r["label"]]["world_size"] else r for r in records]


def _row(rec: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:  # got's values may be None (a failed candidate)
    """One candidate's row: its plan record's predictions against ``got`` (`run_candidate`'s measurements)."""
    breakdown = rec["memory_breakdown"]
    pred_state = breakdown["model_state"]
    pred_memory = pred_state + breakdown["activations"]
    return {
        "label": rec["label"],
        "predicted_step_s": rec["step_time_s"],
        "measured_step_s": got["step_s"],  # None: every run failed
        "step_rel_error": _rel(rec["step_time_s"], got["step_s"]),
        "predicted_model_state_bytes": pred_state,
        "measured_model_state_bytes": got["model_state_bytes"],
        "state_rel_error": _rel(pred_state, got["model_state_bytes"]),
        "predicted_activation_bytes": breakdown["activations"],
        "measured_activation_bytes": got["activation_bytes"],
        "predicted_memory_bytes": pred_memory,
        "measured_memory_bytes": got["memory_bytes"],
        "memory_rel_error": _rel(pred_memory, got["memory_bytes"]),
        "predicted_comm_bytes_by_group": predicted_comm(rec),
        "measured_comm_bytes_by_group": got.get("comm_bytes_by_group"),
    }


HEADER = (
    f"{'candidate':44s} {'pred step':>10s} {'meas step':>10s} {'err':>5s} {'pred state':>10s} {'meas state':>10s} {'err':>5s} "
    f"{'pred mem':>10s} {'meas mem':>10s} {'err':>5s}"
)


def format_row(r: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    def kb(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e3:.1f} kB"

    measured = "failed" if r["measured_step_s"] is None else f"{r['measured_step_s'] * 1e3:8.2f}ms"
    return (
        f"{r['label'][:44]:44s} {r['predicted_step_s'] * 1e3:8.2f}ms {measured:>10s} {pct(r['step_rel_error']):>5s} "
        f"{kb(r['predicted_model_state_bytes']):>10s} {kb(r['measured_model_state_bytes']):>10s} {pct(r['state_rel_error']):>5s} "
        f"{kb(r['predicted_memory_bytes']):>10s} {kb(r['measured_memory_bytes']):>10s} {pct(r['memory_rel_error']):>5s}"
    )


def cmd_validate(args: argparse.Namespace, model: PlannedModel, cluster: Cluster, settings: Settings) -> int:
    """``shardwise plan --validate``: print the table (and ``--json`` its rows)."""
    if args.repeats < 1 or (args.steps is not None and args.steps < 2 * LOG_EVERY):
        raise ConfigError(
            f"--validate needs --repeats of at least 1 and --steps of at least {2 * LOG_EVERY}; got --repeats {args.repeats}, --steps {args.steps}"
        )
    length = f"{args.steps} steps" if args.steps else f"{MIN_STEPS}-{MAX_STEPS} steps (about {TARGET_S:g} s; up to 10 whole rounds of local SGD and DiLoCo)"
    runs = f", the median of {args.repeats} runs" if args.repeats > 1 else ""
    print(f"validate {model.spec.name} on {cluster.nproc} processes, {cluster.device.name} profile, {length} each{runs}")
    print(HEADER)
    checks: list[dict[str, float]] = []
    rows = validate(model, cluster, settings, args.steps, args.only.split(";") if args.only else None, args.repeats, checks)
    steps = [r["step_rel_error"] for r in rows if r["step_rel_error"] is not None]
    states = [r["state_rel_error"] for r in rows if r["state_rel_error"] is not None]
    mems = [r["memory_rel_error"] for r in rows if r["memory_rel_error"] is not None]
    if not steps:
        print("no candidate finished a run: nothing to set the predictions against")
        return 1
    print(f"median relative error: step time {statistics.median(steps):.1%} over {len(steps)} candidates", end="")
    print(f", model state {statistics.median(states):.1%} (max {max(states):.1%})" if states else "", end="")
    print(f", peak tensor memory per rank {statistics.median(mems):.1%} (max {max(mems):.1%}) over {len(mems)}" if mems else "")
    if checks:
        ratio = statistics.median(c["ratio"] for c in checks)
        print(
            f"machine check: the profile's own calibration point ran {ratio:.2f}x its prediction (median of {len(checks)}); "
            "a ratio far from 1 means this machine's speed has moved since the profile was measured: recalibrate (--calibrate) or expect errors of that size"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r.get("error")]
    for r in failed:
        print(f"{r['label']} failed in every run: {r['error']}")
    return 1 if failed else 0
