"""Trainer callbacks: the `Callback` base class and the three that ship (early stopping, best-model
checkpoints, the learning-rate monitor).

A callback is an object whose hooks the `Trainer` calls on **every training rank**, at the same
points of the loop, with the trainer and the `Engine` first::

    class PrintEveryEpoch(Callback):
        def on_train_epoch_end(self, trainer, engine, epoch):
            engine.print(f"epoch {epoch} done at step {trainer.step}")

    Trainer(callbacks=[PrintEveryEpoch(), EarlyStopping("val_loss", patience=3)], ...)

The hooks, when each runs, what a hook may do (a collective, ``trainer.should_stop``) and how a
callback's state is saved with every checkpoint: docs/trainer.md, "Callbacks".
"""

from __future__ import annotations

import math
import shutil
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer


class Callback:
    """Base class of Trainer callbacks: override the hooks you need (docs/trainer.md, "Callbacks", lists them)."""

    @property
    def state_key(self) -> str:
        """The name this callback's state is stored under in a checkpoint (the class name; a second
        callback of the same class gets ``#1`` appended, in the order of ``callbacks=``)."""
        return type(self).__qualname__

    def check(self, trainer: Trainer, has_val: bool) -> None:
        """Raise `ConfigError` for a setting that cannot work, in the parent, before any process starts."""

    def check_model(self, trainer: Trainer, model: nn.Module) -> None:
        """Raise `ConfigError` for a model this callback cannot work on (``fit``'s model, as given), in the
        parent, before any process starts."""

    def on_fit_start(self, trainer: Trainer, engine: Engine) -> None: ...

    def on_fit_end(self, trainer: Trainer, engine: Engine, summary: dict[str, Any]) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, engine: Engine, epoch: int) -> None: ...

    def on_train_epoch_end(self, trainer: Trainer, engine: Engine, epoch: int) -> None: ...

    def on_train_step_start(self, trainer: Trainer, engine: Engine, step: int) -> None: ...

    def on_train_step_end(self, trainer: Trainer, engine: Engine, step: int, loss: torch.Tensor) -> None: ...

    def on_validation_start(self, trainer: Trainer, engine: Engine) -> None: ...

    def on_validation_end(self, trainer: Trainer, engine: Engine, metrics: dict[str, float]) -> None: ...

    def on_metrics(self, trainer: Trainer, engine: Engine, record: MutableMapping[str, Any]) -> None: ...

    def on_save_checkpoint(self, trainer: Trainer, engine: Engine, path: Path) -> None: ...

    def on_load_checkpoint(self, trainer: Trainer, engine: Engine, path: Path) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None  # a stateless callback has nothing to restore


def dispatch(callbacks: Sequence[Any], hook: str, trainer: Trainer, *args: Any) -> None:
    """Call ``hook`` on every callback that has it (duck-typed callbacks define only some)."""
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(trainer, *args)


def state_keys(callbacks: Sequence[Any]) -> list[str]:
    """Each callback's key in a checkpoint: its ``state_key`` (class name), ``#i`` added to repeats."""
    seen: dict[str, int] = {}
    keys = []
    for cb in callbacks:
        base = cb.state_key if isinstance(cb, Callback) else type(cb).__qualname__
        n = seen.get(base, 0)
        seen[base] = n + 1
        keys.append(base if n == 0 else f"{base}#{n}")
    return keys


def collect_states(callbacks: Sequence[Any]) -> dict[str, Any]:
    """``{state_key: state_dict()}`` of the callbacks that keep state."""
    out = {}
    for key, cb in zip(state_keys(callbacks), callbacks, strict=True):
        if isinstance(cb, Callback):
            state = cb.state_dict()
            if state:
                out[key] = state
    return out


def restore_states(callbacks: Sequence[Any], states: dict[str, Any]) -> None:
    for key, cb in zip(state_keys(callbacks), callbacks, strict=True):
        if isinstance(cb, Callback) and key in states:
            cb.load_state_dict(dict(states[key]))


def agree(engine: Engine, value: float) -> float:
    """One value every training rank agrees on: ``value`` itself when the ranks hold the same one
    (metrics the trainer logs are already reduced), their mean otherwise. One all-reduce of two
    numbers (max of ``value`` and of ``-value``), so equal inputs come back bit for bit."""
    both = torch.tensor([value, -value], dtype=torch.float64, device=engine.device)
    engine.all_reduce(both, "max")
    hi, lo = float(both[0].item()), -float(both[1].item())
    return hi if hi == lo else (hi + lo) / 2


