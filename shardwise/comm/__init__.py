"""Layer 1: every byte shardwise sends goes through here and is recorded."""

from shardwise.comm.collectives import WORLD, Group, all_gather, all_reduce, barrier, broadcast
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes

__all__ = ["WORLD", "CommEvent", "Group", "Recorder", "all_gather", "all_reduce", "barrier", "broadcast", "wire_bytes"]
