"""Layer 5: the `Trainer`. ``fit``, ``validate``, ``test`` and ``predict`` check and plan in the caller's
process (`shardwise.trainer.plan`), start the worker processes when the job needs them, and run the loop
in each (`shardwise.trainer.fit.FitRun`; evaluation in `shardwise.trainer.evaluate`). Map: docs/trainer.md.

The constructor starts the launcher's zygote early (`shardwise.launcher.spawn.prestart`), on purpose: the
ranks' interpreter imports torch while the caller builds its model and data."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.checkpoint.rundir import move_aside, new_run_id
from shardwise.data import ShardedLoader, StreamLoader, unpack_data
from shardwise.data.batches import call_model, loss_from_output
from shardwise.data.stream import is_stream
from shardwise.engine import Engine
from shardwise.engine.loggers import Logger, flatten
from shardwise.errors import ConfigError
from shardwise.launcher.env import detect_env, user_threads
from shardwise.launcher.spawn import launch, prestart, stop_if_bootstrapping
from shardwise.strategies import Layout, OptimizerFactory, Strategy, materialize
from shardwise.trainer import callbacks, evaluate, handoff, plan, streams
from shardwise.trainer.adapters import ModelAdapter
from shardwise.trainer.config import TrainerConfig, from_mapping
from shardwise.trainer.evaluate import batch_size_of, copies_per_shard
from shardwise.trainer.fit import FitRun, make_step_fn
from shardwise.trainer.logging import add_launcher_memory
from shardwise.trainer.lr_find import lr_find
from shardwise.trainer.preempt import Preemption

__all__ = ["Trainer", "batch_size_of", "copies_per_shard", "make_step_fn"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, batch) -> scalar loss`` (mean over the batch)."""
MetricFn = Callable[[Any, Any], torch.Tensor]
"""``metric(output, batch) -> scalar`` averaged over the batch (e.g. accuracy)."""
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def _no_record(record: dict[str, Any]) -> None:
    """``Trainer._emit`` outside a fit: nothing is written."""


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Trainer:
    """Fit a plain ``nn.Module`` with any registered strategy.

    >>> trainer = Trainer(strategy="ddp", nproc=2, global_batch_size=64, max_steps=100,
    ...                   optimizer=make_adam, loss_fn=cross_entropy_loss)   # doctest: +SKIP
    >>> summary = trainer.fit(model, train_set, val_set)                     # doctest: +SKIP

    ``optimizer`` is a factory of the parameters (strategies that shard build the
    optimizer after wrapping). The loss is ``loss_fn(output, batch)`` or, without
    one, the module's ``training_step(batch)``. A module written for Lightning (``training_step``
    and ``configure_optimizers``) trains as it is: see `shardwise.integrations.lightning`. With ``nproc > 1`` (and no launcher
    around), ``fit`` starts the worker processes itself and, when they finish,
    loads the trained weights back into ``model``.
    """

    def __init__(
        self,
        *,
        optimizer: OptimizerFactory | None = None,
        loss_fn: LossFn | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        metrics: Mapping[str, MetricFn] | None = None,
        callbacks: Sequence[Any] = (),
        loggers: Sequence[str | Logger] | str | None = None,
        hparams: Mapping[str, Any] | None = None,
        config: TrainerConfig | None = None,
        devices: int | None = None,
        **settings: Any,
    ) -> None:
        if devices is not None:
            settings.setdefault("nproc", devices)
        self.logger_objects: list[Logger] = []
        """Loggers given as objects (`Logger` subclasses); names go to ``config.loggers``."""
        if loggers is not None:
            items = loggers.split(",") if isinstance(loggers, str) else list(loggers)
            for item in items:
                if not isinstance(item, (str, Logger)):
                    raise ConfigError(f"loggers takes names ('csv', 'tensorboard', 'mlflow', 'wandb') or Logger objects; got {type(item).__name__}")
            self.logger_objects = [item for item in items if isinstance(item, Logger)]
            settings["loggers"] = tuple(item for item in items if isinstance(item, str))
        self.config = from_mapping(settings, base=config)
        prestart(self.config.nproc, self.config.start_method, self.config.accelerator)  # the ranks' zygote imports torch while the model is built
        self.hparams = dict(hparams or {})
        """Extra hyperparameters for the loggers (the CLI passes the recipe's options)."""
        self.optimizer_factory = optimizer or _default_optimizer
        self.optimizer_given = optimizer is not None
        self._adapter: ModelAdapter | None = None
        """The adapter of a module written for another API (`shardwise.trainer.adapters`); None for a plain module."""
        self._threads_from: str | None = None  # set while launching: why the started ranks run their thread count
        self._return_weights = True  # whether fit's workers send the trained weights back (set by fit: `handoff.returns_weights`)
        self.loss_fn = loss_fn
        self.lr_scheduler = lr_scheduler
        self.metrics = dict(metrics or {})
        self.callbacks = list(callbacks)
        self.engine: Engine | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        """The running fit's optimizer (for callbacks; None outside fit)."""
        self.model: nn.Module | None = None
        """The running fit's model as the strategy wrapped it (for callbacks: ``engine.unwrap(trainer.model)``
        is the user's module; None outside fit)."""
        self.step = 0
        self.should_stop = False
        self.preemption = Preemption()
        """The preemption signal this process got during the running fit (`shardwise.trainer.preempt`)."""
        self._engine: Engine | None = None
        self._state: dict[str, Any] | None = None
        self._strategy: Strategy | None = None
        self._layout: Layout | None = None
        self._flops: dict[str, Any] | None = None  # the model's FLOPs per sample, counted before launch (`shardwise.trainer.throughput`)
        self._last_loss: torch.Tensor | None = None  # the last step's loss (rank 0's goes into a checkpoint's manifest)
        self._emit: Callable[[dict[str, Any]], None] = _no_record
        """The running fit's record writer (`FitRun.emit`), for adapters that log records of their own."""

    # -- checks before anything runs ------------------------------------------------------
    def _check(self, model: nn.Module, train_data: Any, val_data: Any = None) -> None:
        """Every check ``fit`` makes before a process starts, and the plan (`shardwise.trainer.plan`)."""
        plan.check_fit(self, model, train_data, val_data)

    def _check_tools(self, val_data: Any, model: nn.Module | None = None) -> None:
        """Loggers and callbacks that cannot work, refused before launch (`shardwise.trainer.plan.check_tools`)."""
        plan.check_tools(self, val_data, model)

    @property
    def layout(self) -> Layout | None:
        """The strategy's plan of the running (or last) fit or evaluation: world size, training and
        serving ranks (`Layout`); None before ``fit`` has checked its arguments. For callbacks' ``check``."""
        return self._layout

    @property
    def saves_nothing(self) -> bool:
        """True under ``fast_dev_run`` (nothing is written: no checkpoints, no logs)."""
        return bool(self.config.fast_dev_run)

    def hyperparameters(self) -> dict[str, Any]:
        """What the loggers record as hyperparameters: the resolved configuration, flat
        (``strategy_options.NAME``, ``mesh.tp``), and the ``hparams`` the Trainer was given."""
        import dataclasses

        values = dataclasses.asdict(self.config)
        values["optimizer"] = getattr(self.optimizer_factory, "__name__", None) or type(self.optimizer_factory).__name__
        if self._layout is not None:
            values["world_size"] = self._layout.world_size
        return {k: v for k, v in flatten({**values, **self.hparams}).items() if v is not None and v != ""}

    def _expendable_ranks(self) -> list[int]:
        """Ranks whose death the run survives, as the plan said (asynchronous parameter-server
        workers other than rank 0); none for most strategies."""
        return list(self._layout.expendable) if self._layout is not None else []

    def _global_batch(self, dl_batch: int | None) -> int:
        return self.config.global_batch_size or dl_batch or 32

    def _batch_notes(self, global_batch: int, dl_batch: int | None, loader: ShardedLoader | StreamLoader) -> dict[str, Any]:
        """What the run's first lines say about the batch (rank 0 prints them): a global batch nobody set,
        and the samples each epoch leaves out."""
        lines = []
        source = "global_batch_size" if self.config.global_batch_size else "dataloader" if dl_batch else "default"
        if source == "default":
            lines.append(f"global batch {global_batch} (the default; set global_batch_size=... or --global-batch-size)")
        elif source == "dataloader":
            lines.append(f"global batch {global_batch} (the DataLoader's batch size; global_batch_size=... sets another)")
        if loader.left_out and loader.limit is None:
            lines.append(
                f"{loader.left_out} samples of {loader.n} are left out of each epoch ({loader.n} % global batch {global_batch}); "
                "drop_last=False keeps them (one more, smaller step an epoch, exact)"
            )
        return {"lines": lines + streams.notes(loader), "from": source}

    # -- fit ------------------------------------------------------------------------------
    tune_lr = lr_find
    """The learning-rate range test (`shardwise.trainer.lr_find.lr_find`): ``trainer.tune_lr(model, data)``."""

    def fit(self, model: nn.Module, train_data: Any, val_data: Any = None) -> dict[str, Any]:
        """Train ``model``; returns the run summary (also written to ``out/summary.json``).

        With worker processes each one trains the model its run of the script built (`trainer.handoff`), and the
        trained weights are set into ``model`` here unless ``return_weights`` says otherwise (a meta-built model's
        are in ``out/checkpoints`` only)."""
        materialize.note_build_state(model)  # built under torch.device("meta"): its initializers replay from this generator state
        stop_if_bootstrapping(model=model)  # a worker importing an unguarded script stops here, keeping its model (see launcher.worker)
        self._check(model, train_data, val_data)
        env = detect_env()
        cfg = self.config
        if cfg.overwrite and cfg.out and cfg.resume is None and env.rank == 0 and not cfg.fast_dev_run:
            aside = move_aside(cfg.out)
            if aside is not None:
                print(f"shardwise: overwrite: the earlier run in {cfg.out} was moved to {aside}", flush=True)
        self._run_id = new_run_id()  # the lineage of this run's checkpoints (a resume takes the checkpoint's)
        self._return_weights = handoff.returns_weights(cfg.return_weights, model, bool(cfg.out) and not cfg.fast_dev_run)
        result = self._launch(_fit_worker, model, train_data, val_data)
        if result is None:
            summary, _ = self._fit(model, train_data, val_data, return_state=False)
            return summary
        summary, state = result
        if state is not None:
            model.load_state_dict(state)
        elif cfg.announce_outputs and summary.get("last_checkpoint"):
            print(
                f"shardwise: the trained weights are in {summary['last_checkpoint']}; `model` in this process was not changed "
                f"(return_weights={cfg.return_weights!r}{', a model built on the meta device' if materialize.has_meta(model) else ''})",
                flush=True,
            )
        return add_launcher_memory(summary, self.config.out, model, state, show=self.config.announce_outputs)

    def _launch(self, worker: Callable[..., Any], model: nn.Module, *args: Any) -> Any:
        """Start the worker processes and return rank 0's result, or None when this process runs
        the loop itself (one process, or started by a launcher)."""
        env = detect_env()
        strategy = self._strategy
        needs_group = strategy is None or strategy.needs_process_group
        if env.distributed or not (self.config.nproc > 1 or needs_group):
            return None
        sent, weights_dir = handoff.for_workers(model, self._adapter is not None)  # no model bytes where workers build their own
        try:
            results = self._launch_workers(worker, sent, *args)
        finally:
            if weights_dir is not None:
                weights_dir.cleanup()
        return results[0]

    def _launch_workers(self, worker: Callable[..., Any], model: Any, *args: Any) -> list[Any]:
        threads, self._threads_from = self._threads_choice(self.config.nproc)
        try:
            return self._launch_ranks(worker, model, threads, *args)
        finally:
            self._threads_from = None

    def _launch_ranks(self, worker: Callable[..., Any], model: Any, threads: int | None, *args: Any) -> list[Any]:
        return launch(
            worker,
            self,
            model,
            *args,
            nproc=self.config.nproc,
            threads_per_proc=threads,
            start_method=self.config.start_method,
            accelerator="cpu" if self.config.accelerator == "cpu" else "auto",
            collective_timeout_s=self.config.timeout_s,
            expendable=self._expendable_ranks(),
            error_dir=Path(self.config.out) / "errors" if self.config.out else None,
            debug_collectives=self.config.debug_collectives,
        )

    def _threads_choice(self, nproc: int | None) -> tuple[int | None, str]:
        """The intra-op threads of each training process and why: for ``nproc`` started processes, or (None) for this
        one, where None leaves torch's own count (which torch took from a user's OMP_NUM_THREADS at its start, unless
        this program has set another since: that one stands)."""
        if self.config.threads:
            return self.config.threads, "the threads setting"
        omp = user_threads()
        if nproc is None:
            return None, "torch's default" if omp is None else "OMP_NUM_THREADS" if omp == torch.get_num_threads() else "torch.set_num_threads here"
        if omp:
            return omp, "OMP_NUM_THREADS"
        cores = os.cpu_count() or 1
        return max(1, cores // nproc), f"{cores} cores // {nproc} processes"

    @contextlib.contextmanager
    def _threads_applied(self) -> Iterator[None]:
        """This process's threads for the run (put back after it); a started rank's were set by the launcher."""
        before = torch.get_num_threads()
        threads, source = (None, self._threads_from) if self._threads_from else self._threads_choice(None)
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads_note = (torch.get_num_threads(), source)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _make_engine(self) -> Engine:
        cfg = self.config
        if cfg.debug_collectives:
            os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # joining a job in this process: before its group exists
        strategy, layout = self._strategy, self._layout
        return Engine(
            strategy=strategy if strategy is not None else cfg.strategy,
            accelerator=cfg.accelerator,
            precision=cfg.precision,
            strategy_options=None if strategy is not None else cfg.strategy_options,
            mesh=cfg.mesh,
            seed=cfg.seed,
            deterministic=cfg.deterministic,
            timeout_s=cfg.timeout_s,
            sync_batchnorm=cfg.sync_batchnorm,
            layout=layout,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
        )

    def _fit(self, model: nn.Module, train_data: Any, val_data: Any, *, return_state: bool) -> tuple[dict[str, Any], Any]:
        wall_start = time.perf_counter()
        engine = self._make_engine()
        self.engine = engine
        self.preemption = Preemption()
        try:
            with self.preemption.installed(self.config.preempt_signals), self._threads_applied():
                return FitRun(self, engine, model, train_data, val_data, wall_start).run(return_state)
        finally:
            self.engine = self._engine = None
            self._state = None
            self.optimizer = self.model = None
            self._emit = _no_record
            if self._adapter is not None:
                self._adapter.detach()
            engine.close()

    # -- validate, test, predict ---------------------------------------------------------
    def validate(self, model: nn.Module, data: Any, *, ckpt_path: str | None = None) -> dict[str, float]:
        """Evaluate ``model`` on ``data`` with the Trainer's strategy and processes: the loss and
        ``metrics`` (or what ``validation_step`` returns) as ``val_<name>``, every sample counted
        once whatever the world size, and ``val_samples`` (on every rank under a launcher). ``ckpt_path`` loads a checkpoint's
        model weights first (a fit's ``last_checkpoint`` or ``best_model_path``)."""
        return self._evaluate("val", model, data, ckpt_path)  # type: ignore[no-any-return]

    def test(self, model: nn.Module, data: Any, *, ckpt_path: str | None = None) -> dict[str, float]:
        """As `validate`, on a test set: the same numbers under ``test_<name>``."""
        return self._evaluate("test", model, data, ckpt_path)  # type: ignore[no-any-return]

    def predict(self, model: nn.Module, data: Any, *, ckpt_path: str | None = None) -> Any:
        """The model's outputs (its ``predict_step(batch)``, else its forward) for every sample of
        ``data``, in dataset order: a tensor with one row per sample (or a tuple or dict of such
        tensors, as the model returns). Every rank computes its share; the result is returned
        where ``predict`` was called (rank 0 under a launcher; None on the other ranks)."""
        return self._evaluate("predict", model, data, ckpt_path)

    def _evaluate(self, kind: str, model: nn.Module, data: Any, ckpt_path: str | None) -> Any:
        materialize.note_build_state(model)
        stop_if_bootstrapping(model=model)
        plan.check_evaluate(self, kind, model, data, ckpt_path)
        result = self._launch(_evaluate_worker, model, kind, data, ckpt_path)
        if result is None:
            result = self._evaluate_here(model, kind, data, ckpt_path)
        return result

    def _evaluate_here(self, model: nn.Module, kind: str, data: Any, ckpt_path: str | None) -> Any:
        with self._threads_applied():
            return self._evaluate_with(model, kind, data, ckpt_path)

    def _evaluate_with(self, model: nn.Module, kind: str, data: Any, ckpt_path: str | None) -> Any:
        engine = self._make_engine()
        try:
            if self._adapter is not None:
                self._adapter.bind(self, model, engine)
            wrapped, _ = engine.setup(model, self.optimizer_factory)
            if not engine.trains:
                return None  # a parameter server: it served inside setup until the workers finished
            if ckpt_path is not None:
                engine.load(ckpt_path, {"model": wrapped}, restore_rng=False)
            dataset, collate, _, dl_batch = unpack_data(data)
            dp = engine.mesh.size("dp")
            batch = self.config.val_batch_size or max(1, self._global_batch(dl_batch) // (engine.data_mesh.size("dp") * self.config.accumulate))
            if kind == "predict":
                dataset = evaluate.head(dataset, evaluate.limited_size(len(dataset), self.config.fast_dev_run or None, batch, dp))
                result = evaluate.predict(engine, engine.unwrap(wrapped), dataset, collate, batch)
            else:
                result = self._validate(engine, wrapped, (dataset, collate, 0, dl_batch), batch, prefix=kind)
            engine.finish()  # the strategy's end of run (parameter servers stop)
            return result if engine.is_rank_zero or kind != "predict" else None  # metrics are agreed: every rank has them
        finally:
            if self._adapter is not None:
                self._adapter.detach()
            engine.close()

    # -- pieces -----------------------------------------------------------------------------
    def _save(self, engine: Engine, state: dict[str, Any], root: Path) -> Path:
        path = self.save_checkpoint(ckpt.step_dir(root, self.step))
        if engine.is_rank_zero:
            ckpt.prune(root, self.config.keep_last, getattr(self, "_run_id", None))  # never another run's checkpoints
        return path

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write a checkpoint of the running fit to ``path`` (every rank calls it: a collective):
        model, optimizer, scheduler, data position, counters and every callback's state. For
        callbacks (`ModelCheckpoint` saves its best checkpoints with it)."""
        engine, state = self._engine, self._state
        if engine is None or state is None:
            raise ConfigError("save_checkpoint saves the running fit: call it from a callback while fit runs")
        counters = state["counters"]
        counters["callbacks"] = callbacks.collect_states(self.callbacks)
        run_id = getattr(self, "_run_id", None)
        # Whether these weights came from finite steps only (pruning keeps the newest such; resume='auto' takes it),
        # and rank 0's loss of the step that led here (None when not finite or before any step).
        last = getattr(self, "_last_loss", None)
        loss = float(last.double().mean()) if isinstance(last, torch.Tensor) else None
        loss = loss if loss is not None and math.isfinite(loss) else None
        meta = {"step": self.step, "run_id": run_id, "finite": bool(counters.get("weights_finite", True)), "loss": loss}
        loader = state.get("loader")
        if loader is not None:
            meta["global_batch"] = int(loader.global_batch)  # read before launch by a resume (`plan.check_resume_batch`)
            order = loader.state_dict().get("order_key")
            if order is not None:
                meta["order_key"] = order
        saved = engine.save(Path(path), state, meta=meta)
        self._callback("on_save_checkpoint", engine, saved)
        return saved

    def _validate(self, engine: Engine, wrapped: nn.Module, val: tuple[Any, Any, int, int | None], batch_size: int, prefix: str = "val") -> dict[str, float]:
        """Every validation sample counted once across ranks; sums reduced, then divided. Every key
        ``validation_step`` returns is logged (as ``val_<key>``), not only the ones named in ``metrics``."""
        dataset, collate, _, _ = val
        limit = self._val_limit() if prefix == "val" else self.config.fast_dev_run or None
        if is_stream(dataset):  # the adapters evaluate map-style data only (refused before launch)
            return self._validate_stream(engine, wrapped, dataset, collate, batch_size, prefix, limit)
        dataset = evaluate.head(dataset, evaluate.limited_size(len(dataset), limit, batch_size, engine.mesh.size("dp")))
        if prefix == "val":
            self._callback("on_validation_start", engine)
        if self._adapter is not None:
            out = self._adapter.evaluate(engine, engine.unwrap(wrapped), dataset, collate, batch_size, prefix)
        else:
            out = evaluate.evaluate(engine, engine.unwrap(wrapped), dataset, collate, batch_size, self._eval_batch, prefix)
        if prefix == "val":
            self._callback("on_validation_end", engine, out)
        return out

    def _validate_stream(self, engine: Engine, wrapped: nn.Module, data: Any, collate: Any, size: int, prefix: str, limit: Any) -> dict[str, float]:
        if prefix == "val":
            self._callback("on_validation_start", engine)
        out = streams.evaluate_stream(engine, engine.unwrap(wrapped), data, collate, size, self._eval_batch, prefix, limit)
        if prefix == "val":
            self._callback("on_validation_end", engine, out)
        return out

    def _val_limit(self) -> int | float | None:
        return self.config.fast_dev_run or self.config.limit_val_batches

    def _eval_batch(self, module: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """The loss and metrics of one validation batch, by name (``loss`` first)."""
        validation_step = getattr(module, "validation_step", None)
        if self.loss_fn is None and callable(validation_step):
            result = validation_step(batch)
            if not isinstance(result, Mapping) or "loss" not in result:
                raise ConfigError(f"validation_step must return a mapping with a 'loss' key (and any metrics); got {type(result).__name__}")
            missing = [name for name in self.metrics if name not in result]
            if missing:
                raise ConfigError(f"metrics {missing} are named in metrics= but validation_step returned only {sorted(result)}")
            return {"loss": result["loss"], **{k: v for k, v in result.items() if k != "loss"}}
        if self.loss_fn is not None:
            output = call_model(module, batch)
            loss = self.loss_fn(output, batch)
        elif callable(training_step := getattr(module, "training_step", None)):
            return {"loss": training_step(batch)}
        else:
            output = call_model(module, batch)
            loss = loss_from_output(output, batch)
        return {"loss": loss, **{name: fn(output, batch) for name, fn in self.metrics.items()}}

    def _callback(self, hook: str, *args: Any) -> None:
        first = [self._adapter] if self._adapter is not None and self._adapter.bound else []  # the module's hooks run first
        callbacks.dispatch([*first, *self.callbacks], hook, self, *args)


def _fit_worker(trainer: Trainer, model: nn.Module, train_data: Any, val_data: Any) -> tuple[dict[str, Any], Any]:
    """Entry point of each process that ``Trainer.fit`` starts."""
    if isinstance(model, handoff.WorkerModel):
        model = model.resolve()
    return trainer._fit(model, train_data, val_data, return_state=trainer._return_weights)


def _evaluate_worker(trainer: Trainer, model: nn.Module, kind: str, data: Any, ckpt_path: str | None) -> Any:
    """Entry point of each process that ``validate``, ``test`` and ``predict`` start."""
    if isinstance(model, handoff.WorkerModel):
        model = model.resolve()
    return trainer._evaluate_here(model, kind, data, ckpt_path)
