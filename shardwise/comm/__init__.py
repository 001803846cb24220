"""Layer 1: every byte shardwise sends goes through here and is recorded.

The collective wrappers and the recorder load with the package; our own allreduce
algorithms, codecs and compressed exchanges load on first use
(``shardwise.comm.allreduce``, ``shardwise.comm.get_codec``, ...).
"""

from __future__ import annotations

import importlib
from typing import Any

from shardwise.comm.collectives import WORLD, Group, all_gather, all_reduce, barrier, broadcast
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes

_LAZY = {
    "allreduce": "shardwise.comm.algorithms",
    "ALGORITHMS": "shardwise.comm.algorithms",
    "Workspace": "shardwise.comm.p2p",
    "get_codec": "shardwise.comm.codecs",
    "CodecState": "shardwise.comm.codecs",
    "compressed_allreduce": "shardwise.comm.compressed",
    "allreduce_traffic": "shardwise.comm.traffic",
    "make_comm_hook": "shardwise.comm.hooks",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwise.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = ["WORLD", "CommEvent", "Group", "Recorder", "all_gather", "all_reduce", "barrier", "broadcast", "wire_bytes", *_LAZY]