class _Monitor(Callback):
    """What EarlyStopping and ModelCheckpoint share: a monitored metric, a mode, and the test of better."""

    def __init__(self, monitor: str, mode: str, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"{type(self).__name__}: mode must be 'min' or 'max'; got {mode!r}")
        if not isinstance(monitor, str) or not monitor:
            raise ConfigError(f"{type(self).__name__}: monitor must name a logged metric (e.g. 'val_loss'); got {monitor!r}")
        if min_delta < 0:
            raise ConfigError(f"{type(self).__name__}: min_delta must be >= 0 (the improvement that counts); got {min_delta}")
        self.monitor, self.mode, self.min_delta = monitor, mode, float(min_delta)

    def check(self, trainer: Trainer, has_val: bool) -> None:
        if self.monitor.startswith("val_") and not has_val:
            raise ConfigError(f"{type(self).__name__} monitors {self.monitor!r} but fit got no validation data; pass val_data to fit or monitor 'train_loss'")

    def better(self, value: float, than: float) -> bool:
        if math.isnan(value):
            return False
        if math.isnan(than):
            return True
        return value < than - self.min_delta if self.mode == "min" else value > than + self.min_delta

    def value_in(self, engine: Engine, record: MutableMapping[str, Any]) -> float | None:
        """The monitored value of ``record``, agreed across ranks; None when the record is not the
        kind that holds it; a ConfigError naming the keys when it should and does not."""
        is_val = "val_samples" in record
        if self.monitor not in record:
            if is_val == self.monitor.startswith("val_"):
                known = sorted(k for k in record if k not in ("step", "epoch"))
                raise ConfigError(f"{type(self).__name__}: monitor {self.monitor!r} is not a logged metric; the metrics logged here are {known}")
            return None
        raw = record[self.monitor]
        value = float("nan") if raw is None else float(raw)
        return agree(engine, value)


