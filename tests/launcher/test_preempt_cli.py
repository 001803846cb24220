"""Preemption as a spot notice or Slurm's --signal delivers it, on both command-line launch paths:
SIGTERM to ``shardwise train`` mid-run, and SIGTERM or SIGUSR1 to torchrun's agent under
``shardwise run``, write a checkpoint and exit 75, and ``--resume auto`` ends bitwise equal to a run
never stopped. (The in-process path, ``Trainer(nproc=2).fit`` in a script, is tests/launcher/test_preempt.py.)"""

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

from tests.cli.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# rank 1 slowed 20x on purpose (a sleep, no change to the maths), so the run is still training when the signal comes
TRAIN = ("train", "--recipe", "digits", "--strategy", "ddp", "--max-steps", "60", "--log-every", "2", "--straggler", "1:20")
RUN = (*TRAIN, "--nproc", "2")
# the same run as torchrun's workers: shardwise run starts 2 processes, each runs shardwise train and joins the job
TORCHRUN = ("run", "--nproc-per-node", "2", "-m", "shardwise", *TRAIN)


def _start(out: Path, args: tuple[str, ...] = RUN) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, "-m", "shardwise", *args, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


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


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run never stopped; without the straggler, which only sleeps (the same weights bit for bit,
    and ~4 s less of 60 slowed steps)."""
    out = tmp_path_factory.mktemp("whole")
    i = RUN.index("--straggler")
    proc = shardwise(*RUN[:i], *RUN[i + 2 :], "--out", str(out), timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _preempt_and_resume(whole: Path, cut: Path, args: tuple[str, ...], sig: signal.Signals) -> subprocess.CompletedProcess[str]:
    """Start ``args``, send ``sig`` once 6 steps are logged, check the checkpoint and exit 75, resume
    with ``--resume auto``, and check the end is bitwise the uninterrupted run's; the stopped run."""
    proc = _start(cut, args)
    deadline = time.monotonic() + 300
    while _steps_logged(cut) < 6 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal could be sent"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 75, stderr[-3000:]
    summary = json.loads((cut / "summary.json").read_text())
    stopped = summary["preempted"]["step"]
    assert 6 <= stopped < 60 and stopped % 2 == 0, summary["preempted"]
    assert summary["steps"] == stopped and (cut / "checkpoints" / f"step-{stopped:08d}").is_dir()
    assert f"preempted by SIGTERM at step {stopped}" in stdout

    resumed = shardwise(*args, "--out", str(cut), "--resume", "auto", timeout=480)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = json.loads((cut / "summary.json").read_text())
    assert done["steps"] == 60 and done["resumed_from"].endswith(f"step-{stopped:08d}") and "preempted" not in done
    a, b = _final_weights(whole), _final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert done["val_loss"] == json.loads((whole / "summary.json").read_text())["val_loss"]
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def test_sigterm_checkpoints_exits_75_and_the_resumed_run_is_bitwise_the_uninterrupted_one(whole, tmp_path):
    stopped = _preempt_and_resume(whole, tmp_path / "cut", RUN, signal.SIGTERM)
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["resumed_from"]  # the resumed run's summary replaced it
    assert "preempted by SIGTERM" in stopped.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_torchrun_s_agent_under_shardwise_run_checkpoints_exits_75_and_resumes_bitwise(whole, tmp_path, sig):
    """Slurm's --signal=USR1@60 reaches the agent too; torchrun alone dies on it and leaves its workers
    running. shardwise run turns it into torchrun's SIGTERM to the workers, and exits 75 in one line."""
    stopped = _preempt_and_resume(whole, tmp_path / "cut", TORCHRUN, sig)
    assert "shardwise run: SIGTERM or SIGUSR1 received" in stopped.stderr and "exit 75" in stopped.stderr
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
