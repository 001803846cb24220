"""Preemption as a spot notice or Slurm's --signal delivers it: SIGTERM to ``shardwise train`` mid-run
writes a checkpoint and exits 75, and ``--resume auto`` ends bitwise equal to a run never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# rank 1 slowed 20x on purpose (a sleep, no change to the maths), so the run is still training when the signal comes
RUN = ("train", "--recipe", "digits", "--strategy", "ddp", "--nproc", "2", "--max-steps", "60", "--log-every", "2", "--straggler", "1:20")


def _start(out: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, "-m", "shardwise", *RUN, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(x).get("step", 0) for x in path.read_text().splitlines() if x.strip()]
    return max(steps, default=0)


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    from shardwise.checkpoint.files import load_file

    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    return dict(load_file(last / "state.pt")["model"])


def test_sigterm_checkpoints_exits_75_and_the_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path):
    whole = shardwise(*RUN, "--out", str(tmp_path / "whole"), timeout=480)
    assert whole.returncode == 0, whole.stderr[-3000:]

    cut = tmp_path / "cut"
    proc = _start(cut)
    deadline = time.monotonic() + 300
    while _steps_logged(cut) < 6 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal could be sent"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 75, stderr[-3000:]
    summary = json.loads((cut / "summary.json").read_text())
    stopped = summary["preempted"]["step"]
    assert summary["preempted"]["signal"] == "SIGTERM" and 6 <= stopped < 60 and stopped % 2 == 0, summary["preempted"]
    assert summary["steps"] == stopped and (cut / "checkpoints" / f"step-{stopped:08d}").is_dir()
    assert f"preempted by SIGTERM at step {stopped}" in stdout

    resumed = shardwise(*RUN, "--out", str(cut), "--resume", "auto", timeout=480)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = json.loads((cut / "summary.json").read_text())
    assert done["steps"] == 60 and done["resumed_from"].endswith(f"step-{stopped:08d}") and "preempted" not in done
    a, b = _final_weights(tmp_path / "whole"), _final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert done["val_loss"] == json.loads((tmp_path / "whole" / "summary.json").read_text())["val_loss"]
