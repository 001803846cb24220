"""Errors shardwise raises for problems a user can fix.

Every message says what was wrong, what was received, and how to fix it.
"""

from __future__ import annotations

EXIT_PREEMPTED = 75
"""The exit code of ``shardwise train`` and ``shardwise run`` when a preemption signal stopped the run
with a checkpoint (EX_TEMPFAIL of sysexits.h, "try again later": a code Slurm scripts and supervisors
requeue on)."""


class ShardwiseError(Exception):
    """Base class of every error shardwise raises on purpose."""


class ConfigError(ShardwiseError, ValueError):
    """A configuration that cannot run (raised before any process starts)."""


class CheckpointError(ShardwiseError):
    """A checkpoint that is missing, damaged, truncated or from another model."""


class LaunchError(ShardwiseError):
    """A worker process failed, or the launch itself could not start."""


class CommError(ShardwiseError):
    """A collective failed or timed out; the message names the rank and the operation."""
