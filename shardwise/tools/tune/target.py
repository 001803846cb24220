"""What the trials of ``shardwise tune hparams`` train, and the ``shardwise train`` command of each.

A `Target` is a recipe (``--recipe``) or your own model (``--model``, ``--data``, ... as ``shardwise
train`` takes them), the settings every trial shares (``--config``, ``--set``, ``--max-steps``), and
the search's own ``--set trainer.val_every`` (or ``log_every``) that makes the runs report the
metric. `Target.configure` checks all of it, and every dimension of the space, with the functions
``shardwise train`` uses (`TrainerConfig`, the strategy's options, the recipe's options), so that a
mistake is one line before any trial starts, not the same error in every trial.
"""

from __future__ import annotations

import difflib
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import ConfigError
from shardwise.launcher.env import standalone_env
from shardwise.tools.tune.space import SEARCH_OWNS, Dimension, format_value

PARAMS_ENV = "SHARDWISE_HPARAMS"
"""The environment variable that hands a trial its ``param.NAME`` values (JSON)."""
OWN_FLAGS = {"model": "--model", "data": "--data", "val_data": "--val-data", "loss": "--loss", "optimizer": "--optimizer"}
ALWAYS = ("train_loss", "samples_per_s", "lr")
"""Metrics every run logs (``metrics.jsonl``); with validation data also ``val_loss`` and ``val_<metric>``."""


