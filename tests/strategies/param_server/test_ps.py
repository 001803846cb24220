"""Parameter servers: sync equals the single-process reference (with Adam state and a scheduler on the
servers), two servers equal one, central equals them, ssp keeps its staleness bound under a straggler
that async does not, compressed pushes send fewer bytes, and every worker records, per step, exactly
the bytes the wire format says.

Global-batch semantics make the reference independent of the number of workers, so one launch of
four processes compares two servers and two workers against one server and three workers.
(`tests/strategies/data_parallel/test_ddp.py` holds ddp to the same single-process reference.)

No sleep and no short timeout decides a result here (the machine may be loaded): the straggler
waits for the fast worker's recorded pushes and pulls (`Marks`), a worker that leaves does so
after the events the assertions count, and timeouts are safety nets.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise import Trainer
from shardwise.engine import Engine
from tests.support.models import adam, ce, classification, max_diff, mlp, params, step_lr

# The launches are long on a loaded machine; their time limits are safety nets (the module fixtures launch
# inside the first test that uses them).
pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

COMMON = dict(precision="64", global_batch_size=16, accumulate=2, max_steps=10, log_every=5, progress_bar=False)
N_BYTES = sum(p.numel() for p in mlp().parameters()) * 8
HEADER = 64  # every message starts with 8 float64 header slots (protocol.HEADER_BYTES)
# The MLP's tensors (float64): 6x16 weight, 16 bias, 16x3 weight, 3 bias. Two servers, largest first onto
# the lightest: [the 96-element weight] and [16 + 48 + 3 = 67 elements].
SHARD_NUMELS = {1: [96 + 16 + 48 + 3], 2: [96, 67]}


class Marks:
    """Counters the ranks of one launch share through files: one rank posts how far it got, another
    waits until a count is reached. The order of events a test needs comes from these, not from sleeps."""

    def __init__(self, root: Path, run: str) -> None:
        self.dir = Path(root) / run
        self.dir.mkdir(parents=True, exist_ok=True)

    def post(self, name: str, value: int) -> None:
        tmp = self.dir / f".{name}.{os.getpid()}"
        tmp.write_text(str(value))
        os.replace(tmp, self.dir / name)

    def read(self, name: str) -> int:
        try:
            return int((self.dir / name).read_text())
        except FileNotFoundError:
            return 0

    def wait(self, name: str, at_least: int, limit_s: float = 150.0) -> None:
        deadline = time.monotonic() + limit_s
        while self.read(name) < at_least:
            assert time.monotonic() < deadline, f"{self.dir.name}/{name} never reached {at_least} (a safety net, not a timing)"
            time.sleep(0.002)

    def announce_exchanges(self, engine: Engine, who: str) -> None:
        """Post ``{who}-push`` (the pushes out) and ``{who}-pull`` (the answers in) as this worker's recorder sees them."""
        add, counts = engine.recorder.add, {"push": 0, "pull": 0}

        def add_and_post(event: Any) -> None:
            add(event)
            if event.op in counts and event.group == "ps":
                counts[event.op] += 1
                self.post(f"{who}-{event.op}", counts[event.op])

        engine.recorder.add = add_and_post  # type: ignore[method-assign]


