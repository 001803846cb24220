"""The ``shardwise`` command.

::

    shardwise train --recipe NAME | --model MODULE:FACTORY --data MODULE:FACTORY [--val-data ...] [--loss MODULE:FN] [--optimizer MODULE:FACTORY]
                    [--strategy NAME] [--nproc N] [--max-steps N] [--out DIR]
                    [--resume auto|PATH] [--overwrite] [--config FILE.toml] [--set section.key=value ...]
                    [--STRATEGY-OPTION VALUE ...]   # one flag per strategy option (`shardwise train --help`)
    shardwise export CHECKPOINT_DIR OUT.safetensors      # consolidated weights, any strategy's checkpoint
    shardwise run [torchrun flags] script.py [args ...]
    shardwise bench comm [--nproc P] [--algorithms ...] [--sizes ...] [--json FILE]
    shardwise bench scaling --recipe NAME --strategy S[,S] --nproc 1,2,4 [--json FILE] [--png FILE]   # measured speed-up beside the plan's
    shardwise strategies [NAME]                          # each strategy's options: flag, TOML key, default, help
    shardwise recipes
    shardwise tune lr|batch-size|hparams --recipe NAME [...]  # range test, largest batch that fits, parallel search; see shardwise/tools/tune
    shardwise plot RUN_DIR [RUN_DIR ...] [--out DIR]         # PNGs of runs; see shardwise/tools/plot
    shardwise plan --model NAME|PATH.json|module:factory|--params N --nproc N [...]   # which strategy; see shardwise/tools/advisor
    shardwise predict CHECKPOINT --recipe NAME --out DIR [--nproc N] [--strategy S]   # shards + index.json; see shardwise/tools/predict.py
    shardwise preprocess --recipe charlm|digits --workers 1,2                          # shardwise.data.map, timed; see shardwise/tools/preprocess.py
    shardwise --version
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.config import add_arguments, flag
from shardwise.errors import ConfigError, ShardwiseError

_TRAIN_DESCRIPTION = (
    "Train a built-in recipe (--recipe) or your own model (--model and --data, functions of a module of yours: "
    "--model mymodels:make_model for make_model in ./mymodels.py) with any strategy."
)
_OWN = (
    "your own model (instead of --recipe)",
    "MODULE:NAME is imported as `python -m` would, from the current directory first (a module file here, or a package); "
    'also keys of the config\'s [recipe] section (model = "mymodels:make_model").',
)
_OWN_KEYS = {"model": "--model", "data": "--data", "val_data": "--val-data", "loss": "--loss", "optimizer": "--optimizer"}
"""Your own model's parts: flags of `shardwise train`, and keys of the config's [recipe] section (the flag wins)."""
_TRAINER_GROUP = ("trainer settings", "Each sets the [trainer] key of its name in a --config file (--max-steps: max_steps).")


@dataclass(frozen=True, kw_only=True)
class TrainCommand:
    """``shardwise train``'s own flags (the trainer settings' are `TrainerConfig`'s, the strategies' their options)."""

    recipe: str | None = flag(None, "recipe name (see `shardwise recipes`); or your own model with --model and --data")
    model: str | None = flag(
        None,
        "called with no arguments; returns the torch.nn.Module to train (or (module, example_input), as `shardwise plan` takes)",
        metavar="MODULE:FACTORY",
        group=_OWN,
    )
    data: str | None = flag(
        None, "called with no arguments; returns the training data (a map-style Dataset, or a DataLoader over one)", metavar="MODULE:FACTORY", group=_OWN
    )
    val_data: str | None = flag(
        None, "as --data, for the validation data (evaluated every --val-every steps and at the end)", metavar="MODULE:FACTORY", group=_OWN
    )
    loss: str | None = flag(
        None,
        "the loss itself, loss(output, batch) -> scalar tensor, output = model(x) for an (x, y) batch; "
        "default: the model's own (training_step, or the loss a transformers model returns for a batch with labels)",
        metavar="MODULE:FN",
        group=_OWN,
    )
    optimizer: str | None = flag(None, "called with the parameters, returns the optimizer (default: AdamW, lr 1e-3)", metavar="MODULE:FACTORY", group=_OWN)
    straggler: str | None = flag(None, "slow rank RANK down FACTOR times on purpose (demonstrations, benchmarks)", metavar="RANK:FACTOR")
    config: str | None = flag(None, "TOML file with [trainer] and [recipe] sections")
    set: list[str] = flag(help="override one setting (repeatable)", action="append", metavar="SECTION.KEY=VALUE", default_factory=list)
    print_summary: bool = flag(False, "print summary.json to stdout at the end")


@dataclass(frozen=True, kw_only=True)
class ExportCommand:
    """``shardwise export``'s arguments."""

    checkpoint: str = flag(help="a checkpoint directory (e.g. runs/x/checkpoints/step-00000300)", positional=True)
    out: str = flag(help="the .safetensors file to write", positional=True)
    key: str = flag("model", "which saved model to export (default: model)")


