"""How long ``shardwise.launch`` takes to start its ranks: a process's first and second launch of a
two-rank all-reduce, with the ranks forked from the zygote (the default) and as fresh interpreters
(``start_method="spawn"``). Each row is a fresh ``python`` (so the first launch is a first), the
two methods in turn, ``--repeats`` times; wall seconds of each ``launch`` call, medians.

    python benchmarks/launch.py [--repeats 5] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
import torch, torch.distributed as dist
import shardwise

def total():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

if __name__ == "__main__":
    method, nproc = sys.argv[1], int(sys.argv[2])
    times = []
    for _ in range(2):
        start = time.perf_counter()
        assert shardwise.launch(total, nproc=nproc, start_method=method) == [float(nproc)] * nproc
        times.append(time.perf_counter() - start)
    print(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got: dict[str, list[list[float]]] = {"forkserver": [], "spawn": []}
    for i in range(args.repeats):
        for method in list(got)[i % 2 :] + list(got)[: i % 2]:
            done = subprocess.run([sys.executable, "-c", CHILD, method, str(args.nproc)], cwd=root, capture_output=True, text=True, check=True)
            got[method].append(json.loads(done.stdout.splitlines()[-1]))
    print(f"launch of a {args.nproc}-rank all-reduce, wall seconds, median of {args.repeats} fresh processes, {os.cpu_count()} cores")
    print(f"{'start_method':14s} {'first launch':>13s} {'second launch':>14s}")
    for method, runs in got.items():
        first, second = (statistics.median(r[k] for r in runs) for k in (0, 1))
        print(f"{method:14s} {first:13.2f} {second:14.2f}")


if __name__ == "__main__":
    main()
