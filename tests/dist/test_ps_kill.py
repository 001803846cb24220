"""A worker process that really dies (``os._exit`` mid-run: no DONE, no clean shutdown) in async mode:
the server notices the silence, the other worker finishes, and the lost worker is reported.

`shardwise.launch` stops every rank as soon as one dies (the right default for every other
strategy), so this test starts its three processes itself and joins them to one gloo group.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.models import adam, ce, classification, mlp


def _process(rank: int, port: int, conn: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    from shardwise.engine import Engine

    engine = Engine(strategy="ps", strategy_options={"servers": 1, "mode": "async", "worker_timeout_s": 2.0}, precision="64", accelerator="cpu")
    model, opt = engine.setup(mlp(), adam)
    if engine.trains:
        x, y = classification().tensors
        w = engine.mesh.coordinate("dp")
        for step in range(30):
            if w == 1 and step == 5:
                os._exit(1)  # a crash: the servers hear nothing more from this worker
            lo = (step * 8) % 96 + w * 4
            engine.forward_backward(model, [(x[lo: lo + 4], y[lo: lo + 4])], lambda m, b: ce(m(b[0]), b))
            engine.step(opt)
            opt.zero_grad(set_to_none=True)
        if w == 0:
            conn.send(engine.strategy.summary()["ps"])
    dist.destroy_process_group()
    conn.close()


def test_a_killed_worker_in_async_mode_is_reported_and_the_run_completes():
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    procs, conns = [], []
    try:
        for rank in range(3):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_process, args=(rank, store.port, child))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        assert mpc.wait([conns[0]], timeout=150), "worker 0 never reported"
        ps = conns[0].recv()
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0, 1, 0]  # the server and worker 0 finished cleanly
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    assert ps["lost_workers"] == [1], ps
    assert ps["updates_per_server"] == [30 + 5], ps  # every gradient that arrived was applied
