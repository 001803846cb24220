"""Model adapters: how the `Trainer` runs a module written for another framework's API.

An integration registers a factory here when it is imported (`shardwise.integrations.lightning`
registers the one for Lightning-style modules); the Trainer asks the registered factories for an
adapter of each model it is given and never imports an integration itself. See docs/integrations.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer

__all__ = ["AdapterFactory", "ModelAdapter", "adapter_for", "register_adapter"]


class ModelAdapter(Protocol):
    """What the Trainer calls on an adapter. It is also the Trainer's first callback: its hooks
    (``on_fit_start``, ...) run before the Trainer's own callbacks while it is `bound`."""

    @property
    def bound(self) -> bool:
        """True between `bind` and `detach` (in the process that runs the loop)."""

    def bind(self, trainer: Trainer, module: nn.Module, engine: Engine | None) -> None:
        """Attach to ``module`` in this process (``engine`` None: the parent's checks)."""

    def detach(self) -> None:
        """Undo `bind` (the module may be the caller's own)."""

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The optimizer factory the strategy calls, in place of the Trainer's ``optimizer``."""

    def make_schedule(self, optimizer: torch.optim.Optimizer) -> Any:
        """The learning-rate schedule the loop steps (None without one), in place of ``lr_scheduler``."""

    def evaluate(self, engine: Engine, module: nn.Module, dataset: Any, collate: Any, batch_size: int, prefix: str) -> dict[str, float]:
        """One evaluation pass (``prefix`` "val" or "test"), in place of the Trainer's own."""


AdapterFactory = Callable[..., "ModelAdapter | None"]
"""``factory(trainer, model, kind, *, has_val, total) -> adapter or None`` (None: not its kind of model).
``kind`` is "fit", "val", "test" or "predict"; it raises `ConfigError` for what it cannot run."""

_FACTORIES: list[AdapterFactory] = []
_ENTRY_POINTS = "shardwise.adapters"
"""The entry-point group an installed integration declares its factory under (shardwise's own
Lightning one in pyproject.toml), loaded the first time the Trainer asks for an adapter, so a script
that takes the Trainer from ``shardwise.trainer`` gets the same adapters as ``from shardwise import Trainer``."""
_loaded = False


def _load_entry_points() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from importlib.metadata import entry_points

    for point in entry_points(group=_ENTRY_POINTS):
        register_adapter(point.load())


def register_adapter(factory: AdapterFactory) -> AdapterFactory:
    """Add ``factory`` to those the Trainer asks (once, however often an integration is imported)."""
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)
    return factory


def adapter_for(trainer: Trainer, model: nn.Module, kind: str, *, has_val: bool = False, total: int | None = None) -> ModelAdapter | None:
    """The first registered adapter that takes ``model`` (None: the Trainer runs it itself), built in the
    parent after every check the adapter can make there."""
    _load_entry_points()
    for factory in _FACTORIES:
        adapter = factory(trainer, model, kind, has_val=has_val, total=total)
        if adapter is not None:
            return adapter
    return None