@dataclass(frozen=True, kw_only=True)
class StrategiesCommand:
    """``shardwise strategies``'s argument."""

    name: str | None = flag(None, "one strategy only", positional=True, nargs="?")


def train_parser() -> argparse.ArgumentParser:
    """``shardwise train``'s parser on its own, every generated strategy flag included."""
    p = argparse.ArgumentParser(prog="shardwise train", description=_TRAIN_DESCRIPTION)
    train_arguments(p, strategy_flags=True)
    return p


def train_arguments(p: argparse.ArgumentParser, strategy_flags: bool) -> None:
    """The command's own flags, the trainer settings' (`TrainerConfig`), then (``strategy_flags``) one per strategy option."""
    from shardwise.trainer.config import TrainerConfig

    add_arguments(p, TrainCommand)
    add_arguments(p, TrainerConfig, unset=True, marked_only=True, group=_TRAINER_GROUP)
    if strategy_flags:
        add_strategy_flags(p)


_OPTION_DEST = "strategy_option__"  # argparse dest prefix of the generated strategy flags


def add_strategy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per strategy option, generated from the strategy dataclasses (`shardwise.strategies.options`).

    An option several strategies have is one flag in a group of its own, its help naming them;
    the others are grouped per strategy under the strategy's one-line description. Each flag
    defaults to None (not given), so a value from the TOML file or ``--set`` stands unless the
    flag is given; the value is converted to the chosen strategy's field type in ``cmd_train``.
    """
    from shardwise.strategies.options import catalog, summary_line

    known = catalog()
    flags = known.flags
    taken = {s for action in parser._actions for s in action.option_strings}

    def add(group: Any, flag: Any) -> None:
        if flag.flag in taken:  # an option named like a trainer flag keeps only its TOML key (a test keeps this empty)
            return
        text = flag.help().replace("%", "%%")  # argparse %-formats help strings
        if flag.switch:
            group.add_argument(flag.flag, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag.flag, dest=flag.dest, metavar=flag.metavar, default=None, help=text)

    shared = [f for f in flags.values() if f.shared]
    if shared:
        group = parser.add_argument_group(
            "options of several strategies",
            "Each sets trainer.strategy_options.NAME for the chosen strategy; the strategies that take it are in brackets.",
        )
        for flag in shared:
            add(group, flag)
    for strategy in known.strategies:
        also = [flags[o.name].flag for o in strategy.options if flags[o.name].shared]
        text = summary_line(strategy.cls) + (f" Also takes {', '.join(also)} (above)." if also else "")
        group = parser.add_argument_group(f"strategy {strategy.label}", text.replace("%", "%%"))
        for option in strategy.options:
            if not flags[option.name].shared:
                add(group, flags[option.name])
    if known.unlisted:
        parser.epilog = "Strategies whose options are not listed here (set them with --set trainer.strategy_options.KEY=VALUE): " + ", ".join(
            name for name, _ in known.unlisted
        )


def strategy_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy options given as flags: ``{option name: value}``, flags left out omitted."""
    return {k[len(_OPTION_DEST) :]: v for k, v in vars(args).items() if k.startswith(_OPTION_DEST) and v is not None}


