"""``shardwise tune lr`` and ``shardwise tune batch-size``: the tuners on a built-in recipe.

::

    shardwise tune lr --recipe digits [--strategy ddp --nproc 2] [--min-lr 1e-6 --max-lr 10 --steps 100]
                      [--png lr_find.png] [--json FILE] [--config FILE.toml] [--set section.key=value ...]
    shardwise tune batch-size --recipe digits --memory-budget 2GB [--strategy ddp --nproc 2] [--steps 5]
                      [--max-batch N] [--json FILE]
    shardwise tune hparams --recipe digits | --model MODULE:FACTORY --data MODULE:FACTORY [...]
                      --space KEY=KIND:ARGS [--space ...] [--trials N] [--parallel K] [--metric val_loss]
                      [--direction minimize] [--max-steps N] [--pruner median] [--out DIR] [--json FILE]

The run's settings come from the recipe's defaults, then ``--config`` and ``--set`` (as for
``shardwise train``; strategy options go through ``--set trainer.strategy_options.KEY=VALUE``),
then the flags here.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.config import add_arguments as add_flags
from shardwise.config import flag
from shardwise.errors import ConfigError

TUNE_HELP = "find a learning rate (range test), the largest batch that fits memory, or the best hyperparameters (search)"

_SETTINGS = ("strategy", "nproc", "precision", "accelerator", "global_batch_size", "accumulate", "seed")


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    """The flags both tuners take (`shardwise.config.flag`: each field's flag, default and help), besides
    the trainer settings of `_SETTINGS` (`TrainerConfig`'s flags)."""

    recipe: str = flag(help="recipe name (see `shardwise recipes`)", required=True)
    config: str | None = flag(None, "TOML file with [trainer] and [recipe] sections")
    set: list[str] = flag(help="override one setting (repeatable)", action="append", metavar="SECTION.KEY=VALUE", default_factory=list)
    json: str | None = flag(None, "write the result as JSON to this file")


@dataclass(frozen=True, kw_only=True)
class LrOptions(TuneOptions):
    """``shardwise tune lr``'s flags."""

    min_lr: float = flag(1e-6, "rate of the first step (default 1e-6)")
    max_lr: float = flag(10.0, "rate of the last step (default 10)")
    steps: int = flag(100, "steps of the sweep (default 100)")
    smoothing: float = flag(0.9, "weight of the past in the loss's moving average (default 0.9)")
    diverge: float = flag(4.0, "stop when the smoothed loss exceeds this many times its lowest (default 4)")
    png: str = flag("lr_find.png", "picture of loss against rate (default lr_find.png; needs matplotlib; '' for none)")


@dataclass(frozen=True, kw_only=True)
class BatchSizeOptions(TuneOptions):
    """``shardwise tune batch-size``'s flags."""

    memory_budget: str | None = flag(None, "per process, e.g. 2GB or 512MiB (required on CPU; on GPU the default is what fits CUDA memory)")
    steps: int = flag(8, "training steps per size (default 8; the first is not timed)")
    max_batch: int | None = flag(None, "largest micro-batch to try (default: what the training set holds)")


@dataclass(frozen=True, kw_only=True)
class HparamsOptions:
    """``shardwise tune hparams``'s flags (`shardwise.tools.tune.hparams.search_hparams`'s arguments)."""

    recipe: str | None = flag(None, "recipe name (see `shardwise recipes`); or your own model with --model and --data")
    model: str | None = flag(None, "your own model, as `shardwise train --model` takes it", metavar="MODULE:FACTORY")
    data: str | None = flag(None, "its training data, as `shardwise train --data`", metavar="MODULE:FACTORY")
    val_data: str | None = flag(None, "its validation data, as `shardwise train --val-data`", metavar="MODULE:FACTORY")
    loss: str | None = flag(None, "its loss, as `shardwise train --loss`", metavar="MODULE:FN")
    optimizer: str | None = flag(None, "its optimizer, as `shardwise train --optimizer`", metavar="MODULE:FACTORY")
    space: list[str] = flag(
        help="one setting to search (repeatable): KEY=uniform:LO:HI, loguniform:LO:HI, int:LO:HI, logint:LO:HI or choice:A,B,...; "
        "KEY as --set takes it (recipe.lr, trainer.global_batch_size, trainer.strategy_options.NAME) or param.NAME for your own "
        "factories (shardwise.tools.tune.hparam)",
        action="append",
        metavar="KEY=KIND:ARGS",
        default_factory=list,
    )
    trials: int = flag(8, "runs to try (default 8)")
    parallel: int = flag(1, "runs at a time, each its own processes (default 1)")
    metric: str = flag("val_loss", "what the runs log that the search optimizes: val_loss, val_accuracy, train_loss, samples_per_s (default val_loss)")
    direction: str | None = flag(
        None, "minimize or maximize the metric (default: minimize a loss, maximize an accuracy or samples_per_s)", choices=("minimize", "maximize")
    )
    max_steps: int | None = flag(None, "steps of each run (default: the recipe's or the config's)")
    report_every: int | None = flag(None, "steps between the values the pruner sees (the runs' val_every; default a fifth of --max-steps)")
    pruner: str = flag("median", "stop bad runs early: median, halving, hyperband or none (default median)", choices=("median", "halving", "hyperband", "none"))
    startup_trials: int = flag(2, "finished runs before the median pruner stops any (default 2)")
    sampler: str = flag("tpe", "how the next run's values are chosen: tpe, random or grid (default tpe)", choices=("tpe", "random", "grid"))
    search_seed: int = flag(0, "seed of the sampler (the runs' own seed is --seed)")
    threads: int | None = flag(None, "threads per process of each run (default: the cores over parallel x nproc)")
    out: str = flag("runs/hparams", "the search's directory: one trial-NNNN/ run directory per trial, search.json (default runs/hparams)")
    overwrite: bool = flag(False, "move an earlier search in --out aside (into replaced-<time>/) rather than refuse")
    config: str | None = flag(None, "TOML file with [trainer] and [recipe] sections, shared by every run")
    set: list[str] = flag(help="override one setting of every run (repeatable)", action="append", metavar="SECTION.KEY=VALUE", default_factory=list)
    json: str | None = flag(None, "write the trials, the best and its command as JSON to this file")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``shardwise tune``'s three subcommands and their flags."""
    sub = parser.add_subparsers(dest="tune_command", required=True, metavar="{lr,batch-size,hparams}")
    lr = sub.add_parser(
        "lr",
        help="learning-rate range test: sweep the rate up, suggest the steepest descent of the loss",
        description="Learning-rate range test (Smith 2017, section 3.3): the rate rises geometrically over a short run; "
        "the suggestion is where the smoothed loss falls fastest; the run stops when the loss diverges.",
    )
    _trainer_flags(lr, LrOptions)
    bs = sub.add_parser(
        "batch-size",
        help="the largest micro-batch per rank that fits a memory budget, and the throughput of each size tried",
        description="Try micro-batch sizes (doubling, then bisecting) in fresh processes, a few training steps each; "
        "a size fits when every rank's peak memory is within the budget (CUDA memory on GPU, resident memory on CPU).",
    )
    _trainer_flags(bs, BatchSizeOptions)
    hp = sub.add_parser(
        "hparams",
        help="hyperparameter search: trials of a recipe or your own model, each a shardwise train run, K at a time (Optuna)",
        description="Search hyperparameters with Optuna (TPE): each trial is a `shardwise train` run of its own (its own processes and "
        "out directory under --out), --parallel of them at a time; the metric each run logs goes to a pruner that stops bad runs early. "
        "Prints the table of trials and the `shardwise train` command of the best. Needs pip install 'shardwise[tune]'.",
    )
    _trainer_flags(hp, HparamsOptions)


def _trainer_flags(p: argparse.ArgumentParser, options: type) -> None:
    from shardwise.trainer.config import TrainerConfig

    add_flags(p, options)
    add_flags(p, TrainerConfig, unset=True, only=_SETTINGS, group=("trainer settings", "Each sets the [trainer] key of its name (as in a --config file)."))


def _recipe_trainer(args: argparse.Namespace) -> tuple[Any, Any]:
    """The recipe's parts and a Trainer with its settings, the config file's, ``--set`` and the flags."""
    from shardwise.engine import seed_everything
    from shardwise.strategies.options import resolve
    from shardwise.tools.recipes import get_recipe
    from shardwise.trainer import Trainer
    from shardwise.trainer.config import TrainerConfig, apply_overrides, flag_values, from_mapping, load_toml

    recipe = get_recipe(args.recipe)
    sections = apply_overrides(load_toml(args.config) if args.config else {}, args.set)
    unknown = sorted(set(sections) - {"trainer", "recipe"})
    if unknown:
        raise ConfigError(f"unknown config sections {unknown}; use [trainer] and [recipe] (strategy options go under [trainer.strategy_options])")
    settings: dict[str, Any] = {**recipe.trainer_defaults, **sections.get("trainer", {})}
    settings.update(flag_values(args))
    options = settings.get("strategy_options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"trainer.strategy_options must be a table of option = value; got {options!r}")
    if options:
        settings["strategy_options"] = resolve(str(settings.get("strategy", TrainerConfig.strategy)), options)
    config = from_mapping(settings)
    seed_everything(config.seed)  # the model starts as `shardwise train` would start it
    parts = recipe.parts(sections.get("recipe"))
    trainer = Trainer(config=config, optimizer=parts.optimizer, loss_fn=parts.loss_fn, lr_scheduler=parts.lr_scheduler)
    return trainer, parts


def main(args: argparse.Namespace) -> int:
    if args.tune_command == "lr":
        return _lr(args)
    if args.tune_command == "hparams":
        return _hparams(args)
    return _batch_size(args)


def _hparams(args: argparse.Namespace) -> int:
    from shardwise.tools.tune.hparams import search_hparams
    from shardwise.tools.tune.space import format_value
    from shardwise.trainer.config import flag_values

    given = {k: v for k, v in flag_values(args).items() if k in _SETTINGS}  # --out and --overwrite are the search's own
    flags = [f"trainer.{k}={format_value(v)}" for k, v in given.items()]  # --strategy ddp: trainer.strategy=ddp
    result = search_hparams(
        args.space,
        recipe=args.recipe,
        model=args.model,
        data=args.data,
        val_data=args.val_data,
        loss=args.loss,
        optimizer=args.optimizer,
        config=args.config,
        settings=[*args.set, *flags],
        trials=args.trials,
        parallel=args.parallel,
        metric=args.metric,
        direction=args.direction,
        max_steps=args.max_steps,
        report_every=args.report_every,
        pruner=args.pruner,
        startup_trials=args.startup_trials,
        sampler=args.sampler,
        seed=args.search_seed,
        out=args.out,
        overwrite=args.overwrite,
        threads=args.threads,
    )
    print(result.table())
    counts = {s: sum(t.state == s for t in result.trials) for s in ("complete", "pruned", "fail")}
    n = len(result.trials)
    print(f"{n} trial{'s' if n != 1 else ''} in {result.seconds:.1f} s: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    best = result.best
    _write_json(args.json, result.to_dict())
    if best is None:
        first = next((t.error for t in result.trials if t.error), "every trial was pruned")
        print(f"shardwise: no trial completed; the first error: {first}", file=sys.stderr)
        return 1
    print(f"best: trial {best.number}, {result.metric} {best.value:.4g} ({result.direction}) after {best.steps} steps; its run: {best.out}")
    print(f"reproduce: {result.command()}")
    return 0


def _lr(args: argparse.Namespace) -> int:
    from shardwise.trainer.lr_find import check_settings

    check_settings(args.min_lr, args.max_lr, args.steps, args.smoothing, args.diverge)  # before the recipe is built
    trainer, parts = _recipe_trainer(args)
    cfg = trainer.config
    print(
        f"learning-rate range test: {args.recipe}, {cfg.strategy} on {cfg.nproc} process{'es' if cfg.nproc > 1 else ''}, "
        f"global batch {cfg.global_batch_size}, {args.steps} steps from {args.min_lr:g} to {args.max_lr:g}",
        flush=True,
    )
    from shardwise.trainer.lr_find import lr_find

    result = lr_find(
        trainer,
        parts.model,
        parts.train,
        min_lr=args.min_lr,
        max_lr=args.max_lr,
        steps=args.steps,
        smoothing=args.smoothing,
        diverge=args.diverge,
        png=args.png or None,
    )
    n = len(result.lrs)
    if result.stopped_early:
        print(f"stopped at step {n} of {args.steps} (lr {result.lrs[-1]:.3g}): the smoothed loss passed {args.diverge:g}x its lowest")
    low = min(range(n), key=lambda i: result.smoothed[i])
    print(f"smoothed loss {result.smoothed[0]:.4g} at the start, lowest {result.smoothed[low]:.4g} at lr {result.lrs[low]:.3g}")
    print(f"suggested learning rate: {result.suggestion:.3g} (steepest descent of the smoothed loss, step {result.suggestion_index + 1})")
    if result.png:
        print(f"wrote {result.png}")
    _write_json(args.json, result.to_dict())
    return 0


def _batch_size(args: argparse.Namespace) -> int:
    from shardwise.tools.tune.batch_size import find_batch_size, format_bytes, parse_bytes

    if args.memory_budget is not None:
        parse_bytes(args.memory_budget)  # a misspelt budget is said before the recipe is built
    trainer, parts = _recipe_trainer(args)
    cfg = trainer.config
    budget = f"a budget of {args.memory_budget} per process" if args.memory_budget else "CUDA memory"
    print(
        f"batch-size finder: {args.recipe}, {cfg.strategy} on {cfg.nproc} process{'es' if cfg.nproc > 1 else ''}, {budget}, {args.steps} steps per size",
        flush=True,
    )
    result = find_batch_size(trainer, parts.model, parts.train, memory_budget=args.memory_budget, steps=args.steps, max_batch=args.max_batch)
    print(result.table())
    cap = " (the most the training set allows: larger sizes were not tried)" if result.capped_by_data else ""
    budget_text = f" within {args.memory_budget} ({format_bytes(result.budget_bytes)})" if result.budget_bytes is not None else ""
    print(f"largest micro-batch per rank that fits{budget_text}: {result.micro_batch} (global batch {result.global_batch}){cap}")
    _write_json(args.json, result.to_dict())
    return 0


def _write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
