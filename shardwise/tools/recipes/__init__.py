"""Built-in recipes: a model, real data that ships with a package, a loss, and sensible settings.

A recipe is looked up by name like a strategy; its parts are built from a dict of
options (``[recipe]`` in a TOML config, or ``--set recipe.hidden=256``).

Design notes: Recipes
=====================

A recipe is a name, its options with defaults, the trainer settings it starts from, and a
`build(options) -> RecipeParts` (model, train and validation data, loss, metrics, optimizer
factory, optional scheduler, and an optional `after_fit(model) -> str` whose text the CLI
prints on rank 0). Data comes from packages, never from the network:

- `digits`: scikit-learn's bundled 8x8 digits, an MLP (the data-parallel demo).
- `charlm`: a GPT-style decoder (`CharGPT`: `embed`, `blocks.{i}` of attention with separate
  `q/k/v/proj` and an MLP `fc/proj`, `head`) over characters of the help topics that ship with
  Python (`pydoc_data.topics`, ~465,000 characters, 103 distinct). The first 90% of the text
  trains and the last 10% validates (split by position: no window in both). Its forward is its
  top-level children applied in order, the contract pipeline parallelism splits on; attention
  reads its head count from `q`'s output width at run time, so column-split heads (tensor
  parallelism) need no model change. After fit it samples text from a seeded generator. With
  the defaults (4 blocks, width 128, AdamW 1e-3, global batch 32) ddp on 2 CPU processes has
  val loss 2.46 after 100 steps and 2.03 after 300 (ln 103 = 4.63 is a uniform guess), ~45 s.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from shardwise.errors import ConfigError


@dataclass
class RecipeParts:
    """What ``Trainer.fit`` needs, built by a recipe."""

    model: nn.Module
    train: Any
    val: Any
    loss_fn: Callable[[Any, Any], Any]
    optimizer: Callable[[Any], Any]
    metrics: dict[str, Callable[[Any, Any], Any]] = field(default_factory=dict)
    lr_scheduler: Callable[[Any], Any] | None = None
    after_fit: Callable[[nn.Module], str] | None = None
    """Run on the trained model (whole, in the launching process) after fit; its text is printed (charlm samples text)."""


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    build: Callable[[Mapping[str, Any]], RecipeParts]
    """Builds the parts from the recipe options (defaults merged in)."""
    options: Mapping[str, Any]
    """Recipe options and their defaults."""
    trainer_defaults: Mapping[str, Any]
    """Trainer settings this recipe starts from (the user's settings win)."""

    def parts(self, overrides: Mapping[str, Any] | None = None) -> RecipeParts:
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(self.options))
        if unknown:
            close = {u: difflib.get_close_matches(u, list(self.options), n=1) for u in unknown}
            hints = "".join(f" (did you mean {c[0]!r} for {u!r}?)" for u, c in close.items() if c)
            raise ConfigError(f"recipe {self.name!r} has no options {unknown}{hints}; its options are {sorted(self.options)}")
        return self.build({**self.options, **overrides})


_RECIPES = {"digits": "shardwise.tools.recipes.digits:RECIPE", "charlm": "shardwise.tools.recipes.charlm:RECIPE"}


def available() -> list[str]:
    return sorted(_RECIPES)


def get_recipe(name: str) -> Recipe:
    if name not in _RECIPES:
        close = difflib.get_close_matches(name, available(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown recipe {name!r}.{hint} Known recipes: {', '.join(available())}")
    module, attr = _RECIPES[name].split(":")
    return getattr(importlib.import_module(module), attr)
