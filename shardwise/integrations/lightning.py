"""Lightning-style modules in the `Trainer`: a module written for Lightning's API trains as it is.

A module that defines both ``training_step`` and ``configure_optimizers`` is taken as a
LightningModule (duck typing: Lightning is never imported). Write it as for Lightning, with
`LightningModule` from here as the base class (or a real ``lightning.LightningModule``, which
works unchanged when Lightning is installed)::

    from shardwise import Trainer
    from shardwise.integrations.lightning import LightningModule

    class Classifier(LightningModule):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)
        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))
        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self(batch[0]), batch[1])
            self.log("train_loss", loss, prog_bar=True)
            return loss
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": StepLR(opt, 10), "interval": "step"}}

    Trainer(strategy="ddp", nproc=2, max_epochs=3, out="runs/lit").fit(Classifier(), train_set)

What is supported:

- ``training_step(batch, batch_idx)`` returning the loss or a dict with ``"loss"``; ``validation_step``
  and ``test_step`` (through ``Trainer.fit``'s validation, ``Trainer.validate`` and ``Trainer.test``),
  ``predict_step(batch, batch_idx)`` (``Trainer.predict``).
- ``configure_optimizers`` in every return form Lightning documents, with one optimizer: an optimizer;
  a list or tuple of one; a dict ``{"optimizer", "lr_scheduler", "monitor"}`` whose ``lr_scheduler`` is
  a scheduler or a dict ``{"scheduler", "interval": "step"|"epoch", "frequency", "monitor", "strict",
  "name"}``; two lists ``([optimizer], [scheduler])``. A scheduler given bare steps once per epoch, as in
  Lightning. ``ReduceLROnPlateau`` reads its ``monitor`` from the values logged so far.
- ``self.log(name, value, prog_bar=, on_step=, on_epoch=, sync_dist=, batch_size=, logger=)`` and
  ``self.log_dict``: values go into ``metrics.jsonl`` and the loggers (rank 0 writes). In
  ``training_step`` the default is ``on_step=True``: the step's value (the mean over its micro-batches;
  over every data-parallel rank with ``sync_dist=True``, else rank 0's own) joins the training record
  of each logged step. ``on_epoch=True`` values are averaged over the epoch weighted by batch size and
  **always** reduced over every rank, so every rank agrees; they are logged in one record when the
  epoch ends (``NAME_step`` / ``NAME_epoch`` when both are on). In ``validation_step`` / ``test_step``
  each value is the mean over every sample, counted once whatever the world size.
- ``self.device``, ``self.global_step``, ``self.current_epoch``, ``self.trainer`` (``global_step``,
  ``current_epoch``, ``max_epochs``, ``max_steps``, ``estimated_stepping_batches``, ``world_size``,
  ``global_rank``, ``is_global_zero``, ``should_stop``, ``callback_metrics``), ``self.hparams`` and
  ``self.save_hyperparameters()``.
- Hooks without a batch argument: ``SUPPORTED_HOOKS``. They run on every rank, before the Trainer's
  own callbacks.

Anything else a Lightning module may rely on (manual optimization, several optimizers, the per-batch
and per-backward hooks, ``setup``, its own data loaders, ...) is refused in the parent, before any
process starts, with a one-line `ConfigError` naming it, so that nothing is silently skipped.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.trainer import evaluate as _evaluate
from shardwise.trainer.evaluate import batch_size_of

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer

__all__ = ["SUPPORTED_HOOKS", "LightningAdapter", "LightningModule", "adapter_for", "is_lightning_module", "parse_optimizers"]

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


# -- the adapter ------------------------------------------------------------------------------------


@dataclass
class _Logged:
    """One logged name: its running sums, and how it was logged."""

    total: float = 0.0
    weight: float = 0.0
    sync: bool = False
    logger: bool = True

    def add(self, value: float, weight: float) -> None:
        self.total += value * weight
        self.weight += weight


def _as_float(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor):
        from shardwise.checkpoint import full_tensor

        tensor = full_tensor(value).detach()
        if tensor.numel() != 1:
            raise ConfigError(f"self.log({name!r}, ...) takes a scalar; got a tensor of shape {tuple(tensor.shape)}")
        return float(tensor.item())
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise ConfigError(f"self.log({name!r}, ...) takes a number or a scalar tensor; got {type(value).__name__} (log metric.compute() for a metric object)")


class LightningAdapter:
    """Runs a Lightning-style module inside the Trainer: its optimizer and schedule, ``self.log``,
    ``batch_idx``, and its hooks (as the Trainer's first callback). Built in the parent by
    `adapter_for`; bound to the module in each process by `bind`."""

    def __init__(self, kind: str, total: int | None = None) -> None:
        self.kind = kind
        self.total = total
        self.epoch = 0
        self.latest: dict[str, float] = {}
        self.schedule: Schedule | None = None
        self._module: nn.Module | None = None
        self._trainer: Trainer | None = None
        self._engine: Engine | None = None
        self._context: str | None = None
        self._batch: Any = None
        self._batch_idx = 0
        self._step: dict[str, _Logged] = {}
        self._epoch: dict[str, _Logged] = {}
        self._hook: dict[str, _Logged] = {}
        self._configured: torch.optim.Optimizer | None = None
        self._scheduler: SchedulerConfig | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"kind": self.kind, "total": self.total}  # only the description crosses to the workers; bind builds the rest

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["kind"], state["total"])  # type: ignore[misc]

    @property
    def bound(self) -> bool:
        return self._module is not None

    # -- binding --------------------------------------------------------------------------------
    def bind(self, trainer: Trainer, module: nn.Module, engine: Engine | None) -> None:
        """Attach to ``module`` in this process: ``self.trainer``, ``self.log`` and the step shims."""
        self.__init__(self.kind, self.total)  # type: ignore[misc]
        self._module, self._trainer, self._engine = module, trainer, engine
        # nn.Module keeps plain attributes in __dict__; `trainer` may be a property (Lightning's, ours)
        setattr(module, "trainer", TrainerView(trainer, self, engine, self.total))  # noqa: B010
        own = module.__dict__
        own["log"], own["log_dict"] = self.log, self.log_dict
        user_step: Callable[..., Any] = module.training_step  # type: ignore[assignment]
        user_predict = getattr(module, "predict_step", None)
        takes_idx = _takes_index(user_step)

        def training_step(batch: Any) -> torch.Tensor:
            return self._training_step(user_step, batch, takes_idx)

        own["training_step"] = training_step  # what the Trainer's step function calls
        if callable(user_predict) and _defines(module, "predict_step"):
            own["predict_step"] = lambda batch: self._call(user_predict, batch, "predict")

    def detach(self) -> None:
        """Remove what `bind` added (the module may be the caller's own, in a one-process run)."""
        module = self._module
        if module is None:
            return
        for name in ("log", "log_dict", "training_step", "predict_step"):
            module.__dict__.pop(name, None)
        if "trainer" in module.__dict__:
            del module.__dict__["trainer"]
        else:
            setattr(module, "trainer", None)  # noqa: B010
        self._module = self._trainer = self._engine = None

    # -- optimizer and schedule -----------------------------------------------------------------
    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The optimizer factory the strategy calls: the module's ``configure_optimizers``, checked to
        optimize parameters the strategy hands over (its shards under sharded strategies)."""
        assert self._module is not None
        configure: Callable[[], Any] = self._module.configure_optimizers  # type: ignore[assignment]
        optimizer, scheduler = parse_optimizers(configure())
        given = {id(p) for p in params}
        strays = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in given)
        if strays:
            raise ConfigError(
                f"configure_optimizers optimizes {strays} tensor(s) that the strategy does not train in this process; "
                "build the optimizer over self.parameters() inside configure_optimizers"
            )
        self._configured, self._scheduler = optimizer, scheduler
        return optimizer

    def make_schedule(self, optimizer: torch.optim.Optimizer) -> Schedule | None:
        """The scheduler configure_optimizers returned, stepped as Lightning would (None without one)."""
        config = self._scheduler
        if config is None:
            return None
        if optimizer is not self._configured:  # the strategy rebuilt the optimizer from the one returned (zero1)
            config.scheduler.optimizer = optimizer
        self.schedule = Schedule(config, lambda: self.latest)
        return self.schedule

    # -- self.log ------------------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """``self.log`` as in Lightning (see the module docstring for where each value goes)."""
        context = self._context
        if context is None or context == "end":
            raise ConfigError(
                f"self.log({name!r}, ...) was called outside training_step, validation_step, test_step and the epoch hooks "
                "(on_train_epoch_start/end, on_validation_epoch_start/end, on_test_epoch_start/end); log from one of them"
            )
        if reduce_fx not in ("mean", torch.mean):
            raise ConfigError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): only the mean is supported")
        if sync_dist_group is not None:
            raise ConfigError(f"self.log({name!r}, sync_dist_group=...) is not supported: values reduce over every data-parallel rank")
        x = _as_float(value, name)
        keep = logger is not False
        if context == "train":
            weight = float(batch_size if batch_size is not None else batch_size_of(self._batch))
            step = True if on_step is None else on_step
            epoch = False if on_epoch is None else on_epoch
            if step:
                self._step.setdefault(name, _Logged(sync=sync_dist, logger=keep)).add(x, weight)
            if epoch:
                self._epoch.setdefault(name, _Logged(sync=True, logger=keep)).add(x, weight)
            if step and epoch:  # Lightning's names for a value logged both ways
                self._step[f"{name}_step"] = self._step.pop(name)
                self._epoch[f"{name}_epoch"] = self._epoch.pop(name)
            for key, logged in self._step.items():  # this rank's value so far, for a scheduler's monitor this step
                self.latest[key] = logged.total / max(logged.weight, 1e-300)
        elif context in ("val", "test"):
            self._hook[name] = _Logged(x, 1.0, logger=keep)  # the evaluation weights it by the batch
        else:  # an epoch hook: one value per rank, averaged over the ranks
            target = self._epoch if context == "train_epoch" else self._hook
            target.setdefault(name, _Logged(sync=True, logger=keep)).add(x, 1.0)

    def log_dict(self, values: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value, **kwargs)

    def _reduce(self, logged: dict[str, _Logged], everywhere: bool) -> dict[str, float]:
        """Means of the logged values; over every rank for the synchronized ones (one collective)."""
        names = sorted(logged)
        synced = [n for n in names if everywhere or logged[n].sync]
        out = {n: logged[n].total / max(logged[n].weight, 1e-300) for n in names if n not in synced}
        if synced and self._engine is not None:
            sums = torch.tensor([[logged[n].total, logged[n].weight] for n in synced], dtype=torch.float64, device=self._engine.device)
            self._engine.all_reduce(sums, "sum")
            out.update({n: float(sums[i, 0] / sums[i, 1]) for i, n in enumerate(synced)})
        elif synced:
            out.update({n: logged[n].total / max(logged[n].weight, 1e-300) for n in synced})
        self.latest.update(out)
        return {n: v for n, v in out.items() if logged[n].logger}

    # -- the steps -----------------------------------------------------------------------------
    def _call(self, method: Callable[..., Any], batch: Any, context: str) -> Any:
        previous, self._context, self._batch = self._context, context, batch
        try:
            result = method(batch, self._batch_idx)
        finally:
            self._context = previous
            self._batch_idx += 1
        return result

    def _training_step(self, user_step: Callable[..., Any], batch: Any, takes_idx: bool) -> torch.Tensor:
        self._context, self._batch = "train", batch
        try:
            result = user_step(batch, self._batch_idx) if takes_idx else user_step(batch)
        finally:
            self._context = None
            self._batch_idx += 1
        if isinstance(result, Mapping):
            if "loss" not in result:
                raise ConfigError(f"training_step returned a dict without 'loss' (keys {sorted(result)}); return the loss or {{'loss': loss, ...}}")
            result = result["loss"]
        if result is None:
            raise ConfigError(f"{self.kind}.training_step returned None (skipping a batch): not supported, every rank must step together; return the loss")
        if not isinstance(result, torch.Tensor):
            raise ConfigError(f"training_step must return the loss tensor; got {type(result).__name__}")
        return result

    def evaluate(self, engine: Engine, module: nn.Module, dataset: Any, collate: Any, batch_size: int, prefix: str) -> dict[str, float]:
        """``validation_step`` / ``test_step`` over the data, every sample counted once: the logged
        values by the names they were logged under, then the epoch-end hook's values."""
        step = getattr(module, "validation_step" if prefix == "val" else "test_step")
        self._batch_idx = 0
        self._hook_call(f"on_{'validation' if prefix == 'val' else prefix}_epoch_start", prefix)

        def eval_fn(_: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
            self._hook = {}
            self._call(step, batch, prefix)
            return {name: torch.tensor(v.total, dtype=torch.float64) for name, v in self._hook.items()}

        out = _evaluate.evaluate(engine, module, dataset, collate, batch_size, eval_fn, prefix)
        cut = len(prefix) + 1
        values = {k if k == f"{prefix}_samples" else k[cut:]: v for k, v in out.items()}
        self.latest.update({k: v for k, v in values.items() if isinstance(v, float)})
        self._hook = {}
        self._hook_call(f"on_{'validation' if prefix == 'val' else prefix}_epoch_end", f"{prefix}_epoch")
        values.update(self._reduce(self._hook, everywhere=True))
        self._hook = {}
        return values

    def _hook_call(self, name: str, context: str) -> None:
        module = self._module
        if module is not None and _defines(module, name):
            previous, self._context = self._context, context
            try:
                getattr(module, name)()
            finally:
                self._context = previous

    # -- the Trainer's callback hooks (called first, on every rank) ----------------------------------
    def on_fit_start(self, trainer: Trainer, engine: Engine) -> None:
        self._hook_call("on_fit_start", "end")
        self._hook_call("on_train_start", "end")

    def on_train_epoch_start(self, trainer: Trainer, engine: Engine, epoch: int) -> None:
        self.epoch, self._batch_idx = epoch, 0
        self._hook_call("on_train_epoch_start", "train_epoch")

    def on_metrics(self, trainer: Trainer, engine: Engine, record: dict[str, Any]) -> None:
        if "samples_per_s" in record and self._step:  # the training record of a logged step
            record.update(self._reduce(self._step, everywhere=False))
        if "samples_per_s" in record:
            self._step = {}
        self.latest.update({k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "step"})

    def on_train_step_start(self, trainer: Trainer, engine: Engine, step: int) -> None:
        self._step = {}  # a step that is not logged leaves its values behind (log_every, as in Lightning)

    def on_validation_start(self, trainer: Trainer, engine: Engine) -> None:
        self._hook_call("on_validation_start", "end")

    def on_validation_end(self, trainer: Trainer, engine: Engine, metrics: dict[str, float]) -> None:
        self._hook_call("on_validation_end", "end")

    def on_train_epoch_end(self, trainer: Trainer, engine: Engine, epoch: int) -> None:
        self._hook_call("on_train_epoch_end", "train_epoch")
        self._flush_epoch(trainer, epoch)
        if self.schedule is not None:
            self.schedule.epoch_end(epoch)

    def _flush_epoch(self, trainer: Trainer, epoch: int) -> None:
        if self._epoch:
            values = self._reduce(self._epoch, everywhere=True)
            self._epoch = {}
            if values:
                trainer._emit({"step": trainer.step, "epoch": epoch, **values})

    def on_fit_end(self, trainer: Trainer, engine: Engine, summary: dict[str, Any]) -> None:
        self._flush_epoch(trainer, self.epoch)  # a fit that stopped inside an epoch (max_steps)
        self._hook_call("on_train_end", "end")
        self._hook_call("on_fit_end", "end")


def _takes_index(method: Callable[..., Any]) -> bool:
    """True when ``method`` accepts ``batch_idx`` after the batch (Lightning's signature)."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def adapter_for(trainer: Trainer, model: nn.Module, kind: str, *, has_val: bool = False, total: int | None = None) -> LightningAdapter | None:
    """The adapter for a Lightning-style ``model`` (None for any other module), after every check
    that can be made in the parent: the Trainer's settings, the module's hooks, the step ``kind``
    ("fit", "val", "test", "predict") needs, and (for fit) what ``configure_optimizers`` returns.
    ``total`` is the fit's estimated number of optimizer steps (``trainer.estimated_stepping_batches``)."""
    if not is_lightning_module(model):
        return None
    name = type(model).__name__
    if kind == "fit":
        if trainer.optimizer_given:
            raise ConfigError(f"{name} defines configure_optimizers: drop Trainer(optimizer=...) (giving both is ambiguous)")
        if trainer.lr_scheduler is not None:
            raise ConfigError(f"{name} defines configure_optimizers: return the scheduler from it and drop Trainer(lr_scheduler=...)")
        if trainer.loss_fn is not None:
            raise ConfigError(f"{name} defines training_step: drop Trainer(loss_fn=...) (the loss is what training_step returns)")
    needs = {"val": "validation_step", "test": "test_step"}.get(kind, "validation_step" if has_val else None)
    if needs is not None and not _defines(model, needs):
        what = "validation data was given to fit" if kind == "fit" else f"Trainer.{'validate' if kind == 'val' else kind}"
        raise ConfigError(f"{what} but {name} defines no {needs}(batch, batch_idx); define it" + (" or drop the validation data" if kind == "fit" else ""))
    check_module(model)
    adapter = LightningAdapter(name, total)
    if kind == "fit":  # the return form, checked here on the parent's copy (the optimizer it builds is discarded)
        adapter.bind(trainer, model, None)
        try:
            adapter.make_optimizer(list(model.parameters()))
        finally:
            adapter.detach()
    return adapter
