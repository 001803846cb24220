"""``shardwise plan --calibrate``, part two: what each strategy costs per step beyond its model and its collectives.

On this machine a small model's step is mostly per-operation overhead, which the model's own timed
step (`shardwise.strategies.cost.model_spec.StepFit`) captures; what it does not capture is each strategy's
own work per step: DDP's hooks and buckets, FSDP's gather and free around every unit, the
tensor-parallel collectives' launch, a pipeline's schedule actions and point-to-point messages,
the parameter server's protocol, the Trainer's loop around all of it. Here each strategy trains a
calibration network (`CalibrationNet`, a stack of residual MLP blocks whose layer pairs tensor
parallelism splits and a pipeline cuts) at three sizes of what its cost scales with (`LAYERS` deep,
so as many parameter tensors, FSDP units and split linears; micro-batches for a pipeline: whatever
`shardwise.strategies.cost.estimate.framework_units` counts, so the fit and the prediction count alike), `REPEATS`
times each (in rounds over all keys), with the `Trainer` on 2 processes as a user runs it. At each size

    extra = measured step - (timed compute + alpha-beta collectives)   (`shardwise.strategies.cost.estimate`)

for the strategy's own work (local SGD's and DiLoCo's averaging round, every ``sync_every`` steps, is
divided by `shardwise.strategies.cost.estimate.framework_scale`, the share of it a step carries: the prediction multiplies
by it again; their runs log whole rounds, `shardwise.tools.advisor.validate.log_every_for`),

and a least-squares fit through each size's median over the rounds gives ``Framework(step_s, per_unit_s, ...)``
for the profile, with its largest residual: the third term is per parameter for the strategies whose
own work goes over gradients and weights once a step, per second of compute for those whose work
runs beside the compute (`scaling`). Fits are not clamped silently: a negative slope is reported
and set to 0 (the intercept is then the points' mean), a negative intercept to 0.

Each step time is the median of the run's logged intervals (`shardwise.tools.advisor.validate.measured_step_s`),
each run as long as ``--validate`` trains a candidate (`shardwise.tools.advisor.validate.steps_for`: 30-200
steps, about 2 s), so that both measure alike. A calibration step is a few milliseconds; on two cores
one run still moves 10-50% between runs (the wake-up of a rank blocked in a collective is what varies,
and the machine's speed drifts over minutes), hence the rounds, the median over them (the faster of
two, taken before, left the profile predicting its own points 1.1-1.6x too fast; two independent
calibrations of two rounds each, through their means, predicted digits' candidates 25-50% apart:
recursive doubling 3.06 and 1.75 ms, fp16 3.36 and 4.87 ms) and the third size. Each round times the
networks' own steps again (`time_step`), so that their error averages over the rounds as well.

The calibration network is neither built-in recipe, so ``shardwise plan --validate`` on digits and
charlm checks the resulting predictions on models the fit never saw.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from shardwise.strategies.cost.families import all_costs, cost_of
from shardwise.strategies.cost.family import CALIBRATION_LAYERS, Point
from shardwise.strategies.cost.model_spec import measured_spec
from shardwise.strategies.data_parallel.cost import CALIBRATION_CODECS
from shardwise.tools.advisor.models import time_step

WIDTH = 64
FEATURES = 32
CLASSES = 8
GLOBAL_BATCH = 32
REPEATS = 4
"""Runs of each point, in rounds over all keys; a key's fit goes through each point's median run."""
SAMPLES = 512
WIDE = (256, 512)
"""The wide point's (width, global batch): 2 layers (a pipeline's 4 blocks, 4 micro-batches) with about
ten times the compute of the widest deep point and charlm's gradient bytes, so compute and parameters
vary apart from the units and `Framework.per_compute` or `Framework.per_param_s` can be fitted."""


class Block(nn.Module):
    """A residual MLP block (``x + fc2(gelu(fc1(x)))``): tensor parallelism splits fc1 by columns and fc2 by rows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class CalibrationNet(nn.Module):
    """``embed``, ``depth`` `Block` s in a ModuleList, ``head``: the shape of the models the strategies cut."""

    def __init__(self, depth: int, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch[1])


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _data(samples: int = SAMPLES) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(samples, FEATURES, generator=g), torch.randint(0, CLASSES, (samples,), generator=g))


CODECS = CALIBRATION_CODECS
LAYERS = CALIBRATION_LAYERS

POINTS: dict[str, Point] = {key: point for cost in all_costs().values() for key, point in cost.calibration_points().items()}
"""key -> (strategy, options, what varies: "layers" or "microbatches", its values): every costed strategy's
own (`StrategyCost.calibration_points`), in the planner's order."""
PIPELINE_DEPTH = 4


