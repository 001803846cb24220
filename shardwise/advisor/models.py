"""``--model`` for ``shardwise plan``: a recipe, a Hugging Face config JSON, a ``module:factory`` or a parameter count.

Returns the `ModelSpec` the cost model reads and, when there is a real module (a recipe or a
factory), the module itself so each strategy's ``plan`` can check it (a pipeline that cannot
split it, tensor parallelism that finds no layer to shard) exactly as it will at launch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.plan.model_spec import ModelSpec, from_hf_config, from_param_count, measured_spec
from shardwise.recipes import available as recipes
from shardwise.recipes import get_recipe

EXAMPLE_SAMPLES = 8
"""Samples in the example batch FLOPs and activations are counted on (they scale per sample)."""


@dataclass
class PlannedModel:
    spec: ModelSpec
    module: nn.Module | None = None
    recipe: str | None = None


def _stack(samples: list[Any]) -> Any:
    first = samples[0]
    if isinstance(first, tuple | list):
        return tuple(torch.stack([torch.as_tensor(s[i]) for s in samples]) for i in range(len(first)))
    return torch.stack([torch.as_tensor(s) for s in samples])


def recipe_model(name: str) -> PlannedModel:
    """A built-in recipe's model, measured on its own first training samples."""
    parts = get_recipe(name).parts()
    batch = _stack([parts.train[i] for i in range(EXAMPLE_SAMPLES)])
    example = batch[0] if isinstance(batch, tuple) else batch
    return PlannedModel(measured_spec(name, parts.model, example, EXAMPLE_SAMPLES), parts.model, name)


def factory_model(spec: str) -> PlannedModel:
    """``module:callable`` returning an ``nn.Module`` or ``(module, example_input)``; without an
    example, the module's ``example_input`` attribute (a tensor with a batch dimension) is used."""
    mod_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model {spec!r}: cannot import {attr!r} from module {mod_name!r} ({exc}); give module:callable importable from here") from None
    made = factory()
    model, example = (made[0], made[1]) if isinstance(made, tuple) else (made, getattr(made, "example_input", None))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    if example is None:
        raise ConfigError(f"--model {spec!r}: return (model, example_input) from the factory so FLOPs and activations can be counted")
    samples = int(example.shape[0]) if isinstance(example, torch.Tensor) else int(example[0].shape[0])
    return PlannedModel(measured_spec(spec, model, example, samples), model)


def load_model(
    spec: str, *, params: float | None = None, layers: int | None = None, hidden: int | None = None, heads: int | None = None, seq: int | None = None
) -> PlannedModel:
    """Resolve ``--model`` (or ``--params``) into a `PlannedModel`; an unknown name is a one-line `ConfigError`."""
    if params is not None and spec in ("", None):
        return PlannedModel(from_param_count(params, layers=layers, hidden=hidden, heads=heads, seq=seq or 2048))
    if spec in recipes():
        return recipe_model(spec)
    if spec.endswith(".json"):
        return PlannedModel(from_hf_config(Path(spec), seq=seq))
    if ":" in spec:
        return factory_model(spec)
    raise ConfigError(
        f"unknown --model {spec!r}; give a recipe ({', '.join(recipes())}), a Hugging Face config .json, module:factory, or --params N (e.g. --params 7.5e9)"
    )