class EarlyStopping(_Monitor):
    """Stop training when ``monitor`` has not improved for ``patience`` checks.

    A check is each record that holds the metric: every evaluation for ``val_*`` metrics
    (``val_every``), every log step for ``train_loss``. An improvement is a value better than the
    best so far by more than ``min_delta``. The value is agreed across ranks (`agree`) before the
    test, so every rank stops after the same step. Its state (best, wait) is saved with each
    checkpoint, so a resumed run counts patience from where it was. summary.json gets
    ``early_stopping``: the monitor, best value, stopped step (None when it did not stop).
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        super().__init__(monitor, mode, min_delta)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"EarlyStopping: patience must be a whole number >= 1 (checks without improvement); got {patience!r}")
        self.patience = patience
        self.best = float("nan")
        self.wait = 0
        self.stopped_step: int | None = None

    def on_metrics(self, trainer: Trainer, engine: Engine, record: MutableMapping[str, Any]) -> None:
        value = self.value_in(engine, record)
        if value is not None and self.stopped_step is None and self._stops(engine, value, trainer.step):
            trainer.should_stop = True

    def update(self, engine: Engine, value: float | torch.Tensor, step: int) -> bool:
        """In a loop of your own (the `Engine`): feed the monitored value after each check, on
        every rank; True when training should stop, the same answer on every rank (the value is
        agreed across them first, one all-reduce). ``state_dict`` goes into your checkpoint::

            if stop.update(engine, val_loss, step):
                break
        """
        if self.stopped_step is not None:
            return True
        return self._stops(engine, agree(engine, float(value)), step)

    def _stops(self, engine: Engine, value: float, step: int) -> bool:
        if self.better(value, self.best):
            self.best, self.wait = value, 0
            return False
        self.wait += 1
        if self.wait < self.patience:
            return False
        self.stopped_step = step
        engine.print(f"early stopping at step {step}: {self.monitor} did not improve on {self.best:.6g} for {self.wait} checks")
        return True

    def on_fit_end(self, trainer: Trainer, engine: Engine, summary: dict[str, Any]) -> None:
        summary["early_stopping"] = {"monitor": self.monitor, "mode": self.mode, "best": self.best, "wait": self.wait, "stopped_step": self.stopped_step}

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.wait = int(state["wait"])
        self.stopped_step = state.get("stopped_step")


class ModelCheckpoint(_Monitor):
    """Keep the ``save_top_k`` best checkpoints by ``monitor``, apart from the periodic ones.

    Each record holding the metric (an evaluation, for ``val_*``) whose agreed value ranks among
    the best ``save_top_k`` so far is saved, whole (model, optimizer, loader, callbacks: a run can
    resume from it), to ``dirpath/step-NNNNNNNN`` (default ``out/checkpoints/best``); the one it
    pushes out of the top k is deleted. Keep-last pruning and ``resume='auto'`` look only at
    ``out/checkpoints/step-*``, so the two sets never touch. summary.json gets ``best_model_score``,
    ``best_model_path`` and ``best_k`` (every kept checkpoint with its score).
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "min", save_top_k: int = 1, dirpath: str | None = None) -> None:
        super().__init__(monitor, mode)
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < 1:
            raise ConfigError(f"ModelCheckpoint: save_top_k must be a whole number >= 1; got {save_top_k!r}")
        self.save_top_k = save_top_k
        self.dirpath = dirpath
        self.best_k: list[dict[str, Any]] = []
        """The kept checkpoints, best first: ``{"step", "score", "path"}``."""

    def check(self, trainer: Trainer, has_val: bool) -> None:
        super().check(trainer, has_val)
        if self.dirpath is None and trainer.config.out is None and not trainer.config.fast_dev_run:
            raise ConfigError("ModelCheckpoint needs somewhere to write: set out=... (--out DIR) or ModelCheckpoint(dirpath=...)")

    def directory(self, trainer: Trainer) -> Path | None:
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.config.out) / "checkpoints" / "best" if trainer.config.out else None

    def _rank(self, entry: dict[str, Any]) -> tuple[float, int]:
        score = float(entry["score"])
        key = score if self.mode == "min" else -score
        return (math.inf if math.isnan(key) else key, int(entry["step"]))

    def on_metrics(self, trainer: Trainer, engine: Engine, record: MutableMapping[str, Any]) -> None:
        value = self.value_in(engine, record)
        root = self.directory(trainer)
        if value is None or root is None or trainer.saves_nothing:
            return
        if any(int(e["step"]) == trainer.step for e in self.best_k):
            return  # this step is kept already (an evaluation and the final one at the same step)
        full = len(self.best_k) >= self.save_top_k
        if full and not self.better(value, float(self.best_k[-1]["score"])):
            return
        path = root / f"step-{trainer.step:08d}"
        self.best_k.append({"step": trainer.step, "score": value, "path": str(path)})
        self.best_k.sort(key=self._rank)
        dropped = self.best_k[self.save_top_k :]
        del self.best_k[self.save_top_k :]
        trainer.save_checkpoint(path)  # collective: every rank reached the same decision
        if engine.is_rank_zero:
            for entry in dropped:
                shutil.rmtree(entry["path"], ignore_errors=True)

    def on_load_checkpoint(self, trainer: Trainer, engine: Engine, path: Path) -> None:
        """A best checkpoint written after the step resumed from belongs to steps that run again: remove it."""
        root = self.directory(trainer)
        if root is None or not engine.is_rank_zero or not root.is_dir():
            return
        kept = {str(Path(e["path"])) for e in self.best_k}
        for child in root.iterdir():
            if child.is_dir() and child.name.startswith("step-") and str(child) not in kept and int(child.name[5:] or 0) > trainer.step:
                shutil.rmtree(child, ignore_errors=True)

    @property
    def best_model_score(self) -> float | None:
        return float(self.best_k[0]["score"]) if self.best_k else None

    @property
    def best_model_path(self) -> str | None:
        return str(self.best_k[0]["path"]) if self.best_k else None

    def on_fit_end(self, trainer: Trainer, engine: Engine, summary: dict[str, Any]) -> None:
        summary["best_model_score"] = self.best_model_score
        summary["best_model_path"] = self.best_model_path
        summary["best_k"] = [dict(e) for e in self.best_k]
        summary["best_monitor"] = {"monitor": self.monitor, "mode": self.mode}

    def state_dict(self) -> dict[str, Any]:
        return {"best_k": [dict(e) for e in self.best_k]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_k = [dict(e) for e in state["best_k"]]


class LearningRateMonitor(Callback):
    """Add each parameter group's learning rate (and momentum, with ``log_momentum``) to every
    training log record: ``lr-<Optimizer>`` for one group, ``lr-<Optimizer>/pg<i>`` for several;
    momentum is SGD's ``momentum`` or Adam's first beta."""

    def __init__(self, log_momentum: bool = False) -> None:
        self.log_momentum = log_momentum

    def on_metrics(self, trainer: Trainer, engine: Engine, record: MutableMapping[str, Any]) -> None:
        optimizer = trainer.optimizer
        if "train_loss" not in record or optimizer is None:
            return
        name = type(optimizer).__name__
        groups = optimizer.param_groups
        for i, group in enumerate(groups):
            suffix = f"/pg{i}" if len(groups) > 1 else ""
            record[f"lr-{name}{suffix}"] = float(group["lr"])
            if self.log_momentum:
                momentum = group["betas"][0] if "betas" in group else group.get("momentum")
                if momentum is not None:
                    record[f"momentum-{name}{suffix}"] = float(momentum)
