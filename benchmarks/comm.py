"""Allreduce algorithms and compression codecs vs the backend's own allreduce.

    python benchmarks/comm.py --nproc 2 --json comm.json

The same as ``shardwise bench comm``; see `shardwise.tools.bench.comm` for the options.
"""

from __future__ import annotations

import sys

from shardwise.tools.bench.comm import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
