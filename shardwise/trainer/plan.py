"""The checks before anything runs: ``fit``, ``validate``, ``test`` and ``predict`` refuse what cannot
work in the parent, with one line each, and plan the strategy once (`shardwise.engine.plan`); the
workers receive the plan."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.checkpoint.rundir import check_out
from shardwise.data import fetch, order_changed, unpack_data
from shardwise.data.batches import check_batch_fits, returns_own_loss
from shardwise.data.stream import is_stream, stream_length
from shardwise.engine.loggers import check_names
from shardwise.engine.plan import plan_strategy
from shardwise.errors import ConfigError
from shardwise.launcher.env import detect_env
from shardwise.launcher.spawn import check_world_size
from shardwise.strategies import Batch, Layout, Strategy, available, checkpointing, compiling, get_strategy, materialize
from shardwise.trainer import callbacks, streams, throughput
from shardwise.trainer.adapters import adapter_for

if TYPE_CHECKING:
    from shardwise.trainer.loop import Trainer

__all__ = ["check_evaluate", "check_fit", "check_tools", "plan", "world_size"]


def world_size(trainer: Trainer) -> int:
    """The job's world size: the launcher's (checked against ``nproc``), else ``nproc``."""
    env = detect_env()
    if env.distributed and trainer.config.nproc > 1:
        check_world_size(trainer.config.nproc, env.world_size, env.source, "Trainer(nproc=...)")
    return env.world_size if env.distributed else trainer.config.nproc


def plan(trainer: Trainer, model: nn.Module, dl_batch: int | None) -> None:
    """Resolve, plan and check the strategy for ``model`` (once: the workers receive both) and keep them
    on the trainer (``trainer.layout``)."""
    cfg = trainer.config
    trainer._strategy, trainer._layout = plan_strategy(
        cfg.strategy,
        cfg.strategy_options,
        world_size(trainer),
        precision=cfg.precision,
        sync_batchnorm=cfg.sync_batchnorm,
        mesh=cfg.mesh,
        model=model,
        batch=Batch(trainer._global_batch(dl_batch), cfg.accumulate),
    )


def check_fit(trainer: Trainer, model: nn.Module, train_data: Any, val_data: Any = None) -> None:
    """Everything ``fit`` can refuse before a process starts; sets the trainer's adapter and plan."""
    cfg = trainer.config
    if not isinstance(model, nn.Module):
        raise ConfigError(f"fit needs a torch.nn.Module; got {type(model).__name__}")
    has_step = callable(getattr(model, "training_step", None))
    if trainer.loss_fn is None and not has_step and not returns_own_loss(model):
        raise ConfigError(
            f"no loss: pass loss_fn=... (a function of the model output and the batch) to the Trainer, "
            f"or define a training_step(batch) method on {type(model).__name__} (a model whose forward "
            "takes `labels`, as transformers' models do, trains on its own loss with no loss_fn)"
        )
    dataset, collate, _, dl_batch = unpack_data(train_data)
    if dataset is None:
        raise ConfigError("fit needs training data: a Dataset, a stream or a DataLoader")
    first = streams.check_fit(trainer, dataset, collate, trainer._global_batch(dl_batch)) if is_stream(dataset) else None
    per_epoch = (stream_length(dataset) or 0) // trainer._global_batch(dl_batch)
    estimate = cfg.fast_dev_run or cfg.max_steps or (cfg.max_epochs or 1) * per_epoch
    trainer._adapter = adapter_for(trainer, model, "fit", has_val=val_data is not None, total=estimate or None)
    plan(trainer, model, dl_batch)
    strategy, layout = trainer._strategy, trainer._layout
    assert strategy is not None and layout is not None
    checkpointing.check(model, cfg.activation_checkpointing)  # a bad value, or a model with no block list to checkpoint
    compiling.check(cfg.compile, model, strategy, _device(cfg))  # a strategy, model or machine compile cannot work on
    if materialize.has_meta(model):
        materialize.plan_init(model).check()  # a meta tensor no initializer sets: refused here, not in every worker
    if not cfg.drop_last:
        check_drop_last(strategy, layout)
    check_tools(trainer, val_data, model)
    streams.check_val(trainer, val_data)
    check_resume_batch(cfg, trainer._global_batch(dl_batch), dataset)
    if detect_env().rank == 0 and not cfg.fast_dev_run:  # rank 0 writes the run directory (others may start after it has)
        check_out(cfg.out, cfg.resume, cfg.overwrite)
    own_cp = has_step and layout.degrees.get("cp", 1) > 1  # cp checks a training_step model on its self(...) call's arguments
    sample = first if first is not None else _first(dataset, collate, quiet=has_step and not own_cp)  # a stream's: its first sample
    if (own_cp or not has_step) and sample is not None:
        if not has_step:
            check_batch_fits(model, sample)
        strategy.check_sample(model, sample, layout)  # tp rehearses its split on it (meta tensors)
    trainer._flops = throughput.count_for_fit(trainer, model, sample) if cfg.count_flops else None  # the model's FLOPs, once, on meta tensors


def _first(dataset: Any, collate: Any, quiet: bool) -> Any:
    """A batch of the data set's first sample (None for an empty or unindexable one); ``quiet``: None too where
    reading it fails (only the FLOP count wanted it; the workers' loader says what is wrong)."""
    if not hasattr(dataset, "__getitem__") or stream_length(dataset) == 0:
        return None
    try:
        return fetch(dataset, [0], collate)
    except Exception:  # noqa: BLE001
        if quiet:
            return None
        raise


