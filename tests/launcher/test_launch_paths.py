"""Every way a user starts a job, as a user runs it: `python script.py` with and without the
`__main__` guard, `shardwise run` around a script that calls `launch` / `Trainer.fit` (nothing
spawned twice), and the leader killed by SIGTERM, SIGHUP or SIGKILL (no worker survives it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPTS = Path(__file__).parents[1] / "support" / "scripts"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SHARDWISE_LAUNCHER")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(extra)
    return env


def _python(*args: str, timeout: int = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env(**extra))


# -- item: a script works with or without the guard, run with plain `python script.py` ---------------
@pytest.mark.parametrize("script", ["unguarded_trainer.py", "guarded_trainer.py"])
def test_the_readme_trainer_example_trains_with_or_without_the_main_guard(tmp_path, script):
    proc = _python(str(SCRIPTS / script), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The code below fit runs once, in the parent: the workers stop at the fit call.
    assert proc.stdout.count("fit done 4 2") == 1, proc.stdout
    assert (tmp_path / "out" / "summary.json").exists()
    # Every process's peak memory (issue 37): each rank's at fit start and end beside its prediction, and
    # this launching process's, added by the parent after its workers returned (summary.json rewritten).
    memory = json.loads((tmp_path / "out" / "summary.json").read_text())["memory"]
    assert memory["source"] == "VmHWM" and memory["runtime_baseline_bytes"] > 0 and [r["role"] for r in memory["ranks"]] == ["dp0", "dp1"]
    for r in memory["ranks"]:
        assert 0 < r["start"]["rss_bytes"] <= r["start"]["peak_bytes"] <= r["end"]["peak_bytes"]  # a high-water mark only rises
        pred = r["predicted"]
        assert pred["params"] == pred["grads"] == 4 * (4 * 2 + 2) and pred["peak"] == pred["baseline"] + pred["above_baseline"] > pred["baseline"]
    launcher = memory["launcher"]
    assert launcher["peak_bytes"] >= launcher["rss_bytes"] > 0 and launcher["predicted"]["peak"] >= memory["runtime_baseline_bytes"]
    # the workers' table on stdout; the launching process's row after it, on stderr (the script's own output stays first on stdout)
    assert "peak resident memory per process" in proc.stdout and proc.stderr.count("launcher   (this process)") == 1, proc.stderr


def test_the_readme_launch_example_runs_unguarded_and_each_rank_runs_main_once(tmp_path):
    count = tmp_path / "count"
    proc = _python(str(SCRIPTS / "unguarded_launch.py"), COUNT_FILE=str(count))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("results [(0, 2, 3.0), (1, 2, 3.0)]") == 1, proc.stdout
    assert sorted(count.read_text().split()) == ["0", "1"]


# -- item: under torchrun, launch and Trainer join the job and spawn nothing --------------------------
def test_launch_under_shardwise_run_runs_main_once_per_torchrun_process(tmp_path):
    count = tmp_path / "count"
    proc = _python("-m", "shardwise", "run", "--nproc-per-node", "2", str(SCRIPTS / "unguarded_launch.py"), COUNT_FILE=str(count))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(count.read_text().split()) == ["0", "1"]  # 2 runs of main, not 2 x 2
    # Each torchrun process gets its own rank's result, in a one-element list.
    assert "results [(0, 2, 3.0)]" in proc.stdout and "results [(1, 2, 3.0)]" in proc.stdout, proc.stdout


def test_trainer_under_shardwise_run_joins_the_job(tmp_path):
    proc = _python("-m", "shardwise", "run", "--nproc-per-node", "2", str(SCRIPTS / "unguarded_trainer.py"), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("shardwise: 2 processes") == 1 and proc.stdout.count("fit done 4 2") == 2, proc.stdout


# -- item: killing the leader kills the workers -------------------------------------------------------
def _marked(marker: str) -> list[int]:
    """Processes (not zombies) whose environment holds this test's marker."""
    needle = f"SHARDWISE_TEST_MARKER={marker}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(d.name))
        except OSError:
            continue
    return found


def _leaders(tmp: Path) -> dict[str, tuple[list[str], Path, int]]:
    """Path name -> (command, a file that shows the workers are running, lines it needs)."""
    digits = [
        "-m",
        "shardwise",
        "train",
        "--recipe",
        "digits",
        "--strategy",
        "ddp",
        "--nproc",
        "2",
        "--max-steps",
        "100000",
        "--log-every",
        "1",
        "--out",
        str(tmp / "train"),
    ]
    return {
        "shardwise train": (digits, tmp / "train" / "metrics.jsonl", 1),
        "Trainer(nproc=2)": ([str(SCRIPTS / "unguarded_trainer.py"), str(tmp / "trainer"), "100000"], tmp / "trainer" / "metrics.jsonl", 1),
        "launch": ([str(SCRIPTS / "unguarded_launch.py"), "600"], tmp / "launch-count", 2),
        "shardwise run": (["-m", "shardwise", "run", "--nproc-per-node", "2", str(SCRIPTS / "unguarded_launch.py"), "600"], tmp / "run-count", 2),
    }


def _default_sighup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the run's processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_no_worker_outlives_its_killed_leader(tmp_path, sig):
    started: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for name, (args, _ready, _lines) in _leaders(tmp_path).items():
            marker = uuid.uuid4().hex
            count = {"launch": tmp_path / "launch-count", "shardwise run": tmp_path / "run-count"}.get(name)
            extra = {"SHARDWISE_TEST_MARKER": marker, **({"COUNT_FILE": str(count)} if count else {})}
            # a leader started from a terminal: SIGHUP at its default action even where this test runs
            # under nohup (an ignored signal stays ignored across exec, and the leader would never see it)
            proc = subprocess.Popen(
                [sys.executable, *args], env=_env(**extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_default_sighup
            )
            started[name] = (proc, marker)
        deadline = time.monotonic() + 150
        for name, (_args, ready, lines) in _leaders(tmp_path).items():
            while not (ready.exists() and len(ready.read_text().splitlines()) >= lines):
                assert started[name][0].poll() is None, f"{name}: the leader exited early ({started[name][0].returncode})"
                assert time.monotonic() < deadline, f"{name}: the workers never started"
                time.sleep(0.2)
        for proc, _ in started.values():
            proc.send_signal(sig)
        for proc, _ in started.values():
            proc.wait(30)
        time.sleep(0.5)
        give_up = time.monotonic() + 10
        alive = {name: _marked(marker) for name, (_, marker) in started.items()}
        while any(alive.values()) and time.monotonic() < give_up:
            time.sleep(0.25)
            alive = {name: _marked(marker) for name, (_, marker) in started.items()}
        assert not any(alive.values()), f"alive 10 s after {sig.name} to the leader: {alive}"
    finally:
        for proc, marker in started.values():
            for pid in [proc.pid, *_marked(marker)]:  # only processes this test started carry its marker
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
