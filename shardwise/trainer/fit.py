"""One fit in one process: `FitRun` places the model, trains it step by step, and writes the summary.

`Trainer.fit` checks and plans in the parent (`shardwise.trainer.plan`), starts the processes, and each
runs a `FitRun`: ``setup`` (the strategy places the model, the data loader, a resume), ``open`` (the run's
files, loggers, progress bar), ``train`` (epochs of `step`), ``finish`` (the summary every rank returns).
No strategy-specific branches: everything goes through `Engine`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.checkpoint.rundir import describe_outputs, new_run_id
from shardwise.comm import monitored_barrier
from shardwise.data import ShardedLoader, StreamLoader, loader_options, pinning, unpack_data
from shardwise.data.batches import call_model, loss_from_output
from shardwise.data.stream import first_samples, is_stream, loader_for
from shardwise.engine import Engine, call_through, seed_everything
from shardwise.engine.loggers import Loggers, RunInfo
from shardwise.errors import CommError
from shardwise.launcher.memory import snapshot
from shardwise.strategies import StepFn
from shardwise.strategies.cost.peak import tensors_of
from shardwise.trainer import callbacks, evaluate, nonfinite, resume, streams, throughput
from shardwise.trainer.logging import Progress, RunFiles, batch_seq, format_memory, memory_section, write_rank_comm
from shardwise.trainer.profile import StepProfiler, format_breakdown

if TYPE_CHECKING:
    from collections.abc import Callable

    from shardwise.trainer.loop import LossFn, Trainer

__all__ = ["FitRun", "make_step_fn"]

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


def _epoch_over(loader: ShardedLoader | StreamLoader) -> bool:
    """Whether the loader's epoch has taken all its steps (a stream without ``__len__`` tells only when it ends)."""
    steps = loader.steps_per_epoch
    return steps is not None and loader.step_in_epoch >= steps


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


