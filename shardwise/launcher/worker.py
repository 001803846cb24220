"""The process ``shardwise.launch`` starts for each rank: ``python -m shardwise.launcher.worker BOOT RANK``.

Why not multiprocessing's spawn: it re-imports the user's script as ``__mp_main__`` to
find the functions defined there, and a script without an ``if __name__ == "__main__":``
guard then calls ``launch`` / ``Trainer.fit`` again while the child bootstraps; the child
dies and the parent waits forever. Here the script is imported the same way, but a call
to ``launch`` or ``Trainer.fit`` during that import stops the import (everything above
the call is defined, which is all the function can use), so guarded and unguarded
scripts both work, and nothing below the call runs in a worker.

Results and errors go to files in the launch's directory, never through a pipe the
parent might not be reading.
"""

from __future__ import annotations

import os
import sys


def _pin_to_parent() -> None:
    # First thing: a worker must never outlive the launcher (see lifeline).
    from shardwise.launcher.lifeline import die_with_parent

    die_with_parent(int(os.environ["SHARDWISE_PARENT_PID"]))


def _import_main(spec: tuple[str, str] | None) -> None:
    """Run the user's script as ``__mp_main__`` (aliased ``__main__``, so pickles that name
    ``__main__.X`` find it), stopping quietly at its first launch."""
    if spec is None:
        return
    import importlib.util
    import types

    from shardwise.launcher import spawn

    kind, target = spec
    module = types.ModuleType("__mp_main__")
    if kind == "path":
        with open(target, "rb") as f:
            code = compile(f.read(), target, "exec")
        module.__file__ = target
    else:
        found = importlib.util.find_spec(target)
        if found is None or found.loader is None:
            return
        code = found.loader.get_code(target)  # type: ignore[attr-defined]
        module.__file__ = found.origin
        module.__spec__ = found
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    spawn._bootstrapping = True
    try:
        exec(code, module.__dict__)
    except spawn.StopImport:
        pass
    finally:
        spawn._bootstrapping = False


def main(boot_dir: str, rank: int) -> int:
    import pickle
    from pathlib import Path

    _pin_to_parent()
    # A crash in native code (SIGSEGV, or SIGABRT from "terminate called without an active exception")
    # leaves no Python traceback; with faulthandler each rank prints where its threads were.
    import faulthandler

    faulthandler.enable(all_threads=True)
    # The launcher ends the ranks still running once one has failed (SIGTERM): each prints where its
    # threads were first, so a rank that was waiting on a peer says on what (then ends as before).
    import signal

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    boot = Path(boot_dir)
    # On SIGUSR2 (the launcher's request when a peer failed) the stacks go to a file it keeps.
    stacks = open(boot / f"stack-{rank}.txt", "w")  # noqa: SIM115  # open for the life of the process: faulthandler writes to its descriptor
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    with open(boot / "boot.pkl", "rb") as f:
        main_spec, sys_path, argv = pickle.load(f)
    sys.path[:] = sys_path
    sys.argv[:] = argv
    import torch
    import torch.distributed as dist

    from shardwise.launcher.env import choose_device, connect, detect_env
    from shardwise.launcher.report import describe

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    accelerator = os.environ["SHARDWISE_ACCELERATOR"]
    timeout_s = float(os.environ["SHARDWISE_COLLECTIVE_TIMEOUT_S"])
    try:
        try:
            _import_main(main_spec)
            with open(boot / "payload.pkl", "rb") as f:
                fn, args, kwargs = pickle.load(f)
        except Exception as exc:
            raise _load_error(exc) from exc
        env = detect_env()
        connect(env, choose_device(accelerator, env), timeout_s=timeout_s)
        result = fn(*args, **kwargs)
        try:
            data = pickle.dumps(result)
        except Exception as exc:  # an unpicklable result is the caller's problem, not a crash
            data = pickle.dumps(f"<result of rank {rank} not picklable: {exc}>")
        _write(boot / f"result-{rank}.pkl", data)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        failure = describe(rank, exc)
        try:
            exc_bytes = pickle.dumps(exc)
            pickle.loads(exc_bytes)
        except Exception:
            exc_bytes = b""
        _write(boot / f"error-{rank}.pkl", pickle.dumps((failure, exc_bytes)))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None when the launcher's stdout or stderr was closed (a daemon)
            stream.flush()
    return code


def _load_error(exc: Exception) -> Exception:
    from shardwise.errors import LaunchError

    return LaunchError(
        f"the worker could not load the function to run ({type(exc).__name__}: {exc}). Define the function, "
        "and everything it uses, at the top level of a module or script, above the call to launch/fit "
        '(not inside `if __name__ == "__main__":`, where workers do not look)'
    )


def _write(path: os.PathLike[str], data: bytes) -> None:
    # Written whole, then renamed: the parent never reads half a file.
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


if __name__ == "__main__":
    # The result (or the error) is on disk, the process group destroyed and the streams flushed: end
    # here, without the interpreter's finalization. Its garbage collection of torch.distributed's
    # native objects (gloo process groups of earlier runs in this process) aborted about one worker
    # exit in two after several runs in one launch ("terminate called without an active
    # exception", exit code -6 or -11), after the result was written.
    os._exit(main(sys.argv[1], int(sys.argv[2])))
