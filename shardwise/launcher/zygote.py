"""The process ``launch`` forks its workers from: torch is imported once, not once per rank.

A fresh interpreter pays about 2 s of CPU to import torch, and another 1.2 s when it builds its
first optimizer (torch imports its compiler stack, ``torch._dynamo``, on first use): about 3 s
per rank on every launch before any training, whatever the machine. The launcher instead starts
one zygote per launcher process, which imports torch, ``torch._dynamo`` and shardwise's worker side
and then waits; each rank is a fork of it, and every later launch in the same process (a notebook,
a sweep, a test suite) forks the same zygote again. When it starts: at the process's second launch,
or at its first when the ranks outnumber the cores (``Trainer()`` starts it then, while the model
is built), or ahead of any launch of ``shardwise train``, while its recipe loads; a first launch with a core per rank starts fresh interpreters,
which import torch side by side and so start sooner than ranks waiting for a zygote to import it
alone (``shardwise.launcher.spawn._zygote``).

Ranks on CPU only, for now: ranks that will run on CUDA start as fresh interpreters until forking
them is checked on a GPU (the zygote touches no CUDA, which is what forkserver-style starts need).

Forking is safe here because the zygote runs nothing: no tensor operation (so no OpenMP thread
pool; numpy's OpenBLAS is held to one thread), no CUDA (checked after the imports: a zygote that
finds CUDA initialized says so, and the launcher starts fresh interpreters instead), no thread.
Each child is set up the way ``subprocess.Popen`` sets up a fresh worker: its own stdin, stdout
and stderr (sent over the socket), working directory, environment, ``argv``, and the signal
dispositions a fresh interpreter would have, then it runs ``shardwise.launcher.worker.main``.

Lifetime: the zygote ignores SIGINT, SIGTERM, SIGHUP and SIGUSR1/2 (a preemption notice sent to
the whole process group is for the ranks, which checkpoint on it, not for their parent), and
exits when the launcher's end of its socket closes or the launcher is gone, however the launcher
ended. Its workers die with it (``lifeline``), so none outlives the launcher.

What a fork cannot give: a setting torch reads when it is imported has the value the launcher's
environment had when the zygote started (``TORCH_CPP_LOG_LEVEL``, for one), except
``TORCH_DISTRIBUTED_DEBUG``, which each rank reads again. ``start_method="spawn"``
(``launch``, ``TrainerConfig``) starts every rank as a fresh interpreter instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

# What every worker imports: torch, its compiler stack (imported by the first optimizer), the
# process-group layer and shardwise's training side. Strategy-specific modules (FSDP, DTensor)
# are left to the ranks that use them.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "shardwise.launcher.worker", "shardwise.trainer", "shardwise.strategies")
# Left to the launcher and the workers: the zygote never acts on them (see the module docstring).
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_MAX_MESSAGE = 1 << 22
_READY_TIMEOUT_S = 300.0


def available() -> bool:
    """Forked workers need fork, file descriptors passed over a Unix socket, and Linux's
    parent-death signal (``lifeline``)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "send_fds")


class ZygoteUnavailable(RuntimeError):
    """The zygote could not start or refused (the launcher then starts fresh interpreters)."""


class Child:
    """A rank forked by the zygote, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.collect()
            self.returncode = self.zygote.exit_codes.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.zygote.collect(wait_s=0.05 if left is None else min(0.05, left))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # reaped children are never signalled: their pid may be another process's now
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's side: starts the zygote process and asks it for ranks."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS starts no thread pool to fork
        # this process's sys.path, so that the zygote imports the same shardwise and torch
        bootstrap = (
            "import sys, pickle; sys.path[:] = pickle.loads(bytes.fromhex(sys.argv[1])); "
            "from shardwise.launcher.zygote import serve; serve(int(sys.argv[2]), int(sys.argv[3]))"
        )
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", bootstrap, pickle.dumps(list(sys.path)).hex(), str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            theirs.close()
        self.sock = mine
        self.owner = os.getpid()  # a fork of the launcher (multiprocessing's fork) starts its own zygote
        self.exit_codes: dict[int, int] = {}
        self.lock = threading.Lock()
        self.ready = False
        self.dead = False
        self.children: set[int] = set()

    def _receive(self, wait_s: float | None) -> tuple[Any, ...] | None:
        ready, _, _ = select.select([self.sock], [], [], wait_s)
        if not ready:
            return None
        data = self.sock.recv(_MAX_MESSAGE)
        if not data:
            self._lost()
            return None
        message: tuple[Any, ...] = pickle.loads(data)
        if message[0] == "exited":
            _, pid, status = message
            self.children.discard(pid)
            self.exit_codes[pid] = os.waitstatus_to_exitcode(status)
        return message

    def _lost(self) -> None:
        # The zygote died (killed, out of memory): its children died with it.
        self.dead = True
        for pid in self.children:
            self.exit_codes.setdefault(pid, -int(signal.SIGKILL))
        self.children.clear()

    def collect(self, wait_s: float = 0.0) -> None:
        """Note the exit of every child the zygote has reported."""
        with self.lock:
            if self.dead:
                return
            while self._receive(wait_s) is not None:
                wait_s = 0.0

    def _await(self, kind: str) -> tuple[Any, ...]:
        while True:
            message = self._receive(_READY_TIMEOUT_S)
            if message is None:
                raise ZygoteUnavailable("the zygote ended or did not answer")
            if message[0] == "refused":
                raise ZygoteUnavailable(message[1])
            if message[0] == kind:
                return message

    def start(self, args: list[Any], env: dict[str, str]) -> Child:
        """Fork a worker running ``shardwise.launcher.worker.main(*args)`` with ``env`` as its
        environment, stdin from /dev/null, and this process's working directory, stdout and stderr
        (the file descriptors 1 and 2, as a subprocess would inherit them)."""
        global _refused
        with self.lock:
            if self.dead:
                raise ZygoteUnavailable("the zygote has ended")
            if not self.ready:
                try:
                    self._await("ready")
                except ZygoteUnavailable as exc:
                    _refused = str(exc)  # not tried again in this process: each try costs an import of torch
                    self.dead = True
                    raise
                self.ready = True
            request = {"args": args, "env": env, "cwd": os.getcwd(), "argv": list(sys.argv), "ignored": _ignored_here()}
            with open(os.devnull, "r+b") as null:
                # what a subprocess would inherit as its stdout and stderr; a closed one (a daemon's, or
                # its number reused by a descriptor closed on exec) is /dev/null for the rank
                fds = [null.fileno()] + [fd if _inherited(fd) else null.fileno() for fd in (1, 2)]
                socket.send_fds(self.sock, [pickle.dumps(request)], fds)
            pid = self._await("started")[1]
            self.children.add(pid)
        return Child(self, pid, ["shardwise.launcher.worker", *map(str, args)])

    def close(self) -> None:
        """End the zygote (its children, if any are left, die with it)."""
        if self.owner != os.getpid():
            return
        with contextlib.suppress(OSError):
            self.sock.close()
        if not self.ready:
            self.process.kill()  # still importing (started ahead, never used): nothing to finish
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _inherited(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:
        return False


def _ignored_here() -> list[int]:
    """Signals this process ignores: a fresh interpreter started from here would ignore them too
    (an ignored signal stays ignored across exec; ``nohup``, a shell's background job)."""
    out = []
    for sig in _IGNORED:
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) == signal.SIG_IGN:
                out.append(int(sig))
    return out


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()
_refused: str | None = None  # why this process's zygote could not start, once it could not