def cmd_train(args: argparse.Namespace) -> int:
    from shardwise.engine import seed_everything
    from shardwise.launcher.spawn import prestart
    from shardwise.tools.recipes import get_recipe
    from shardwise.trainer.config import apply_overrides, flag_values, from_mapping, load_toml
    from shardwise.trainer.loop import Trainer

    sections = load_toml(args.config) if args.config else {}
    sections = apply_overrides(sections, args.set)
    unknown = sorted(set(sections) - {"trainer", "recipe"})
    if unknown:
        hint = " (strategy options go under [trainer.strategy_options])" if "strategy_options" in unknown else ""
        raise ShardwiseError(f"unknown config sections {unknown}; use [trainer] and [recipe]{hint}")
    own = _own_model_specs(args, sections.get("recipe", {}))
    recipe = get_recipe(args.recipe) if own is None else None
    values: dict[str, Any] = {**(recipe.trainer_defaults if recipe is not None else {}), **sections.get("trainer", {})}
    values.update(flag_values(args))
    values = _resolve_strategy_options(values, strategy_flag_values(args))
    config = from_mapping(values)  # validates before anything is built or started
    prestart(config.nproc, config.start_method, config.accelerator, even_one_off=True)  # the ranks' zygote imports torch while the recipe is built
    seed_everything(config.seed)  # every rank (under an external launcher) builds the same initial model
    parts = recipe.parts(sections.get("recipe")) if recipe is not None else _own_parts(own or {})
    callbacks = []
    if args.straggler is not None:
        from shardwise.trainer.straggler import Straggler

        callbacks.append(Straggler.from_spec(args.straggler))
    if recipe is not None:
        hparams = {"recipe": args.recipe, **{f"recipe.{k}": v for k, v in {**recipe.options, **sections.get("recipe", {})}.items()}}
    else:
        hparams = dict(own or {})
    trainer = Trainer(
        config=config,
        optimizer=parts.optimizer,
        loss_fn=parts.loss_fn,
        lr_scheduler=parts.lr_scheduler,
        metrics=parts.metrics,
        callbacks=callbacks,
        hparams=hparams,
    )
    summary = trainer.fit(parts.model, parts.train, parts.val)
    preempted = (summary or {}).get("preempted")
    if parts.after_fit is not None and _is_rank_zero() and not preempted:
        print(parts.after_fit(parts.model), flush=True)
    if args.print_summary:
        print(json.dumps(summary, indent=2, default=str))
    if preempted:
        from shardwise.errors import EXIT_PREEMPTED

        if _is_rank_zero():
            print(
                f"shardwise: preempted by {preempted['signal']} at step {preempted['step']}: checkpoint written; "
                f"--resume auto continues (exit {EXIT_PREEMPTED})",
                flush=True,
            )
        return EXIT_PREEMPTED
    return 0


def _own_model_specs(args: argparse.Namespace, section: dict[str, Any]) -> dict[str, str] | None:
    """Your own model's ``module:name`` specs from the flags and the config's [recipe] section (flags win),
    or None for a recipe; either a recipe or a model, checked before anything is imported."""
    given = {key: getattr(args, key) for key in _OWN_KEYS if getattr(args, key) is not None}
    from_config = {key: section[key] for key in _OWN_KEYS if key in section}
    specs = {**from_config, **given}
    if not specs:
        if args.recipe is None:
            raise ConfigError(
                "shardwise train needs --recipe NAME (one of `shardwise recipes`) or your own model: --model MODULE:FACTORY --data MODULE:FACTORY"
            )
        return None
    if args.recipe is not None:
        raise ConfigError(f"--recipe {args.recipe} and {', '.join(_OWN_KEYS[k] for k in specs)} both name what to train; give a recipe or your own model")
    extra = sorted(set(section) - set(_OWN_KEYS))
    if extra:
        raise ConfigError(f"[recipe] keys {extra} are options of built-in recipes; with your own model the section takes {sorted(_OWN_KEYS)}")
    missing = [_OWN_KEYS[k] for k in ("model", "data") if k not in specs]
    if missing:
        raise ConfigError(f"your own model needs {' and '.join(missing)} as well (MODULE:FACTORY, e.g. --data mymodels:make_data)")
    for key, spec in specs.items():
        if not isinstance(spec, str):
            raise ConfigError(f"{_OWN_KEYS[key]} takes MODULE:NAME (a string); got {spec!r}")
    return specs


