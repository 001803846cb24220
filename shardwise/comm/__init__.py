"""Layer 1: every byte shardwise sends goes through here and is recorded.

The collective wrappers (`collectives.py`: the six collectives broadcast, scatter, gather, reduce,
all-gather and all-reduce, and point-to-point) and the `Recorder` load with the package; our own
allreduce algorithms (flat, and ``hierarchical_allreduce`` over nodes), codecs and compressed
exchanges load on first use (``shardwise.comm.allreduce``, ``shardwise.comm.get_codec``, ...). Design notes (how bytes are
counted, the algorithms' and codecs' traffic tables, error feedback, DDP hooks, ``shardwise bench
comm``): docs/comm.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardwise.comm.collectives import (
    WORLD,
    Group,
    Pending,
    all_gather,
    all_reduce,
    all_reduce_async,
    all_to_all,
    all_to_all_autograd,
    barrier,
    broadcast,
    broadcast_async,
    gather,
    irecv,
    isend,
    monitored_barrier,
    new_group,
    recv,
    reduce,
    scatter,
    send,
)
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes

_LAZY = {
    "allreduce": "shardwise.comm.algorithms",
    "ALGORITHMS": "shardwise.comm.algorithms",
    "Workspace": "shardwise.comm.p2p",
    "get_codec": "shardwise.comm.codecs",
    "CodecState": "shardwise.comm.codecs",
    "compressed_allreduce": "shardwise.comm.compressed",
    "allreduce_traffic": "shardwise.comm.traffic",
    "hierarchical_traffic": "shardwise.comm.traffic",
    "hierarchical_allreduce": "shardwise.comm.hierarchical",
    "NodeLevels": "shardwise.comm.hierarchical",
    "make_comm_hook": "shardwise.comm.hooks",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwise.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "WORLD",
    "CommEvent",
    "Group",
    "Pending",
    "Recorder",
    "all_gather",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_autograd",
    "barrier",
    "broadcast",
    "broadcast_async",
    "gather",
    "irecv",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "scatter",
    "send",
    "wire_bytes",
    *_LAZY,
]
