"""Resume of the strategies whose state is not all on rank 0: parameter servers and replicas.

Parameter servers: the servers' shards, optimizer state and versions are in the checkpoint (each
server writes ``server-NNN.pt`` into the checkpoint's temporary directory before the manifest),
and a run resumed in new processes goes on from them. Sync equals an uninterrupted run bit for
bit (one and two servers); two servers' checkpoint resumes under one server too, and one
server's under two. Async cannot: which worker's gradient reaches a server first is timing,
so the test checks that it resumes from the servers' saved state and trains on.

Local SGD, DiLoCo, gossip: each rank's replica (model, optimizer, DiLoCo's outer state) is in the
checkpoint (``replica-RRRRR.pt``) and the round clock too, so a resume mid-round equals an
uninterrupted run bit for bit on every rank.

Two launches of four processes (a launch costs seconds here): the first runs every
uninterrupted run (its mid-run checkpoints are the ones resumed), the second every resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise
from shardwise import Trainer
from shardwise import checkpoint as ckpt
from tests.support.models import adam, ce, classification, mlp, params, step_lr

pytestmark = pytest.mark.dist

N = 6  # 100 samples in global batches of 12: 8 steps an epoch, so step 6 is mid-epoch
SYNC = {"one_server": {"servers": 1, "mode": "sync"}, "two_servers": {"servers": 2, "mode": "sync"}}
ASYNC = {"servers": 1, "mode": "async"}


def _fit(out: Path, max_steps: int, resume: str | None, options: dict[str, Any]) -> dict[str, Any]:
    # Dropout draws from each worker's RNG every step: a resume that lost it would differ.
    model = mlp(dropout=0.2)
    trainer = Trainer(
        strategy="ps",
        strategy_options=options,
        precision="64",
        global_batch_size=12,
        accumulate=2,
        max_steps=max_steps,
        clip_grad_norm=1.0,
        optimizer=adam,
        loss_fn=ce,
        lr_scheduler=step_lr,
        out=str(out),
        checkpoint_every=N,
        resume=resume,
        deterministic=True,
        log_every=3,
        progress_bar=False,
    )
    summary = trainer.fit(model, classification(100))
    return {"params": params(model), "summary": summary}


# 100 samples in global batches of 16 over four replicas: step 5 is mid-epoch, and mid-round for H = 3 and H = 2.
R = 5
REPLICAS = {
    "local-sgd": {"sync_every": 3},
    "diloco": {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9},
    "gossip": {"sync_every": 2},
}


def _fit_replicas(strategy: str, out: Path, max_steps: int, resume: str | None) -> dict[str, Any]:
    model = mlp(dropout=0.2)  # dropout: each rank's RNG stream must come back too
    trainer = Trainer(
        strategy=strategy,
        strategy_options=REPLICAS[strategy],
        precision="64",
        global_batch_size=16,
        max_steps=max_steps,
        optimizer=adam,
        loss_fn=ce,
        out=str(out),
        checkpoint_every=R,
        resume=resume,
        deterministic=True,
        log_every=R,
        progress_bar=False,
    )
    summary = trainer.fit(model, classification(100))
    return {"params": params(model), "summary": summary}


def _uninterrupted(root: Path) -> dict[str, Any]:
    out = {name: _fit(root / name, 2 * N, None, options) for name, options in SYNC.items()}
    out["async"] = _fit(root / "async", N, None, ASYNC)
    out.update({name: _fit_replicas(name, root / name, 2 * R, None) for name in REPLICAS})
    return out


def _resumed(root: Path) -> dict[str, Any]:
    step = f"checkpoints/step-{N:08d}"
    out = {name: _fit(root / f"{name}-resumed", 2 * N, str(root / name / step), options) for name, options in SYNC.items()}
    # Two servers' checkpoint resumed by one server: the shards are found by tensor. No steps (three
    # workers would draw other dropout masks than two): the final save shows what was restored.
    out["two_to_one"] = _fit(root / "two_to_one", N, str(root / "two_servers" / step), SYNC["one_server"])
    # And one server's checkpoint resumed by two: the second server's tensors and Adam state come
    # from a file it did not write (its index is past the saved count).
    out["one_to_two"] = _fit(root / "one_to_two", N, str(root / "one_server" / step), SYNC["two_servers"])
    out["async"] = _fit(root / "async", 2 * N, "auto", ASYNC)
    step = f"checkpoints/step-{R:08d}"
    out.update({name: _fit_replicas(name, root / f"{name}-resumed", 2 * R, str(root / name / step)) for name in REPLICAS})
    return out


# Two launches of many runs: slow on a loaded machine. The limits are safety nets; nothing here is timed.
@pytest.mark.timeout(900)
def test_servers_and_replicas_checkpoint_their_state_and_a_resume_goes_on_from_it(tmp_path):
    every_rank = shardwise.launch(_uninterrupted, tmp_path, nproc=4, threads_per_proc=1, timeout=420)
    full = every_rank[0]
    for name, servers in (("one_server", 1), ("two_servers", 2)):
        step = tmp_path / name / f"checkpoints/step-{N:08d}"
        manifest = ckpt.verify(step)  # every file hashed, the servers' included
        assert sorted(f for f in manifest["files"] if f.startswith("server-")) == [f"server-{s:03d}.pt" for s in range(servers)]
        saved = [ckpt.load_file(step / f"server-{s:03d}.pt") for s in range(servers)]
        assert [st["version"] for st in saved] == [N] * servers and all(st["optimizer"]["state"] for st in saved)
    first_async = full["async"]
    saved_async = ckpt.load_file(tmp_path / f"async/checkpoints/step-{N:08d}/server-000.pt")
    # Saved when worker 0 finished its N steps: its N pushes and however many of worker 1's had arrived.
    assert N <= saved_async["version"] <= 3 * N and first_async["summary"]["ps"]["updates_per_server"] == [3 * N]

    resumed_every_rank = shardwise.launch(_resumed, tmp_path, nproc=4, threads_per_proc=1, timeout=420)
    resumed = resumed_every_rank[0]
    for name, servers in (("one_server", 1), ("two_servers", 2)):
        ref, got = full[name], resumed[name]
        summary = got["summary"]
        assert summary["resumed_from"].endswith(f"step-{N:08d}") and summary["steps_this_run"] == N, name
        for key in ref["params"]:
            assert torch.equal(ref["params"][key], got["params"][key]), f"{name}: {key} differs after resume"
        assert summary["train_loss"] == ref["summary"]["train_loss"], name
        workers = 4 - servers
        assert summary["ps"]["updates_per_server"] == [N] * servers
        assert summary["ps"]["staleness_hist"] == {"0": N * workers * servers}, summary["ps"]
    # Another number of servers: one server holds exactly the two servers' tensors and Adam state.
    two_to_one = resumed["two_to_one"]
    assert two_to_one["summary"]["resumed_from"].endswith(f"step-{N:08d}") and two_to_one["summary"]["steps_this_run"] == 0
    before = [ckpt.load_file(tmp_path / f"two_servers/checkpoints/step-{N:08d}/server-00{s}.pt") for s in range(2)]
    after = ckpt.load_file(tmp_path / f"two_to_one/checkpoints/step-{N:08d}/server-000.pt")
    assert after["servers"] == 1 and after["param_ids"] == [0, 1, 2, 3] and after["version"] == N
    for st in before:
        for k, gid in enumerate(st["param_ids"]):
            assert torch.equal(after["params"][gid], st["params"][k])
            old, new = st["optimizer"]["state"][k], after["optimizer"]["state"][gid]
            assert old.keys() == new.keys() and all(torch.equal(old[key], new[key]) for key in old)
    model = ckpt.load_file(tmp_path / f"two_servers/checkpoints/step-{N:08d}/state.pt")["model"]
    assert all(torch.equal(model[key], two_to_one["params"][key]) for key in model)
    # More servers than saved: each of the two holds exactly the one server's tensors and Adam state
    # for the tensors it now owns, and between them every tensor.
    assert resumed["one_to_two"]["summary"]["steps_this_run"] == 0
    saved = ckpt.load_file(tmp_path / f"one_server/checkpoints/step-{N:08d}/server-000.pt")
    split = [ckpt.load_file(tmp_path / f"one_to_two/checkpoints/step-{N:08d}/server-00{s}.pt") for s in range(2)]
    assert sorted(gid for st in split for gid in st["param_ids"]) == saved["param_ids"] == [0, 1, 2, 3]
    for st in split:
        assert st["servers"] == 2 and st["version"] == N and st["param_ids"]
        for k, gid in enumerate(st["param_ids"]):
            assert torch.equal(st["params"][k], saved["params"][gid])
            old, new = saved["optimizer"]["state"][gid], st["optimizer"]["state"].get(k, {})
            assert old.keys() == new.keys() and all(torch.equal(old[key], new[key]) for key in old), f"server {st['index']}: tensor {gid}'s Adam state"
    # Async: resumed from the servers' saved state (not from scratch) and trained on.
    got = resumed["async"]
    assert got["summary"]["resumed_from"].endswith(f"step-{N:08d}") and got["summary"]["steps"] == 2 * N
    assert got["summary"]["ps"]["updates_per_server"] == [3 * N] and got["summary"]["ps"]["lost_workers"] == []
    final = ckpt.load_file(tmp_path / f"async/checkpoints/step-{2 * N:08d}/server-000.pt")
    assert final["version"] >= saved_async["version"] + N  # the servers counted on from the saved version
    lines = [json.loads(line) for line in (tmp_path / "async/metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in lines if "train_loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert not torch.equal(first_async["params"]["0.weight"], got["params"]["0.weight"])

    # Replicas: mid-round at the save, the four replicas (and their Adam states) differ, so each rank
    # needs its own file; every rank's resumed replica equals its uninterrupted one, bit for bit.
    for name in REPLICAS:
        step = tmp_path / name / f"checkpoints/step-{R:08d}"
        files = ckpt.verify(step)["files"]
        assert {f"replica-{r:05d}.pt" for r in range(4)} <= set(files), name
        a, b = (ckpt.load_file(step / f"replica-{r:05d}.pt") for r in range(2))
        assert not torch.equal(a["model"]["0.weight"], b["model"]["0.weight"]), name
        for rank in range(4):
            ref, got = every_rank[rank][name]["params"], resumed_every_rank[rank][name]["params"]
            for key in ref:
                assert torch.equal(ref[key], got[key]), f"{name} rank {rank}: {key} differs after resume"
        section = {"local-sgd": "local_sgd"}.get(name, name)
        summary = resumed[name]["summary"]
        assert summary["resumed_from"].endswith(f"step-{R:08d}") and summary[section] == full[name]["summary"][section], name
