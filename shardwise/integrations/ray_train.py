"""Ray Train: the Trainer inside ``ray.train.torch.TorchTrainer``'s workers, its metrics and
checkpoints reported to Ray.

Ray places the workers, restarts them after a failure and keeps the checkpoints; inside each worker
`fit` runs the same ``Trainer.fit``::

    from shardwise.integrations.ray_train import fit

    def train_loop(config):
        trainer = Trainer(strategy="ddp", max_steps=100, checkpoint_every=20, out=config["out"])
        fit(trainer, make_model(), train_set, val_set)

    result = TorchTrainer(train_loop, train_loop_config={"out": "/shared/run"},
                          scaling_config=ray.train.ScalingConfig(num_workers=2)).fit()

It joins Ray's process group (spawning nothing), reports every record and checkpoint to Ray
(`RayReport`, a barrier every rank reaches), and resumes from Ray's checkpoint when Ray restarts
the workers. What it does on each worker, and why: docs/integrations.md, "Ray Train".
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.errors import ConfigError
from shardwise.trainer.callbacks import Callback

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer

__all__ = ["RayReport", "fit"]

INSTALL = "pip install 'shardwise[ray]'"


def _ray_train() -> Any:
    """``ray.train``, or a one-line `ConfigError` naming the install command."""
    try:
        import ray.train
    except ImportError:
        raise ConfigError(f"shardwise.integrations.ray_train needs Ray Train, which is not installed: {INSTALL}") from None
    return ray.train


class RayReport(Callback):
    """Report the Trainer's metrics and checkpoints to Ray Train (`fit` adds it for the run).

    Each hook runs on every rank at the same point of the loop, so every rank calls
    ``ray.train.report`` the same number of times, as Ray requires."""

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {}
        """Every key logged so far, the newest value of each: what a checkpoint is reported with. Saved
        in each checkpoint, so a resumed run reports what was logged before it too (and a run that had
        already finished reports its last metrics with the checkpoint it hands over)."""

    def state_dict(self) -> dict[str, Any]:
        return {"metrics": dict(self.metrics)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.metrics = dict(state.get("metrics", {}))

    def check(self, trainer: Trainer, has_val: bool) -> None:
        layout = trainer.layout
        if layout is not None and layout.servers:
            raise ConfigError(
                f"strategy {layout.strategy!r} keeps {len(layout.servers)} serving rank(s) out of the training loop, and Ray Train "
                "needs every worker to report at the same steps; under Ray use a strategy whose ranks all train "
                "(ddp, zero1, fsdp, tp, pipeline, local-sgd, ...)"
            )

    def on_metrics(self, trainer: Trainer, engine: Engine, record: MutableMapping[str, Any]) -> None:
        # Values are already agreed across ranks; Ray keeps rank 0's.
        self.metrics.update(record)
        _ray_train().report(dict(self.metrics))

    def on_save_checkpoint(self, trainer: Trainer, engine: Engine, path: Path) -> None:
        train = _ray_train()
        # One directory holds every rank's files (the manifest, written last by rank 0, lists them):
        # rank 0 hands it over; the others report with it, without a checkpoint of their own.
        checkpoint = train.Checkpoint.from_directory(str(path)) if engine.is_rank_zero else None
        train.report({**self.metrics, "step": trainer.step, "checkpoint": Path(path).name}, checkpoint=checkpoint)


def fit(trainer: Trainer, model: nn.Module, train_data: Any, val_data: Any = None) -> dict[str, Any]:
    """``trainer.fit(model, train_data, val_data)`` inside a Ray Train worker: Ray's process group
    joined, metrics and checkpoints reported to Ray, resumed from Ray's latest checkpoint after a
    restart. Call it on every worker, from the function given to ``TorchTrainer``; returns the
    run's summary on every rank (see the module docstring)."""
    train = _ray_train()
    try:
        context = train.get_context()
        world_size, rank = int(context.get_world_size()), int(context.get_world_rank())
    except RuntimeError:
        raise ConfigError(
            "shardwise.integrations.ray_train.fit runs inside a Ray Train worker: call it from the function given to "
            "ray.train.torch.TorchTrainer(train_loop_per_worker, ...); outside Ray, call trainer.fit(model, data) itself"
        ) from None
    cfg = trainer.config
    if cfg.nproc > 1 and cfg.nproc != world_size:
        raise ConfigError(
            f"Trainer(nproc={cfg.nproc}) asked for {cfg.nproc} processes, but this Ray Train job has {world_size} workers "
            f"(ScalingConfig(num_workers={world_size})); shardwise joins Ray's workers and spawns nothing. Leave nproc out "
            f"(or set nproc={world_size}), or give TorchTrainer ScalingConfig(num_workers={cfg.nproc})"
        )
    reporter = RayReport()
    trainer.callbacks.append(reporter)
    checkpoint = train.get_checkpoint()
    try:
        if checkpoint is None:
            return trainer.fit(model, train_data, val_data)
        # Ray restarted the workers, or the run was started again under the same RunConfig name: Ray's
        # latest checkpoint replaces resume= (auto, or a path), whatever it was.
        with checkpoint.as_directory() as directory:
            if rank == 0:
                print(f"shardwise: Ray Train holds a checkpoint of this run; resuming from {checkpoint.path}", flush=True)
            trainer.config = dataclasses.replace(cfg, resume=str(directory))
            return trainer.fit(model, train_data, val_data)
    finally:
        trainer.config = cfg
        trainer.callbacks.remove(reporter)