def _own_parts(specs: dict[str, str]) -> Any:
    """Build your own model's parts from its ``module:name`` specs (`advisor.models.import_object`, the
    loader `shardwise plan --model` uses): each factory called here, its result checked, before launch."""
    import inspect

    from torch import nn
    from torch.utils.data import DataLoader

    from shardwise.data.stream import is_stream
    from shardwise.tools.advisor.models import import_object
    from shardwise.tools.recipes import RecipeParts

    def call(key: str) -> Any:
        factory = import_object(specs[key], _OWN_KEYS[key])
        try:
            inspect.signature(factory).bind()
        except TypeError:
            raise ConfigError(
                f"{_OWN_KEYS[key]} {specs[key]} takes arguments {inspect.signature(factory)}, but is called with none; "
                "give a function that builds and returns it"
            ) from None
        except ValueError:  # no signature to read (a builtin): call it and see
            pass
        return factory()

    model = call("model")
    if isinstance(model, tuple) and model and isinstance(model[0], nn.Module):
        model = model[0]  # (module, example_input), as `shardwise plan --model` takes: the example is the planner's
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {specs['model']} returned {_kind(model)}, not a torch.nn.Module; return the model (an nn.Module instance)")

    def data(key: str) -> Any:
        if key not in specs:
            return None
        value = call(key)
        readable = isinstance(value, DataLoader) or (hasattr(value, "__getitem__") and hasattr(value, "__len__"))
        if not readable and not (is_stream(value) and not hasattr(value, "__next__")):  # a generator is read once: no epochs, no resume
            raise ConfigError(
                f"{_OWN_KEYS[key]} {specs[key]} returned {_kind(value)}, not a data set; return a map-style Dataset "
                "(with __getitem__ and __len__, e.g. torch.utils.data.TensorDataset(x, y)), a stream (an IterableDataset) or a DataLoader over one"
            )
        return value

    train, val = data("data"), data("val_data")
    loss = import_object(specs["loss"], "--loss") if "loss" in specs else None
    optimizer = import_object(specs["optimizer"], "--optimizer") if "optimizer" in specs else None
    return RecipeParts(model=model, train=train, val=val, loss_fn=loss, optimizer=optimizer)  # type: ignore[arg-type]  # None: the Trainer's defaults


def _kind(value: Any) -> str:
    t = type(value)
    return "None" if value is None else f"a {t.__name__}" + (f" ({t.__module__})" if t.__module__ not in ("builtins", "__main__") else "")


def _resolve_strategy_options(settings: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The strategy options from TOML, ``--set`` and flags (flags win), checked against the chosen
    strategy's fields and converted to their types, before anything is built."""
    from shardwise.strategies.options import resolve
    from shardwise.trainer.config import TrainerConfig

    from_config = settings.get("strategy_options", {})
    if not isinstance(from_config, dict):
        raise ConfigError(f"trainer.strategy_options must be a table of option = value (e.g. [trainer.strategy_options]); got {from_config!r}")
    values = {**from_config, **given}
    strategy = settings.get("strategy", TrainerConfig.strategy)
    if not values or not isinstance(strategy, str):
        return settings  # nothing to check here (a strategy that is not a name is refused by the config)
    return {**settings, "strategy_options": resolve(strategy, values, flags=set(given))}


def cmd_strategies(name: str | None) -> int:
    """List each strategy with its options: flag, TOML key, default and help."""
    import textwrap

    from shardwise.strategies import available
    from shardwise.strategies.options import catalog, format_value, metavar, strategy_options, summary_line

    if name is not None:
        strategy_options(name)  # an unknown name: the registry's error, with the closest name
    known = catalog()
    print("Each option is a flag of `shardwise train` and a key of [trainer.strategy_options] in a --config file.\n")
    listed = {n: s for s in known.strategies for n in s.names}
    unlisted = dict(known.unlisted)
    done: set[str] = set()
    for n in available() if name is None else [name]:
        if n in done:
            continue
        if n in unlisted:
            print(f"{n}: options not listed ({unlisted[n]}); pass them with --set trainer.strategy_options.KEY=VALUE\n")
            done.add(n)
            continue
        s = listed[n]
        done.update(s.names)
        print(f"{s.label}: {summary_line(s.cls)}")
        if not s.options:
            print("  (no options)")
        for o in s.options:
            flag = f"{o.flag} / --no-{o.flag[2:]}" if o.switch else f"{o.flag} {metavar(o.type, o.name)}"
            print(f"  {flag}   ({o.name} = {format_value(o.default)})")
            for line in textwrap.wrap(o.help or "(no description)", width=92):
                print(f"      {line}")
        print()
    return 0


def _is_rank_zero() -> bool:
    from shardwise.launcher.env import detect_env

    return detect_env().rank == 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import export_safetensors

    n, size = export_safetensors(args.checkpoint, args.out, key=args.key)
    print(f"wrote {n} tensors ({size / 2**20:.2f} MiB) to {args.out}")
    return 0


def cmd_run(argv: Sequence[str]) -> int:
    from shardwise.launcher.torchrun import run

    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: shardwise run [torchrun flags] script.py [args ...]\n\n"
            "Runs a script on torch.distributed.run (torchrun) with defaults that work:\n"
            "  --standalone on one machine, fresh rendezvous stores on restart,\n"
            "  a short last-call wait for --nnodes MIN:MAX. Every torchrun flag is accepted."
        )
        return 0
    return run(argv)


