"""Benchmarks shipped with the package: ``shardwise bench NAME [options]``.

- ``comm``: our allreduce algorithms and compressed exchanges against the backend's
  own allreduce, 1 KB to 64 MB (`shardwise.tools.bench.comm`).
- ``scaling``: a recipe or your model trained at 1, 2, 4, ... processes per strategy: measured
  samples/s, speed-up and efficiency, beside the planner's (`shardwise.tools.bench.scaling`).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Sequence

from shardwise.errors import ConfigError

BENCHMARKS = {"comm": "shardwise.tools.bench.comm", "scaling": "shardwise.tools.bench.scaling"}


def main(argv: Sequence[str]) -> int:
    """Dispatch ``shardwise bench NAME ...`` to the benchmark's own ``main``."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: shardwise bench NAME [options]\n\nbenchmarks:\n"
            "  comm      allreduce algorithms and codecs vs native (shardwise bench comm --help)\n"
            "  scaling   speed-up and efficiency against processes, measured and predicted (shardwise bench scaling --help)"
        )
        return 0
    name = argv[0]
    if name not in BENCHMARKS:
        close = difflib.get_close_matches(name, BENCHMARKS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown benchmark {name!r}.{hint} Known benchmarks: {', '.join(BENCHMARKS)}")
    module = importlib.import_module(BENCHMARKS[name])
    return int(module.main(argv[1:]))
