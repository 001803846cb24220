"""``naive-mp``: one process, the model's layers placed across several devices, run one after
the other (the lectures' ``ToyMpModel``: ``net1`` on ``cuda:0``, ``net2`` on ``cuda:1``, the
activation moved between them).

Only one device computes at a time, so this is model parallelism without any overlap: it lets
a model that does not fit one device run, at the speed of one device (the pipeline strategy
overlaps micro-batches instead). The model is split as ``pipeline`` splits it (a sequence of
layers, balanced by parameter count or at ``split_points``), and keeps its original names, so
checkpoints move to and from every other strategy.

>>> import torch
>>> from torch import nn
>>> mp = apply_naive_mp(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), ["cpu", "cpu"])
>>> [str(d) for d in mp.devices], mp.stage_layers
(['cpu', 'cpu'], [['0', '1'], ['2']])
>>> mp(torch.zeros(3, 4)).shape
torch.Size([3, 2])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies.common import LocalParallel
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Strategy, plan_layout
from shardwise.strategies.pipeline.split import StageModule, _register, sequence_layers, split_layers
from shardwise.strategies.precision import move


class NaiveMP(nn.Module):
    """The model's layers spread over ``devices``; ``forward`` moves the activation to each stage's
    device, and the output to ``output_device`` (the first device: where the loader puts labels)."""

    def __init__(self, stages: Sequence[StageModule], devices: Sequence[torch.device], output_device: torch.device) -> None:
        super().__init__()
        for stage in stages:
            for name in stage.layer_names:
                _register(self, name, stage.get_submodule(name))
        self._stages = list(stages)
        self.devices = list(devices)
        self.output_device = output_device
        self.stage_layers = [list(s.layer_names) for s in stages]

    def forward(self, *x: Any) -> Any:
        out: Any = x
        for stage, device in zip(self._stages, self.devices, strict=True):
            out = stage(*move(out, device)) if isinstance(out, tuple) else stage(move(out, device))
        return move(out, self.output_device)


def check_forward_is_its_layers(model: nn.Module) -> None:
    """naive-mp runs the top-level children one after another: a forward that does anything else
    (functional code between them, a skip, a module used twice) would train another network, so it
    is refused, as is a forward ``torch.fx`` cannot read to check. The pipeline splits such models."""
    from shardwise.strategies.pipeline import traced

    name = type(model).__name__
    try:
        gm = traced.trace(model)
    except traced.TraceFailure as failure:
        raise ConfigError(
            f"naive-mp runs {name}'s top-level children one after another, and torch.fx cannot read its forward to check that "
            f"this is all it does ({failure}); use strategy 'pipeline', which proves or splits the forward itself"
        ) from None
    if not traced.is_chain(gm):
        raise ConfigError(
            f"naive-mp runs {name}'s top-level children one after another, but its forward does more than that (code between "
            "them, a skip connection or a module used twice), which naive-mp would leave out and train another network; use "
            "strategy 'pipeline', which splits the traced forward so that code runs on its stage"
        )


def apply_naive_mp(
    model: nn.Module, devices: Sequence[str | torch.device], split_points: Sequence[str] | None = None, output_device: str | torch.device | None = None
) -> NaiveMP:
    """Split ``model`` into ``len(devices)`` stages and put stage ``i`` on ``devices[i]``."""
    devs = [torch.device(d) for d in devices]
    if len(devs) < 2:
        raise ConfigError(f"naive model parallelism needs at least 2 devices; got {[str(d) for d in devs]}")
    check_forward_is_its_layers(model)
    runs = split_layers(sequence_layers(model), len(devs), split_points)
    stages = [StageModule(run).to(dev) for run, dev in zip(runs, devs, strict=True)]
    return NaiveMP(stages, devs, torch.device(output_device) if output_device is not None else devs[0])


class NaiveMPRun(LocalParallel):
    """The layers on their devices in one process: one optimizer, nothing to synchronize."""

    model: NaiveMP

    def after_step(self, step: int) -> None:
        return None  # one process, one copy of each layer: nothing to average

    def save_extra_state(self, directory: Path) -> None:
        return None  # the model and optimizer hold everything, under the model's own names

    def load_extra_state(self, path: Path) -> None:
        return None

    def finish(self) -> None:
        return None  # one process: nothing to gather

    def summary(self) -> dict[str, Any]:
        return {"naive_mp": {"devices": [str(d) for d in self.model.devices], "stage_layers": self.model.stage_layers}}


@dataclass(frozen=True)
class NaiveModelParallel(Strategy):
    """Layers placed across the visible CUDA devices of one process (or the ``devices`` given)."""

    name: ClassVar[str] = "naive-mp"
    compile_unit: ClassVar[str] = "blocks"  # each block on one device

    devices: tuple[str, ...] | None = None
    """Devices the stages go to, one stage each, in order (default: every visible CUDA device)."""
    split_points: tuple[str, ...] | None = None
    """Layer names that start stages 1, 2, ... (default: stages balanced by parameter count)."""

    def __post_init__(self) -> None:
        for field_name in ("devices", "split_points"):
            value = getattr(self, field_name)
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            if value is not None and not all(isinstance(v, (str, torch.device)) for v in value):
                raise ConfigError(f"naive-mp {field_name} must be names (a list, or one comma-separated string); got {getattr(self, field_name)!r}")
            object.__setattr__(self, field_name, tuple(str(v) for v in value) if value is not None else None)
        if self.split_points == ():
            object.__setattr__(self, "split_points", None)

    def _devices(self) -> list[str]:
        if self.devices is not None:
            return list(self.devices)
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        """One process, two devices or more; refuses a model `split_layers` cannot cut into as many stages. Pure."""
        if world_size != 1:
            raise ConfigError(
                f"naive-mp runs in one process that drives several devices; got a world size of {world_size}; use strategy 'pipeline' for one process per stage"
            )
        devices = self._devices()
        if len(devices) < 2:
            raise ConfigError(
                f"naive-mp places layers on several GPUs of one process, but this machine has {len(devices)} visible "
                "CUDA device(s); it needs at least 2. Use strategy 'pipeline' (--strategy pipeline --pp N --nproc N), "
                "which splits the model the same way across processes and also runs on CPUs"
            )
        if model is not None:
            check_forward_is_its_layers(model)
            split_layers(sequence_layers(model), len(devices), self.split_points)
        return plan_layout(self.name, world_size, batch=batch, mesh=mesh)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> NaiveMPRun:
        self.plan(1)  # the devices are there (an Engine plans without the model)
        wrapped = apply_naive_mp(model, self._devices(), self.split_points, output_device=mesh.device)
        return NaiveMPRun(wrapped, make_optimizer(wrapped.parameters()))
