"""The bring-your-own-loop API: a hand-written loop on the Engine equals the plain PyTorch loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise import Engine, launch
from tests.support.models import ce, classification, max_diff, mlp, params, sgd

pytestmark = pytest.mark.dist


def _reference(steps: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process: global batch 16 as two micro-batches of 8, clipped."""
    model = mlp()
    opt = sgd(model.parameters())
    x, y = classification().tensors
    for step in range(steps):
        for half in range(2):
            sl = slice(step * 16 + half * 8, step * 16 + half * 8 + 8)
            (ce(model(x[sl]), (None, y[sl])) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
    return params(model)


def _engine_loop(out: str, steps: int) -> dict:
    engine = Engine(strategy="ddp", accelerator="cpu", precision="64")
    assert engine.world_size == 2 and engine.env.source == "existing"  # the launcher's group is used as it is
    with engine.rank_zero_first():
        marker = Path(out) / "prepared"
        if engine.is_rank_zero:
            marker.write_text("data ready")
        assert marker.read_text() == "data ready"  # rank 1 only gets here after rank 0
    model, opt = engine.setup(mlp(), sgd)
    x, y = classification().tensors
    r = engine.rank
    for step in range(steps):
        for half in range(2):
            # Micro-batch `half` of the global batch is 8 samples; this rank takes 4 of them.
            base = step * 16 + half * 8 + r * 4
            batch = engine.to_device((x[base : base + 4], y[base : base + 4]))
            if half == 0:
                with engine.no_sync(model):
                    engine.backward(ce(model(batch[0]), batch) / 2)
            else:
                engine.backward(ce(model(batch[0]), batch) / 2)
        norm = engine.clip_grad_norm(model, opt, 0.1)
        engine.step(opt)
        opt.zero_grad()
    total = engine.all_reduce(torch.tensor([float(r + 1)]), op="sum")
    engine.save(Path(out) / "ck", {"model": model, "optimizer": opt, "step": steps})
    fresh, fresh_opt = engine.setup(mlp(seed=3), sgd)
    rest = engine.load(Path(out) / "ck", {"model": fresh, "optimizer": fresh_opt, "step": None})
    engine.barrier()
    # The timed variant: each bucket through a Python hook, recorded with its time.
    timed = Engine(strategy="ddp", accelerator="cpu", precision="64", strategy_options={"record_buckets": True})
    tmodel, topt = timed.setup(mlp(), sgd)
    for _ in range(3):
        with timed.no_sync(tmodel):
            timed.backward(ce(tmodel(x[:4]), (None, y[:4])))
        timed.backward(ce(tmodel(x[4:8]), (None, y[4:8])))
        timed.step(topt)
    timed_totals = timed.recorder.totals()["all_reduce"]
    return {
        "timed": (timed_totals["count"], timed_totals["payload_bytes"], timed_totals["seconds"]),
        "params": params(engine.unwrap(model)),
        "loaded": params(engine.unwrap(fresh)),
        "rest": rest,
        "sum": total.item(),
        "norm": float(norm),
        "allreduces": engine.recorder.count("all_reduce", "dp"),
        "group": dist.is_initialized(),
    }


def test_engine_loop_with_ddp_equals_plain_pytorch(tmp_path):
    ref = _reference(5)
    r0, r1 = launch(_engine_loop, str(tmp_path), 5, nproc=2, timeout=150)  # below the test's 180 s: a hang names its ranks
    # Micro-batch 0 of the reference is samples 0..7 = rank 0's and rank 1's first quarters: same global batch.
    assert max_diff(ref, r0["params"]) < 1e-10 and max_diff(r0["params"], r1["params"]) == 0
    assert max_diff(r0["params"], r0["loaded"]) == 0 and r0["rest"] == {"step": 5}
    assert r0["sum"] == r1["sum"] == 3.0
    assert r0["allreduces"] == 5  # no_sync skipped the first micro-batch of every step
    assert r0["norm"] > 0.1  # the clip was active
    n_bytes = sum(p.numel() for p in mlp().parameters()) * 8
    count, payload, seconds = r0["timed"]
    assert count == 3 and payload == 3 * n_bytes and seconds > 0  # one bucket a step, timed


class _Hooks:
    """A callback of the loop's own: Engine.call runs the hooks it defines, with what the loop passes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_step_end(self, engine: Engine, step: int) -> None:
        self.calls.append(("on_step_end", step))


def _engine_tools(out: str) -> dict:
    from shardwise.trainer.callbacks import EarlyStopping

    hooks = _Hooks()
    engine = Engine(strategy="ddp", accelerator="cpu", precision="64", out=out, loggers="csv,tensorboard", callbacks=[hooks, object()])
    model, opt = engine.setup(mlp(), sgd)
    engine.log_hyperparams({"lr": 0.1, "model": {"width": 32}})
    x, y = classification().tensors
    # The monitored value differs across ranks (rank 0: 1, 2, 3, ... rises; rank 1: -2, -4, ... falls
    # faster): only the agreed mean (-0.5 a step) decides, and patience 2 with min_delta 1 stops both
    # ranks at the same step, 3 (step 1 is the first best; 2 and 3 improve by 0.5 < 1).
    stop = EarlyStopping("score", "min", patience=2, min_delta=1.0)
    stopped_at = None
    for step in range(1, 9):
        batch = (x[step * 8 + engine.rank * 4 :][:4], y[step * 8 + engine.rank * 4 :][:4])
        loss = ce(model(batch[0]), batch)
        engine.backward(loss)
        engine.step(opt)
        opt.zero_grad()
        mean_loss = engine.all_reduce(loss.detach().clone())
        engine.log_dict({"train_loss": mean_loss, "rank_loss": loss})  # rank 0's own loss as it is
        engine.call("on_step_end", engine, step)
        score = float(step) if engine.rank == 0 else -2.0 * step
        if stop.update(engine, score, step):
            stopped_at = step
            break
    summary = engine.finish()
    engine.close()
    return {"calls": hooks.calls, "stopped_at": stopped_at, "state": stop.state_dict(), "steps": summary}


def test_engine_logs_once_from_rank_0_and_runs_callbacks_and_early_stopping(tmp_path):
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r0, r1 = launch(_engine_tools, str(tmp_path), nproc=2, timeout=150)
    assert r0["stopped_at"] == r1["stopped_at"] == 3 and r0["state"] == r1["state"] == {"best": -0.5, "wait": 2, "stopped_step": 3}
    assert r0["calls"] == r1["calls"] == [("on_step_end", s) for s in (1, 2, 3)]
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]  # one row per step: rank 1 logged nothing
    params = json.loads((tmp_path / "csv" / "hparams.json").read_text())
    assert params == {"lr": 0.1, "model.width": 32}
    summary = json.loads((tmp_path / "csv" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["ddp"]["world_size"] == 2  # finish()'s summary, at close
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("train_loss")] == [(int(r["step"]), round(float(r["train_loss"]), 5)) for r in rows]
    assert all(float(r["train_loss"]) != float(r["rank_loss"]) for r in rows)  # the mean differs from rank 0's own


def test_engine_loggers_refuse_bad_names_and_a_missing_out():
    import pytest

    from shardwise.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown logger 'csvv'. Did you mean 'csv'"):
        Engine(strategy="single", accelerator="cpu", out="x", loggers=["csvv"])
    with pytest.raises(ConfigError, match=r"pass Engine\(out=DIR, loggers=...\)"):
        Engine(strategy="single", accelerator="cpu", loggers="csv")