class FitRun:
    """The training loop of one process; its state is what the loop's steps share."""

    def __init__(self, trainer: Trainer, engine: Engine, model: nn.Module, train_data: Any, val_data: Any, wall_start: float) -> None:
        self.trainer, self.engine, self.model = trainer, engine, model
        self.cfg = trainer.config
        self.train_data, self.val_data = train_data, val_data
        self.wall_start = wall_start
        self.losses: list[torch.Tensor] = []  # detached per-step losses since the last log (no sync per step)
        self.last_train_loss = float("nan")
        self.val_metrics: dict[str, float] = {}
        self.val_step = -1  # the step of the last evaluation (the final one is not repeated at the same step)
        self.last_ckpt: Path | None = None
        self.preempted: dict[str, Any] | None = None  # the signal and the step, once the log step's reduction says one came
        self.seq = 0  # tokens per sample, read from the first batch trained on

    def run(self, return_state: bool) -> tuple[dict[str, Any], Any]:
        """The whole fit on this rank: the summary, and rank 0's full model state when ``return_state``."""
        if not self.setup():
            return {}, None
        resumed_from = self.resume()
        if resumed_from is not None and self.start_step >= self.total:
            return resume.already_finished(self.trainer, self.engine, self.wrapped, self.state, resumed_from, self.start_step, self.total, return_state)
        self.open(resumed_from)
        self.train()
        return self.finish(resumed_from, return_state)

    # -- before the first step --------------------------------------------------------------
    def setup(self) -> bool:
        """Place the model, build the optimizer, schedule and data loader; False on a rank that does not train."""
        trainer, engine, model, cfg = self.trainer, self.engine, self.model, self.cfg
        self.table = evaluate.module_table(model) if cfg.model_summary else None  # the whole model, before the strategy splits it
        adapter = trainer._adapter
        if adapter is not None:
            adapter.bind(trainer, model, engine)
        # this rank's peak before the strategy places the model, and the model's sizes for the prediction (meta-built too)
        self.memory_start, self.model_tensors = snapshot(engine.device), tensors_of(model)
        self.built_whole = not any(p.is_meta for p in model.parameters())
        wrapped, optimizer = engine.setup(model, adapter.make_optimizer if adapter is not None else trainer.optimizer_factory)
        if not engine.trains:
            # A rank the strategy keeps for service (a parameter server): it served inside
            # setup until the training ranks finished; rank 0 trains and writes the summary.
            if not cfg.fast_dev_run:
                write_rank_comm(cfg.out, engine.rank, engine.world_size, engine.recorder.report(1), None)
            return False
        # The model is built and identical everywhere; from here each rank draws its own
        # stream, so dropout masks differ across data shards (a resume restores them).
        seed_everything(cfg.seed + 1 + engine.rank)
        self.wrapped, self.optimizer = wrapped, optimizer
        trainer.optimizer, trainer.model = optimizer, wrapped
        scheduler = trainer.lr_scheduler(optimizer) if trainer.lr_scheduler is not None else None
        if adapter is not None:
            scheduler = adapter.make_schedule(optimizer)
        self.scheduler = scheduler
        self.loader = self._loader()
        streams.agree_on_first_samples(engine, self.loader)  # a stream that reads differently per process: refused, not trained
        self.total = cfg.max_steps or (cfg.max_epochs or 1) * (self.loader.steps_per_epoch or 0)  # a stream without __len__ needs max_steps
        if cfg.fast_dev_run:
            self.total = cfg.fast_dev_run
        self.counters: dict[str, Any] = {"step": 0, "samples": 0, "nonfinite_skipped": 0, "nonfinite_trained": 0, "weights_finite": True}
        self.state: dict[str, Any] = {"model": wrapped, "optimizer": optimizer, "loader": self.loader, "counters": self.counters}
        if scheduler is not None:
            self.state["scheduler"] = scheduler
        trainer._state, trainer._engine = self.state, engine
        self.out = None if trainer.saves_nothing else cfg.out
        self._announce()
        return True

    def _loader(self) -> ShardedLoader | StreamLoader:
        cfg, engine = self.cfg, self.engine
        dataset, collate, workers, dl_batch = unpack_data(self.train_data)
        dl_pin, dl_prefetch = loader_options(self.train_data)  # a DataLoader's own settings count too
        pin, self.pin_note = pinning(cfg.pin_memory or dl_pin, engine.device)
        self.dl_batch = dl_batch
        self.global_batch = global_batch = self.trainer._global_batch(dl_batch)
        if cfg.overfit_batches:  # a stream's first batches are taken into memory
            many = cfg.overfit_batches * global_batch
            dataset = first_samples(dataset, many, cfg.seed) if is_stream(dataset) else evaluate.head(dataset, min(len(dataset), many))
        return loader_for(
            dataset,
            resume=cfg.stream_resume,
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
            pin_memory=pin,
            prefetch_factor=cfg.prefetch_factor or dl_prefetch,
        )

    def _announce(self) -> None:
        """The run's first lines (rank 0): what is saved where, and what the batch leaves out."""
        cfg, engine = self.cfg, self.engine
        if cfg.fast_dev_run:
            engine.print(f"shardwise: fast_dev_run: {self.total} step(s) and {self.total} validation batch(es) per rank; nothing is saved or logged")
        elif cfg.announce_outputs:
            engine.print(describe_outputs(cfg.out, cfg.checkpoint_every, cfg.keep_last))
            threads, source = self.trainer.threads_note
            engine.print(
                f"shardwise: strategy {cfg.strategy} on {engine.world_size} process(es), {threads} thread(s) each "
                f"({source}{'' if source == 'the threads setting' else '; --threads N sets another'})"
            )
        self.batch_notes = self.trainer._batch_notes(self.global_batch, self.dl_batch, self.loader)
        if cfg.announce_outputs and not cfg.fast_dev_run:
            for note in self.batch_notes["lines"]:
                engine.print(f"shardwise: {note}")
        if self.pin_note and cfg.announce_outputs:
            engine.print(f"shardwise: {self.pin_note}")  # pin_memory without CUDA: said once, then ignored

    def resume(self) -> Path | None:
        """Restore a checkpoint when ``resume`` says so (the run's id, counters and callbacks' states too)."""
        trainer, engine = self.trainer, self.engine
        if getattr(trainer, "_run_id", None) is None:
            trainer._run_id = new_run_id()
        resumed_from = resume.restore(trainer, engine, self.state)
        if resumed_from is not None:
            self.counters = self.state["counters"]
            for key, value in {"nonfinite_skipped": 0, "nonfinite_trained": 0, "weights_finite": True}.items():
                self.counters.setdefault(key, value)  # a checkpoint written before these counters
            trainer._run_id = ckpt.run_id_of(resumed_from) or getattr(trainer, "_run_id", None) or new_run_id()
        trainer.step = self.start_step = int(self.counters["step"])
        trainer._last_loss = None
        if resumed_from is not None:
            callbacks.restore_states(trainer.callbacks, self.counters.get("callbacks", {}))
            trainer._callback("on_load_checkpoint", engine, resumed_from)
        return resumed_from

    def open(self, resumed_from: Path | None) -> None:
        """The run's files, loggers, model summary and progress bar; the step function and its checks."""
        trainer, engine, cfg, out = self.trainer, self.engine, self.cfg, self.out
        resumed = resumed_from is not None
        self.files = RunFiles(out, engine.is_rank_zero, append=resumed, after_step=self.start_step if resumed else None)
        run_info = RunInfo(Path(out) if out else None, trainer._run_id, cfg.experiment_name, cfg.tracking_uri, self.start_step if resumed else None)
        self.loggers = Loggers.build(cfg.loggers, trainer.logger_objects, run_info if engine.is_rank_zero and not cfg.fast_dev_run else None)
        self.loggers.log_hyperparams(trainer.hyperparameters())
        self.model_summary = None
        if self.table is not None:  # the whole table before the bar starts: a bar drawn first breaks into it
            per_rank = evaluate.per_rank_counts(engine, engine.unwrap(self.wrapped))
            self.model_summary = {"modules": self.table, "parameters_per_rank": per_rank}
            engine.print(evaluate.format_summary(self.table, per_rank))
        self.progress = Progress(enabled=engine.is_rank_zero, total=self.total, initial=self.start_step, bar=cfg.progress_bar)
        if resumed:
            self.progress.write(f"resumed from {resumed_from} at step {self.start_step}")
        step_fn = make_step_fn(trainer.loss_fn, engine.unwrap(self.wrapped))
        self.weights = _Weights()
        if not cfg.drop_last:
            step_fn = self.weights.wrap(step_fn)  # the epoch's smaller last batch: each micro-batch's share (`ShardedLoader.step_weights`)
        self.step_fn = step_fn
        # The grad scaler checks fp16 gradients itself and skips what overflows: not ours to stop (the loss still is).
        self.check = nonfinite.NonFiniteCheck(
            engine.unwrap(self.wrapped), engine.group, engine.recorder, check_grads=engine.precision.scaler is None, agree=engine.steps_together
        )
        self.val = unpack_data(self.val_data)
        self.val_batch = cfg.val_batch_size or max(1, self.loader.micro)
        self.ckpt_root = Path(out) / "checkpoints" if out else None
        trainer._callback("on_fit_start", engine)
        trainer._emit = self.emit  # for callbacks that log records of their own (a Lightning module's epoch values)

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> None:
        """Epochs of steps until ``max_steps`` (or the epochs) or a callback's stop."""
        trainer, loader, cfg = self.trainer, self.loader, self.cfg
        self.rates = throughput.Rates.start(trainer, self.engine, self.global_batch)  # the peak before the clock starts (a CPU's may be measured)
        self.t_log, self.steps_at_log = time.perf_counter(), self.start_step
        self.train_start = time.perf_counter()
        self.profiler = StepProfiler(cfg, self.engine, Path(self.out) if self.out else None, self.start_step, self.total) if cfg.profile else None
        self.phase: Callable[[str], contextlib.AbstractContextManager[Any]] = self.profiler.phase if self.profiler is not None else _no_phase
        while trainer.step < self.total and not trainer.should_stop:
            epoch = loader.epoch + (1 if _epoch_over(loader) else 0)
            trainer._callback("on_train_epoch_start", self.engine, epoch)
            batches = iter(loader)
            while (micro := self._next_batch(batches)) is not None:
                if self.step(micro):
                    break
            if _epoch_over(loader) or loader.step_in_epoch == 0:
                trainer._callback("on_train_epoch_end", self.engine, epoch)
        if self.losses:  # stopped between log steps (a callback set should_stop after this step's log check)
            self.log_train()
        self.train_s = time.perf_counter() - self.train_start
        self.rates.stop()
        loader.close()  # data-loading workers end with the training (they would outlive the run otherwise)

    def _next_batch(self, batches: Any) -> list[Any] | None:
        """The next step's micro-batches on this rank's device, or None when the epoch is over."""
        if self.profiler is not None:
            self.profiler.step_start(self.trainer.step + 1)
        with self.phase("data"):
            micro = next(batches, None)
            if micro is not None:
                micro = [self.engine.to_device(b) for b in micro]
                self.seq = self.seq or batch_seq(micro[0])  # tokens per sample, for the memory prediction
                self.rates.saw(micro)  # the step's tokens (its real (B, T): lengths may vary)
        if micro is None and self.profiler is not None:
            self.profiler.step_abort()
        return micro

    def step(self, micro: list[Any]) -> bool:
        """One optimizer step and what follows it (logs, evaluation, checkpoint); True when training ends."""
        trainer, engine, cfg = self.trainer, self.engine, self.cfg
        trainer._callback("on_train_step_start", engine, trainer.step + 1)
        self.weights.start(self.loader.last_weights)
        with self.phase("forward_backward"):
            loss = engine.forward_backward(self.wrapped, micro, self.step_fn)
        with self.phase("optimizer"):
            verdict = self.check.verdict(trainer.step + 1, loss)  # every rank, agreed; before clipping scales the gradients
            skip = verdict is not None and nonfinite.act_on(cfg.on_nonfinite, verdict, self.counters, self.progress.write, self.ckpt_root)
            self.optimizer_step(skip)
        trainer.step += 1
        self._count(verdict is None)
        trainer._last_loss = loss
        if not skip:
            self.losses.append(loss)
        done = trainer.step >= self.total
        self.after_step(done)
        trainer._callback("on_train_step_end", engine, trainer.step, loss)
        return done or trainer.should_stop

    def optimizer_step(self, skip: bool) -> None:
        """Clip, step and zero the gradients (a skipped step only zeroes them), then the schedule."""
        engine, optimizer, scheduler, cfg = self.engine, self.optimizer, self.scheduler, self.cfg
        stepped = False
        if not skip:
            if cfg.clip_grad_norm is not None:
                engine.clip_grad_norm(self.wrapped, optimizer, cfg.clip_grad_norm)
            stepped = engine.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None and stepped:
            scheduler.step()  # as after a grad scaler's skip: a skipped step moves no schedule

    def _count(self, finite: bool) -> None:
        counters, loader = self.counters, self.loader
        counters["step"] = self.trainer.step
        counters["samples"] = counters["samples"] + (self.global_batch if loader.last_weights is None else loader.last_step_samples)
        if finite:
            counters["weights_finite"] = True

    def after_step(self, done: bool) -> None:
        """The log, evaluation, checkpoint and debug barrier due after this step."""
        trainer, cfg, engine = self.trainer, self.cfg, self.engine
        step = trainer.step
        if step % cfg.log_every == 0 or done or trainer.should_stop:
            self.log_train()
        if self.val[0] is not None and cfg.val_every and step % cfg.val_every == 0 and not done:
            self.val_metrics = self.validate()
            self.progress.write("  ".join(f"{k} {v:.4g}" for k, v in {"step": step, **self.val_metrics}.items()))
        if self.ckpt_root is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and not done:
            self.last_ckpt = trainer._save(engine, self.state, self.ckpt_root)
        if cfg.debug_collectives:
            try:
                monitored_barrier(group=engine.group, timeout_s=cfg.timeout_s, recorder=engine.recorder)
            except CommError as exc:
                raise CommError(f"debug_collectives: at the barrier after step {step}: {exc}") from exc

    # -- records ----------------------------------------------------------------------------
    def emit(self, record: dict[str, Any]) -> None:
        """One record to the callbacks (every rank: a callback may add keys or decide to stop), the files and the loggers."""
        self.trainer._callback("on_metrics", self.engine, record)
        self.files.log(record)
        self.loggers.log_metrics(record)

    def log_train(self) -> None:
        """The only per-log collective: the mean training loss over the loop's group and steps (a rank that
        loops alone, an async parameter-server worker, logs its own), with whether any rank got a preemption
        signal (`preempt`) and every rank's compile seconds since the last log (the rates leave out the
        largest). Skipped non-finite steps leave no loss: a window of only those logs nan (every rank alike:
        the skip is agreed)."""
        trainer, engine, losses = self.trainer, self.engine, self.losses
        local = torch.stack(losses).double().mean() if losses else torch.tensor(float("nan"), dtype=torch.float64, device=engine.device)
        size, rank = engine.group.size, engine.group.rank  # and each rank's compile seconds in its own slot (x size: the mean's)
        compiled = torch.zeros(size, dtype=torch.float64, device=local.device)
        compiled[rank] = self.rates.window_compile() * size
        both = engine.all_reduce(torch.cat([torch.stack([local, torch.full_like(local, trainer.preemption.flag)]), compiled]), "mean")
        mean, preempt = both[0], float(both[1].item())
        self.last_train_loss = float(mean.item())
        if preempt > 0 and self.preempted is None:
            self.preempted = {"signal": trainer.preemption.signal or "on another rank", "step": trainer.step}
            trainer.should_stop = True
        now = time.perf_counter()
        record = {
            "step": trainer.step,
            "epoch": self.loader.epoch,
            "train_loss": self.last_train_loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            **self.rates.window(trainer.step - self.steps_at_log, now - self.t_log, float(both[2:].max())),  # samples_per_s, tokens_per_s, mfu
        }
        if self.counters["nonfinite_skipped"]:
            record["nonfinite_skipped"] = int(self.counters["nonfinite_skipped"])
        self.emit(record)
        self.progress.update(trainer.step - self.steps_at_log, record)
        self.t_log, self.steps_at_log = now, trainer.step
        losses.clear()

    def validate(self) -> dict[str, float]:
        metrics = self.trainer._validate(self.engine, self.wrapped, self.val, self.val_batch)
        self.val_step = self.trainer.step
        self.emit({"step": self.trainer.step, **metrics})
        return metrics

    # -- after the last step ----------------------------------------------------------------------
    def finish(self, resumed_from: Path | None, return_state: bool) -> tuple[dict[str, Any], Any]:
        """The final evaluation and checkpoint, the summary (every rank; rank 0 writes and prints it)."""
        trainer, engine = self.trainer, self.engine
        profile_section = self.profiler.finish() if self.profiler is not None else None
        if self.val[0] is not None and self.val_step != trainer.step and self.preempted is None:  # preempted: the checkpoint first, no evaluation
            self.val_metrics = self.validate()
        if self.ckpt_root is not None:
            self.last_ckpt = trainer._save(engine, self.state, self.ckpt_root)
        self.progress.close()
        summary = self.summary(resumed_from, profile_section)
        trainer._callback("on_fit_end", engine, summary)  # every rank; a callback may add its section
        self.files.summary(summary)
        self.loggers.finalize(summary)
        self.files.close()
        if engine.is_rank_zero:
            self._print_summary(summary, profile_section)
        model_state = None
        if return_state:
            full = engine.consolidated_state_dict(self.wrapped)  # collective under sharded strategies: every rank
            model_state = full if engine.is_rank_zero else None
        return summary, model_state

    def summary(self, resumed_from: Path | None, profile_section: dict[str, Any] | None) -> dict[str, Any]:
        trainer, engine, cfg, loader = self.trainer, self.engine, self.cfg, self.loader
        steps_run = trainer.step - self.start_step
        self.wall = time.perf_counter() - self.wall_start
        comm = engine.recorder.report(steps_run)
        write_rank_comm(self.out, engine.rank, engine.world_size, comm, steps_run)
        strategy_section = engine.finish()  # on every rank: the strategy's end of run (collective reports, servers stop)
        memory = memory_section(  # after the recorder's report: its one all-reduce is not the run's traffic
            engine,
            self.memory_start,
            snapshot(engine.device),
            self.model_tensors,
            micro_batch=loader.micro,
            seq=self.seq,
            optimizer=self.optimizer,
            built_whole=self.built_whole,
        )
        summary: dict[str, Any] = {
            "strategy": cfg.strategy,
            "world_size": engine.world_size,
            "threads": self.trainer.threads_note[0],  # this process's torch.get_num_threads() while it trained
            "threads_from": self.trainer.threads_note[1],
            "mesh": dict(engine.layout.degrees),  # dp x pp x tp of the training ranks, as the strategy planned it
            "precision": cfg.precision,
            "global_batch_size": self.global_batch,
            "global_batch_size_from": self.batch_notes["from"],
            "drop_last": cfg.drop_last,
            "samples_left_out_per_epoch": loader.left_out,
            "accumulate": cfg.accumulate,
            "steps": trainer.step,
            "steps_this_run": steps_run,
            "samples": int(self.counters["samples"]),
            "wall_s": self.wall,
            "train_s": self.train_s,
            **self.rates.summary(steps_run, self.train_s),  # samples_per_s .. mfu, throughput: step time less the slowest rank's compile
            "train_loss": self.last_train_loss,
            "on_nonfinite": cfg.on_nonfinite,
            "nonfinite_skipped": int(self.counters["nonfinite_skipped"]),
            "nonfinite_trained": int(self.counters["nonfinite_trained"]),
            **self.val_metrics,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "last_checkpoint": str(self.last_ckpt) if self.last_ckpt else None,
            "comm": comm,
            **strategy_section,
            "memory": memory,
        }
        if self.model_summary is not None:
            summary["model_summary"] = self.model_summary
        if profile_section is not None:
            summary["profile"] = profile_section
        if self.preempted is not None:
            summary["preempted"] = self.preempted
        return summary

    def _print_summary(self, summary: dict[str, Any], profile_section: dict[str, Any] | None) -> None:
        if "memory_per_rank" in summary:
            from shardwise.strategies.cost.memory import format_table

            print(format_table(summary["memory_per_rank"]), flush=True)
        print(format_memory(summary["memory"]), flush=True)
        if profile_section is not None:
            print(format_breakdown(profile_section), flush=True)
        line = "  ".join(f"{k} {summary[k]:.4g}" for k in ("train_loss", "val_loss", "val_accuracy", "samples_per_s") if isinstance(summary.get(k), float))
        print(f"done: {self.trainer.step} steps in {self.wall:.1f}s  {line}  {throughput.end_line(summary)}".rstrip(), flush=True)
