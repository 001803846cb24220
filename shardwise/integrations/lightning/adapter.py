"""The adapter that runs a Lightning-style module in the `Trainer` (`shardwise.trainer.adapters`):
its optimizer and schedule, ``self.log``, ``batch_idx`` and its hooks. See docs/integrations.md, "Lightning"."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.integrations.lightning.api import Schedule, SchedulerConfig, TrainerView, _defines, check_module, is_lightning_module, parse_optimizers
from shardwise.trainer import evaluate as _evaluate
from shardwise.trainer.adapters import register_adapter
from shardwise.trainer.evaluate import batch_size_of

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer

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
        """``self.log`` as in Lightning (docs/integrations.md, "Lightning", says where each value goes)."""
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


@register_adapter
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
