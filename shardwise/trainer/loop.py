"""Layer 5: the training loop. No strategy-specific branches: everything goes through `Engine`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.batches import call_model, check_batch_fits, loss_from_output, returns_own_loss
from shardwise.data import ShardedLoader, eval_batches, eval_shard, fetch, unpack_data
from shardwise.engine import Engine, call_through, seed_everything
from shardwise.errors import ConfigError
from shardwise.launcher.env import detect_env
from shardwise.launcher.spawn import check_world_size, launch, stop_if_bootstrapping
from shardwise.rundir import check_out, describe_outputs, move_aside, new_run_id
from shardwise.strategies import Batch, Layout, OptimizerFactory, StepFn, Strategy, get_strategy
from shardwise.strategies.batchnorm import check_sync_batchnorm
from shardwise.trainer.config import TrainerConfig, from_mapping
from shardwise.trainer.logging import Progress, RunFiles

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, batch) -> scalar loss`` (mean over the batch)."""
MetricFn = Callable[[Any, Any], torch.Tensor]
"""``metric(output, batch) -> scalar`` averaged over the batch (e.g. accuracy)."""
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (tuple, list)):
        return batch_size_of(batch[0])
    if isinstance(batch, Mapping):
        return batch_size_of(next(iter(batch.values())))
    raise TypeError(f"cannot tell the size of a batch of type {type(batch).__name__}")


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


