"""Built-in recipes: a model, real data that ships with a package, a loss, and sensible settings.

A recipe is looked up by name like a strategy; its parts are built from a dict of
options (``[recipe]`` in a TOML config, or ``--set recipe.hidden=256``).
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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
            raise ConfigError(f"recipe {self.name!r} has no options {unknown}; its options are {sorted(self.options)}")
        return self.build({**self.options, **overrides})


_RECIPES = {"digits": "shardwise.recipes.digits:RECIPE", "charlm": "shardwise.recipes.charlm:RECIPE"}


def available() -> list[str]:
    return sorted(_RECIPES)


def get_recipe(name: str) -> Recipe:
    if name not in _RECIPES:
        close = difflib.get_close_matches(name, available(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown recipe {name!r}.{hint} Known recipes: {', '.join(available())}")
    module, attr = _RECIPES[name].split(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
