"""The shardwise command as a user runs it, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each subprocess has its own limit below the test's (a hang then fails with its output, not pytest's kill),
# both generous: a loaded 2-core machine runs the 300-step digits run several times slower than an idle one.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SCRIPTS = Path(__file__).parent.parent / "support" / "scripts"


def shardwise(*args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_digits_with_ddp_on_two_processes_reaches_95_percent(tmp_path):
    proc = shardwise("train", "--recipe", "digits", "--strategy", "ddp", "--nproc", "2", "--out", str(tmp_path), timeout=480)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("strategy", "world_size", "steps", "samples", "wall_s", "samples_per_s", "train_loss", "val_loss", "val_accuracy"):
        assert key in summary, key
    assert summary["strategy"] == "ddp" and summary["world_size"] == 2 and summary["steps"] == 300
    assert summary["val_accuracy"] >= 0.95
    assert summary["val_samples"] == 359
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "train_loss" in r]
    assert [r["step"] for r in train] == list(range(20, 301, 20))
    # The last line of metrics.jsonl is the final validation; compare the first and last training losses
    # (measured 1.71 at step 20, 0.0085 at step 300).
    assert "val_loss" in lines[-1] and train[-1]["train_loss"] < 0.1 * train[0]["train_loss"], (train[0], train[-1])
    assert "backend gloo" in proc.stdout and proc.stdout.count("backend gloo") == 1  # reported once, on rank 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000100", "step-00000200", "step-00000300"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--strategy", "ddpp"], "unknown strategy 'ddpp'. Did you mean 'ddp'?"),
        (["--strategy", "ddp", "--bucket-cap-mb", "big"], "strategy 'ddp': option bucket_cap_mb (--bucket-cap-mb) must be a number; got 'big'"),
        (["--allreduce", "ring"], "--allreduce is an option of strategy ddp; strategy 'single' does not take it"),
        (["--nproc", "0"], "nproc must be a whole number >= 1; got 0"),
        (["--strategy", "ddp", "--nproc", "2", "--global-batch-size", "15"], "global batch 15 is not divisible by world size 2 x accumulate 1"),
        (["--set", "trainer.max_step=3"], "did you mean max_steps?"),
        (["--resume", "auto"], "set out as well"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(args, message):
    proc = shardwise("train", "--recipe", "digits", "--max-steps", "2", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_lists():
    strategies = shardwise("strategies").stdout
    assert "ddp: Distributed data parallel" in strategies
    assert "  --allreduce ALLREDUCE   (allreduce = native)\n      Gradient allreduce algorithm: native, ring," in strategies
    assert "digits" in shardwise("recipes").stdout


def test_generated_strategy_flags_reach_the_strategy_and_the_help_is_the_field_docstring(tmp_path):
    # --bucket-cap-mb and --no-broadcast-buffers had no hand-written flag: they come from DDP's fields.
    proc = shardwise(
        "train",
        "--recipe",
        "digits",
        "--strategy",
        "ddp",
        "--nproc",
        "2",
        "--max-steps",
        "2",
        "--allreduce",
        "ring",
        "--bucket-cap-mb",
        "1.5",
        "--no-broadcast-buffers",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ddp"] == {"bucket_cap_mb": 1.5, "world_size": 2, "allreduce": "ring", "compression": None}
    text = " ".join(shardwise("train", "--help").stdout.split())  # argparse wraps to the terminal's width
    assert "strategy ddp: Distributed data parallel: whole model per rank, gradients averaged each step." in text
    assert (
        "--allreduce ALLREDUCE Gradient allreduce algorithm: native, ring, tree, recursive-doubling, ... (shardwise.comm.algorithms), "
        "or hierarchical (reduce inside each node, all-reduce among node leaders, broadcast back). (default: native)" in text
    )
    assert "--node-size N Processes per node for allreduce=hierarchical" in text


def test_shardwise_run_restarts_a_crashed_job_and_resumes_from_its_checkpoint(tmp_path):
    proc = shardwise("run", "--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPTS / "flaky_train.py"), str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["world_size"] == 2
    assert summary["resumed_from"].endswith("step-00000002")  # the crash came at step 3
    assert "simulated crash of rank 1" in proc.stderr


def test_plain_torchrun_with_its_shared_agent_store_is_joined(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "flaky_train.py"), str(tmp_path), "--no-crash"],
        capture_output=True,
        text=True,
        timeout=480,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["world_size"] == 2 and summary["resumed_from"] is None


def test_shardwise_run_without_restarts_reports_the_failure(tmp_path):
    proc = shardwise("run", "--nproc-per-node", "2", str(SCRIPTS / "flaky_train.py"), str(tmp_path))
    assert proc.returncode != 0
    assert "simulated crash of rank 1" in proc.stderr