@dataclass
class Target:
    recipe: str | None
    own: dict[str, str]
    dims: dict[str, Dimension]
    config: str | None = None
    sets: list[str] = field(default_factory=list)
    max_steps: int | None = None
    report_every: int | None = None
    nprocs: list[int] = field(default_factory=lambda: [1])
    max_steps_flag: int | None = None
    threads: int | None = None
    """The threads each trial's processes run (set by `env`): the trials' commands and the reproduce line pass them."""
    """``--max-steps`` as given to the search (passed on to every trial as that flag)."""

    @classmethod
    def build(cls, dims: dict[str, Dimension], *, recipe: str | None, own: Mapping[str, str | None]) -> Target:
        given = {k: v for k, v in own.items() if v is not None}
        if recipe is not None and given:
            raise ConfigError(f"--recipe {recipe} and {', '.join(OWN_FLAGS[k] for k in given)} both name what to train; give a recipe or your own model")
        if recipe is None and not given:
            raise ConfigError("the search needs --recipe NAME (one of `shardwise recipes`) or your own model: --model MODULE:FACTORY --data MODULE:FACTORY")
        if recipe is None:
            missing = [OWN_FLAGS[k] for k in ("model", "data") if k not in given]
            if missing:
                raise ConfigError(f"your own model needs {' and '.join(missing)} as well (MODULE:FACTORY, e.g. --data mymodels:make_data)")
            for key, spec in given.items():
                if ":" not in spec:
                    raise ConfigError(f"{OWN_FLAGS[key]} takes MODULE:NAME (e.g. mymodels:make_model); got {spec!r}")
        else:
            from shardwise.tools.recipes import get_recipe

            get_recipe(recipe)
        return cls(recipe=recipe, own={k: str(v) for k, v in given.items()}, dims=dims)

    def configure(
        self, config: str | None, settings: Mapping[str, Any] | Sequence[str], *, max_steps: int | None, metric: str, report_every: int | None
    ) -> None:
        """The shared settings, checked; every dimension's key and values, checked; the metric, checked."""
        from shardwise.trainer.config import apply_overrides, load_toml

        self.config = config
        if isinstance(settings, Mapping):
            self.sets = [f"{k}={format_value(v)}" for k, v in settings.items()]
        else:
            self.sets = [str(s) for s in settings]
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ConfigError(f"--max-steps must be a whole number >= 1; got {max_steps!r}")
        if report_every is not None and (isinstance(report_every, bool) or not isinstance(report_every, int) or report_every < 1):
            raise ConfigError(f"--report-every must be a whole number >= 1; got {report_every!r}")
        sections = apply_overrides(load_toml(config) if config else {}, self.sets)
        if max_steps is not None:
            sections.setdefault("trainer", {})["max_steps"] = max_steps
        trainer = self._check_sections(sections, "the shared settings (--config, --set and the trainer flags)")
        self.max_steps = trainer.max_steps
        self.nprocs = [trainer.nproc]
        for dim in self.dims.values():
            self._check_dimension(dim, sections)
        self._check_metric(metric, sections)
        self._set_report_every(metric, sections, report_every)
        self.max_steps_flag = max_steps

    def _check_sections(self, sections: dict[str, Any], what: str) -> Any:
        """The `TrainerConfig` these sections make (strategy options resolved), or a `ConfigError` naming ``what``."""
        from shardwise.strategies.options import resolve
        from shardwise.tools.recipes import get_recipe
        from shardwise.trainer.config import TrainerConfig, from_mapping

        unknown = sorted(set(sections) - {"trainer", "recipe"})
        if unknown:
            raise ConfigError(f"{what}: unknown config sections {unknown}; use [trainer] and [recipe] (strategy options go under [trainer.strategy_options])")
        if self.recipe is None and sorted(set(sections.get("recipe", {})) - set(OWN_FLAGS)):
            extra = sorted(set(sections["recipe"]) - set(OWN_FLAGS))
            raise ConfigError(f"{what}: [recipe] keys {extra} are options of built-in recipes; with your own model the section takes {sorted(OWN_FLAGS)}")
        defaults = get_recipe(self.recipe).trainer_defaults if self.recipe else {}
        values = {**defaults, **sections.get("trainer", {})}
        if set(values) & {"out", "resume", "overwrite"}:
            raise ConfigError(f"{what}: {sorted(set(values) & {'out', 'resume', 'overwrite'})} are the search's to set (each trial its own out); use --out")
        options = values.get("strategy_options", {})
        if not isinstance(options, dict):
            raise ConfigError(f"{what}: trainer.strategy_options must be a table of option = value; got {options!r}")
        try:
            if options:
                values["strategy_options"] = resolve(str(values.get("strategy", TrainerConfig.strategy)), options)
            return from_mapping(values)
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}") from None

    def _check_dimension(self, dim: Dimension, sections: dict[str, Any]) -> None:
        from shardwise.tools.recipes import get_recipe
        from shardwise.trainer.config import apply_overrides, field_names

        where = f"--space {dim.key}={dim.spec()}"
        if dim.section == "param":
            if not dim.name.isidentifier():
                raise ConfigError(f"{where}: param.NAME takes a Python name (read with hparam({dim.name!r}) in your factories); got {dim.name!r}")
            return
        if dim.section == "recipe":
            self._check_recipe_key(dim, where)
            return
        if dim.section != "trainer":
            raise ConfigError(f"{where}: unknown section {dim.section!r}; keys are trainer.NAME, trainer.strategy_options.NAME, recipe.NAME or param.NAME")
        first = dim.name.split(".", 1)[0]
        if first in SEARCH_OWNS:
            raise ConfigError(f"{where}: the search sets trainer.{first} itself (--out, --max-steps); search other settings")
        if first not in field_names():
            close = difflib.get_close_matches(first, field_names(), n=1)
            hint = f" (did you mean trainer.{close[0]}?)" if close else ""
            if self.recipe is not None and first in (options := get_recipe(self.recipe).options):
                hint = f" (recipe {self.recipe!r} has it: recipe.{first}, default {options[first]!r})"
            elif self.recipe is None and first in ("lr", "learning_rate", "weight_decay", "momentum"):
                hint = f" (your optimizer's settings are your factory's: param.{first}, read with shardwise.tools.tune.hparam({first!r}, default))"
            raise ConfigError(f"{where}: trainer has no setting {first!r}{hint}; `shardwise train --help` lists them")
        for value in dim.edges():
            self._check_sections(apply_overrides(sections, [f"{dim.key}={format_value(value)}"]), f"{where}: with {dim.key}={format_value(value)}")
            if dim.name == "nproc":
                self.nprocs.append(int(value))

    def _check_recipe_key(self, dim: Dimension, where: str) -> None:
        from shardwise.tools.recipes import get_recipe

        if self.recipe is None:
            raise ConfigError(
                f"{where}: recipe.NAME is a built-in recipe's option; for your own model's settings use param.NAME "
                f"and read it in your factories with shardwise.tools.tune.hparam({dim.name!r}, default)"
            )
        options = sorted(get_recipe(self.recipe).options)
        if dim.name not in options:
            close = difflib.get_close_matches(dim.name, options, n=1)
            hint = f" (did you mean recipe.{close[0]}?)" if close else ""
            raise ConfigError(f"{where}: recipe {self.recipe!r} has no option {dim.name!r}{hint}; its options are {options}")

    def _check_metric(self, metric: str, sections: dict[str, Any]) -> None:
        known = set(ALWAYS)
        if self.recipe is not None:
            known |= {"val_loss"}
            if metric not in known:  # the recipe's own metrics (val_accuracy): built only when asked for
                from shardwise.tools.recipes import get_recipe

                parts = get_recipe(self.recipe).parts(sections.get("recipe"))
                known |= {f"val_{name}" for name in parts.metrics}
        elif "val_data" in self.own or "val_data" in sections.get("recipe", {}):
            known |= {"val_loss"}
        if metric not in known:
            close = difflib.get_close_matches(metric, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            val = "" if "val_loss" in known else "; val_loss needs validation data (--val-data)"
            raise ConfigError(f"--metric {metric!r} is not a value the runs log{hint}; they log {', '.join(sorted(known))}{val}")

    def _set_report_every(self, metric: str, sections: dict[str, Any], report_every: int | None) -> None:
        """How often the trials log the metric (what the pruner sees): ``report_every``, else the
        shared settings' ``val_every``/``log_every`` where given, else a fifth of the run; the runs
        log as often (unless ``log_every`` is given), so that a pruned run stops within as many steps."""
        key = "val_every" if metric.startswith("val_") else "log_every"
        shared = sections.get("trainer", {})
        given = shared.get(key)
        if report_every is None and given is None and self.max_steps:
            report_every = max(1, self.max_steps // 5)
        if report_every is not None:
            self.sets.append(f"trainer.{key}={report_every}")
            if key == "val_every" and "log_every" not in shared:  # a pruned run stops at a log step (the preemption path)
                self.sets.append(f"trainer.log_every={report_every}")
        self.report_every = report_every or given

    def max_nproc(self) -> int:
        return max(self.nprocs)

    def base_args(self) -> list[str]:
        args = ["--recipe", self.recipe] if self.recipe else [a for k, spec in self.own.items() for a in (OWN_FLAGS[k], spec)]
        if self.config:
            args += ["--config", self.config]
        if self.max_steps_flag is not None:
            args += ["--max-steps", str(self.max_steps_flag)]
        args += [a for s in self.sets for a in ("--set", s)]
        if self.threads is not None and not any(s.startswith("trainer.threads=") for s in self.sets) and "trainer.threads" not in self.dims:
            args += ["--threads", str(self.threads)]  # the count the trials ran with, not a fresh run's automatic one
        return args

    def sampled_args(self, params: Mapping[str, Any]) -> list[str]:
        return [a for k, v in params.items() if not k.startswith("param.") for a in ("--set", f"{k}={format_value(v)}")]

    def command(self, params: Mapping[str, Any], out: str) -> list[str]:
        return [sys.executable, "-m", "shardwise", "train", *self.base_args(), *self.sampled_args(params), "--out", out]

    def reproduce(self, params: Mapping[str, Any]) -> str:
        own = self.own_params(params)
        prefix = f"{PARAMS_ENV}={shlex.quote(json.dumps(own))} " if own else ""
        return prefix + shlex.join(["shardwise", "train", *self.base_args(), *self.sampled_args(params)])

    @staticmethod
    def own_params(params: Mapping[str, Any]) -> dict[str, Any]:
        return {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("param.")}

    def env(self, threads: int) -> dict[str, str]:
        """The trials' environment: this one, less a launcher's variables (`standalone_env`), with ``threads`` per process."""
        env = {k: v for k, v in standalone_env().items() if k != PARAMS_ENV}
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.threads = threads
        return env

    def trial_env(self, env: dict[str, str], params: Mapping[str, Any]) -> dict[str, str]:
        own = self.own_params(params)
        return {**env, PARAMS_ENV: json.dumps(own)} if own else env

    def describe(self, trials: int, parallel: int, dims: Mapping[str, Dimension], root: Any, threads: str) -> str:
        what = f"recipe {self.recipe}" if self.recipe else f"model {self.own['model']}"
        steps = f"{self.max_steps} steps each" if self.max_steps else "the run's own length"
        report = f", metric reported every {self.report_every} steps" if self.report_every else ""
        space = ", ".join(f"{k}={d.spec()}" for k, d in dims.items())
        return (
            f"hyperparameter search: {what}, {trials} trial{'s' if trials != 1 else ''}, {parallel} at a time ({threads} thread{'s' if threads != '1' else ''} "
            f"per process), {steps}{report}; space {space}; trials in {root}/trial-NNNN"
        )

    def summary(self, dims: Mapping[str, Dimension], **more: Any) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "own": self.own,
            "config": self.config,
            "sets": self.sets,
            "max_steps": self.max_steps,
            "report_every": self.report_every,
            "space": {k: d.spec() for k, d in dims.items()},
            **{k: v if isinstance(v, (str, int, float)) else type(v).__name__ for k, v in more.items()},
        }


__all__ = ["ALWAYS", "OWN_FLAGS", "PARAMS_ENV", "Target"]
