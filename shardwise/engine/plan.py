"""The one place a strategy is resolved, planned and checked (the `Engine` alone, the `Trainer`'s parent)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from shardwise.strategies import Batch, Layout, Strategy, get_strategy
from shardwise.strategies.batchnorm import check_sync_batchnorm
from shardwise.strategies.precision import normalize as normalize_precision

__all__ = ["plan_strategy"]


def plan_strategy(
    spec: str | Strategy,
    options: Mapping[str, Any] | None,
    world_size: int,
    *,
    precision: str | int = "32",
    sync_batchnorm: bool = False,
    mesh: Mapping[str, int] | None = None,
    model: nn.Module | None = None,
    batch: Batch | None = None,
) -> tuple[Strategy, Layout]:
    """The strategy object for ``spec`` (a name and its options, or an object) and its plan of the job:
    the world, the mesh, the batch split and the model, then the precision and ``sync_batchnorm`` it
    allows. What it refuses is a `ConfigError` before any process starts (in the Trainer's parent)."""
    strategy = get_strategy(spec, **(options or {}))
    layout = strategy.plan(world_size, model=model, batch=batch, mesh=mesh)
    strategy.check_precision(normalize_precision(precision), layout)
    check_sync_batchnorm(strategy.name, sync_batchnorm)
    return strategy, layout
