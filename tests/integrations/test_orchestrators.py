"""shardwise inside the systems teams already run: torchx (local scheduler), a Kubeflow PyTorchJob
(two pods' environments set by hand, no torchrun) and Flyte (the example workflow, run locally; its GPU
task preempted and retried).

Each runs the digits recipe with ddp on 2 processes for 20 steps, and its summary.json must equal
the same run started by ``shardwise train --nproc 2`` number for number: the launcher changes who
starts the processes, never what they compute."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--recipe", "digits", "--strategy", "ddp", "--max-steps", "20"]
SAME = ("strategy", "world_size", "steps", "samples", "train_loss", "val_loss", "val_accuracy", "val_samples")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SHARDWISE_LAUNCHER", "TORCHELASTIC_RUN_ID")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("PET_")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # torchrun and torchx of this venv
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("reference") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", *ARGS, "--nproc", "2", "--out", str(out)], capture_output=True, text=True, timeout=300, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(out)
    assert summary["world_size"] == 2 and summary["steps"] == 20
    return summary


def _same_run(got: dict[str, Any], reference: dict[str, Any]) -> None:
    assert {k: got[k] for k in SAME} == {k: reference[k] for k in SAME}

    # The same collectives and bytes (their seconds differ from run to run).
    def traffic(s: dict[str, Any]) -> dict[str, tuple[int, int]]:
        return {k: (v["count"], v["payload_bytes"]) for k, v in s["comm"]["by_op"].items()}

    assert traffic(got) == traffic(reference) and traffic(got)["dp/all_reduce"][0] == 20


def _readme_command(command: str, tmp_path: Path) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """The README's block that runs ``command``, run here as written (``bash -e`` from a directory
    with the clone's examples, as tests/readme/test_readme_shell.py runs the other blocks; it leaves
    this one to this file: RUN_ELSEWHERE). Its words, and the finished process."""
    from tests.readme.test_readme import RUN_ELSEWHERE, blocks

    assert RUN_ELSEWHERE[command].endswith(Path(__file__).name)
    (code,) = [code for _, code in blocks("bash") if command in code]
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the commands run from the clone's root
    # flytekit's local sandbox, torchx and torch's elastic agent make temporary directories: here, not in /tmp
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run(["bash", "-e", "-c", code], capture_output=True, text=True, timeout=500, cwd=tmp_path, env=_env(TMPDIR=str(tmp_path / "tmp")))
    return shlex.split(code), proc


def test_the_torchx_component_runs_on_the_local_scheduler(tmp_path, reference):
    """The README's torchx command (run here only: test_readme_shell defers it; a missing extra fails, it does not skip)."""
    assert importlib.util.find_spec("torchx") is not None, "torchx is missing: pip install -e '.[dev]' (or '.[torchx]')"
    args, proc = _readme_command("torchx run -s local_cwd ", tmp_path)
    # `torchx run -s local_cwd "$(python -c ...shardwise.torchx...)":train -j 1x2 -- ARGS --out OUT`, the reference's ARGS
    assert args[:4] == ["torchx", "run", "-s", "local_cwd"] and "shardwise.integrations.torchx" in args[4] and args[4].endswith(":train"), args
    assert args[5:8] == ["-j", "1x2", "--"] and args[8:-2] == ARGS and args[-2] == "--out", args
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Job finished: SUCCEEDED" in proc.stdout + proc.stderr
    # torchrun's workers (its "[rank]:" prefix), joined as torchrun's ranks: nothing spawned by shardwise.
    assert "[0]:shardwise: 2 processes, backend gloo" in proc.stdout + proc.stderr
    _same_run(_summary(tmp_path / args[-1]), reference)


def test_the_torchx_component_is_torchx_ddp_with_shardwise_as_the_program():
    pytest.importorskip("torchx")
    from shardwise.integrations.torchx import train

    app = train("--recipe", "digits", j="2x4", env={"A": "1"})
    (role,) = app.roles
    command = role.args[1]
    assert role.entrypoint == "bash" and role.num_replicas == 2 and role.name == "shardwise"
    assert command.startswith("torchrun ") and "--nnodes 2 --nproc_per_node 4" in command and command.endswith("-m shardwise train --recipe digits")
    assert role.env["A"] == "1" and role.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_pytorchjob_pods_train_without_torchrun(tmp_path, reference):
    out = tmp_path / "run"
    port = str(_free_port())
    pods = []
    for index in range(2):
        # What the training operator sets on master-0 (index 0) and worker-0 (index 1) with nprocPerNode 1.
        pod = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port}
        pod.update(WORLD_SIZE="2", RANK=str(index), PET_NODE_RANK=str(index), PET_NNODES="2", PET_NPROC_PER_NODE="1", PYTHONUNBUFFERED="1")
        # One intra-op thread, as the reference's workers have: with 2 threads the matmuls sum in
        # another order and the losses differ in the 8th digit.
        pod["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "shardwise", "train", *ARGS, "--out", str(out)]
        pods.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(**pod)))
    results = [p.communicate(timeout=300) for p in pods]
    for p, (_, stderr) in zip(pods, results, strict=True):
        assert p.returncode == 0, stderr[-3000:]
    assert results[0][0].count("shardwise: 2 processes, backend gloo") == 1 and "shardwise: 2 processes" not in results[1][0]
    _same_run(_summary(out), reference)


