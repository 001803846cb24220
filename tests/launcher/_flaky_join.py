"""A rank's failure to join its process group, planted for tests/launcher/test_join_retry.py.

A launched function's module is imported in each rank before the rank joins (to unpickle the function), so this
module's top-level code runs there first. Where ``FLAKY_JOIN`` is set it replaces ``torch.distributed``'s
``init_process_group`` in rank 0 with one that raises what gloo raised on a loaded machine:

- ``once:PATH``: the first rank 0 that finds no file at PATH writes it and fails; a later launch's rank 0 joins;
- ``always``: every rank 0 fails;
- ``other``: every rank 0 fails with a failure that is not a broken connection (a bad address).
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

import torch.distributed as dist

from shardwise.errors import LaunchError

GLOO = (
    "Gloo connectFullMesh failed with [third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:18068. This is typically caused by a remote worker crashing."
)


def _fail(message: str) -> Any:
    def init_process_group(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(message)

    return init_process_group


_mode = os.environ.get("FLAKY_JOIN", "")
if _mode and os.environ.get("RANK") == "0":
    if _mode.startswith("once:"):
        path = _mode.split(":", 1)[1]
        if not os.path.exists(path):
            open(path, "w").close()
            dist.init_process_group = _fail(GLOO)
    elif _mode == "always":
        dist.init_process_group = _fail(GLOO)
    elif _mode == "other":
        dist.init_process_group = _fail("getaddrinfo failed: Name or service not known")


def rank() -> int:
    return dist.get_rank()


def fails_after_joining() -> NoReturn:
    """A failure in the function that reads like a broken join: past the join, it is the function's and stays."""
    raise LaunchError(f"rank {dist.get_rank()} of 2 could not join the process group at 127.0.0.1:1 with gloo ({GLOO})")