def _device(cfg: Any) -> str:
    """The device type the workers will train on (what compile's backend needs on the machine)."""
    import torch

    return "cuda" if cfg.accelerator == "cuda" or (cfg.accelerator == "auto" and torch.cuda.is_available()) else "cpu"


def check_resume_batch(cfg: Any, global_batch: int, dataset: Any = None) -> None:
    """A resume onto a checkpoint saved with another global batch is a ConfigError here, before launch: the data
    position is a place in global batches of that size (the newest checkpoint's manifest says it; the workers' load
    refuses it too, for a checkpoint written before the manifest said)."""
    if cfg.resume is None or (cfg.resume == "auto" and cfg.out is None):
        return
    from shardwise.checkpoint.files import list_checkpoints, read_manifest

    candidates = list_checkpoints(Path(cfg.out) / "checkpoints") if cfg.resume == "auto" else [Path(cfg.resume)]
    if not candidates or not (candidates[-1] / "manifest.json").exists():
        return
    try:
        manifest = read_manifest(candidates[-1])
    except Exception:  # noqa: BLE001 - a damaged checkpoint: the workers' resume skips or names it
        return
    saved, order = manifest.get("global_batch"), manifest.get("order_key")
    key = getattr(dataset, "order_key", None)
    if isinstance(order, str) and isinstance(key, str) and order != key:
        raise ConfigError(f"{candidates[-1]}: " + order_changed(dataset, order, key))
    if saved is not None and int(saved) != global_batch:
        raise ConfigError(
            f"the checkpoint to resume, {candidates[-1]}, was trained with a global batch of {saved} samples, and this run "
            f"takes {global_batch}: its data position is a place in batches of {saved}. Resume with global_batch_size={saved} "
            "(--global-batch-size), or start a new run (another out directory)"
        )


def check_evaluate(trainer: Trainer, kind: str, model: nn.Module, data: Any, ckpt_path: str | None) -> None:
    """Everything ``validate`` (``kind`` "val"), ``test`` and ``predict`` can refuse before a process
    starts; sets the trainer's adapter and plan."""
    what = "validate" if kind == "val" else kind
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{what} needs a torch.nn.Module; got {type(model).__name__}")
    if materialize.has_meta(model) and ckpt_path is None:
        raise ConfigError(
            f"{what} got {type(model).__name__} on the meta device: it holds no weights here "
            "(a meta-built model's trained weights are in its run's checkpoints). Pass ckpt_path= (fit's summary "
            "'last_checkpoint', or trainer.best_model_path)"
        )
    dataset, _, _, dl_batch = unpack_data(data)
    if kind == "predict" and is_stream(dataset):
        raise ConfigError(f"predict returns one row per sample in dataset order, and {type(dataset).__name__} is a stream: give a map-style Dataset")
    if dataset is None or (not is_stream(dataset) and len(dataset) == 0):
        raise ConfigError(f"{what} needs a non-empty Dataset, stream or DataLoader; got {data!r}")
    if kind != "predict" and trainer.loss_fn is None and not callable(getattr(model, "validation_step", None)) and not returns_own_loss(model):
        if not callable(getattr(model, "training_step", None)):
            raise ConfigError("no loss to evaluate: pass loss_fn=... to the Trainer or define validation_step(batch) on the model")
    if ckpt_path is not None and not Path(ckpt_path).exists():
        raise ConfigError(f"ckpt_path={ckpt_path!r}: no such checkpoint directory")
    trainer._adapter = adapter_for(trainer, model, kind)
    streams.check_val(trainer, data, what)
    plan(trainer, model, dl_batch)


def check_tools(trainer: Trainer, val_data: Any, model: nn.Module | None = None) -> None:
    """Loggers and callbacks that cannot work, in the parent before launch (one line each)."""
    cfg = trainer.config
    check_names(cfg.loggers)
    if (cfg.loggers or trainer.logger_objects) and cfg.out is None and cfg.tracking_uri is None:
        named = ", ".join([*cfg.loggers, *(type(x).__name__ for x in trainer.logger_objects)])
        if any(n != "mlflow" for n in cfg.loggers):
            raise ConfigError(f"loggers ({named}) write into the run directory: set out=... (--out DIR)")
    has_val = val_data is not None
    for cb in trainer.callbacks:
        if isinstance(cb, callbacks.Callback):
            cb.check(trainer, has_val)
            if model is not None:
                cb.check_model(trainer, model)


def check_drop_last(strategy: Strategy, layout: Layout) -> None:
    """``drop_last=False`` where the strategy takes a smaller batch exactly (`Strategy.smaller_last_batch`),
    refused before launch elsewhere."""
    if not strategy.smaller_last_batch or layout.degrees.get("pp", 1) > 1:
        able = [n for n in available() if get_strategy(n).smaller_last_batch]
        raise ConfigError(
            f"drop_last=False: strategy {layout.strategy!r} cannot take the epoch's smaller last batch exactly "
            "(a pipeline splits each batch into a fixed number of micro-batches; parameter servers and replicas do not average "
            f"every rank's gradient of a step); it works with {', '.join(able)} (without a pipeline dimension). Leave drop_last=True "
            "(on the command line, leave out --keep-last-batch: the remainder is left out) or choose a global batch that divides the data set"
        )