def copies_per_shard(engine: Engine) -> int:
    """How many ranks evaluate each data shard: the pipeline and tensor-parallel ranks of one
    data-parallel replica all see the same samples, so a sum over the loop's ranks counts each
    sample this many times (1 for purely data-parallel strategies)."""
    return max(1, engine.group.size // engine.mesh.size("dp"))


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Trainer:
    """Fit a plain ``nn.Module`` with any registered strategy.

    >>> trainer = Trainer(strategy="ddp", nproc=2, global_batch_size=64, max_steps=100,
    ...                   optimizer=make_adam, loss_fn=cross_entropy_loss)   # doctest: +SKIP
    >>> summary = trainer.fit(model, train_set, val_set)                     # doctest: +SKIP

    ``optimizer`` is a factory of the parameters (strategies that shard build the
    optimizer after wrapping). The loss is ``loss_fn(output, batch)`` or, without
    one, the module's ``training_step(batch)``. With ``nproc > 1`` (and no launcher
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
        config: TrainerConfig | None = None,
        devices: int | None = None,
        **settings: Any,
    ) -> None:
        if devices is not None:
            settings.setdefault("nproc", devices)
        self.config = from_mapping(settings, base=config)
        self.optimizer_factory = optimizer or _default_optimizer
        self.loss_fn = loss_fn
        self.lr_scheduler = lr_scheduler
        self.metrics = dict(metrics or {})
        self.callbacks = list(callbacks)
        self.engine: Engine | None = None
        self.step = 0
        self.should_stop = False
        self._strategy: Strategy | None = None
        self._layout: Layout | None = None

    # -- checks before anything runs ------------------------------------------------------
    def _world_size(self) -> int:
        env = detect_env()
        if env.distributed and self.config.nproc > 1:
            check_world_size(self.config.nproc, env.world_size, env.source, "Trainer(nproc=...)")
        return env.world_size if env.distributed else self.config.nproc

    def _check(self, model: nn.Module, train_data: Any) -> None:
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
        # The strategy is built once, here, and planned once: the plan checks the world, the mesh,
        # the batch split and the model before any process starts; workers receive both.
        strategy = get_strategy(cfg.strategy, **cfg.strategy_options)
        self._strategy = strategy
        self._layout = strategy.plan(self._world_size(), model=model, batch=Batch(self._global_batch(dl_batch), cfg.accumulate), mesh=cfg.mesh)
        check_sync_batchnorm(cfg.strategy, cfg.sync_batchnorm)
        if detect_env().rank == 0:  # rank 0 writes the run directory (others may start after it has)
            check_out(cfg.out, cfg.resume, cfg.overwrite)
        if not has_step and (not hasattr(dataset, "__len__") or len(dataset) > 0) and hasattr(dataset, "__getitem__"):
            check_batch_fits(model, fetch(dataset, [0], collate))

    def _expendable_ranks(self) -> list[int]:
        """Ranks whose death the run survives, as the plan said (asynchronous parameter-server
        workers other than rank 0); none for most strategies."""
        return list(self._layout.expendable) if self._layout is not None else []

    def _global_batch(self, dl_batch: int | None) -> int:
        return self.config.global_batch_size or dl_batch or 32

    # -- fit ------------------------------------------------------------------------------
    def fit(self, model: nn.Module, train_data: Any, val_data: Any = None) -> dict[str, Any]:
        """Train ``model``; returns the run summary (also written to ``out/summary.json``)."""
        stop_if_bootstrapping()  # a worker importing an unguarded script stops here (see launcher.worker)
        self._check(model, train_data)
        env = detect_env()
        cfg = self.config
        if cfg.overwrite and cfg.out and cfg.resume is None and env.rank == 0:
            aside = move_aside(cfg.out)
            if aside is not None:
                print(f"shardwise: overwrite: the earlier run in {cfg.out} was moved to {aside}", flush=True)
        self._run_id = new_run_id()  # the lineage of this run's checkpoints (a resume takes the checkpoint's)
        needs_group = self.config.strategy != "single"
        if not env.distributed and (self.config.nproc > 1 or needs_group):
            results = launch(
                _fit_worker,
                self,
                model,
                train_data,
                val_data,
                nproc=self.config.nproc,
                start_method=self.config.start_method,
                accelerator="cpu" if self.config.accelerator == "cpu" else "auto",
                collective_timeout_s=self.config.timeout_s,
                expendable=self._expendable_ranks(),
                error_dir=Path(self.config.out) / "errors" if self.config.out else None,
            )
            summary, state = results[0]
            model.load_state_dict(state)
            return summary  # type: ignore[no-any-return]
        summary, _ = self._fit(model, train_data, val_data, return_state=False)
        return summary

    def _fit(self, model: nn.Module, train_data: Any, val_data: Any, *, return_state: bool) -> tuple[dict[str, Any], Any]:
        cfg = self.config
        wall_start = time.perf_counter()
        strategy, layout = self._strategy, self._layout
        engine = Engine(
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
        )
        self.engine = engine
        try:
            return self._run(engine, model, train_data, val_data, wall_start, return_state)
        finally:
            self.engine = None
            engine.close()

    def _run(self, engine: Engine, model: nn.Module, train_data: Any, val_data: Any, wall_start: float, return_state: bool) -> tuple[dict[str, Any], Any]:
        cfg = self.config
        wrapped, optimizer = engine.setup(model, self.optimizer_factory)
        if not engine.trains:
            # A rank the strategy keeps for service (a parameter server): it served inside
            # setup until the training ranks finished; rank 0 trains and writes the summary.
            return {}, None
        # The model is built and identical everywhere; from here each rank draws its own
        # stream, so dropout masks differ across data shards (a resume restores them).
        seed_everything(cfg.seed + 1 + engine.rank)
        scheduler = self.lr_scheduler(optimizer) if self.lr_scheduler is not None else None
        dataset, collate, workers, dl_batch = unpack_data(train_data)
        global_batch = self._global_batch(dl_batch)
        loader = ShardedLoader(
            dataset,
            global_batch=global_batch,
            world_size=engine.data_mesh.size("dp"),
            rank=engine.data_mesh.coordinate("dp"),
            accumulate=cfg.accumulate,
            seed=cfg.seed,
            collate_fn=collate,
            num_workers=max(workers, cfg.num_workers),
        )
        total = cfg.max_steps or (cfg.max_epochs or 1) * loader.steps_per_epoch
        counters: dict[str, Any] = {"step": 0, "samples": 0}
        state: dict[str, Any] = {"model": wrapped, "optimizer": optimizer, "loader": loader, "counters": counters}
        if scheduler is not None:
            state["scheduler"] = scheduler

        engine.print(describe_outputs(cfg.out, cfg.checkpoint_every, cfg.keep_last))
        if getattr(self, "_run_id", None) is None:
            self._run_id = new_run_id()
        resumed_from = self._resume(engine, state)
        if resumed_from is not None:
            counters = state["counters"]
            self._run_id = ckpt.run_id_of(resumed_from) or getattr(self, "_run_id", None) or new_run_id()
        self.step = start_step = int(counters["step"])
        if resumed_from is not None and start_step >= total:
            return self._already_finished(engine, wrapped, state, resumed_from, start_step, total, return_state)
        files = RunFiles(cfg.out, engine.is_rank_zero, append=resumed_from is not None, after_step=start_step if resumed_from is not None else None)
        progress = Progress(enabled=engine.is_rank_zero, total=total, initial=start_step, bar=cfg.progress_bar)
        if resumed_from is not None:
            progress.write(f"resumed from {resumed_from} at step {start_step}")
        step_fn = make_step_fn(self.loss_fn, engine.unwrap(wrapped))
        val = unpack_data(val_data)
        val_batch = cfg.val_batch_size or max(1, loader.micro)
        ckpt_root = Path(cfg.out) / "checkpoints" if cfg.out else None
        self._callback("on_fit_start", engine)

        losses: list[torch.Tensor] = []  # detached per-step losses since the last log (no sync per step)
        last_train_loss = float("nan")
        val_metrics: dict[str, float] = {}
        t_log, steps_at_log = time.perf_counter(), start_step
        train_start = time.perf_counter()
        last_ckpt: Path | None = None

        def log_train() -> None:
            # The only per-log collective: the mean training loss over the loop's group and steps
            # (a rank that loops alone, an async parameter-server worker, logs its own).
            nonlocal last_train_loss, t_log, steps_at_log
            mean = engine.all_reduce(torch.stack(losses).double().mean().reshape(1), "mean")
            last_train_loss = float(mean.item())
            now = time.perf_counter()
            record = {
                "step": self.step,
                "epoch": loader.epoch,
                "train_loss": last_train_loss,
                "lr": optimizer.param_groups[0]["lr"],
                "samples_per_s": (self.step - steps_at_log) * global_batch / max(now - t_log, 1e-9),
            }
            files.log(record)
            progress.update(self.step - steps_at_log, record)
            t_log, steps_at_log = now, self.step
            losses.clear()

        while self.step < total and not self.should_stop:
            for micro in loader:
                micro = [engine.to_device(b) for b in micro]
                loss = engine.forward_backward(wrapped, micro, step_fn)
                if cfg.clip_grad_norm is not None:
                    engine.clip_grad_norm(wrapped, optimizer, cfg.clip_grad_norm)
                stepped = engine.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None and stepped:
                    scheduler.step()
                self.step += 1
                counters["step"] = self.step
                counters["samples"] = counters["samples"] + global_batch
                losses.append(loss)
                done = self.step >= total
                if self.step % cfg.log_every == 0 or done or self.should_stop:
                    log_train()
                if val[0] is not None and cfg.val_every and self.step % cfg.val_every == 0 and not done:
                    val_metrics = self._validate(engine, wrapped, val, val_batch)
                    files.log({"step": self.step, **val_metrics})
                    progress.write("  ".join(f"{k} {v:.4g}" for k, v in {"step": self.step, **val_metrics}.items()))
                if ckpt_root is not None and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and not done:
                    last_ckpt = self._save(engine, state, ckpt_root)
                self._callback("on_train_step_end", engine, self.step, loss)
                if done or self.should_stop:
                    break
        if losses:  # stopped between log steps (a callback set should_stop after this step's log check)
            log_train()
        train_s = time.perf_counter() - train_start
        loader.close()  # data-loading workers end with the training (they would outlive the run otherwise)
        if val[0] is not None:
            val_metrics = self._validate(engine, wrapped, val, val_batch)
            files.log({"step": self.step, **val_metrics})
        if ckpt_root is not None:
            last_ckpt = self._save(engine, state, ckpt_root)
        progress.close()
        steps_run = self.step - start_step
        wall = time.perf_counter() - wall_start
        comm = engine.recorder.report(steps_run)
        strategy_section = engine.finish()  # on every rank: the strategy's end of run (collective reports, servers stop)
        summary: dict[str, Any] = {
            "strategy": cfg.strategy,
            "world_size": engine.world_size,
            "mesh": dict(engine.layout.degrees),  # dp x pp x tp of the training ranks, as the strategy planned it
            "precision": cfg.precision,
            "global_batch_size": global_batch,
            "accumulate": cfg.accumulate,
            "steps": self.step,
            "steps_this_run": steps_run,
            "samples": int(counters["samples"]),
            "wall_s": wall,
            "train_s": train_s,
            "samples_per_s": steps_run * global_batch / max(train_s, 1e-9),
            "train_loss": last_train_loss,
            **val_metrics,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "last_checkpoint": str(last_ckpt) if last_ckpt else None,
            "comm": comm,
            **strategy_section,
        }
        files.summary(summary)
        files.close()
        if engine.is_rank_zero:
            if "memory_per_rank" in summary:
                from shardwise.plan.memory import format_table

                print(format_table(summary["memory_per_rank"]), flush=True)
            line = "  ".join(f"{k} {summary[k]:.4g}" for k in ("train_loss", "val_loss", "val_accuracy", "samples_per_s") if isinstance(summary.get(k), float))
            print(f"done: {self.step} steps in {wall:.1f}s  {line}", flush=True)
        self._callback("on_fit_end", engine, summary)
        model_state = None
        if return_state:
            full = engine.consolidated_state_dict(wrapped)  # collective under sharded strategies: every rank
            model_state = full if engine.is_rank_zero else None
        return summary, model_state

    # -- pieces -----------------------------------------------------------------------------
    def _resume(self, engine: Engine, state: dict[str, Any]) -> Path | None:
        cfg = self.config
        if cfg.resume is None:
            return None
        if cfg.resume == "auto":
            assert cfg.out is not None
            path = ckpt.latest_valid(Path(cfg.out) / "checkpoints")
            if path is None:
                engine.print("resume='auto': no checkpoint yet, starting fresh")
                return None
        else:
            path = Path(cfg.resume)
        plain = engine.load(path, state)
        state["counters"] = dict(plain["counters"])
        return path

    def _save(self, engine: Engine, state: dict[str, Any], root: Path) -> Path:
        run_id = getattr(self, "_run_id", None)
        path = engine.save(ckpt.step_dir(root, self.step), state, meta={"step": self.step, "run_id": run_id})
        if engine.is_rank_zero:
            ckpt.prune(root, self.config.keep_last, run_id)  # never another run's checkpoints
        return path

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

    def _validate(self, engine: Engine, wrapped: nn.Module, val: tuple[Any, Any, int, int | None], batch_size: int) -> dict[str, float]:
        """Every validation sample counted once across ranks; sums reduced, then divided. Every key
        ``validation_step`` returns is logged (as ``val_<key>``), not only the ones named in ``metrics``."""
        dataset, collate, _, _ = val
        module = engine.unwrap(wrapped)
        was_training = module.training
        module.eval()
        totals: dict[str, float] = {}
        count = 0
        world, rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
        # Under FSDP (and pipelines) a forward is collective: every rank must make the same
        # number of calls. Shards differ by at most one sample, so a rank with fewer batches
        # runs a real batch again and drops its result (val_samples still counts each once).
        calls = max(-(-len(eval_shard(len(dataset), world, r)) // batch_size) for r in range(world))
        keys: list[str] = []
        with torch.no_grad(), engine.autocast():
            done = 0
            for batch in eval_batches(dataset, world, rank, batch_size, collate):
                batch = engine.to_device(batch)
                n = batch_size_of(batch)
                values = self._eval_batch(module, batch)
                keys = keys or list(values)
                count += n
                for k, v in values.items():
                    totals[k] = totals.get(k, 0.0) + float(v) * n
                done += 1
            for _ in range(calls - done):
                keys = keys or list(self._eval_batch(module, engine.to_device(fetch(dataset, [0], collate))))
        module.train(was_training)
        # Every rank ran at least one call, so every rank knows the keys (the same code returns them).
        sums = torch.tensor([float(count)] + [totals.get(k, 0.0) for k in keys], dtype=torch.float64, device=engine.device)
        engine.all_reduce(sums, "sum")
        sums /= copies_per_shard(engine)
        samples = max(sums[0].item(), 1.0)
        out = {f"val_{k}": sums[1 + i].item() / samples for i, k in enumerate(keys)}
        out["val_samples"] = int(sums[0].item())
        self._callback("on_validation_end", engine, out)
        return out

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
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)


def _fit_worker(trainer: Trainer, model: nn.Module, train_data: Any, val_data: Any) -> tuple[dict[str, Any], Any]:
    """Entry point of each process that ``Trainer.fit`` starts."""
    return trainer._fit(model, train_data, val_data, return_state=True)
