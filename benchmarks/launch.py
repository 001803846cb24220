"""How long ``shardwise.launch`` takes to start its ranks: a process's first three launches of a
two-rank all-reduce, with the default start (fresh interpreters at a first launch of a core per
rank, the zygote started at the second, forks from it after) and with fresh interpreters always
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
import tempfile

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
    for _ in range(3):
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
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "two_launches.py")  # a script: launch's ranks import the function from it
        with open(script, "w") as f:
            f.write(CHILD)
        for i in range(args.repeats):
            for method in list(got)[i % 2 :] + list(got)[: i % 2]:
                done = subprocess.run([sys.executable, script, method, str(args.nproc)], cwd=root, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"the {method} run failed:\n{done.stderr}")
                got[method].append(json.loads(done.stdout.splitlines()[-1]))
    print(f"launch of a {args.nproc}-rank all-reduce, wall seconds, median of {args.repeats} fresh processes, {os.cpu_count()} cores")
    print(f"{'start_method':14s} {'first launch':>13s} {'second launch':>14s} {'third launch':>13s}")
    for method, runs in got.items():
        first, second, third = (statistics.median(r[k] for r in runs) for k in (0, 1, 2))
        print(f"{method:14s} {first:13.2f} {second:14.2f} {third:13.2f}")


if __name__ == "__main__":
    main()
