"""The README's bring-your-own-loop example as a user saves it: `launch(main, nproc=2)` at top level.

Usage: python unguarded_launch.py [SECONDS]. Each rank appends its rank to $COUNT_FILE (if set),
sleeps SECONDS (0 by default) and returns (rank, world size, allreduced sum); the parent prints the list.
Under `shardwise run` the same script joins torchrun's job instead of spawning.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from shardwise import Engine, launch


def main(seconds: float):
    engine = Engine(strategy="ddp")
    if os.environ.get("COUNT_FILE"):
        with open(os.environ["COUNT_FILE"], "a") as f:
            f.write(f"{engine.rank}\n")
    time.sleep(seconds)
    t = torch.ones(1) * (engine.rank + 1)
    dist.all_reduce(t)
    return engine.rank, engine.world_size, t.item()


print(f"results {launch(main, float(sys.argv[1]) if len(sys.argv) > 1 else 0.0, nproc=2)}", flush=True)  # one write: the torchrun processes share stdout
