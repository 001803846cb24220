"""The search space of ``shardwise tune hparams``: one dimension per setting, parsed and checked
before any trial starts.

A dimension is ``KEY=KIND:ARGS`` on the command line (``--space recipe.lr=loguniform:1e-4:1e-1``)
or ``{KEY: "KIND:ARGS"}`` in Python, where a list stands for a choice (``{"trainer.global_batch_size":
[32, 64, 128]}``). Kinds: ``uniform:LO:HI``, ``loguniform:LO:HI`` (floats), ``int:LO:HI``,
``logint:LO:HI`` (whole numbers, both ends included), ``choice:A,B,...`` (each value read as a
``--set`` value is: TOML numbers, booleans, quoted strings, else a bare word).

KEY is what ``shardwise train --set`` takes: ``trainer.NAME`` (a `TrainerConfig` setting),
``trainer.strategy_options.NAME`` (an option of the trial's strategy), ``recipe.NAME`` (an option
of the recipe), or ``param.NAME``: a value of your own, handed to each trial in the environment and
read by your factories with `shardwise.tools.tune.hparam` (``lr = hparam("lr", 1e-3)``), the way to
tune a ``--model module:factory``'s own settings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.errors import ConfigError

KINDS = ("uniform", "loguniform", "int", "logint", "choice")
SEARCH_OWNS = ("out", "resume", "overwrite", "max_steps")
"""Trainer settings the search sets itself for every trial (``--out``, ``--max-steps``)."""


@dataclass(frozen=True)
class Dimension:
    """One setting the search varies: ``key`` (as ``--set`` takes it), its kind and range or choices."""

    key: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    choices: tuple[Any, ...] = ()

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def name(self) -> str:
        """The key after its section (``lr`` of ``recipe.lr``, ``strategy_options.x`` of ``trainer.strategy_options.x``)."""
        return self.key.split(".", 1)[1]

    def edges(self) -> list[Any]:
        """The values checked before the search: both ends of a range, every choice."""
        if self.kind == "choice":
            return list(self.choices)
        if self.kind in ("int", "logint"):
            return [int(self.low), int(self.high)]
        return [self.low, self.high]

    def suggest(self, trial: Any) -> Any:
        """This dimension's value for an Optuna trial."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind in ("int", "logint"):
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.kind == "logint")
        return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "loguniform")

    def spec(self) -> str:
        if self.kind == "choice":
            return "choice:" + ",".join(format_value(c) for c in self.choices)
        return f"{self.kind}:{format_value(self.edges()[0])}:{format_value(self.edges()[1])}"


def parse_value(text: str) -> Any:
    """A value as ``--set`` reads it (TOML), a bare word as a string."""
    from shardwise.trainer.config import parse_value as read

    return read(text.strip())


def format_value(value: Any) -> str:
    """A value as ``--set`` takes it back (``parse_value(format_value(v)) == v``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return text if parse_value(text) == value and "," not in text else json.dumps(text)


def parse_dimension(key: str, spec: Any) -> Dimension:
    """One dimension from ``KIND:ARGS`` (or a list: a choice); a `ConfigError` that shows the form."""
    key = key.strip()
    where = f"--space {key}={spec if isinstance(spec, str) else list(spec)}"
    if key.count(".") < 1 or not all(key.split(".")):
        raise ConfigError(f"{where}: the key is SECTION.NAME as `shardwise train --set` takes it (recipe.lr, trainer.global_batch_size); got {key!r}")
    if not isinstance(spec, str):
        if isinstance(spec, Sequence) and len(spec) > 0:
            return Dimension(key, "choice", choices=tuple(spec))
        raise ConfigError(f"{where}: give KIND:ARGS (one of {', '.join(KINDS)}) or a non-empty list of choices")
    kind, _, rest = spec.strip().partition(":")
    if kind not in KINDS:
        raise ConfigError(
            f"{where}: unknown kind {kind!r}; use uniform:LO:HI, loguniform:LO:HI, int:LO:HI, logint:LO:HI or choice:A,B,... "
            "(e.g. recipe.lr=loguniform:1e-4:1e-1)"
        )
    if kind == "choice":
        choices = tuple(parse_value(c) for c in rest.split(",") if c.strip())
        if not choices:
            raise ConfigError(f"{where}: choice needs at least one value, e.g. choice:32,64,128")
        return Dimension(key, kind, choices=choices)
    ends = rest.split(":")
    try:
        low, high = (float(e) for e in ends) if len(ends) == 2 else (None, None)
    except ValueError:
        low = high = None
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        raise ConfigError(f"{where}: {kind} takes two numbers, {kind}:LO:HI (e.g. {kind}:{'1e-4:1e-1' if 'log' in kind else '1:8'}); got {rest!r}")
    if low >= high:
        raise ConfigError(f"{where}: the low end must be below the high end; got {low:g} and {high:g}")
    if kind in ("int", "logint") and (low != int(low) or high != int(high)):
        raise ConfigError(f"{where}: {kind} takes whole numbers; got {rest!r} (use uniform for a float range)")
    if kind.startswith("log") and low <= 0:
        raise ConfigError(f"{where}: a log scale needs a low end above 0; got {low:g}")
    return Dimension(key, kind, low=low, high=high)


def parse_space(items: Sequence[str] | Mapping[str, Any]) -> dict[str, Dimension]:
    """The dimensions of ``--space KEY=SPEC ...`` (or a mapping ``{KEY: SPEC}``), each key once."""
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        for item in items:
            key, eq, spec = str(item).partition("=")
            if not eq:
                raise ConfigError(f"--space takes KEY=KIND:ARGS, e.g. --space recipe.lr=loguniform:1e-4:1e-1; got {item!r}")
            pairs.append((key, spec))
    if not pairs:
        raise ConfigError("the search needs a space: at least one --space KEY=KIND:ARGS (e.g. --space recipe.lr=loguniform:1e-4:1e-1)")
    space: dict[str, Dimension] = {}
    for key, spec in pairs:
        dim = parse_dimension(str(key), spec)
        if dim.key in space:
            raise ConfigError(f"--space names {dim.key} twice; give each setting one range")
        space[dim.key] = dim
    return space


def grid_size(space: Mapping[str, Dimension]) -> int:
    """How many points a grid over ``space`` has (every dimension a choice or a whole-number range)."""
    size = 1
    for dim in space.values():
        if dim.kind == "choice":
            size *= len(dim.choices)
        elif dim.kind in ("int", "logint"):
            size *= int(dim.high) - int(dim.low) + 1
        else:
            raise ConfigError(f"--sampler grid needs choices or whole-number ranges; {dim.key} is {dim.spec()} (use choice:A,B,...)")
    return size


def grid_values(dim: Dimension) -> list[Any]:
    return list(dim.choices) if dim.kind == "choice" else list(range(int(dim.low), int(dim.high) + 1))


__all__ = ["KINDS", "SEARCH_OWNS", "Dimension", "format_value", "grid_size", "grid_values", "parse_dimension", "parse_space", "parse_value"]