def running() -> bool:
    """Whether this process has a zygote started and not ended."""
    z = _zygote
    return z is not None and z.owner == os.getpid() and not z.dead and z.process.poll() is None


def shared() -> Zygote:
    """This process's zygote, started on first use (and again if the last one ended)."""
    global _zygote
    with _zygote_lock:
        if _refused is not None:
            raise ZygoteUnavailable(_refused)
        if _zygote is None or _zygote.owner != os.getpid() or _zygote.dead or _zygote.process.poll() is not None:
            _zygote = Zygote()
            import atexit

            atexit.register(_zygote.close)
        return _zygote


# ---------------------------------------------------------------------------------------------
# The zygote process


def serve(fd: int, launcher: int) -> None:
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    # The launcher may be gone by the time there is something to tell it (a run refused before its
    # launch): then there is nobody to tell, and nothing to say on its terminal.
    with contextlib.suppress(OSError):
        _serve(sock, launcher)


def _serve(sock: socket.socket, launcher: int) -> None:
    refused = _preload()
    sock.send(pickle.dumps(("ready", os.getpid()) if refused is None else ("refused", refused)))
    if refused is not None:
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [], 1.0)
        if os.getppid() != launcher:
            return  # the launcher is gone (a copy of its socket may live on in a process it forked)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(sock)
        if sock.fileno() not in ready:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        if not data:
            return  # the launcher closed its end, or ended
        request = pickle.loads(data)
        pid = os.fork()
        if pid == 0:
            _child(sock, (wake_r, wake_w), fds, request)
        for fd_ in fds:
            os.close(fd_)
        sock.send(pickle.dumps(("started", pid)))


def _preload() -> str | None:
    import importlib

    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as exc:  # the fresh interpreters the launcher starts instead report it in full
        return f"importing the worker's modules failed: {type(exc).__name__}: {exc}"
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialized while importing the worker's modules; a fork would inherit it"
    threads = len(os.listdir("/proc/self/task"))  # native ones too (a BLAS pool), which threading does not list
    if threads > 1:
        return f"{threads - 1} thread(s) were started while importing the worker's modules; a fork would copy their locks, not them"
    return None


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(pickle.dumps(("exited", pid, status)))


def _reread_environment() -> None:
    """What torch.distributed reads from the environment when it is imported, read again from the
    rank's: ``TORCH_DISTRIBUTED_DEBUG`` (``launch(debug_collectives=True)`` sets it per launch)."""
    import torch.distributed as dist

    if dist.is_available():
        dist.set_debug_level_from_env()


def _reseed() -> None:
    """Seed as a fresh interpreter is seeded: torch's CPU generator and numpy's global one from the
    operating system's entropy (each fork would otherwise draw the zygote's numbers; Python's
    ``random`` reseeds itself after a fork). CUDA's generators were never created here and keep
    the default seed a fresh interpreter gives them."""
    import torch

    torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _child(sock: socket.socket, wake: tuple[int, int], fds: list[int], request: dict[str, Any]) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        sock.close()
        for fd in wake:
            os.close(fd)
        # the dispositions a fresh interpreter started by the launcher would have
        for sig in (signal.SIGCHLD, *_IGNORED):
            if sig in request["ignored"]:
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        # Out of the way first: a received descriptor may have a number 0-2 itself (a zygote started
        # with one of them closed), which the dup2 of another would overwrite.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in enumerate(high):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv[:] = request["argv"]
        _reread_environment()
        _reseed()
        from shardwise.launcher import worker

        code = worker.main(*request["args"])
    except BaseException:  # noqa: BLE001 - a fork must never return into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
