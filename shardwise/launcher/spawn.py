"""Start N local worker processes from Python: ``shardwise.launch(fn, nproc=N)``.

The parent holds the rendezvous store (a TCPStore on a port the OS picks, so two
launches never race for a port), the children join it and run ``fn``. Each child is a
fresh interpreter, or a fork of one that imported torch once (``shardwise.launcher.zygote``),
running ``shardwise.launcher.worker``, which imports the user's script the way
multiprocessing's spawn does, but stops that import at the script's own call to
``launch`` / ``Trainer.fit``: a script works with or without an
``if __name__ == "__main__":`` guard. Results and errors come back through files, so a
large result can never block a child on a pipe nobody reads.

The parent watches all children: when one fails, the others are stopped at once (they
would otherwise wait in a collective until its timeout) and the failure is raised in the
parent as the worker's own exception, with a short report (rank, exception, the user's
file:line) and the full traceback in a file; a launch that runs past ``timeout`` is
stopped and names the ranks still running. Children die with the parent, however it
dies (see ``lifeline``).

Under a launcher that already started the job (torchrun, Slurm, Ray, an existing process
group) nothing is spawned: ``launch`` joins the job and runs ``fn`` in this process.

``expendable`` names ranks the job can lose (asynchronous parameter-server workers,
which no other rank waits for): when one of them dies or fails, the parent says so on
stderr and waits for the others; its result is ``None``. Every other rank still stops
the job at once.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError, LaunchError
from shardwise.launcher import zygote as zygote_mod

_GRACE_S = 5.0
_POLL_S = 0.05
_bootstrapping = False  # set by shardwise.launcher.worker while it imports the user's script


class StopImport(BaseException):
    """Raised by ``launch``/``Trainer.fit`` while a worker imports the user's script: it has what it needs (above the call)."""


_built: dict[str, Any] = {}  # what the script built above its call, in a worker (Trainer.fit's model)
_model_calls = [0]  # fit/validate/test/predict calls this process made: a worker's run of the script stops at the first


def stop_if_bootstrapping(**built: Any) -> None:
    """Called first by ``launch`` and ``Trainer.fit``: in a worker importing the user's script (an unguarded
    top-level call), stop the import here, keeping ``built`` (the model the script made: the worker trains its
    own, and the parent sends no model bytes). In the parent, counts the calls that carry a model (`model_calls`)."""
    if _bootstrapping:
        _built.clear()
        _built.update(built)
        raise StopImport
    _model_calls[0] += "model" in built


def model_calls() -> int:
    """Calls with a model so far: only the first can train the model a worker's run of the script built."""
    return _model_calls[0]


def built_by_script(name: str) -> Any:
    """An object the worker's run of the user's script passed to its call (None outside a worker)."""
    return _built.get(name)


def reruns_script() -> bool:
    """True when workers this process launches run its script up to the call (a script or ``-m`` module)."""
    return _main_spec() is not None


class _WorkerFailed(Exception):
    def __init__(self, exc: BaseException, report: str) -> None:
        super().__init__(report)
        self.exc, self.report = exc, report


