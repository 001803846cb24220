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

Design notes: replicas that step alone
======================================

- **`after_step`** is where local SGD averages the replicas every H steps (one allreduce of
  parameters and floating buffers per dtype), DiLoCo takes its outer step (mean pseudo-gradient
  `theta - theta_i`, optionally compressed with a codec from `shardwise.comm.codecs`, then
  Nesterov SGD on `theta`), and gossip mixes with its ring neighbours (`Peers` point-to-point,
  recorded as `dp/gossip`). It is a strategy method called by `Engine.step`, not an optimizer
  post-hook, because a skipped fp16 step never calls the optimizer and every rank must still
  reach the same averaging rounds. The engine counts optimizer steps (`Engine.steps_taken`)
  and keeps the count in the checkpoint (`state.pt`, `__engine__`), so after a resume the
  rounds fall on the same steps as in an uninterrupted run.
- **Each replica is checkpointed.** Between rounds the replicas differ, and their inner
  optimizer states always do, so `state.pt` (rank 0's copy) is not enough: `save_extra_state`
  writes `replica-RRRRR.pt` on every rank (model, optimizer, the mixer's state, round counters)
  inside the checkpoint's temporary directory, before the manifest, which hashes it with the
  rest (`checkpoint.write(extra=...)`). DiLoCo's mixer state is `theta` (the parameters of the
  last round), the outer optimizer's momentum, and the codec's residuals and generators. A
  checkpoint without this rank's file (another world size, or another strategy's) loads rank
  0's model into every replica and starts the mixer afresh from it (a printed line says so).
  Local SGD, DiLoCo and gossip resumed mid-round in new processes equal an uninterrupted run
  bit for bit (`tests/strategies/param_server/test_ps_resume.py`: four ranks, float64, dropout, Adam inside, every
  rank compared).
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
