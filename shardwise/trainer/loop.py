"""Layer 5: the training loop. No strategy-specific branches: everything goes through `Engine`."""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.checkpoint.rundir import check_out, describe_outputs, move_aside, new_run_id
from shardwise.comm import monitored_barrier
from shardwise.data import ShardedLoader, fetch, unpack_data
from shardwise.data.batches import call_model, check_batch_fits, loss_from_output, returns_own_loss
from shardwise.engine import Engine, call_through, seed_everything
from shardwise.engine.loggers import Logger, Loggers, RunInfo, check_names, flatten
from shardwise.errors import CommError, ConfigError
from shardwise.integrations.lightning import LightningAdapter, adapter_for
from shardwise.launcher.env import detect_env
from shardwise.launcher.memory import snapshot
from shardwise.launcher.spawn import check_world_size, launch, prestart, stop_if_bootstrapping
from shardwise.strategies import Batch, Layout, OptimizerFactory, StepFn, Strategy, checkpointing, get_strategy, materialize
from shardwise.strategies.batchnorm import check_sync_batchnorm
from shardwise.strategies.cost.peak import tensors_of
from shardwise.trainer import callbacks, evaluate, handoff
from shardwise.trainer.config import TrainerConfig, from_mapping
from shardwise.trainer.evaluate import batch_size_of, copies_per_shard
from shardwise.trainer.logging import Progress, RunFiles, add_launcher_memory, batch_seq, format_memory, memory_section, write_rank_comm
from shardwise.trainer.lr_find import lr_find
from shardwise.trainer.nonfinite import NonFiniteCheck, NonFiniteError, Verdict, stop_message
from shardwise.trainer.preempt import Preemption
from shardwise.trainer.profile import StepProfiler, format_breakdown

__all__ = ["Trainer", "batch_size_of", "copies_per_shard", "make_step_fn"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, batch) -> scalar loss`` (mean over the batch)."""
MetricFn = Callable[[Any, Any], torch.Tensor]
"""``metric(output, batch) -> scalar`` averaged over the batch (e.g. accuracy)."""
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


_NULL = contextlib.nullcontext()


def _no_phase(name: str) -> contextlib.AbstractContextManager[None]:
    """The loop's phase marker when the profiler is off: nothing is timed or recorded."""
    return _NULL


