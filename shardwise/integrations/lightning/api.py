"""Lightning's API as shardwise understands it: which modules are Lightning-style and what they may
not do (`check_module`), ``configure_optimizers``' return forms (`parse_optimizers`), ``self.trainer``
(`TrainerView`) and the `LightningModule` base class. See docs/integrations.md, "Lightning"."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.integrations.lightning.adapter import LightningAdapter
    from shardwise.trainer.loop import Trainer

SUPPORTED_HOOKS = frozenset(
    {
        "on_fit_start",
        "on_fit_end",
        "on_train_start",
        "on_train_end",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_validation_start",
        "on_validation_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_test_epoch_start",
        "on_test_epoch_end",
    }
)
"""The module hooks the Trainer calls (any other ``on_*`` method a module defines is refused)."""

UNSUPPORTED = {
    "setup": "build layers in __init__ (the Trainer places and shards the model itself)",
    "teardown": "put clean-up code after fit returns",
    "prepare_data": "prepare the data before calling fit",
    "configure_model": "build layers in __init__ (the strategy shards the built model)",
    "configure_sharded_model": "build layers in __init__ (the strategy shards the built model)",
    "configure_callbacks": "pass callbacks=[...] to the Trainer",
    "configure_gradient_clipping": "use Trainer(clip_grad_norm=...)",
    "optimizer_step": "the Trainer steps the optimizer; drop the override",
    "optimizer_zero_grad": "the Trainer zeroes the gradients; drop the override",
    "lr_scheduler_step": "return the scheduler from configure_optimizers and let the Trainer step it",
    "backward": "the strategy runs backward; drop the override",
    "train_dataloader": "pass the training data to fit(model, train_data, val_data)",
    "val_dataloader": "pass the validation data to fit(model, train_data, val_data)",
    "test_dataloader": "pass the data to trainer.test(model, data)",
    "predict_dataloader": "pass the data to trainer.predict(model, data)",
    "transfer_batch_to_device": "the Trainer moves batches; drop the override",
}
"""Lightning methods that change what the loop does; a module that overrides one is refused."""

_CALLS = {
    "manual_backward": "manual optimization (self.manual_backward)",
    "toggle_optimizer": "several optimizers (self.toggle_optimizer)",
    "untoggle_optimizer": "several optimizers (self.untoggle_optimizer)",
    "optimizers": "manual optimization (self.optimizers())",
    "lr_schedulers": "manual optimization (self.lr_schedulers())",
}
"""Calls inside a module's methods that need the loop Lightning runs for manual optimization."""

_BASE_MODULES = ("lightning.", "pytorch_lightning.", "lightning_fabric.", "torch.", "shardwise.")


def _owner(module: nn.Module, name: str) -> type | None:
    """The class in ``module``'s MRO that defines ``name`` (None when no class does)."""
    return next((cls for cls in type(module).__mro__ if name in vars(cls)), None)


def _defines(module: nn.Module, name: str) -> bool:
    """True when the user's code defines ``name`` (not a base class: Lightning's, torch's or ours)."""
    owner = _owner(module, name)
    return owner is not None and not (owner.__module__ + ".").startswith(_BASE_MODULES) and callable(getattr(module, name, None))


def is_lightning_module(module: Any) -> bool:
    """A module written for Lightning's API: it defines ``training_step`` and ``configure_optimizers``."""
    return isinstance(module, nn.Module) and _defines(module, "training_step") and _defines(module, "configure_optimizers")


def _user_classes(module: nn.Module) -> list[type]:
    return [cls for cls in type(module).__mro__ if not (cls.__module__ + ".").startswith(_BASE_MODULES) and cls is not object]


