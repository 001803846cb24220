"""launch's ranks are forks of one process that imported torch once (shardwise.launcher.zygote), and
each rank starts as a fresh interpreter would: its own random seeds, the launcher's environment,
working directory, stdout and signal dispositions at the time of the launch; none outlives the
zygote, and the zygote is left alone by the signals meant for its ranks."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardwise import launch
from shardwise.errors import LaunchError
from shardwise.launcher import zygote


def _who() -> dict[str, object]:
    return {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "parent": os.getppid(),
        "torch": torch.rand(4).tolist(),
        "numpy": np.random.rand(4).tolist(),
        "marker": os.environ.get("ZYGOTE_TEST_MARKER"),
        "gone": os.environ.get("ZYGOTE_TEST_GONE"),
        "cwd": os.getcwd(),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sighup": signal.getsignal(signal.SIGHUP),
        "sigchld": signal.getsignal(signal.SIGCHLD),
    }


def _say_hello() -> None:
    print(f"hello from rank {dist.get_rank()}", flush=True)


def _wait_then_sum(flag: str) -> float:
    while not Path(flag).exists():
        time.sleep(0.05)
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item()


def _wait_long() -> None:
    time.sleep(300)


pytestmark = [pytest.mark.dist, pytest.mark.skipif(not zygote.available(), reason="forked workers need Linux")]


@pytest.fixture(autouse=True)
def _zygote_running():
    # A process's first launch of no more ranks than cores starts fresh interpreters (see
    # test_the_first_launch_...); these tests are about the launches that fork from the zygote.
    zygote.shared()


def test_ranks_are_forks_of_one_zygote_that_later_launches_reuse_and_each_starts_as_a_fresh_interpreter(tmp_path, monkeypatch):
    # The premise: a launcher whose Ctrl-C is Python's default (in full runs an earlier test in the same worker left it
    # ignored, and an ignored signal rightly stays ignored in the ranks; tests/conftest.py names such a test)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # tests/conftest.py puts the worker's handler back after
    monkeypatch.setenv("ZYGOTE_TEST_GONE", "set before the zygote started")
    first = launch(_who, nproc=2)
    template = zygote.shared().process.pid
    assert [r["parent"] for r in first] == [template, template]
    assert first[0]["gone"] == "set before the zygote started"
    # the environment and working directory of the launch, not of the zygote's start
    monkeypatch.setenv("ZYGOTE_TEST_MARKER", "set after")
    monkeypatch.delenv("ZYGOTE_TEST_GONE")
    monkeypatch.chdir(tmp_path)
    second = launch(_who, nproc=2)
    assert zygote.shared().process.pid == template
    assert [r["parent"] for r in second] == [template, template]
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in second)
    for r in second:
        assert r["marker"] == "set after" and r["gone"] is None and r["cwd"] == str(tmp_path)
        # a fresh interpreter's signal dispositions, not the zygote's (it ignores SIGINT/SIGHUP and handles SIGCHLD)
        assert r["sigint"] and r["sighup"] == signal.SIG_DFL and r["sigchld"] == signal.SIG_DFL
    # every rank of every launch draws its own random numbers (the zygote's generators are reseeded)
    draws = [r[k] for r in first + second for k in ("torch", "numpy")]
    assert len({tuple(d) for d in draws}) == len(draws)


def test_spawn_starts_fresh_interpreters_that_are_children_of_the_launcher():
    results = launch(_who, nproc=2, start_method="spawn")
    assert [r["parent"] for r in results] == [os.getpid(), os.getpid()]


def test_a_rank_writes_to_the_launcher_s_stdout_as_it_is_at_the_launch(capfd):
    launch(_say_hello, nproc=2)
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_signals_for_the_ranks_leave_the_zygote_alone(tmp_path):
    # A preemption notice goes to the whole process group: the zygote must not die of it (its ranks
    # die with it) but go on serving.
    template = zygote.shared()
    flag = tmp_path / "go"
    launch(_who, nproc=1)  # the zygote is ready
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        os.kill(template.process.pid, sig)
    time.sleep(0.3)
    assert template.process.poll() is None
    flag.touch()
    assert launch(_wait_then_sum, str(flag), nproc=2) == [3.0, 3.0]
    assert zygote.shared() is template


def test_a_killed_zygote_takes_its_ranks_with_it_and_the_next_launch_starts_a_new_one(tmp_path):
    launch(_who, nproc=1)
    old = zygote.shared().process

    def kill_soon() -> None:
        time.sleep(2.0)
        old.kill()

    import threading

    threading.Thread(target=kill_soon, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"died with exit code -9"):
        launch(_wait_long, nproc=2, collective_timeout_s=600)
    assert time.monotonic() - start < 120  # not the ranks' 300 s sleep: they died with the zygote
    results = launch(_who, nproc=2)
    assert results[0]["parent"] == zygote.shared().process.pid != old.pid


def test_the_zygote_ends_when_its_launcher_ends(tmp_path):
    import subprocess

    script = tmp_path / "leader.py"
    script.write_text(
        "import os, sys, shardwise\n"
        "from shardwise.launcher import zygote\n"
        "def f():\n    return os.getppid()\n"
        "shardwise.launch(f, nproc=1)\n"
        "print(zygote.shared().process.pid, flush=True)\n"
        "import time; time.sleep(300)\n"
    )
    leader = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert leader.stdout is not None
        pid = int(leader.stdout.readline())
        leader.kill()  # SIGKILL: no atexit, no finally
        leader.wait()
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the zygote outlived its launcher"
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_started_then_close() -> None:
    """A zygote was started (and is running); it is ended here, the test's own."""
    started = zygote._zygote
    try:
        assert started is not None and started.process.poll() is None
    finally:
        if started is not None:
            started.close()


