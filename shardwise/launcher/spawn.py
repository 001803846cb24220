"""Start N local worker processes from Python: ``shardwise.launch(fn, nproc=N)``.

The parent holds the rendezvous store (a TCPStore on a port the OS picks, so two
launches never race for a port), the children join it and run ``fn``. The parent
watches all of them: when one fails, the others are stopped at once (they would
otherwise wait in a collective until its timeout) and the failure is raised in
the parent with the worker's traceback; a launch that runs past ``timeout``
is stopped and names the ranks still running.

``expendable`` names ranks the job can lose (asynchronous parameter-server workers,
which no other rank waits for): when one of them dies or fails, the parent says so on
stderr and waits for the others; its result is ``None``. Every other rank still stops
the job at once.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import sys
import time
import traceback
from typing import Any, Callable, Collection

from shardwise.errors import ConfigError, LaunchError

_GRACE_S = 5.0


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def _worker(
    rank: int,
    nproc: int,
    port: int,
    threads: int,
    accelerator: str,
    timeout_s: float,
    payload: bytes,
    conn: mpc.Connection,
) -> None:
    # Children of shardwise.launch speak torch's environment convention, so that
    # user code (and shardwise.launcher.env) sees an ordinary distributed job.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SHARDWISE_LAUNCHER="spawn",
        OMP_NUM_THREADS=str(threads),
    )
    import torch
    import torch.distributed as dist

    from shardwise.launcher.env import choose_device, connect, detect_env

    torch.set_num_threads(threads)
    try:
        fn, args, kwargs = pickle.loads(payload)
        env = detect_env()
        connect(env, choose_device(accelerator, env), timeout_s=timeout_s)
        result = fn(*args, **kwargs)
        try:
            conn.send(("ok", pickle.dumps(result)))
        except Exception as exc:  # an unpicklable result is the caller's problem, not a crash
            conn.send(("ok", pickle.dumps(f"<result of rank {rank} not picklable: {exc}>")))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:
            payload = pickle.dumps(LaunchError(f"rank {rank} raised {type(exc).__name__}: {exc}"))
        conn.send(("error", (payload, tb)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _default_threads(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    start_method: str = "spawn",
    timeout: float | None = None,
    threads_per_proc: int | None = None,
    accelerator: str = "cpu",
    collective_timeout_s: float = 120.0,
    expendable: Collection[int] = (),
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` local processes joined in one process group.

    Returns the list of each rank's return value (``None`` for a rank of ``expendable``
    that died or failed: the others ran on without it). ``fn`` and its arguments are
    pickled by value (each rank gets its own copy of every tensor), so they must be
    picklable: a function defined at the top level of a module. In a notebook,
    define it in a module, or run the notebook's code as a script with ``shardwise run``.

    >>> def hello():
    ...     import torch.distributed as dist
    ...     return dist.get_rank()
    >>> launch(hello, nproc=2)  # doctest: +SKIP
    [0, 1]
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be a whole number >= 1; got {nproc!r}")
    lost_ok = set(expendable)
    if 0 in lost_ok or any(not isinstance(r, int) or not 0 <= r < nproc for r in lost_ok):
        raise ConfigError(f"expendable ranks must be in 1 .. {nproc - 1} (rank 0 reports the result); got {sorted(expendable)}")
    if start_method not in mp.get_all_start_methods():
        raise ConfigError(f"start_method must be one of {mp.get_all_start_methods()}; got {start_method!r}")
    import torch.distributed as dist

    threads = threads_per_proc or _default_threads(nproc)
    ctx: Any = mp.get_context(start_method)
    # Plain pickle, by value: multiprocessing's own pickler (with torch's reducers) would
    # put tensors in shared memory, and every rank would then step the same parameters.
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise LaunchError(
            f"could not send the function and its arguments to the workers: {exc}. They must be picklable: "
            "define the function at module level (not a lambda or a nested function), or run the script "
            "with `shardwise run`"
        ) from exc
    # The parent serves the rendezvous store: port 0 lets the OS choose a free one.
    store = dist.TCPStore(
        "127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=collective_timeout_s),
    )
    procs: list[mp.process.BaseProcess] = []
    conns: dict[int, mpc.Connection] = {}
    try:
        for rank in range(nproc):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(rank, nproc, store.port, threads, accelerator, collective_timeout_s, payload, child_conn),
                name=f"shardwise-rank{rank}",
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns[rank] = parent_conn
        return _supervise(procs, conns, timeout, lost_ok)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
        del store


def _supervise(
    procs: list[mp.process.BaseProcess], conns: dict[int, mpc.Connection], timeout: float | None,
    expendable: Collection[int] = (),
) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = dict(conns)
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = mpc.wait(list(pending.values()) + [procs[r].sentinel for r in pending], timeout=remaining)
        if not ready:
            running = sorted(pending)
            raise LaunchError(f"launch timed out after {timeout:.0f}s; ranks still running: {running}")
        for rank, conn in list(pending.items()):
            if conn in ready or procs[rank].sentinel in ready:
                try:
                    status, payload = conn.recv()
                except EOFError:
                    procs[rank].join(_GRACE_S)
                    if rank in expendable:
                        del pending[rank]
                        results[rank] = None
                        print(f"shardwise: rank {rank} died with exit code {procs[rank].exitcode}; the strategy "
                              "can lose it, so the run goes on without it", file=sys.stderr, flush=True)
                        continue
                    raise LaunchError(
                        f"rank {rank} died with exit code {procs[rank].exitcode} before reporting a result "
                        "(killed, out of memory, or a crash in native code)"
                    ) from None
                del pending[rank]
                if status == "error" and rank in expendable:
                    results[rank] = None
                    print(f"shardwise: rank {rank} failed; the strategy can lose it, so the run goes on without it:\n"
                          f"{payload[1]}", file=sys.stderr, flush=True)
                    continue
                if status == "error":
                    exc_payload, tb = payload
                    exc = pickle.loads(exc_payload)
                    raise exc from RemoteTraceback(f"\n\nrank {rank} failed:\n{tb}")
                results[rank] = pickle.loads(payload)
    for p in procs:
        p.join()
    return [results[r] for r in range(len(procs))]


def is_interactive() -> bool:
    """True in a notebook or a REPL, where spawned children cannot import ``__main__``."""
    main = sys.modules.get("__main__")
    return main is None or not hasattr(main, "__file__")
