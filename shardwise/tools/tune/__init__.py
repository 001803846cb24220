"""Tuning a run before it starts: the learning-rate range test and the batch-size finder (issue 14).

- ``lr_find`` / ``Trainer.tune_lr`` (in ``shardwise.trainer.lr_find``, so that the Trainer can
  carry it as a method): an exponential sweep of the learning rate over a short run, the smoothed
  loss, the suggestion at its steepest descent, an early stop when the loss diverges, and a PNG
  (Smith 2017, "Cyclical Learning Rates for Training Neural Networks", section 3.3).
- ``find_batch_size`` (``batch_size``): the largest micro-batch per rank whose training steps fit
  a memory budget (CUDA memory, or a CPU process's peak resident memory), each size tried in fresh
  processes, doubling then bisecting, with the throughput of every size tried.
- ``search_hparams`` (``hparams``): a hyperparameter search on Optuna, each trial a ``shardwise
  train`` run of its own (a recipe or your own model), ``parallel`` at a time, bad runs pruned as
  their metric is logged; ``hparam`` reads a ``param.NAME`` of the space in your own factories
  (``space.py`` the space, ``target.py`` the runs' commands and checks, ``trial.py`` one run).
- ``commands``: ``shardwise tune lr``, ``tune batch-size`` and ``tune hparams``.

Layer 6: it drives the Trainer (layer 5) through its public settings and ``fit``. The names load
on first use, so the command line's parser (which imports ``commands``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LRFindResult": "shardwise.trainer.lr_find",
    "lr_find": "shardwise.trainer.lr_find",
    "BatchSizeResult": "shardwise.tools.tune.batch_size",
    "Trial": "shardwise.tools.tune.batch_size",
    "find_batch_size": "shardwise.tools.tune.batch_size",
    "parse_bytes": "shardwise.tools.tune.batch_size",
    "HparamSearchResult": "shardwise.tools.tune.hparams",
    "HparamTrial": "shardwise.tools.tune.hparams",
    "hparam": "shardwise.tools.tune.hparams",
    "search_hparams": "shardwise.tools.tune.hparams",
}

if TYPE_CHECKING:
    from shardwise.tools.tune.batch_size import BatchSizeResult, Trial, find_batch_size, parse_bytes
    from shardwise.tools.tune.hparams import HparamSearchResult, HparamTrial, hparam, search_hparams
    from shardwise.trainer.lr_find import LRFindResult, lr_find


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise.tools.tune' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "BatchSizeResult",
    "HparamSearchResult",
    "HparamTrial",
    "LRFindResult",
    "Trial",
    "find_batch_size",
    "hparam",
    "lr_find",
    "parse_bytes",
    "search_hparams",
]