def make_step_fn(loss_fn: LossFn | None, module: nn.Module) -> StepFn:
    """The per-micro-batch forward: ``loss_fn(model(inputs), batch)``, the module's ``training_step``,
    or else the loss the model returns itself (``model(**batch).loss``, as transformers' models do)."""
    if loss_fn is not None:

        def step(model: nn.Module, batch: Any) -> torch.Tensor:
            return loss_fn(call_model(model, batch), batch)
    elif callable(getattr(module, "training_step", None)):

        def step(model: nn.Module, batch: Any) -> torch.Tensor:
            return call_through(model, module, "training_step", batch)  # type: ignore[no-any-return]
    else:

        def step(model: nn.Module, batch: Any) -> torch.Tensor:
            return loss_from_output(call_model(model, batch), batch)

    return step


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
        self._lightning: LightningAdapter | None = None
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

    # -- checks before anything runs ------------------------------------------------------
    def _world_size(self) -> int:
        env = detect_env()
        if env.distributed and self.config.nproc > 1:
            check_world_size(self.config.nproc, env.world_size, env.source, "Trainer(nproc=...)")
        return env.world_size if env.distributed else self.config.nproc

    def _check(self, model: nn.Module, train_data: Any, val_data: Any = None) -> None:
        cfg = self.config
        if not isinstance(model, nn.Module):
            raise ConfigError(f"fit needs a torch.nn.Module; got {type(model).__name__}")
        has_step = callable(getattr(model, "training_step", None))
        if self.loss_fn is None and not has_step and not returns_own_loss(model):
            raise ConfigError(
                f"no loss: pass loss_fn=... (a function of the model output and the batch) to the Trainer, "
                f"or define a training_step(batch) method on {type(model).__name__} (a model whose forward "
                "takes `labels`, as transformers' models do, trains on its own loss with no loss_fn)"
            )
        dataset, collate, _, dl_batch = unpack_data(train_data)
        if dataset is None:
            raise ConfigError("fit needs training data: a Dataset or a DataLoader")
        per_epoch = len(dataset) // self._global_batch(dl_batch) if hasattr(dataset, "__len__") else 0
        estimate = cfg.fast_dev_run or cfg.max_steps or (cfg.max_epochs or 1) * per_epoch
        self._lightning = adapter_for(self, model, "fit", has_val=val_data is not None, total=estimate or None)
        # The strategy is built once, here, and planned once: the plan checks the world, the mesh,
        # the batch split and the model before any process starts; workers receive both.
        strategy = get_strategy(cfg.strategy, **cfg.strategy_options)
        self._strategy = strategy
        self._layout = strategy.plan(self._world_size(), model=model, batch=Batch(self._global_batch(dl_batch), cfg.accumulate), mesh=cfg.mesh)
        strategy.check_precision(cfg.precision, self._layout)
        check_sync_batchnorm(cfg.strategy, cfg.sync_batchnorm)
        checkpointing.check(model, cfg.activation_checkpointing)  # a bad value, or a model with no block list to checkpoint
        if materialize.has_meta(model):
            materialize.plan_init(model).check()  # a meta tensor no initializer sets: refused here, not in every worker
        if not cfg.drop_last:
            _check_drop_last(strategy, self._layout)
        self._check_tools(val_data, model)
        if detect_env().rank == 0 and not cfg.fast_dev_run:  # rank 0 writes the run directory (others may start after it has)
            check_out(cfg.out, cfg.resume, cfg.overwrite)
        if not has_step and (not hasattr(dataset, "__len__") or len(dataset) > 0) and hasattr(dataset, "__getitem__"):
            sample = fetch(dataset, [0], collate)
            check_batch_fits(model, sample)
            strategy.check_sample(model, sample, self._layout)  # tp rehearses its split on it (meta tensors)

    def _check_tools(self, val_data: Any, model: nn.Module | None = None) -> None:
        """Loggers and callbacks that cannot work, in the parent before launch (one line each)."""
        check_names(self.config.loggers)
        if (self.config.loggers or self.logger_objects) and self.config.out is None and self.config.tracking_uri is None:
            named = ", ".join([*self.config.loggers, *(type(x).__name__ for x in self.logger_objects)])
            if any(n != "mlflow" for n in self.config.loggers):
                raise ConfigError(f"loggers ({named}) write into the run directory: set out=... (--out DIR)")
        has_val = val_data is not None
        for cb in self.callbacks:
            if isinstance(cb, callbacks.Callback):
                cb.check(self, has_val)
                if model is not None:
                    cb.check_model(self, model)

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

    def _batch_notes(self, global_batch: int, dl_batch: int | None, loader: ShardedLoader) -> dict[str, Any]:
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
        return {"lines": lines, "from": source}

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
        needs_group = self.config.strategy != "single"
        if env.distributed or not (self.config.nproc > 1 or needs_group):
            return None
        sent, weights_dir = handoff.for_workers(model, self._lightning is not None)  # no model bytes where workers build their own
        try:
            results = self._launch_workers(worker, sent, *args)
        finally:
            if weights_dir is not None:
                weights_dir.cleanup()
        return results[0]

    def _launch_workers(self, worker: Callable[..., Any], model: Any, *args: Any) -> list[Any]:
        return launch(
            worker,
            self,
            model,
            *args,
            nproc=self.config.nproc,
            start_method=self.config.start_method,
            accelerator="cpu" if self.config.accelerator == "cpu" else "auto",
            collective_timeout_s=self.config.timeout_s,
            expendable=self._expendable_ranks(),
            error_dir=Path(self.config.out) / "errors" if self.config.out else None,
            debug_collectives=self.config.debug_collectives,
        )

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
        )

    def _fit(self, model: nn.Module, train_data: Any, val_data: Any, *, return_state: bool) -> tuple[dict[str, Any], Any]:
        wall_start = time.perf_counter()
        engine = self._make_engine()
        self.engine = engine
        self.preemption = Preemption()
        try:
            with self.preemption.installed(self.config.preempt_signals):
                return self._run(engine, model, train_data, val_data, wall_start, return_state)
        finally:
            self.engine = self._engine = None
            self._state = None
            self.optimizer = self.model = None
            if self._lightning is not None:
                self._lightning.detach()
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
        cfg = self.config
        if not isinstance(model, nn.Module):
            raise ConfigError(f"{kind if kind != 'val' else 'validate'} needs a torch.nn.Module; got {type(model).__name__}")
        if materialize.has_meta(model) and ckpt_path is None:
            raise ConfigError(
                f"{'validate' if kind == 'val' else kind} got {type(model).__name__} on the meta device: it holds no weights here "
                "(a meta-built model's trained weights are in its run's checkpoints). Pass ckpt_path= (fit's summary "
                "'last_checkpoint', or trainer.best_model_path)"
            )
        dataset, _, _, dl_batch = unpack_data(data)
        if dataset is None or len(dataset) == 0:
            raise ConfigError(f"{'validate' if kind == 'val' else kind} needs a non-empty Dataset or DataLoader; got {data!r}")
        if kind != "predict" and self.loss_fn is None and not callable(getattr(model, "validation_step", None)) and not returns_own_loss(model):
            if not callable(getattr(model, "training_step", None)):
                raise ConfigError("no loss to evaluate: pass loss_fn=... to the Trainer or define validation_step(batch) on the model")
        if ckpt_path is not None and not Path(ckpt_path).exists():
            raise ConfigError(f"ckpt_path={ckpt_path!r}: no such checkpoint directory")
        self._lightning = adapter_for(self, model, kind)
        strategy = get_strategy(cfg.strategy, **cfg.strategy_options)
        self._strategy = strategy
        self._layout = strategy.plan(self._world_size(), model=model, batch=Batch(self._global_batch(dl_batch), cfg.accumulate), mesh=cfg.mesh)
        result = self._launch(_evaluate_worker, model, kind, data, ckpt_path)
        if result is None:
            result = self._evaluate_here(model, kind, data, ckpt_path)
        return result

    def _evaluate_here(self, model: nn.Module, kind: str, data: Any, ckpt_path: str | None) -> Any:
        engine = self._make_engine()
        try:
            if self._lightning is not None:
                self._lightning.bind(self, model, engine)
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
            if self._lightning is not None:
                self._lightning.detach()
            engine.close()

    def _run(self, engine: Engine, model: nn.Module, train_data: Any, val_data: Any, wall_start: float, return_state: bool) -> tuple[dict[str, Any], Any]:
        cfg = self.config
        table = evaluate.module_table(model) if cfg.model_summary else None  # the whole model, before the strategy splits it
        lightning = self._lightning
        if lightning is not None:
            lightning.bind(self, model, engine)
        # this rank's peak before the strategy places the model, and the model's sizes for the prediction (meta-built too)
        memory_start, model_tensors, built_whole = snapshot(engine.device), tensors_of(model), not any(p.is_meta for p in model.parameters())
        wrapped, optimizer = engine.setup(model, lightning.make_optimizer if lightning is not None else self.optimizer_factory)
        if not engine.trains:
            # A rank the strategy keeps for service (a parameter server): it served inside
            # setup until the training ranks finished; rank 0 trains and writes the summary.
            if not cfg.fast_dev_run:
                write_rank_comm(cfg.out, engine.rank, engine.world_size, engine.recorder.report(1), None)
            return {}, None
        # The model is built and identical everywhere; from here each rank draws its own
        # stream, so dropout masks differ across data shards (a resume restores them).
        seed_everything(cfg.seed + 1 + engine.rank)
        self.optimizer, self.model = optimizer, wrapped
        scheduler = self.lr_scheduler(optimizer) if self.lr_scheduler is not None else None
        if lightning is not None:
            scheduler = lightning.make_schedule(optimizer)
        dataset, collate, workers, dl_batch = unpack_data(train_data)
        global_batch = self._global_batch(dl_batch)
        if cfg.overfit_batches:
            dataset = evaluate.head(dataset, min(len(dataset), cfg.overfit_batches * global_batch))
        seq = 0  # tokens per sample, read from the first batch trained on
        loader = ShardedLoader(
            dataset,
            global_batch=global_batch,
            world_size=engine.data_mesh.size("dp"),
            rank=engine.data_mesh.coordinate("dp"),
            accumulate=cfg.accumulate,
            seed=cfg.seed,
            shuffle=not cfg.overfit_batches,
            collate_fn=collate,
            num_workers=max(workers, cfg.num_workers),
            limit=cfg.limit_train_batches,
            drop_last=cfg.drop_last,
        )
        total = cfg.max_steps or (cfg.max_epochs or 1) * loader.steps_per_epoch
        if cfg.fast_dev_run:
            total = cfg.fast_dev_run
        counters: dict[str, Any] = {"step": 0, "samples": 0, "nonfinite_skipped": 0, "nonfinite_trained": 0, "weights_finite": True}
        state: dict[str, Any] = {"model": wrapped, "optimizer": optimizer, "loader": loader, "counters": counters}
        if scheduler is not None:
            state["scheduler"] = scheduler
        self._state, self._engine = state, engine
        out = None if self.saves_nothing else cfg.out

        if cfg.fast_dev_run:
            engine.print(f"shardwise: fast_dev_run: {total} step(s) and {total} validation batch(es) per rank; nothing is saved or logged")
        elif cfg.announce_outputs:
            engine.print(describe_outputs(cfg.out, cfg.checkpoint_every, cfg.keep_last))
        batch_notes = self._batch_notes(global_batch, dl_batch, loader)
        if cfg.announce_outputs and not cfg.fast_dev_run:
            for note in batch_notes["lines"]:
                engine.print(f"shardwise: {note}")
        if getattr(self, "_run_id", None) is None:
            self._run_id = new_run_id()
        resumed_from = self._resume(engine, state)
        if resumed_from is not None:
            counters = state["counters"]
            for key, value in {"nonfinite_skipped": 0, "nonfinite_trained": 0, "weights_finite": True}.items():
                counters.setdefault(key, value)  # a checkpoint written before these counters
            self._run_id = ckpt.run_id_of(resumed_from) or getattr(self, "_run_id", None) or new_run_id()
        self.step = start_step = int(counters["step"])
        self._last_loss: torch.Tensor | None = None
        if resumed_from is not None:
            callbacks.restore_states(self.callbacks, counters.get("callbacks", {}))
            self._callback("on_load_checkpoint", engine, resumed_from)
        if resumed_from is not None and start_step >= total:
            return self._already_finished(engine, wrapped, state, resumed_from, start_step, total, return_state)
        files = RunFiles(out, engine.is_rank_zero, append=resumed_from is not None, after_step=start_step if resumed_from is not None else None)
        run_info = RunInfo(Path(out) if out else None, self._run_id, cfg.experiment_name, cfg.tracking_uri, start_step if resumed_from is not None else None)
        loggers = Loggers.build(cfg.loggers, self.logger_objects, run_info if engine.is_rank_zero and not cfg.fast_dev_run else None)
        loggers.log_hyperparams(self.hyperparameters())
        self._loggers = loggers
        model_summary = None
        if table is not None:  # the whole table before the bar starts: a bar drawn first breaks into it
            per_rank = evaluate.per_rank_counts(engine, engine.unwrap(wrapped))
            model_summary = {"modules": table, "parameters_per_rank": per_rank}
            engine.print(evaluate.format_summary(table, per_rank))
        progress = Progress(enabled=engine.is_rank_zero, total=total, initial=start_step, bar=cfg.progress_bar)
        if resumed_from is not None:
            progress.write(f"resumed from {resumed_from} at step {start_step}")
        step_fn = make_step_fn(self.loss_fn, engine.unwrap(wrapped))
        weights = _Weights()
        if not cfg.drop_last:
            step_fn = weights.wrap(step_fn)  # the epoch's smaller last batch: each micro-batch's share (`ShardedLoader.step_weights`)
        # The grad scaler checks fp16 gradients itself and skips what overflows: not ours to stop (the loss still is).
        nonfinite = NonFiniteCheck(
            engine.unwrap(wrapped), engine.group, engine.recorder, check_grads=engine.precision.scaler is None, agree=engine.steps_together
        )
        val = unpack_data(val_data)
        val_batch = cfg.val_batch_size or max(1, loader.micro)
        ckpt_root = Path(out) / "checkpoints" if out else None
        self._callback("on_fit_start", engine)

        losses: list[torch.Tensor] = []  # detached per-step losses since the last log (no sync per step)
        last_train_loss = float("nan")
        val_metrics: dict[str, float] = {}
        val_step = -1  # the step of the last evaluation (the final one is not repeated at the same step)
        t_log, steps_at_log = time.perf_counter(), start_step
        train_start = time.perf_counter()
        last_ckpt: Path | None = None
        preempted: dict[str, Any] | None = None  # the signal and the step, once the log step's reduction says one came
        profiler = StepProfiler(cfg, engine, Path(out) if out else None, start_step, total) if cfg.profile else None
        phase = profiler.phase if profiler is not None else _no_phase

        def emit(record: dict[str, Any]) -> None:
            self._callback("on_metrics", engine, record)  # every rank: a callback may add keys or decide to stop
            files.log(record)
            loggers.log_metrics(record)

        self._emit = emit  # for callbacks that log records of their own (a Lightning module's epoch values)

        def log_train() -> None:
            # The only per-log collective: the mean training loss over the loop's group and steps
            # (a rank that loops alone, an async parameter-server worker, logs its own).
            nonlocal last_train_loss, t_log, steps_at_log, preempted
            # One reduction carries the loss and whether any rank got a preemption signal (`preempt`).
            # Skipped non-finite steps leave no loss: a window of only those logs nan (every rank alike: the skip is agreed).
            local = torch.stack(losses).double().mean() if losses else torch.tensor(float("nan"), dtype=torch.float64, device=engine.device)
            both = engine.all_reduce(torch.stack([local, torch.full_like(local, self.preemption.flag)]), "mean")
            mean, preempt = both[0], float(both[1].item())
            last_train_loss = float(mean.item())
            if preempt > 0 and preempted is None:
                preempted = {"signal": self.preemption.signal or "on another rank", "step": self.step}
                self.should_stop = True
            now = time.perf_counter()
            record = {
                "step": self.step,
                "epoch": loader.epoch,
                "train_loss": last_train_loss,
                "lr": optimizer.param_groups[0]["lr"],
                "samples_per_s": (self.step - steps_at_log) * global_batch / max(now - t_log, 1e-9),
            }
            if counters["nonfinite_skipped"]:
                record["nonfinite_skipped"] = int(counters["nonfinite_skipped"])
            emit(record)
            progress.update(self.step - steps_at_log, record)
            t_log, steps_at_log = now, self.step
            losses.clear()

        def validate() -> dict[str, float]:
            nonlocal val_step
            metrics = self._validate(engine, wrapped, val, val_batch)
            val_step = self.step
            emit({"step": self.step, **metrics})
            return metrics

        while self.step < total and not self.should_stop:
            epoch = loader.epoch + (1 if loader.step_in_epoch >= loader.steps_per_epoch else 0)
            self._callback("on_train_epoch_start", engine, epoch)
            batches = iter(loader)
            while True:
                if profiler is not None:
                    profiler.step_start(self.step + 1)
                with phase("data"):
                    micro = next(batches, None)
                    if micro is not None:
                        micro = [engine.to_device(b) for b in micro]
                        seq = seq or batch_seq(micro[0])  # tokens per sample, for the memory prediction
                if micro is None:  # the epoch is over
                    if profiler is not None:
                        profiler.step_abort()
                    break
                self._callback("on_train_step_start", engine, self.step + 1)
                weights.start(loader.last_weights)
                with phase("forward_backward"):
                    loss = engine.forward_backward(wrapped, micro, step_fn)
                with phase("optimizer"):
                    verdict = nonfinite.verdict(self.step + 1, loss)  # every rank, agreed; before clipping scales the gradients
                    skip = verdict is not None and self._on_nonfinite(verdict, counters, progress, ckpt_root)
                    stepped = False
                    if not skip:
                        if cfg.clip_grad_norm is not None:
                            engine.clip_grad_norm(wrapped, optimizer, cfg.clip_grad_norm)
                        stepped = engine.step(optimizer)
                    optimizer.zero_grad(set_to_none=True)
                    if scheduler is not None and stepped:
                        scheduler.step()  # as after a grad scaler's skip: a skipped step moves no schedule
                self.step += 1
                counters["step"] = self.step
                counters["samples"] = counters["samples"] + (global_batch if loader.last_weights is None else loader.last_step_samples)
                if verdict is None:
                    counters["weights_finite"] = True
                self._last_loss = loss
                if not skip:
                    losses.append(loss)
                done = self.step >= total
                if self.step % cfg.log_every == 0 or done or self.should_stop:
                    log_train()
                if val[0] is not None and cfg.val_every and self.step % cfg.val_every == 0 and not done:
                    val_metrics = validate()
                    progress.write("  ".join(f"{k} {v:.4g}" for k, v in {"step": self.step, **val_metrics}.items()))
                if ckpt_root is not None and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and not done:
                    last_ckpt = self._save(engine, state, ckpt_root)
                if cfg.debug_collectives:
                    try:
                        monitored_barrier(group=engine.group, timeout_s=cfg.timeout_s, recorder=engine.recorder)
                    except CommError as exc:
                        raise CommError(f"debug_collectives: at the barrier after step {self.step}: {exc}") from exc
                self._callback("on_train_step_end", engine, self.step, loss)
                if done or self.should_stop:
                    break
            if loader.step_in_epoch >= loader.steps_per_epoch or loader.step_in_epoch == 0:
                self._callback("on_train_epoch_end", engine, epoch)
        if losses:  # stopped between log steps (a callback set should_stop after this step's log check)
            log_train()
        train_s = time.perf_counter() - train_start
        loader.close()  # data-loading workers end with the training (they would outlive the run otherwise)
        profile_section = profiler.finish() if profiler is not None else None
        if val[0] is not None and val_step != self.step and preempted is None:  # preempted: the checkpoint first, no evaluation
            val_metrics = validate()
        if ckpt_root is not None:
            last_ckpt = self._save(engine, state, ckpt_root)
        progress.close()
        steps_run = self.step - start_step
        wall = time.perf_counter() - wall_start
        comm = engine.recorder.report(steps_run)
        write_rank_comm(out, engine.rank, engine.world_size, comm, steps_run)
        strategy_section = engine.finish()  # on every rank: the strategy's end of run (collective reports, servers stop)
        memory = memory_section(  # after the recorder's report: its one all-reduce is not the run's traffic
            engine,
            memory_start,
            snapshot(engine.device),
            model_tensors,
            micro_batch=loader.micro,
            seq=seq,
            optimizer=optimizer,
            built_whole=built_whole,
        )
        summary: dict[str, Any] = {
            "strategy": cfg.strategy,
            "world_size": engine.world_size,
            "mesh": dict(engine.layout.degrees),  # dp x pp x tp of the training ranks, as the strategy planned it
            "precision": cfg.precision,
            "global_batch_size": global_batch,
            "global_batch_size_from": batch_notes["from"],
            "drop_last": cfg.drop_last,
            "samples_left_out_per_epoch": loader.left_out,
            "accumulate": cfg.accumulate,
            "steps": self.step,
            "steps_this_run": steps_run,
            "samples": int(counters["samples"]),
            "wall_s": wall,
            "train_s": train_s,
            "samples_per_s": steps_run * global_batch / max(train_s, 1e-9),
            "train_loss": last_train_loss,
            "on_nonfinite": cfg.on_nonfinite,
            "nonfinite_skipped": int(counters["nonfinite_skipped"]),
            "nonfinite_trained": int(counters["nonfinite_trained"]),
            **val_metrics,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "last_checkpoint": str(last_ckpt) if last_ckpt else None,
            "comm": comm,
            **strategy_section,
            "memory": memory,
        }
        if model_summary is not None:
            summary["model_summary"] = model_summary
        if profile_section is not None:
            summary["profile"] = profile_section
        if preempted is not None:
            summary["preempted"] = preempted
        self._callback("on_fit_end", engine, summary)  # every rank; a callback may add its section
        files.summary(summary)
        loggers.finalize(summary)
        files.close()
        if engine.is_rank_zero:
            if "memory_per_rank" in summary:
                from shardwise.strategies.cost.memory import format_table

                print(format_table(summary["memory_per_rank"]), flush=True)
            print(format_memory(summary["memory"]), flush=True)
            if profile_section is not None:
                print(format_breakdown(profile_section), flush=True)
            line = "  ".join(f"{k} {summary[k]:.4g}" for k in ("train_loss", "val_loss", "val_accuracy", "samples_per_s") if isinstance(summary.get(k), float))
            print(f"done: {self.step} steps in {wall:.1f}s  {line}", flush=True)
        model_state = None
        if return_state:
            full = engine.consolidated_state_dict(wrapped)  # collective under sharded strategies: every rank
            model_state = full if engine.is_rank_zero else None
        return summary, model_state

    # -- pieces -----------------------------------------------------------------------------
    def _on_nonfinite(self, verdict: Verdict, counters: dict[str, Any], progress: Progress, ckpt_root: Path | None) -> bool:
        """What ``on_nonfinite`` does with a step the check found non-finite (`shardwise.trainer.nonfinite`);
        True when the step is to be skipped. Every rank gets the same verdict and does the same."""
        mode = self.config.on_nonfinite
        if mode == "stop":
            newest = next((p for p in reversed(ckpt.list_checkpoints(ckpt_root)) if ckpt.is_finite(p)), None) if ckpt_root is not None else None
            raise NonFiniteError(stop_message(verdict, newest))
        if mode == "skip":
            counters["nonfinite_skipped"] = int(counters["nonfinite_skipped"]) + 1
            progress.write(f"shardwise: {verdict.describe()}; on_nonfinite='skip': step skipped ({counters['nonfinite_skipped']} so far)")
            return True
        counters["nonfinite_trained"] = int(counters["nonfinite_trained"]) + 1
        counters["weights_finite"] = False
        progress.write(f"shardwise: warning: {verdict.describe()}; on_nonfinite='warn': trained on it")
        return False

    def _resume(self, engine: Engine, state: dict[str, Any]) -> Path | None:
        cfg = self.config
        if cfg.resume is None:
            return None
        if cfg.resume == "auto":
            assert cfg.out is not None
            with warnings.catch_warnings(record=True) as skipped:  # said as the run's own lines, not as Python warnings
                warnings.simplefilter("always")
                path = ckpt.latest_valid(Path(cfg.out) / "checkpoints", finite=True)  # never back onto NaN weights
            for w in skipped:
                engine.print(f"shardwise: resume='auto': {w.message}")
            if path is None:
                engine.print("resume='auto': no checkpoint yet, starting fresh")
                return None
        else:
            path = Path(cfg.resume)
        plain = engine.load(path, state)
        state["counters"] = dict(plain["counters"])
        return path

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
        saved = engine.save(Path(path), state, meta=meta)
        self._callback("on_save_checkpoint", engine, saved)
        return saved

    def _already_finished(
        self, engine: Engine, wrapped: nn.Module, state: dict[str, Any], resumed_from: Path, step: int, total: int, return_state: bool
    ) -> tuple[dict[str, Any], Any]:
        """Resuming a run that already reached its last step: say so, train nothing, return its summary.
        A checkpoint from elsewhere is saved into this run's directory, so ``out`` holds what it continued."""
        cfg = self.config
        engine.print(f"shardwise: the run already finished at step {step} (max steps {total}); nothing to train")
        root = Path(cfg.out) / "checkpoints" if cfg.out else None
        if root is not None and Path(resumed_from).resolve().parent != root.resolve():
            summary_path = self._save(engine, state, root)
        else:
            summary_path = Path(resumed_from)
        strategy_section = engine.finish()  # the strategy's end of run (parameter servers stop)
        summary: dict[str, Any] = {}
        if cfg.out and (Path(cfg.out) / "summary.json").exists():
            import json

            try:
                summary = json.loads((Path(cfg.out) / "summary.json").read_text())
            except ValueError:
                summary = {}
        summary.update(
            {
                "strategy": cfg.strategy,
                "world_size": engine.world_size,
                "steps": step,
                "steps_this_run": 0,
                "already_finished": True,
                "resumed_from": str(resumed_from),
                **strategy_section,
            }
        )
        summary.pop("samples_per_s", None)
        summary["last_checkpoint"] = str(summary_path)
        model_state = None
        if return_state:
            full = engine.consolidated_state_dict(wrapped)  # collective under sharded strategies: every rank
            model_state = full if engine.is_rank_zero else None
        return summary, model_state

    def _validate(self, engine: Engine, wrapped: nn.Module, val: tuple[Any, Any, int, int | None], batch_size: int, prefix: str = "val") -> dict[str, float]:
        """Every validation sample counted once across ranks; sums reduced, then divided. Every key
        ``validation_step`` returns is logged (as ``val_<key>``), not only the ones named in ``metrics``."""
        dataset, collate, _, _ = val
        limit = self._val_limit() if prefix == "val" else self.config.fast_dev_run or None
        dataset = evaluate.head(dataset, evaluate.limited_size(len(dataset), limit, batch_size, engine.mesh.size("dp")))
        if prefix == "val":
            self._callback("on_validation_start", engine)
        if self._lightning is not None:
            out = self._lightning.evaluate(engine, engine.unwrap(wrapped), dataset, collate, batch_size, prefix)
        else:
            out = evaluate.evaluate(engine, engine.unwrap(wrapped), dataset, collate, batch_size, self._eval_batch, prefix)
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
        first = [self._lightning] if self._lightning is not None and self._lightning.bound else []  # the module's hooks run first
        callbacks.dispatch([*first, *self.callbacks], hook, self, *args)


