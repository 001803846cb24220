"""Hygiene for every test (after Lightning's): a test that leaks environment variables,
a process group, or child processes fails."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# One thread per process: the suite runs several processes on two cores.
torch.set_num_threads(1)


# Set by pytest itself, and by torch on first use of its compiler stack (optimizers import it).
# The two KMP_ ones: set on first import by some builds of scikit-learn's OpenMP runtime (seen on a GPU machine's image).
_SET_BY_OTHERS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            cmd = (stat.parent / "cmdline").read_bytes()
            # multiprocessing's resource tracker and shardwise's zygote (the process launch forks its
            # ranks from) live as long as the interpreter, by design.
            if b"resource_tracker" not in cmd and b"forkserver" not in cmd and b"shardwise.launcher.zygote" not in cmd:
                out.add(int(stat.parent.name))
    return out


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@pytest.fixture(autouse=True)
def hygiene(request):
    env_before = dict(os.environ)
    children_before = _children() if Path("/proc").exists() else set()
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS} if main else {}
    yield
    # A test that leaves a signal's handler changed (twice, in full runs, SIGINT was ignored in a worker that later ran the
    # Ctrl-C and zygote tests, which pass alone): put it back, and say which test it was (pytest's warnings summary).
    changed_signals = [sig.name for sig, h in handlers.items() if signal.getsignal(sig) is not h]
    for sig, h in handlers.items():
        if signal.getsignal(sig) is not h and h is not None:
            signal.signal(sig, h)
    if changed_signals:
        warnings.warn(f"{request.node.nodeid} left the handlers of {changed_signals} changed (put back)", stacklevel=1)
    leaked_group = dist.is_available() and dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    env_after = dict(os.environ)
    changed = {k for k in set(env_before) | set(env_after) if env_before.get(k) != env_after.get(k) and k not in _SET_BY_OTHERS}
    os.environ.clear()
    os.environ.update(env_before)
    leaked_children = (_children() - children_before) if Path("/proc").exists() else set()
    assert not leaked_group, "the test left a process group initialized"
    assert not changed, f"the test changed environment variables: {sorted(changed)}"
    assert not leaked_children, f"the test left child processes running: {sorted(leaked_children)}"


# Every multi-process test (marked ``dist``) has a hard timeout so a hang fails instead of stalling
# CI; shardwise.launch also stops all workers as soon as one fails.
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("dist") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(180))
