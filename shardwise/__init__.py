"""shardwise: distributed deep-learning training on PyTorch.

The public names load on first use, so ``import shardwise`` costs little more
than ``import torch`` and pulls in no optional dependency.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardwise.integrations import moved as _moved

__version__ = "0.1.0"

# The 0.1 import paths that step 1 of issue 38 moved (shardwise.recipes, shardwise.ray_train, ...)
# still import, with a DeprecationWarning naming the new path: shardwise/integrations/moved.py.
_moved.install()

_EXPORTS = {
    "Trainer": "shardwise.trainer.loop",
    "meta_init": "shardwise.strategies.materialize",
    "TrainerConfig": "shardwise.trainer.config",
    "Engine": "shardwise.engine",
    "seed_everything": "shardwise.engine",
    "launch": "shardwise.launcher.spawn",
    "Mesh": "shardwise.comm.mesh",
    "Recorder": "shardwise.comm.recorder",
    "ShardedLoader": "shardwise.data",
    "StreamLoader": "shardwise.data.stream",
    "TokenShards": "shardwise.data",
    "TextShards": "shardwise.data",
    "write_token_shards": "shardwise.data",
    "get_strategy": "shardwise.strategies",
    "register_strategy": "shardwise.strategies",
    "available_strategies": "shardwise.strategies",
    "ShardwiseError": "shardwise.errors",
    "ConfigError": "shardwise.errors",
    "CheckpointError": "shardwise.errors",
    "LaunchError": "shardwise.errors",
    "CommError": "shardwise.errors",
    "NonFiniteError": "shardwise.trainer.nonfinite",
    "init_from": "shardwise.checkpoint.pretrained",
}

if TYPE_CHECKING:
    from shardwise.checkpoint.pretrained import init_from
    from shardwise.comm.mesh import Mesh
    from shardwise.comm.recorder import Recorder
    from shardwise.data import ShardedLoader, TextShards, TokenShards, write_token_shards
    from shardwise.data.stream import StreamLoader
    from shardwise.engine import Engine, seed_everything
    from shardwise.errors import CheckpointError, CommError, ConfigError, LaunchError, ShardwiseError
    from shardwise.launcher.spawn import launch
    from shardwise.strategies import available as available_strategies
    from shardwise.strategies import get_strategy, register_strategy
    from shardwise.trainer.config import TrainerConfig
    from shardwise.trainer.loop import Trainer
    from shardwise.trainer.nonfinite import NonFiniteError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    if name == "Trainer":  # the integrations whose model adapters the Trainer takes register themselves when imported
        importlib.import_module("shardwise.integrations.lightning")
    value = getattr(module, "available" if name == "available_strategies" else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


# Spelled out (not sorted(_EXPORTS)) so that linters and type checkers see the public names;
# tests/strategies/test_registry.py checks that it matches _EXPORTS.
__all__ = [
    "CheckpointError",
    "CommError",
    "ConfigError",
    "Engine",
    "LaunchError",
    "Mesh",
    "NonFiniteError",
    "Recorder",
    "ShardedLoader",
    "ShardwiseError",
    "StreamLoader",
    "TextShards",
    "TokenShards",
    "Trainer",
    "TrainerConfig",
    "available_strategies",
    "get_strategy",
    "init_from",
    "launch",
    "meta_init",
    "register_strategy",
    "seed_everything",
    "write_token_shards",
]
