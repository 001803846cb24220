"""Replicas that step alone: ``local-sgd``, ``diloco`` and ``gossip``.

Every rank holds the whole model and its own optimizer, trains on its own slice of each
global batch with no synchronization in backward, and meets the others every ``sync_every``
optimizer steps (H) in the run's ``after_step``:

- `local_sgd.LocalSGD`: the replicas are replaced by their mean (one allreduce of every
  parameter and floating buffer per dtype);
- `diloco.DiLoCo`: an outer Nesterov SGD steps the shared parameters on the mean
  pseudo-gradient (one allreduce of it, optionally compressed) and every replica restarts there;
- `gossip.Gossip`: each replica averages with its ring neighbours only (point-to-point).

What they share, one module: `base` (the option check, the plan, placement, the tensors a
round covers, and `base.ReplicaRun`, whose ``after_step`` counts rounds and whose checkpoint
keeps each rank's own replica). Nothing is sent between rounds, and every byte of a round goes
through `shardwise.comm` and is recorded.
"""

from __future__ import annotations

import importlib
from typing import Any

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