def check_module(module: nn.Module) -> None:
    """Refuse, with the hook's name, what the Trainer would otherwise skip or run differently."""
    kind = type(module).__name__
    if getattr(module, "automatic_optimization", True) is False:
        raise ConfigError(
            f"{kind} sets automatic_optimization = False: manual optimization is not supported; "
            "let training_step return the loss and the Trainer run backward and the optimizer step"
        )
    for cls in _user_classes(module):
        for name in vars(cls):
            if name in UNSUPPORTED:
                raise ConfigError(f"{kind} defines {name}(), which the Trainer does not call: {UNSUPPORTED[name]}")
            if name.startswith("on_") and callable(vars(cls)[name]) and name not in SUPPORTED_HOOKS:
                raise ConfigError(
                    f"{kind} defines the hook {name}(), which the Trainer does not call; "
                    f"supported hooks: {', '.join(sorted(SUPPORTED_HOOKS))} (move its code into one of them or a Callback)"
                )
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue  # no source (defined interactively): the runtime guards below still refuse
        for call, what in _CALLS.items():
            if re.search(rf"self\.{call}\(", source):
                raise ConfigError(f"{kind} calls self.{call}(): {what} is not supported; return the loss from training_step")


# -- configure_optimizers --------------------------------------------------------------------------


