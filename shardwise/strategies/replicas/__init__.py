"""Replicas that step alone: ``local-sgd`` (`local_sgd`), ``diloco`` (`diloco`) and ``gossip`` (`gossip`).

Every rank holds the whole model and its own optimizer and meets the others every ``sync_every``
optimizer steps in the run's ``after_step``; what they share is in `base`. Design notes:
docs/strategies/replicas.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real classes for type checkers; at run time they load on first use
    from shardwise.strategies.replicas.diloco import DiLoCo
    from shardwise.strategies.replicas.gossip import Gossip
    from shardwise.strategies.replicas.local_sgd import LocalSGD

_CLASSES = {
    "LocalSGD": "shardwise.strategies.replicas.local_sgd",
    "DiLoCo": "shardwise.strategies.replicas.diloco",
    "Gossip": "shardwise.strategies.replicas.gossip",
}


def __getattr__(name: str) -> Any:
    # Lazy, like the registry: choosing local-sgd does not load DiLoCo's codecs.
    if name not in _CLASSES:
        raise AttributeError(f"module 'shardwise.strategies.replicas' has no attribute {name!r}")
    value = getattr(importlib.import_module(_CLASSES[name]), name)
    globals()[name] = value
    return value


__all__ = ["DiLoCo", "Gossip", "LocalSGD"]