_TOOLS = {  # command -> (its module, the module's help text, its flags function, its entry point)
    "plan": ("shardwise.tools.advisor.commands", "PLAN_HELP", "plan_arguments", "cmd_plan"),
    "simulate": ("shardwise.tools.simulate.commands", "SIMULATE_HELP", "add_arguments", "main"),
    "tune": ("shardwise.tools.tune.commands", "TUNE_HELP", "add_arguments", "main"),
    "plot": ("shardwise.tools.plot.commands", "PLOT_HELP", "add_arguments", "main"),
    "compress": ("shardwise.tools.compress.commands", "COMPRESS_HELP", "add_arguments", "main"),
    "predict": ("shardwise.tools.predict", "HELP", "add_arguments", "main"),
    "preprocess": ("shardwise.tools.preprocess", "HELP", "add_arguments", "main"),
}


def build_parser(strategy_flags: bool = False) -> argparse.ArgumentParser:
    """The ``shardwise`` parser with every subcommand (``strategy_flags``: train's generated strategy flags,
    which import every strategy module)."""
    from shardwise import __version__

    parser = argparse.ArgumentParser(prog="shardwise", description="Distributed training on PyTorch: every strategy behind one flag.")
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train_arguments(sub.add_parser("train", help="train a built-in recipe or your own model", description=_TRAIN_DESCRIPTION), strategy_flags)
    sub.add_parser("run", help="run a script under torchrun with working defaults")
    sub.add_parser("bench", help="benchmarks shipped with the package (`shardwise bench comm --help`)")
    export_help = "write a checkpoint's consolidated model weights to one safetensors file"
    export_description = (
        "Consolidate a checkpoint's model weights (sharded or not) into one .safetensors file "
        "for use outside shardwise (needs the safetensors package: pip install safetensors)."
    )
    add_arguments(sub.add_parser("export", help=export_help, description=export_description), ExportCommand)
    strategies_help = "List each strategy with its options: flag, TOML key, default and help."
    add_arguments(sub.add_parser("strategies", help="list the strategies and their options", description=strategies_help), StrategiesCommand)
    sub.add_parser("recipes", help="list the built-in recipes")
    for name, (module_name, help_name, arguments, _) in _TOOLS.items():
        module = importlib.import_module(module_name)
        text = getattr(module, help_name)
        getattr(module, arguments)(sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + "."))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # torchrun's own flags go straight through; argparse would eat them.
        return _guard(lambda: cmd_run(argv[1:]))
    if argv and argv[0] == "bench":
        from shardwise.tools.bench import main as bench_main  # loaded only for this command

        return _guard(lambda: bench_main(argv[1:]))
    args = build_parser(strategy_flags=argv[:1] == ["train"]).parse_args(argv)  # the strategy flags: only for train
    if args.command == "train":
        return _guard(lambda: cmd_train(args))
    if args.command == "export":
        return _guard(lambda: cmd_export(args))
    if args.command == "strategies":
        return _guard(lambda: cmd_strategies(args.name))
    if args.command in _TOOLS:
        module_name, _, _, entry = _TOOLS[args.command]
        return _guard(lambda: getattr(importlib.import_module(module_name), entry)(args))
    if args.command == "recipes":
        from shardwise.tools.recipes import available as recipes
        from shardwise.tools.recipes import get_recipe

        for name in recipes():
            print(f"{name:12s} {get_recipe(name).description}")
        return 0
    return 2


def _guard(fn: Any) -> int:
    """User errors print one clear line and exit 2; a worker's failure, its short report (the rank, the
    exception, the user's frame, where the full traceback is) and exit 1; anything else keeps its traceback."""
    from shardwise.launcher.spawn import RemoteTraceback

    try:
        return int(fn())
    except ShardwiseError as exc:
        print(f"shardwise: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if isinstance(exc.__cause__, RemoteTraceback):  # the parent's frames (cli, loop, spawn) say nothing about the user's bug
            print(f"shardwise: a worker failed:\n{exc.__cause__}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