def _measure(strategy: str, options: dict[str, Any], model: nn.Module, world: int, predicted_s: float, period: int, batch: int = GLOBAL_BATCH) -> float:
    """Step seconds: the median logged interval (`measured_step_s`: the first left out) of a run as long
    as ``--validate`` trains a candidate predicted at ``predicted_s`` (`steps_for`), logged as it logs
    one (`log_every_for`: whole rounds of local SGD and DiLoCo)."""
    from shardwise.tools.advisor.validate import log_every_for, steps_for, timed_fit

    data = _data(max(SAMPLES, 8 * batch))
    every = log_every_for(period)
    steps = steps_for(predicted_s, None, every)
    return timed_fit(model, data, steps=steps, batch=batch, optimizer=_adam, loss_fn=_loss, strategy=strategy, options=options, nproc=world, log_every=every)


def _spec(depth: int, width: int, batch: int, specs: dict[tuple[int, ...], Any], threads: int = 1) -> Any:
    """The calibration network's spec at ``depth`` and ``width``, its step timed here at ``batch`` with ``threads``
    threads (each calibration rank's), kept in ``specs`` (one calibration round's): every key at that point in the
    round is set against the same timed compute."""
    if (depth, width, batch, threads) not in specs:
        torch.manual_seed(0)
        model = CalibrationNet(depth, width)
        data = _data(max(SAMPLES, 8 * batch))
        fit = time_step(model, data, _loss, _adam, (max(1, batch // 16), batch), threads)
        specs[depth, width, batch, threads] = replace(measured_spec(f"calibration-{depth}x{width}", model, data.tensors[0][:8], 8), step_fit=fit)
    return specs[depth, width, batch, threads]


def measure_point(key: str, size: int | str, profile: Any, world: int = 2, specs: dict[tuple[int, ...], Any] | None = None) -> dict[str, Any]:
    """One calibration run at ``size`` layers or micro-batches, or at the ``"wide"`` point (`WIDE`):
    predicted without the strategy's own cost, measured, their difference, ``units`` (what
    `shardwise.strategies.cost.estimate.framework_units` counts for this layout: parameter tensors, micro-batches, or
    FSDP's groups and tensor parallelism's split linears from the strategy's plan) and ``compute_s`` (the
    rank's compute in the prediction). ``specs`` shares the timed networks between the points of one calibration round."""
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.estimate import Settings
    from shardwise.tools.advisor.candidates import Candidate, evaluate

    strategy, options, varies, _ = POINTS[key]
    width, batch = WIDE if size == "wide" else (WIDTH, GLOBAL_BATCH)
    if size == "wide":
        depth, micro = (PIPELINE_DEPTH, 4) if varies == "microbatches" else (2, None)
    else:
        depth, micro = (PIPELINE_DEPTH, int(size)) if varies == "microbatches" else (int(size), None)
    opts = dict(options, microbatches=micro) if micro is not None else dict(options)
    spec = _spec(depth, width, batch, {} if specs is None else specs, Cluster(profile, world).threads_per_process)
    torch.manual_seed(0)
    model = CalibrationNet(depth, width)
    candidate = Candidate(strategy, opts, world_size=cost_of(strategy).world_size)
    record = evaluate(candidate, spec, Cluster(profile, world), Settings(batch), model)
    if not record["fits"]:
        raise RuntimeError(f"calibration point {key} at {size} {varies} does not plan: {record['reason']}")
    t = record["time_breakdown"]
    predicted = t["step_s"] - t["overhead_s"]
    measured = _measure(strategy, opts, model, record["world_size"], t["step_s"], t["overhead_period"], batch)
    return {
        "key": key,
        "size": size,
        "varies": varies,
        "units": t["overhead_units"],
        "compute_s": t["overhead_compute_s"],
        "params": t["overhead_params"],
        "measured_s": measured,
        "predicted_without_s": predicted,
        "framework_s": t["overhead_s"],
        "scale": t["overhead_scale"],
        "extra_s": (measured - predicted) / t["overhead_scale"],  # unscaled, as the profile keeps it (`framework_scale`)
    }


REFERENCE = ("ddp", 4)
"""The point `machine_check` re-times: ddp on the 4-layer calibration network."""


def machine_check(profile: Any, world: int = 2) -> dict[str, float]:
    """The profile's prediction for one of its own calibration points (`REFERENCE`) against that point
    timed now: ``ratio`` = measured / predicted. It is about 1 right after a calibration; later it
    says how far this machine's speed has moved since (it drifts by tens of per cent over minutes
    here), which bounds how closely any prediction from the profile can match a run made now."""
    key, depth = REFERENCE
    point = measure_point(key, depth, profile, world)
    predicted = point["predicted_without_s"] + point["framework_s"]
    return {"predicted_s": predicted, "measured_s": point["measured_s"], "ratio": point["measured_s"] / predicted}


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return [float(x) for x in torch.linalg.lstsq(a, b).solution.squeeze(1)]


def scaling(key: str) -> str:
    """The third term of ``key``'s fit: ``"per_compute"`` or ``"per_param_s"``, as its strategy's cost says
    (`StrategyCost.fit_against`; why each: docs/planner.md, "Calibration")."""
    return cost_of(POINTS[key][0] if key in POINTS else key.split("/")[0]).fit_against


def fit_framework(points: list[dict[str, Any]], third: str = "per_compute") -> dict[str, Any]:
    """``step_s``, ``per_unit_s`` and ``third`` (``per_compute`` or ``per_param_s``, `scaling`): the
    least-squares fit of ``extra_s`` against a key's points' ``units`` and ``compute_s`` or ``params``
    (a point without it counts 0); the other of the two is 0. A negative coefficient is set to 0 and
    the others fitted again without it, and said so; ``max_residual_s`` is the largest distance of a
    point from the fit."""
    xs = [float(p["units"]) for p in points]
    zs = [float(p.get("compute_s" if third == "per_compute" else "params", 0.0)) for p in points]
    ys = [float(p["extra_s"]) for p in points]
    columns = {"step_s": [1.0] * len(ys), "per_unit_s": xs, third: zs}
    names = [n for n in columns if n == "step_s" or len(set(columns[n])) > 1]
    notes = []
    while True:
        coef = dict(zip(names, _least_squares([[columns[n][i] for n in names] for i in range(len(ys))], ys), strict=True))
        negative = [n for n in names if n != "step_s" and coef[n] < 0]
        if not negative:
            break
        worst = min(negative, key=lambda n: coef[n])
        notes.append(f"{worst} {coef[worst]:.3g} set to 0")
        names.remove(worst)
    fit = {n: max(0.0, coef.get(n, 0.0)) for n in columns}
    if coef["step_s"] < 0:
        notes.append(f"intercept {coef['step_s'] * 1e3:.3g} ms set to 0")
    residual = max(abs(y - (fit["step_s"] + fit["per_unit_s"] * x + fit[third] * z)) for x, z, y in zip(xs, zs, ys, strict=True))
    return {"per_compute": 0.0, "per_param_s": 0.0, **fit, "max_residual_s": residual, "points": points, "notes": notes}


def point_medians(runs: list[dict[str, Any]], sizes: list[int | str]) -> list[dict[str, Any]]:
    """One point per size: its runs' median measured step, prediction, extra and compute, each taken
    apart (each round times the network's step again; of two runs, the mean); units and parameters are
    the same in every run of a size."""
    out = []
    for size in sizes:
        mine = [p for p in runs if p["size"] == size]
        out.append({**mine[0], **{k: statistics.median(p[k] for p in mine) for k in ("measured_s", "predicted_without_s", "extra_s", "compute_s")}})
    return out


def calibrate_framework(profile: Any, keys: list[str] | None = None, repeats: int = REPEATS) -> dict[str, dict[str, Any]]:
    """Every key of `POINTS` (or ``keys``): ``repeats`` rounds, each measuring every key at each of its
    sizes (a slow stretch of the machine lands on many keys once, not on one key's every run), then
    each key's fit through the median of each point's runs, printed."""
    keys = keys or list(POINTS)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    for r in range(repeats):
        specs: dict[tuple[int, ...], Any] = {}  # each round times the networks' steps again: their error averages too
        for key in keys:
            sizes: list[int | str] = [*POINTS[key][3], "wide"]
            runs[key] += [measure_point(key, size, profile, specs=specs) for size in sizes]
        print(f"calibration round {r + 1} of {repeats} done", flush=True)
    out = {}
    for key in keys:
        _, _, varies, values = POINTS[key]
        means, per_size = point_medians(runs[key], [*values, "wide"]), []
        for size in [*values, "wide"]:
            mine = [p for p in runs[key] if p["size"] == size]
            measured = ", ".join(f"{p['measured_s'] * 1e3:.2f}" for p in mine)
            where = "wide" if size == "wide" else f"{size} {varies}"
            per_size.append(f"{where}: measured {measured} ms, model {mine[0]['predicted_without_s'] * 1e3:.2f} ms")
        f = fit_framework(means, scaling(key))
        f["runs"] = runs[key]
        out[key] = f
        notes = " " + "; ".join(f["notes"]) if f["notes"] else ""
        unit = cost_of(POINTS[key][0]).unit
        print(
            f"{key:22s} {f['step_s'] * 1e3:7.2f} ms + {f['per_unit_s'] * 1e3:6.3f} ms/{unit} + "
            + (f"{f['per_compute']:.3f} x compute, " if scaling(key) == "per_compute" else f"{f['per_param_s'] * 1e9:.2f} ns/parameter, ")
            + f"residual {f['max_residual_s'] * 1e3:.2f} ms  ({'; '.join(per_size)}){notes}",
            flush=True,
        )
    return out