@dataclass
class SchedulerConfig:
    """One scheduler as ``configure_optimizers`` described it (Lightning's defaults)."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None


_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name"}


def _one(items: list[Any], what: str) -> Any:
    if len(items) != 1:
        raise ConfigError(
            f"configure_optimizers returned {len(items)} {what}s; one {what} is supported (several optimizers need manual optimization): return one {what}"
        )
    return items[0]


def _scheduler(item: Any, monitor: str | None) -> SchedulerConfig:
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - _SCHEDULER_KEYS)
        if unknown or "scheduler" not in item:
            raise ConfigError(f"an lr_scheduler dict takes the keys {sorted(_SCHEDULER_KEYS)} ('scheduler' required); got {sorted(item)}")
        config = SchedulerConfig(**{"monitor": monitor, **dict(item)})
    else:
        config = SchedulerConfig(item, monitor=monitor)
    if config.interval not in ("step", "epoch"):
        raise ConfigError(f"lr_scheduler interval must be 'step' or 'epoch'; got {config.interval!r}")
    if not isinstance(config.frequency, int) or config.frequency < 1:
        raise ConfigError(f"lr_scheduler frequency must be a whole number >= 1; got {config.frequency!r}")
    if not callable(getattr(config.scheduler, "step", None)):
        raise ConfigError(f"lr_scheduler must be a learning-rate scheduler; got {type(config.scheduler).__name__}")
    if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not config.monitor:
        raise ConfigError("ReduceLROnPlateau needs the logged value it watches: return {'optimizer': opt, 'lr_scheduler': sched, 'monitor': 'val_loss'}")
    return config


def parse_optimizers(result: Any) -> tuple[torch.optim.Optimizer, SchedulerConfig | None]:
    """The optimizer and scheduler of any ``configure_optimizers`` return form Lightning documents."""
    if isinstance(result, torch.optim.Optimizer):
        return result, None
    if isinstance(result, Mapping):
        if "optimizer" not in result:
            raise ConfigError(f"configure_optimizers returned a dict without 'optimizer'; got the keys {sorted(result)}")
        unknown = sorted(set(result) - {"optimizer", "lr_scheduler", "monitor"})
        if unknown:
            raise ConfigError(f"configure_optimizers dict takes 'optimizer', 'lr_scheduler' and 'monitor'; got also {unknown}")
        optimizer, _ = parse_optimizers(result["optimizer"])
        scheduler = result.get("lr_scheduler")
        return optimizer, None if scheduler is None else _scheduler(scheduler, result.get("monitor"))
    if isinstance(result, (list, tuple)):
        items = list(result)
        if len(items) == 2 and all(isinstance(x, (list, tuple)) for x in items):  # ([optimizers], [schedulers])
            optimizer, _ = parse_optimizers(_one(list(items[0]), "optimizer"))
            schedulers = list(items[1])
            return optimizer, _scheduler(_one(schedulers, "scheduler"), None) if schedulers else None
        return parse_optimizers(_one(items, "optimizer"))
    raise ConfigError(
        "configure_optimizers must return an optimizer, a list of one, a dict with 'optimizer' (and 'lr_scheduler'), "
        f"or ([optimizer], [scheduler]); got {type(result).__name__}"
    )


class Schedule:
    """Steps the configured scheduler where Lightning would: after every ``frequency`` optimizer steps
    (``interval='step'``) or epochs (``'epoch'``), with the monitored value for ``ReduceLROnPlateau``.
    Saved in checkpoints (``state_dict``) like any scheduler."""

    def __init__(self, config: SchedulerConfig, metrics: Callable[[], Mapping[str, float]]) -> None:
        self.config = config
        self.metrics = metrics
        self.steps = 0

    def step(self) -> None:
        """After each optimizer step that was taken (the Trainer calls it)."""
        self.steps += 1
        if self.config.interval == "step" and self.steps % self.config.frequency == 0:
            self._advance()

    def epoch_end(self, epoch: int) -> None:
        if self.config.interval == "epoch" and (epoch + 1) % self.config.frequency == 0:
            self._advance()

    def _advance(self) -> None:
        monitor = self.config.monitor
        if monitor is None:
            self.config.scheduler.step()
            return
        values = self.metrics()
        if monitor not in values:
            if self.config.strict:
                raise ConfigError(f"lr_scheduler monitor {monitor!r} was not logged; logged so far: {sorted(values)}")
            return
        self.config.scheduler.step(values[monitor])

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.config.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.config.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])


# -- the module's view of the Trainer ---------------------------------------------------------------


class TrainerView:
    """What ``self.trainer`` offers the module: counters and settings of the running fit."""

    def __init__(self, trainer: Trainer, adapter: LightningAdapter, engine: Engine | None, total: int | None) -> None:
        self._trainer, self._adapter, self._engine = trainer, adapter, engine
        self.max_steps = trainer.config.max_steps or -1
        self.max_epochs = trainer.config.max_epochs
        self.estimated_stepping_batches = total if total is not None else float("inf")
        self.world_size = engine.world_size if engine is not None else trainer.config.nproc
        self.global_rank = engine.rank if engine is not None else 0
        self.is_global_zero = self.global_rank == 0
        self.sanity_checking = False

    @property
    def global_step(self) -> int:
        return self._trainer.step

    @property
    def current_epoch(self) -> int:
        return self._adapter.epoch

    @property
    def should_stop(self) -> bool:
        return self._trainer.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._trainer.should_stop = bool(value)

    @property
    def callback_metrics(self) -> dict[str, float]:
        return dict(self._adapter.latest)

    logged_metrics = callback_metrics


# -- the base class ----------------------------------------------------------------------------------


def _refused(what: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"{what} is not supported by shardwise's Trainer; return the loss from training_step")

    return method


class LightningModule(nn.Module):
    """A base class with what a LightningModule's code uses (``self.log``, ``self.device``,
    ``self.global_step``, ``self.trainer``, ``save_hyperparameters``), for moving Lightning code over
    without Lightning: replace ``L.LightningModule`` by this class; the rest stays as it is."""

    automatic_optimization = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trainer: TrainerView | None = None
        self.hparams: dict[str, Any] = {}

    @property
    def trainer(self) -> TrainerView:
        if self._trainer is None:
            raise ConfigError(f"{type(self).__name__} is not attached to a Trainer: self.trainer exists while Trainer.fit, validate, test or predict runs it")
        return self._trainer

    @trainer.setter
    def trainer(self, view: TrainerView | None) -> None:
        self._trainer = view

    @property
    def device(self) -> torch.device:
        first = next(self.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        raise ConfigError("self.log works while shardwise's Trainer runs the module (fit, validate, test)")

    def log_dict(self, values: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value, **kwargs)

    def save_hyperparameters(self, *names: str, ignore: Iterable[str] | str | None = None) -> None:
        """Record the ``__init__`` arguments of the caller (all, or ``names``) in ``self.hparams``."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        values = dict(caller.f_locals) if caller is not None else {}
        skip = {ignore} if isinstance(ignore, str) else set(ignore or ())
        skip |= {"self", "__class__"}
        chosen = names or tuple(k for k in values if k not in skip and not k.startswith("_"))
        self.hparams.update({k: values[k] for k in chosen if k in values})

    manual_backward = _refused("manual optimization (self.manual_backward)")
    toggle_optimizer = _refused("several optimizers (self.toggle_optimizer)")
    optimizers = _refused("manual optimization (self.optimizers())")