def test_sync_through_the_trainer_equals_the_single_process_reference():
    def fit(strategy: str, nproc: int, **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        model = mlp()
        trainer = Trainer(strategy=strategy, strategy_options=options, nproc=nproc, optimizer=adam, lr_scheduler=step_lr, loss_fn=ce, **COMMON)
        summary = trainer.fit(model, classification())
        return params(model), summary

    ref, ref_summary = fit("single", 1)
    got, summary = fit("ps", 3, servers=1, mode="sync")
    assert max_diff(ref, got) < 1e-10 and max_diff(ref, mlp().state_dict()) > 1e-3
    assert abs(summary["train_loss"] - ref_summary["train_loss"]) < 1e-10
    ps = summary["ps"]
    assert ps["workers"] == 2 and ps["updates_per_server"] == [10] and ps["gradients_per_server"] == [20]
    assert ps["staleness_hist"] == {"0": 20} and ps["max_staleness"] == 0 and ps["lost_workers"] == []
    push, pull = summary["comm"]["by_op"]["ps/push"], summary["comm"]["by_op"]["ps/pull"]
    assert push["count"] == 10 and push["payload_bytes"] == 10 * N_BYTES and push["sent_bytes"] == 10 * (N_BYTES + HEADER)
    assert pull["count"] == 10 and pull["received_bytes"] == 10 * (N_BYTES + HEADER) and pull["sent_bytes"] == 0
    # over the workers only: the two loss logs, the model summary's parameters per rank (the server shows "(serves)"),
    # and the non-finite check's verdict once a step (sync workers step together: a skip must be agreed, or the server waits)
    assert summary["comm"]["by_op"]["workers/all_reduce"]["count"] == 3 + 10
    assert summary["world_size"] == 3 and summary["samples"] == 160


# -- one launch of four processes, the loop by hand on the engine --------------------------------------
def _reference(steps: int) -> dict[str, torch.Tensor]:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = step_lr(opt)
    x, y = classification().tensors
    for step in range(steps):
        lo = (step * 12) % 96
        ce(model(x[lo : lo + 12]), (None, y[lo : lo + 12])).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return params(model)


def _ps_run(strategy: str, options: dict[str, Any], steps: int, marks: Marks | None = None) -> dict[str, Any] | None:
    """Global batch 12 over the workers; returns each worker's parameters, recorded traffic and summary (None on servers).

    With ``marks``, worker 1 is a straggler by events: under ssp it pushes step t only once worker 0's push of
    step t + 1 is out (so worker 0 runs into the bound, S = 1), under async only once worker 0 has finished three
    more steps since worker 1's last pull (so worker 0 runs ahead and worker 1's gradients are stale)."""
    engine = Engine(strategy=strategy, strategy_options=options, precision="64", accelerator="cpu")
    model, opt = engine.setup(mlp(), adam)
    if not engine.trains:
        return None
    sched = step_lr(opt)
    x, y = classification().tensors
    workers, w = engine.data_mesh.size("dp"), engine.data_mesh.coordinate("dp")
    per = 12 // workers
    if marks is not None and w == 0:
        marks.announce_exchanges(engine, "w0")
    seen = 0
    for step in range(steps):
        lo = (step * 12) % 96 + w * per
        engine.forward_backward(model, [(x[lo : lo + per], y[lo : lo + per])], lambda m, b: ce(m(b[0]), b))
        if marks is not None and w == 1:
            if options["mode"] == "ssp":
                marks.wait("w0-push", min(step + 2, steps))  # worker 0's push of step + 1 is out: it waits on us
            else:
                marks.wait("w0-pull", min(seen + 3, steps))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
        sched.step()
        if marks is not None and w == 1:
            seen = marks.read("w0-pull")
    summary = engine.finish()
    assert engine.finish() == summary  # once: a second finish sends nothing (the bytes checks count every message)
    engine.all_reduce(torch.zeros(1))  # the loop's collectives run over the workers only
    return {"worker": w, "params": params(model), "ps": summary["ps"], "comm": engine.recorder.report(steps)["by_op"]}


def _four_processes(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"reference": _reference(10)}
    out["two_servers"] = _ps_run("ps", {"servers": 2, "mode": "sync"}, 10)
    out["two_servers_int8"] = _ps_run("ps", {"servers": 2, "mode": "sync", "compression": "int8"}, 4)
    out["one_server"] = _ps_run("ps", {"servers": 1, "mode": "sync"}, 10)
    out["central"] = _ps_run("central", {}, 10)
    out["int8"] = _ps_run("ps", {"servers": 2, "mode": "async", "compression": "int8"}, 10)
    out["ssp"] = _ps_run("ps", {"servers": 1, "mode": "ssp", "staleness": 1}, 24, Marks(root, "ssp"))
    out["async"] = _ps_run("ps", {"servers": 1, "mode": "async"}, 24, Marks(root, "async"))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch of four processes for the tests below: what every rank returned."""
    return shardwise.launch(_four_processes, tmp_path_factory.mktemp("four"), nproc=4, threads_per_proc=1, timeout=540)


def _check_bytes_per_step(run: dict[str, Any], steps: int, servers: int, workers: int, int8: bool = False) -> None:
    """One worker's recorded traffic against the wire format: each step pushes, to every server, a header and
    the gradient of its shard (8 bytes an element; int8: 1 byte an element and a float64 scale and zero point),
    and pulls from every server a header and its shard's parameters; the session's end is one DONE per server
    (worker 0: then the servers' report and final parameters, and one BYE per server)."""
    numels = SHARD_NUMELS[servers]
    payloads = [n + 16 if int8 else 8 * n for n in numels]
    comm = run["comm"]
    push, pull = comm["ps/push"], comm["ps/pull"]
    assert (push["count"], pull["count"]) == (steps, steps), run["worker"]
    assert push["sent_bytes"] == steps * sum(HEADER + b for b in payloads) and push["received_bytes"] == 0, (run["worker"], push)
    assert push["payload_bytes"] == pull["payload_bytes"] == steps * N_BYTES  # the dense gradient and parameters they stand for
    assert pull["received_bytes"] == steps * sum(HEADER + 8 * n for n in numels) and pull["sent_bytes"] == 0, (run["worker"], pull)
    done = sum(HEADER + b for b in payloads)  # a DONE (or BYE) is a push-sized message
    if run["worker"] == 0:
        stats = 8 * (4 + workers + 2 * 64)  # ServerStats: 4 counters, one lost flag a worker, two 64-bucket histograms
        assert comm["ps/send"]["sent_bytes"] == 2 * done and comm["ps/send"]["count"] == 2 * servers
        assert comm["ps/recv"]["received_bytes"] == sum(stats + HEADER + 8 * n for n in numels)
    else:
        assert comm["ps/send"]["sent_bytes"] == done and comm["ps/send"]["count"] == servers and "ps/recv" not in comm
    assert {key for key in comm if key.startswith("ps/")} <= {"ps/push", "ps/pull", "ps/send", "ps/recv"}


def test_recorded_bytes_per_worker_per_step_equal_the_wire_format_with_two_servers(four):
    by_worker = {r["two_servers"]["worker"]: r for r in four if r["two_servers"] is not None}
    assert sorted(by_worker) == [0, 1]  # ranks 2 and 3 served
    assert by_worker[0]["two_servers"]["ps"]["shard_bytes"] == [8 * n for n in SHARD_NUMELS[2]]
    for r in by_worker.values():
        _check_bytes_per_step(r["two_servers"], 10, servers=2, workers=2)
        _check_bytes_per_step(r["two_servers_int8"], 4, servers=2, workers=2, int8=True)


def test_servers_modes_and_bounds_in_one_launch(four):
    r = four[0]
    ref = r["reference"]
    # sync: two servers and two workers, one server and three workers, central: all the reference.
    for name in ("two_servers", "one_server", "central"):
        assert max_diff(ref, r[name]["params"]) < 1e-10, name
    two, one = r["two_servers"]["ps"], r["one_server"]["ps"]
    assert two["workers"] == 2 and two["updates_per_server"] == [10, 10] and two["gradients_per_server"] == [20, 20]
    assert one["workers"] == 3 and one["updates_per_server"] == [10] and one["staleness_hist"] == {"0": 30}
    assert sum(two["shard_bytes"]) == N_BYTES and max(two["shard_bytes"]) < N_BYTES  # both servers hold a shard
    assert r["central"]["ps"]["servers"] == 1 and r["central"]["ps"]["mode"] == "sync"
    # int8 pushes (async, two workers): about a quarter of the dense bytes, 20 updates per server.
    int8 = r["int8"]
    assert int8["ps"]["updates_per_server"] == [20, 20]
    assert int8["comm"]["ps/push"]["sent_bytes"] < 0.4 * int8["comm"]["ps/push"]["payload_bytes"]
    # ssp with S = 1 and worker 1 pushing step t only after worker 0's step t + 1: never staler than 1, and the
    # bound reached by worker 0's steps 1 .. 23 at least (each applied while worker 1 was one clock behind).
    ssp = r["ssp"]["ps"]
    assert ssp["gradients_per_server"] == [3 * 24] and ssp["max_staleness"] <= 1, ssp
    assert set(ssp["staleness_hist"]) <= {"0", "1"} and ssp["staleness_hist"].get("1", 0) >= 23, ssp
    # async, worker 1 waiting for three more of worker 0's steps before each push: worker 0 runs ahead.
    assert r["async"]["ps"]["max_staleness"] > 1 and r["async"]["ps"]["max_version_lag"] > 2, r["async"]["ps"]


# -- digits accuracy and a lost worker: one launch of three processes (one server, two workers) --------
def _ps_digits(mode: str, steps: int = 300) -> float | None:
    """Validation accuracy (%) of the digits MLP after ``steps`` AdamW steps of global batch 64 (worker 0; None elsewhere)."""
    from shardwise.tools.recipes.digits import DigitsMLP, load_digits_split

    train, val = load_digits_split()
    engine = Engine(strategy="ps", strategy_options={"servers": 1, "mode": mode}, accelerator="cpu", seed=0)
    model, opt = engine.setup(DigitsMLP(), lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=1e-4))
    if not engine.trains:
        return None
    x, y = train.tensors
    workers, w = engine.data_mesh.size("dp"), engine.data_mesh.coordinate("dp")
    per = 64 // workers
    g = torch.Generator().manual_seed(1)
    steps_per_epoch = len(x) // 64
    for step in range(steps):
        if step % steps_per_epoch == 0:
            perm = torch.randperm(len(x), generator=g)
        idx = perm[(step % steps_per_epoch) * 64 + w * per :][:per]
        engine.forward_backward(model, [(x[idx], y[idx])], lambda m, b: ce(m(b[0]), b))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
    engine.finish()  # ends the session; worker 0 receives the servers' final parameters
    if w != 0:
        return None
    module = engine.unwrap(model).eval()
    with torch.no_grad():
        return float((module(val.tensors[0]).argmax(-1) == val.tensors[1]).double().mean() * 100)


def _lost_worker(marks: Marks) -> dict[str, Any] | None:
    """Worker 1 leaves after step 5 without a word (its process ends); worker 0 trains on to step 30 and ends
    its session only once worker 1's five steps are done, so the server has applied all of them.

    ``worker_timeout_s=2`` is how soon the server notices the silence; it decides nothing: worker 0 is never
    dropped, and worker 1, if dropped while only slow, rejoins with its next push (async)."""
    engine = Engine(strategy="ps", strategy_options={"servers": 1, "mode": "async", "worker_timeout_s": 2.0}, precision="64", accelerator="cpu")
    model, opt = engine.setup(mlp(), adam)
    if not engine.trains:
        return None
    x, y = classification().tensors
    w = engine.data_mesh.coordinate("dp")
    for step in range(30 if w == 0 else 5):
        lo = (step * 8) % 96 + w * 4
        engine.forward_backward(model, [(x[lo : lo + 4], y[lo : lo + 4])], lambda m, b: ce(m(b[0]), b))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
    if w != 0:
        marks.post("w1-steps", 5)
        return None  # no DONE: to the server this worker just went silent, then its connection closed
    marks.wait("w1-steps", 5)
    return engine.finish()["ps"]


def _three_processes(root: Path) -> dict[str, Any]:
    return {
        "sync": _ps_digits("sync"),
        "async": _ps_digits("async"),
        "lost": _lost_worker(Marks(root, "lost")),
        "one_server": _ps_run("ps", {"servers": 1, "mode": "sync"}, 6),
        "one_server_int8": _ps_run("ps", {"servers": 1, "mode": "sync", "compression": "int8"}, 4),
    }


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch of three processes (one server, two workers) for the tests below: what every rank returned."""
    return shardwise.launch(_three_processes, tmp_path_factory.mktemp("three"), nproc=3, threads_per_proc=1, timeout=540)


def test_recorded_bytes_per_worker_per_step_equal_the_wire_format_with_one_server(three):
    by_worker = {r["one_server"]["worker"]: r for r in three if r["one_server"] is not None}
    assert sorted(by_worker) == [0, 1]  # rank 2 served
    for r in by_worker.values():
        _check_bytes_per_step(r["one_server"], 6, servers=1, workers=2)
        _check_bytes_per_step(r["one_server_int8"], 4, servers=1, workers=2, int8=True)


def test_async_digits_accuracy_near_sync_and_a_lost_worker_does_not_stop_the_run(three):
    r = three[0]
    assert r["sync"] > 90
    assert abs(r["async"] - r["sync"]) <= 2.0, r
    lost = r["lost"]
    assert lost["lost_workers"] == [1], lost
    assert lost["updates_per_server"] == [30 + 5], lost  # every gradient that arrived was applied


def test_sync_with_a_clip_that_clips_differs_from_the_reference_as_the_readme_says():
    """Each worker clips its own gradient before the push, ddp and single clip the mean once: with a
    clip that clips, sync is not ddp (README, `ps` row). If this starts to pass as equal, ps clips the
    mean and the README should say sync equals ddp again."""

    def fit(strategy: str, nproc: int, **options: Any) -> dict[str, torch.Tensor]:
        model = mlp()
        trainer = Trainer(
            strategy=strategy,
            strategy_options=options,
            nproc=nproc,
            optimizer=adam,
            loss_fn=ce,
            clip_grad_norm=0.05,
            **{**COMMON, "accumulate": 1, "max_steps": 5},
        )
        trainer.fit(model, classification())
        return params(model)

    ref, got = fit("single", 1), fit("ps", 3, servers=1, mode="sync")
    assert max_diff(ref, got) > 1e-6
