"""A worker process that really dies (``os._exit`` mid-run: no DONE, no clean shutdown) in async mode:
the server notices the silence, the other worker finishes, and the lost worker is reported.

`shardwise.launch` stops every rank as soon as one dies (the right default for every other
strategy), so the first test starts its three processes itself and joins them to one gloo group.

No wall-clock guess decides a result (the machine may be loaded): worker 0 goes past step 10 only
once worker 1 is dead (a marker it leaves just before), so every one of worker 1's five gradients
has been applied and every later step of worker 0 is applied after the death. ``worker_timeout_s=2``
is only how soon the server notices the silence: worker 0 is never dropped, and worker 1, if
dropped while merely slow, rejoins with its next push. Process and marker waits are safety nets.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.models import adam, ce, classification, mlp

pytestmark = pytest.mark.dist


def _wait_for(marker: str, limit_s: float = 240.0) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, f"{marker} never appeared (a safety net, not a timing)"
        time.sleep(0.01)


def _process(rank: int, port: int, conn: Any, marker: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    from shardwise.engine import Engine

    engine = Engine(strategy="ps", strategy_options={"servers": 1, "mode": "async", "worker_timeout_s": 2.0}, precision="64", accelerator="cpu")
    model, opt = engine.setup(mlp(), adam)
    if engine.trains:
        x, y = classification().tensors
        w = engine.data_mesh.coordinate("dp")
        for step in range(30):
            if w == 1 and step == 5:
                open(marker, "w").close()
                os._exit(1)  # a crash: the servers hear nothing more from this worker
            if w == 0 and step == 10:
                _wait_for(marker)
            lo = (step * 8) % 96 + w * 4
            engine.forward_backward(model, [(x[lo : lo + 4], y[lo : lo + 4])], lambda m, b: ce(m(b[0]), b))
            engine.step(opt)
            opt.zero_grad(set_to_none=True)
        if w == 0:
            conn.send(engine.finish()["ps"])
    dist.destroy_process_group()
    conn.close()


@pytest.mark.timeout(600)
def test_a_killed_worker_in_async_mode_is_reported_and_the_run_completes(tmp_path):
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    procs, conns = [], []
    try:
        for rank in range(3):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_process, args=(rank, store.port, child, str(tmp_path / "killed")))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        assert mpc.wait([conns[0]], timeout=400), "worker 0 never reported"
        ps = conns[0].recv()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 1, 0]  # the server and worker 0 finished cleanly
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    assert ps["lost_workers"] == [1], ps
    assert ps["updates_per_server"] == [30 + 5], ps  # every gradient that arrived was applied


# -- the same through Trainer.fit: the launcher loses the worker, the trainer finishes without it ---------
class KillWorker:
    """Trainer callback: rank ``rank`` kills its own process (SIGKILL: no exception, no goodbye) after step
    ``step``, leaving a marker file first; rank 0 waits for the marker after step ``2 * step``, so every
    step it takes after that is one the server applies after the death."""

    def __init__(self, rank: int, step: int, marker: str) -> None:
        self.rank, self.step, self.marker = rank, step, marker

    def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: Any) -> None:
        if engine.rank == self.rank and step == self.step:
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if engine.rank == 0 and step == 2 * self.step:
            _wait_for(self.marker)


def _trainer(mode: str, out: Any, worker_timeout_s: float) -> Any:
    from shardwise import Trainer

    out.mkdir(parents=True, exist_ok=True)
    return Trainer(
        strategy="ps",
        strategy_options={"servers": 1, "mode": mode, "worker_timeout_s": worker_timeout_s},
        nproc=3,
        precision="64",
        global_batch_size=8,
        max_steps=30,
        log_every=5,
        val_every=10,
        optimizer=adam,
        loss_fn=ce,
        out=str(out),
        checkpoint_every=10,
        keep_last=3,
        progress_bar=False,
        callbacks=[KillWorker(1, 5, str(out / "killed"))],
    )


@pytest.mark.timeout(600)
def test_a_worker_killed_under_trainer_fit_in_async_mode_is_lost_and_the_run_finishes_without_it(tmp_path, capfd):
    import json

    from shardwise import checkpoint as ckpt

    model = mlp()
    summary = _trainer("async", tmp_path, worker_timeout_s=2.0).fit(model, classification(), classification(n=37, seed=2))
    out, err = capfd.readouterr()
    assert "rank 1 died with exit code -9" in err and "the run goes on without it" in err
    assert "lost worker(s) [1]" in out
    assert summary["steps"] == 30 and json.loads((tmp_path / "summary.json").read_text())["ps"]["lost_workers"] == [1]
    ps = summary["ps"]
    assert ps["lost_workers"] == [1] and ps["updates_per_server"] == [30 + 5], ps  # worker 0's 30 after the 5 of worker 1
    assert summary["val_samples"] == 37  # rank 0 evaluates the whole set alone
    # Checkpoints after the death: worker 0 and the server wrote them; the final model is the server's.
    # Saved at steps 20 and 30, after the death: worker 1's 5 and worker 0's, then 10 more of worker 0's.
    versions = [ckpt.load_file(tmp_path / f"checkpoints/step-000000{s}0/server-000.pt")["version"] for s in (2, 3)]
    assert versions == [20 + 5, 30 + 5] and "server-000.pt" in ckpt.verify(tmp_path / "checkpoints/step-00000030")["files"]


@pytest.mark.timeout(600)
def test_a_worker_killed_in_sync_mode_stops_the_run_and_names_the_rank(tmp_path):
    from shardwise.errors import LaunchError

    # The launcher notices the death and stops the run; the servers' silence timeout is only a safety net
    # here (a short one could drop a worker that is merely slow, and a sync server then stops with its own error).
    with pytest.raises(LaunchError, match="rank 1 died with exit code -9"):
        _trainer("sync", tmp_path, worker_timeout_s=300.0).fit(mlp(), classification())
