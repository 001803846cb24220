"""A rank 0 slow to join its process group, for tests/launcher/test_join.py.

A launched function's module is imported in each rank before the rank joins (to unpickle the function), so this
module's top-level code runs there first. Where ``SLOW_JOIN`` names a file, rank 0's ``init_process_group``
returns ``DELAY`` seconds late and writes the time it returned to that file: what a loaded machine does to gloo's
full-mesh connect, where one rank's side completes well after its peer's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

DELAY = 1.5

_path = os.environ.get("SLOW_JOIN")
if _path and os.environ.get("RANK") == "0":
    _real = dist.init_process_group

    def _slow(*args: Any, **kwargs: Any) -> None:
        _real(*args, **kwargs)
        time.sleep(DELAY)
        with open(_path, "w") as f:
            f.write(repr(time.time()))

    dist.init_process_group = _slow


def started() -> float:
    """When this rank's function began: no collective, as the zygote tests' functions."""
    return time.time()