class RemoteTraceback(Exception):
    """What went wrong in a worker: the short report (rank, exception, the user's frame, where the full traceback is)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def _default_threads(nproc: int) -> int:
    """A user's ``OMP_NUM_THREADS``, else the cores shared out among the ranks (at least one each)."""
    from shardwise.launcher.env import user_threads

    return user_threads() or max(1, (os.cpu_count() or 1) // nproc)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    start_method: str = "forkserver",
    timeout: float | None = None,
    threads_per_proc: int | None = None,
    accelerator: str = "cpu",
    collective_timeout_s: float = 120.0,
    expendable: Collection[int] = (),
    error_dir: str | os.PathLike[str] | None = None,
    debug_collectives: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` local processes joined in one process group.

    Returns the list of each rank's return value (``None`` for a rank of ``expendable``
    that died or failed: the others ran on without it). Under a launcher that already
    started this process as one rank of a job (torchrun / ``shardwise run``, Slurm, Ray,
    or a process group that exists), nothing is spawned: ``fn`` runs here, in the job, and
    the list holds this rank's value only (``[result]``); ``nproc`` must then equal the
    job's world size.

    ``fn`` and its arguments are pickled by value (each rank gets its own copy of every
    tensor): functions and classes with an importable name by reference, as plain pickle does,
    and lambdas, closures and a notebook's functions by value, with cloudpickle
    (``launcher.payload``); an object that cannot be pickled at all (a lock, an open file) is a
    ``LaunchError`` naming where it is held. A script needs no ``if __name__ == "__main__":``
    guard: each worker runs the script's top-level code up to the call to ``launch`` and stops
    there.

    A failing rank raises its own exception here (its type unchanged), caused by a
    ``RemoteTraceback`` with a short report; the full traceback of each failed rank is in
    ``error_dir/rank-N.txt`` (a new temporary directory by default), with where every rank stood
    among its collectives and, for ranks still running, a stack dump (``stack-rank-N.txt``).
    ``debug_collectives`` starts the workers with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch then
    checks that every rank runs the same collective with the same shapes. ``start_method``:
    ``"forkserver"`` (the default; ``"fork"`` is the same) forks each rank from a process that
    imported torch once and stays for later launches (``shardwise.launcher.zygote``: about 3 s of
    CPU less per rank; Linux, ranks on the CPU), except at this process's first launch when each
    rank has a core of its own: fresh interpreters then import torch side by side, sooner; ``"spawn"``
    starts every rank as a fresh interpreter. Either way a rank shares no state with this process.

    >>> def hello():
    ...     import torch.distributed as dist
    ...     return dist.get_rank()
    >>> launch(hello, nproc=2)  # doctest: +SKIP
    [0, 1]
    """
    stop_if_bootstrapping()
    lost_ok = _check_launch(nproc, expendable, start_method)
    from shardwise.launcher.env import check_gpus, detect_env

    env = detect_env()
    if env.distributed:
        return [join_and_run(fn, args, kwargs, nproc=nproc, accelerator=accelerator, timeout_s=collective_timeout_s)]
    check_gpus(accelerator, nproc)
    try:
        extra_env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if debug_collectives else {}
        threads = threads_per_proc or _default_threads(nproc)
        return _spawn(fn, args, kwargs, nproc, timeout, threads, accelerator, collective_timeout_s, lost_ok, error_dir, extra_env, start_method)
    except _WorkerFailed as failed:
        # Raised here, not where it was found: the user's traceback then shows their own call
        # and this line, not the supervisor's internals.
        raise failed.exc from RemoteTraceback(failed.report)


def _check_launch(nproc: int, expendable: Collection[int], start_method: str) -> set[int]:
    """``launch``'s arguments, refused with one line each; the ranks the job may lose."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be a whole number >= 1; got {nproc!r}")
    lost_ok = set(expendable)
    if 0 in lost_ok or any(not isinstance(r, int) or not 0 <= r < nproc for r in lost_ok):
        raise ConfigError(f"expendable ranks must be in 1 .. {nproc - 1} (rank 0 reports the result); got {sorted(expendable)}")
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ConfigError(f"start_method must be 'spawn', 'fork' or 'forkserver'; got {start_method!r}")
    return lost_ok


def check_world_size(nproc: int, world_size: int, source: str, what: str = "launch(nproc=...)") -> None:
    """Under a launcher the job's size is the launcher's: ``nproc`` must agree with it."""
    if nproc != world_size:
        raise ConfigError(
            f"{what} asked for {nproc} processes, but this process already runs in a job of "
            f"{world_size} started by {source}; shardwise joins that job and spawns nothing. "
            f"Set nproc={world_size} (or leave nproc out), or start the job with {nproc} processes"
        )


def join_and_run(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, nproc: int, accelerator: str, timeout_s: float) -> Any:
    """Join the job this process belongs to and run ``fn`` here; the group is left as found."""
    import torch.distributed as dist

    from shardwise.launcher.env import choose_device, connect, detect_env

    env = detect_env()
    check_world_size(nproc, env.world_size, env.source)
    created = connect(env, choose_device(accelerator, env), timeout_s=timeout_s)
    try:
        return fn(*args, **kwargs)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


_Process = subprocess.Popen[bytes] | zygote_mod.Child


_launches = 0
"""Launches this process has started ranks for (`_zygote`: a first one starts fresh interpreters)."""


def _zygote(start_method: str, accelerator: str, nproc: int) -> zygote_mod.Zygote | None:
    """The zygote to fork ranks from (``shardwise.launcher.zygote``), or None: fresh interpreters.

    Fresh interpreters for ``start_method="spawn"``, a platform without fork, a zygote that could not
    start here, and ranks on CUDA (forking them is not yet checked on a GPU). And for this process's
    first launch when its ranks have a core each and no zygote is running yet: the ranks then import
    torch side by side, while a zygote would import it alone before the first fork (a one-off launch
    of 2 ranks on 2 cores ended 0.3-1.7 s later that way, `benchmarks/families.py --whole`). From the
    second launch on, or with more ranks than cores, or once `prestart` started one, the zygote."""
    if start_method == "spawn" or not zygote_mod.available():
        return None
    if accelerator == "cuda" or (accelerator == "auto" and _sees_cuda()):
        return None
    if _launches == 0 and nproc <= _cores() and not zygote_mod.running():
        return None
    try:
        return zygote_mod.shared()
    except zygote_mod.ZygoteUnavailable:
        return None


def _sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cores() -> int:
    """The cores this process may run on (its affinity: a container's or a job's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - a platform without affinity
        return os.cpu_count() or 1


def prestart(nproc: int, start_method: str = "forkserver", accelerator: str = "auto", even_one_off: bool = False) -> None:
    """Start this process's zygote now, so that it imports torch while the caller builds its model and
    data, when a launch of ``nproc`` ranks will fork them from it even as its first: more ranks than
    cores (`_zygote`; ``Trainer()`` calls this), or ``even_one_off``, a caller whose build before the
    launch is long enough to cover the zygote's import (``shardwise train``: its recipe loads a data set;
    a one-off 2-rank digits run on 2 cores then took 0.25 s less and 1.2 CPU-seconds less, 4 pairs).
    Nothing for one process, in a worker or under a launcher (nothing is spawned there)."""
    if nproc < 2 or (nproc <= _cores() and not even_one_off):
        return
    if start_method == "spawn" or _bootstrapping or not zygote_mod.available():
        return
    from shardwise.launcher.env import detect_env

    if not detect_env().distributed:
        _zygote(start_method, accelerator, max(nproc, _cores() + 1))  # as a crowded launch: started now


def _main_spec() -> tuple[str, str] | None:
    """How a worker finds the user's ``__main__`` (multiprocessing's rules): a script's
    path, a module run with ``-m``, or None (a notebook, a REPL, ``python -c``, ``-m pkg``)."""
    main = sys.modules.get("__main__")
    if main is None:
        return None
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else ("name", name)
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    return ("path", os.path.abspath(path))


def _payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], main_spec: tuple[str, str] | None) -> bytes:
    """``(fn, args, kwargs)`` pickled for the workers (``launcher.payload``: plain pickle, or cloudpickle for
    lambdas, closures and a notebook's functions; what neither can send is named with a fix)."""
    from shardwise.launcher import payload

    return payload.dumps(fn, args, kwargs, main_spec)


def _spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nproc: int,
    timeout: float | None,
    threads: int,
    accelerator: str,
    collective_timeout_s: float,
    lost_ok: set[int],
    error_dir: str | os.PathLike[str] | None,
    extra_env: dict[str, str],
    start_method: str = "forkserver",
) -> list[Any]:
    global _launches
    import torch.distributed as dist

    main_spec = _main_spec()
    payload = _payload(fn, args, kwargs, main_spec)
    boot = Path(tempfile.mkdtemp(prefix="shardwise-launch-"))
    procs: list[_Process] = []
    store = None
    try:
        (boot / "payload.pkl").write_bytes(payload)
        (boot / "boot.pkl").write_bytes(pickle.dumps((main_spec, list(sys.path), list(sys.argv))))
        # The parent serves the rendezvous store: port 0 lets the OS choose a free one.
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            nproc,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        zygote = _zygote(start_method, accelerator, nproc)
        _launches += 1
        for rank in range(nproc):
            # Children speak torch's environment convention, so that user code (and
            # shardwise.launcher.env) sees an ordinary distributed job.
            child_env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                SHARDWISE_LAUNCHER="spawn",
                OMP_NUM_THREADS=str(threads),
                SHARDWISE_PARENT_PID=str(os.getpid() if zygote is None else zygote.process.pid),
                SHARDWISE_ACCELERATOR=accelerator,
                SHARDWISE_COLLECTIVE_TIMEOUT_S=str(collective_timeout_s),
                SHARDWISE_LEDGER_DIR=str(boot / "ledger"),
                **extra_env,
            )
            if zygote is not None:
                try:
                    procs.append(zygote.start([str(boot), rank], child_env))
                    continue
                except zygote_mod.ZygoteUnavailable:  # it ended under us: this rank and the rest start afresh
                    zygote = None
                    child_env["SHARDWISE_PARENT_PID"] = str(os.getpid())
            if zygote is None:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "shardwise.launcher.worker", str(boot), str(rank)],
                        env=child_env,
                        stdin=subprocess.DEVNULL,
                    )
                )
        with _forwarding(procs):
            return _supervise(procs, boot, timeout, lost_ok, error_dir)
    finally:
        _stop(procs)
        del store
        shutil.rmtree(boot, ignore_errors=True)


@contextlib.contextmanager
def _forwarding(procs: list[_Process]) -> Iterator[None]:
    """While the workers run, SIGTERM and SIGUSR1 sent to this process go on to them (a preemption
    notice: a Trainer's ranks checkpoint and return, `shardwise.trainer.preempt`); this process
    keeps waiting for their results. Main thread only; the handlers are put back after."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.send_signal(signum)

    before = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def _stop(procs: list[_Process], grace_s: float = _GRACE_S) -> None:
    """SIGTERM every child still running, SIGKILL those that outlive the grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _supervise(procs: list[_Process], boot: Path, timeout: float | None, expendable: Collection[int], error_dir: str | os.PathLike[str] | None) -> list[Any]:
    from shardwise.launcher import report

    results: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = set(range(len(procs)))
    while pending:
        if deadline is not None and time.monotonic() > deadline:
            raise LaunchError(f"launch timed out after {timeout:.0f}s; ranks still running: {sorted(pending)}")
        done = [r for r in sorted(pending) if procs[r].poll() is not None]
        if not done:
            time.sleep(_POLL_S)
            continue
        # A rank that died (no result, no error written) first: its peers' errors ("connection closed
        # by peer") follow from its death, and by the time they are seen it is seen too.
        done.sort(key=lambda r: not (procs[r].returncode != 0 and not (boot / f"error-{r}.pkl").exists()))
        for rank in done:
            pending.discard(rank)
            code = procs[rank].returncode
            result_file, error_file = boot / f"result-{rank}.pkl", boot / f"error-{rank}.pkl"
            if code == 0 and result_file.exists():
                results[rank] = pickle.loads(result_file.read_bytes())
                continue
            if not error_file.exists():
                if rank in expendable:
                    results[rank] = None
                    report.to_stderr(f"shardwise: rank {rank} died with exit code {code}; the strategy can lose it, so the run goes on without it")
                    continue
                died = f"rank {rank} died with exit code {code} before reporting a result (killed, out of memory, or a crash in native code)"
                where = _whereabouts(procs, boot, rank, dead=(rank,))  # the others, still waiting for it: where
                raise LaunchError(died + ("; where each rank was:\n" + "\n".join(where) if where else ""))
            failure, exc_bytes = pickle.loads(error_file.read_bytes())
            if rank in expendable:
                results[rank] = None
                report.to_stderr(f"shardwise: rank {rank} failed; the strategy can lose it, so the run goes on without it:\n{failure.traceback}")
                continue
            _raise_failure(procs, boot, rank, failure, exc_bytes, error_dir)
    return [results[r] for r in range(len(procs))]


def _whereabouts(procs: list[_Process], boot: Path, failed: int, dead: Collection[int] = ()) -> list[str]:
    """Every rank's place in its collectives (`comm.ledger`) when ``failed`` failed; a stack dump of each still running (SIGUSR2)."""
    from shardwise.comm import ledger

    positions = {r: ledger.read(boot / "ledger" / f"rank-{r}") for r in range(len(procs))}
    if all(p is None for p in positions.values()):
        return []  # no shardwise collective ran: nothing to say beyond the failure itself
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(OSError):
            p.send_signal(signal.SIGUSR2)
    if running:
        time.sleep(0.3)  # let faulthandler write (it runs in the signal handler, at once)
    finished = {r for r in range(len(procs)) if procs[r].poll() == 0 and (boot / f"result-{r}.pkl").exists()}
    return ledger.whereabouts(positions, failed, finished, dead)


def _raise_failure(procs: list[_Process], boot: Path, rank: int, failure: Any, exc_bytes: bytes, error_dir: str | os.PathLike[str] | None) -> None:
    """Stop the other ranks, gather every rank that failed by then, raise the first one's exception."""
    from shardwise.launcher import report

    where = _whereabouts(procs, boot, rank)  # before stopping them: their ledgers and stacks as they stand
    _stop(procs, grace_s=1.0)  # peers blocked in a collective with it wait (a Trainer's rank takes SIGTERM as preemption)
    found = {rank: (failure, exc_bytes)}
    for other in range(len(procs)):
        path = boot / f"error-{other}.pkl"
        if other != rank and path.exists():
            found[other] = pickle.loads(path.read_bytes())
    first = rank
    rank = min(found, key=lambda r: found[r][0].at)  # the earliest failure is the cause; a peer that noticed it fails later
    failure, exc_bytes = found[rank]
    failures = [f for f, _ in found.values()]
    directory = Path(error_dir) if error_dir is not None else Path(tempfile.mkdtemp(prefix="shardwise-errors-"))
    text = report.summarize(failures, report.write_tracebacks(failures, directory))
    if where:
        stacks = []
        for other in range(len(procs)):
            dumped = boot / f"stack-{other}.txt"
            if dumped.exists() and dumped.stat().st_size:
                shutil.copy(dumped, directory / f"stack-rank-{other}.txt")
                stacks.append(str(directory / f"stack-rank-{other}.txt"))
        text += "\nwhere each rank was when rank " + str(first) + " failed:\n" + "\n".join(where)
        if stacks:
            text += "\n  stacks of the ranks still running: " + ", ".join(stacks)
    exc = pickle.loads(exc_bytes) if exc_bytes else LaunchError(f"rank {rank} raised {failure.kind}: {failure.message}")
    raise _WorkerFailed(exc.with_traceback(None), text)