def test_a_trainer_for_more_processes_than_cores_starts_the_zygote_while_the_model_is_built(monkeypatch):
    from shardwise import Trainer
    from shardwise.launcher import spawn

    monkeypatch.setattr(zygote, "_zygote", None)
    monkeypatch.setattr(spawn, "_cores", lambda: 2)
    Trainer(nproc=2)
    assert zygote._zygote is None  # a core each: a first launch starts fresh interpreters, nothing to start ahead
    Trainer(nproc=3, start_method="spawn")
    assert zygote._zygote is None
    Trainer(nproc=3)
    _assert_started_then_close()


def test_the_first_launch_of_a_core_each_is_fresh_interpreters_and_the_next_ones_fork(tmp_path):
    import json
    import subprocess

    script = tmp_path / "twice.py"
    script.write_text(
        "import json, os, sys, shardwise\n"
        "from shardwise.launcher import spawn, zygote\n"
        "def parent():\n    return os.getppid()\n"
        "cores = spawn._cores()\n"
        "first = shardwise.launch(parent, nproc=min(2, cores))\n"
        "second = shardwise.launch(parent, nproc=min(2, cores))\n"
        "print(json.dumps({'me': os.getpid(), 'first': first, 'second': second, 'zygote': zygote.shared().process.pid}))\n"
    )
    crowded = tmp_path / "crowded.py"
    crowded.write_text(
        "import json, os, shardwise\n"
        "from shardwise.launcher import spawn, zygote\n"
        "def parent():\n    return os.getppid()\n"
        "print(json.dumps({'first': shardwise.launch(parent, nproc=spawn._cores() + 1), 'zygote': zygote.shared().process.pid}))\n"
    )
    runs = {}
    for name in ("twice", "crowded"):
        done = subprocess.run([sys.executable, str(tmp_path / f"{name}.py")], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        runs[name] = json.loads(done.stdout.splitlines()[-1])
    twice = runs["twice"]
    assert set(twice["first"]) == {twice["me"]}  # fresh interpreters, children of the launcher
    assert set(twice["second"]) == {twice["zygote"]}
    assert set(runs["crowded"]["first"]) == {runs["crowded"]["zygote"]}  # more ranks than cores: forked at once


def test_ranks_on_cuda_start_as_fresh_interpreters(monkeypatch):
    from shardwise.launcher import spawn

    assert spawn._zygote("forkserver", "cpu", 2) is zygote.shared()
    assert spawn._zygote("forkserver", "cuda", 2) is None
    assert spawn._zygote("spawn", "cpu", 2) is None
    monkeypatch.setattr(spawn, "_sees_cuda", lambda: True)
    assert spawn._zygote("forkserver", "auto", 2) is None  # 'auto' runs on the GPU it sees


def test_a_launcher_started_with_its_stdout_closed_still_gets_its_ranks_results(tmp_path):
    import subprocess

    script = tmp_path / "daemon.py"
    script.write_text(
        "import os, sys, shardwise\n"
        "def f():\n"
        "    print('to nowhere')\n"
        "    return os.readlink('/proc/self/fd/1') if os.path.exists('/proc/self/fd/1') else None\n"
        "sys.stderr.write(repr([shardwise.launch(f, nproc=2) for _ in range(2)]))  # fresh interpreters, then forks\n"
    )
    # a daemon's stdout: closed from the start (the number 1 is then reused by whatever the launcher
    # opens next, closed on exec: no rank may write into it)
    done = subprocess.run([sys.executable, str(script)], stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120, preexec_fn=lambda: os.close(1))
    assert done.returncode == 0, done.stderr
    import ast

    fresh, forked = ast.literal_eval(done.stderr.strip().splitlines()[-1])
    assert len(fresh) == 2  # fresh interpreters: sys.stdout is None there, and the flush at exit skips it
    assert forked == ["/dev/null", "/dev/null"]  # forks: the launcher's reused number 1 is not passed on


def test_shardwise_train_starts_the_zygote_ahead_even_for_a_one_off_launch(monkeypatch):
    from shardwise import cli
    from shardwise.launcher import spawn

    monkeypatch.setattr(zygote, "_zygote", None)
    monkeypatch.setattr(spawn, "_cores", lambda: 2)
    spawn.prestart(2, even_one_off=True)  # what shardwise train asks for
    _assert_started_then_close()
    asked = []

    class Stop(Exception):
        pass

    def record(*args, **kwargs):
        asked.append((args, kwargs))
        raise Stop

    monkeypatch.setattr(spawn, "prestart", record)
    with pytest.raises(Stop):
        cli.cmd_train(cli.train_parser().parse_args(["--recipe", "digits", "--nproc", "2"]))
    assert asked == [((2, "forkserver", "auto"), {"even_one_off": True})]


class _RefusesAfter:
    """The shared zygote, but it refuses (as one that ended or stopped answering does) from its
    ``n``-th rank on: the launcher must start that rank and the rest as fresh interpreters."""

    def __init__(self, real: zygote.Zygote, n: int) -> None:
        self.real, self.n, self.process = real, n, real.process

    def start(self, args, env):
        if self.n == 0:
            raise zygote.ZygoteUnavailable("the zygote ended or did not answer")
        self.n -= 1
        return self.real.start(args, env)


def _lifeline() -> dict[str, object]:
    return {"parent": os.getppid(), "follows": int(os.environ["SHARDWISE_PARENT_PID"])}


def test_a_rank_started_fresh_after_the_zygote_refused_follows_the_launcher(monkeypatch):
    # Rank 0 is forked; the zygote refuses rank 1, which starts as a fresh interpreter: a child of the
    # launcher, so its lifeline must follow the launcher's pid (following the zygote's, it would exit
    # at once, its parent not being that pid; or outlive the launcher, were the zygote its parent).
    from shardwise.launcher import spawn

    real = zygote.shared()
    monkeypatch.setattr(spawn, "_zygote", lambda *args: _RefusesAfter(real, 1))
    results = launch(_lifeline, nproc=2)
    assert results[0] == {"parent": real.process.pid, "follows": real.process.pid}
    assert results[1] == {"parent": os.getpid(), "follows": os.getpid()}