def _check_drop_last(strategy: Strategy, layout: Layout) -> None:
    """``drop_last=False`` where the strategy takes a smaller batch exactly (`Strategy.smaller_last_batch`),
    refused before launch elsewhere."""
    if not strategy.smaller_last_batch or layout.degrees.get("pp", 1) > 1:
        from shardwise.strategies import available

        able = [n for n in available() if get_strategy(n).smaller_last_batch]
        raise ConfigError(
            f"drop_last=False: strategy {layout.strategy!r} cannot take the epoch's smaller last batch exactly "
            "(a pipeline splits each batch into a fixed number of micro-batches; parameter servers and replicas do not average "
            f"every rank's gradient of a step); it works with {', '.join(able)} (without a pipeline dimension). Leave drop_last=True "
            "(on the command line, leave out --keep-last-batch: the remainder is left out) or choose a global batch that divides the data set"
        )


class _Weights:
    """The per-micro-batch loss weights of the step running now (`ShardedLoader.step_weights`)."""

    def __init__(self) -> None:
        self.now: list[float] | None = None
        self.i = 0

    def start(self, weights: list[float] | None) -> None:
        self.now, self.i = weights, 0

    def wrap(self, step_fn: StepFn) -> StepFn:
        def weighted(model: nn.Module, batch: Any) -> torch.Tensor:
            loss = step_fn(model, batch)
            if self.now is None:
                return loss
            w = self.now[self.i]
            self.i += 1
            return loss * w

        return weighted


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
