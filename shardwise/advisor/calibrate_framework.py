"""``shardwise plan --calibrate``, part two: what each strategy costs per step beyond its model and its collectives.

On this machine a small model's step is mostly per-operation overhead, which the model's own timed
step (`shardwise.plan.model_spec.StepFit`) captures; what it does not capture is each strategy's
own work per step: DDP's hooks and buckets, FSDP's gather and free around every unit, the
tensor-parallel collectives' launch, a pipeline's schedule actions and point-to-point messages,
the parameter server's protocol, the Trainer's loop around all of it. Here each strategy trains a
calibration network (`CalibrationNet`, a stack of residual MLP blocks whose layer pairs tensor
parallelism splits and a pipeline cuts) at two sizes of what its cost scales with (layers, or
micro-batches for a pipeline), with the `Trainer` on 2 processes as a user runs it. At each size

    extra = measured step - (timed compute + alpha-beta collectives)   (`shardwise.plan.cost`)

and the two points give ``Framework(step_s, per_unit_s)`` for the profile. Fits are not clamped
silently: a negative slope is reported and set to 0, a negative intercept to 0.

The calibration network is neither built-in recipe, so ``shardwise plan --validate`` on digits and
charlm checks the resulting predictions on models the fit never saw.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.advisor.models import time_step
from shardwise.plan.model_spec import measured_spec

WIDTH = 64
FEATURES = 32
CLASSES = 8
GLOBAL_BATCH = 32
STEPS = 50
LOG_EVERY = 5
SAMPLES = 512


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


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))


CODECS = ("fp16", "bf16", "int8", "sign", "topk:0.01", "randomk:0.2", "powersgd:4")
"""Each codec is its own calibration point: their encode and decode costs differ by several times."""

# key -> (strategy, options, what varies: "layers" or "microbatches", its two values)
POINTS: dict[str, tuple[str, dict[str, Any], str, tuple[int, int]]] = {
    "single": ("single", {}, "layers", (2, 8)),
    "ddp": ("ddp", {}, "layers", (2, 8)),
    "ddp/algorithm": ("ddp", {"allreduce": "ring"}, "layers", (2, 8)),
    **{f"ddp/codec/{c.partition(':')[0]}": ("ddp", {"compression": c}, "layers", (2, 8)) for c in CODECS},
    "zero1": ("zero1", {}, "layers", (2, 8)),
    "zero2": ("zero2", {}, "layers", (2, 8)),
    "zero3": ("zero3", {}, "layers", (2, 8)),
    "fsdp": ("fsdp", {}, "layers", (2, 8)),
    "hsdp": ("hsdp", {}, "layers", (2, 8)),
    "tp": ("tp", {"tp": 2}, "layers", (2, 8)),
    "pipeline/gpipe": ("pipeline", {"pp": 2, "schedule": "gpipe"}, "microbatches", (2, 8)),
    "pipeline/1f1b": ("pipeline", {"pp": 2, "schedule": "1f1b"}, "microbatches", (2, 8)),
    "pipeline/interleaved": ("pipeline", {"pp": 2, "schedule": "interleaved", "virtual_stages": 2}, "microbatches", (2, 8)),
    "ps/sync": ("ps", {"servers": 1, "mode": "sync"}, "layers", (2, 8)),
    "ps/async": ("ps", {"servers": 1, "mode": "async"}, "layers", (2, 8)),
    "local-sgd": ("local-sgd", {"sync_every": 8}, "layers", (2, 8)),
    "diloco": ("diloco", {"sync_every": 8}, "layers", (2, 8)),
}
PIPELINE_DEPTH = 4


def _measure(strategy: str, options: dict[str, Any], model: nn.Module, world: int) -> float:
    """Step seconds of the fastest logged interval of ``STEPS`` Trainer steps (`measured_step_s`: the first left out)."""
    from shardwise.advisor.validate import measured_step_s
    from shardwise.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            strategy=strategy,
            strategy_options=options,
            nproc=world,
            max_steps=STEPS,
            log_every=LOG_EVERY,
            global_batch_size=GLOBAL_BATCH,
            accelerator="cpu",
            out=out,
            progress_bar=False,
            model_summary=False,
            optimizer=_adam,
            loss_fn=_loss,
        )
        trainer.fit(model, _data())
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return measured_step_s(rows, GLOBAL_BATCH)


def measure_point(key: str, units: int, profile: Any, world: int = 2) -> dict[str, Any]:
    """One calibration run: predicted without the strategy's own cost, measured, and their difference."""
    from shardwise.advisor.candidates import Candidate, evaluate
    from shardwise.plan.cluster import Cluster
    from shardwise.plan.cost import Settings

    strategy, options, varies, _ = POINTS[key]
    depth = units if varies == "layers" else PIPELINE_DEPTH
    opts = dict(options, microbatches=units) if varies == "microbatches" else dict(options)
    torch.manual_seed(0)
    model = CalibrationNet(depth)
    data = _data()
    example = data.tensors[0][:8]
    fit = time_step(model, data, _loss, _adam, (max(1, GLOBAL_BATCH // 16), GLOBAL_BATCH))
    spec = replace(measured_spec(f"calibration-{depth}", model, example, 8), step_fit=fit)
    candidate = Candidate(strategy, opts, world_size=1 if strategy == "single" else None)
    record = evaluate(candidate, spec, Cluster(profile, world), Settings(GLOBAL_BATCH), model)
    if not record["fits"]:
        raise RuntimeError(f"calibration point {key} at {units} {varies} does not plan: {record['reason']}")
    t = record["time_breakdown"]
    predicted = t["step_s"] - t["overhead_s"]
    measured = _measure(strategy, opts, model, record["world_size"])
    return {"key": key, "units": units, "varies": varies, "measured_s": measured, "predicted_without_s": predicted, "extra_s": measured - predicted}


def fit_framework(points: list[dict[str, Any]]) -> dict[str, Any]:
    """``step_s`` and ``per_unit_s`` through a key's two points (negative parts set to 0, and said so)."""
    lo, hi = sorted(points, key=lambda p: p["units"])
    slope = (hi["extra_s"] - lo["extra_s"]) / (hi["units"] - lo["units"])
    notes = []
    if slope < 0:
        notes.append(f"slope {slope * 1e3:.3g} ms per unit set to 0")
        slope = 0.0
    step = lo["extra_s"] - slope * lo["units"]
    if step < 0:
        notes.append(f"intercept {step * 1e3:.3g} ms set to 0")
        step = 0.0
    return {"step_s": step, "per_unit_s": slope, "points": points, "notes": notes}


def calibrate_framework(profile: Any, keys: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every key of `POINTS` (or ``keys``): its fit, printed as it goes."""
    out = {}
    for key in keys or list(POINTS):
        _, _, varies, values = POINTS[key]
        points = [measure_point(key, u, profile) for u in values]
        out[key] = fit_framework(points)
        f = out[key]
        pts = ", ".join(f"{p['units']} {varies}: measured {p['measured_s'] * 1e3:.2f} ms, model {p['predicted_without_s'] * 1e3:.2f} ms" for p in points)
        notes = " " + "; ".join(f["notes"]) if f["notes"] else ""
        print(f"{key:22s} {f['step_s'] * 1e3:7.2f} ms + {f['per_unit_s'] * 1e3:6.3f} ms/{varies.rstrip('es')}  ({pts}){notes}", flush=True)
    return out