def test_the_flyte_example_workflow_runs_locally_and_returns_the_summary_and_checkpoints(tmp_path, reference):
    """The README's command for the example, ``python examples/flyte_workflow.py OUT STEPS``."""
    # (found, not imported: flytekit makes its temporary directories when imported)
    # The README's Flyte block is run here only (test_readme_shell defers it): a missing extra fails, it does not skip.
    for module in ("flytekit", "flytekitplugins.kfpytorch"):
        assert importlib.util.find_spec(module) is not None, f"{module} is missing: pip install -e '.[dev]' (or '.[flyte]')"
    args, proc = _readme_command("python examples/flyte_workflow.py ", tmp_path)
    assert len(args) == 4 and args[:2] == ["python", "examples/flyte_workflow.py"] and args[3] == ARGS[-1], args  # the reference's 20 steps
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = reference
    for name in ("gpu", "elastic"):
        # The workflow's outputs, as the example prints them, and the run each task wrote.
        assert f"{name}: world_size 2  steps 20  train_loss {r['train_loss']:.4f}  val_accuracy {r['val_accuracy']:.4f}" in proc.stdout, proc.stdout
        assert f"{name}: checkpoints ['step-00000020']" in proc.stdout, proc.stdout
        _same_run(_summary(tmp_path / args[2] / name), reference)


# -- Flyte on spot nodes: a preempted attempt raises a recoverable error, the retry resumes -------------------
ATTEMPT = ROOT / "tests" / "support" / "scripts" / "flyte_attempt.py"


def _attempt(out: Path, attempt: int, tmp: Path, preempt_after: int | None = None) -> tuple[int, str, str]:
    """One attempt of the example's GPU task (the reference's 20 steps, a log step every 10) in a new process, as Flyte
    runs each retry (flytekit's local execution runs none)."""
    args = [sys.executable, str(ATTEMPT), str(out), ARGS[-1], "10", *([str(preempt_after)] if preempt_after is not None else [])]
    env = _env(FLYTE_ATTEMPT_NUMBER=str(attempt), TMPDIR=str(tmp))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stdout, stderr


def test_a_preempted_flyte_gpu_task_is_retried_and_resumes_to_the_uninterrupted_result(tmp_path, reference):
    """The example's ``train_gpu`` (``interruptible=True, retries=3``) on this CPU machine: attempt 0 gets a SIGTERM after
    step 5, checkpoints at the next log step (10) and raises FlyteRecoverableException; attempt 1, the same inputs in a new
    process, resumes from that checkpoint in ``out`` and ends bitwise where the uninterrupted `shardwise train` run ends."""
    from shardwise.checkpoint.export import model_weights

    (tmp_path / "tmp").mkdir()
    out = tmp_path / "run"
    code, _, err = _attempt(out, 0, tmp_path / "tmp", preempt_after=5)
    assert code != 0 and "USER:Recoverable" in err and "preempted (SIGTERM) at step 10" in err, err[-3000:]
    assert json.loads((out / "summary.json").read_text())["preempted"] == {"signal": "SIGTERM", "step": 10}
    code, stdout, err = _attempt(out, 1, tmp_path / "tmp")
    assert code == 0, err[-3000:]
    assert "found no checkpoint" not in stdout  # the retry saw the first attempt's checkpoint
    retried = json.loads(stdout.strip().splitlines()[-1])  # the task's output
    assert (retried["steps"], retried["steps_this_run"], Path(retried["resumed_from"]).name) == (20, 10, "step-00000010")
    same = ("world_size", "steps", "samples", "val_loss", "val_accuracy", "val_samples")  # train_loss: a mean over another log window
    assert {k: retried[k] for k in same} == {k: reference[k] for k in same}
    a, b = model_weights(Path(retried["last_checkpoint"])), model_weights(Path(reference["last_checkpoint"]))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.fixture
def flyte(tmp_path, monkeypatch):
    """shardwise.integrations.flyte, imported with its temporary directories (flytekit's, made at import) under tmp_path."""
    import signal
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    handler = signal.getsignal(signal.SIGINT)  # flytekit installs its own at import
    pytest.importorskip("flytekit")
    import shardwise.integrations.flyte as module

    signal.signal(signal.SIGINT, handler)
    return module


def test_the_flyte_task_trains_on_the_gpus_it_got_else_on_the_cpu(flyte, monkeypatch, capsys):
    import torch

    for count, expected in ((2, "cuda"), (4, "cuda"), (1, "cpu"), (0, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda c=count: c > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        assert flyte.accelerator(2) == expected
    said = capsys.readouterr().out.splitlines()
    assert said == [f"shardwise: torch sees {n} CUDA device{s} for 2 processes: training on the CPU (gloo)" for n, s in ((1, ""), (0, "s"))]


def test_a_retry_that_finds_no_checkpoint_says_out_is_not_durable(flyte, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLYTE_ATTEMPT_NUMBER", raising=False)
    assert flyte.note_attempt(tmp_path / "run") == 0 and capsys.readouterr().out == ""  # a first attempt, or a local run
    monkeypatch.setenv("FLYTE_ATTEMPT_NUMBER", "2")
    assert flyte.note_attempt(tmp_path / "run") == 2
    assert "Flyte attempt 2 of this task found no checkpoint" in capsys.readouterr().out
    (tmp_path / "run" / "checkpoints" / "step-00000010").mkdir(parents=True)
    assert flyte.note_attempt(tmp_path / "run") == 2 and capsys.readouterr().out == ""
    with pytest.raises(flyte.FlyteRecoverableException, match=r"preempted \(SIGTERM\) at step 10"):
        flyte.outputs({"preempted": {"signal": "SIGTERM", "step": 10}, "last_checkpoint": "x"}, tmp_path / "run")
