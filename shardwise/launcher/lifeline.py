"""Workers die with the process that started them.

A parent killed by SIGKILL (or by SIGTERM/SIGHUP, whose default action skips every
``finally``) cannot stop its children, and they would train on alone. Two guards:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this process the moment
  its parent exits. Set from inside the child, so the parent may already be gone: the
  parent's pid is checked right after.
- Everywhere: a daemon thread that compares ``os.getppid()`` with the parent's pid twice
  a second and exits the process when it changed (the parent died and the child was
  re-parented).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5
_installed = False


def _set_pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        pass


def _watch(parent: int) -> None:
    while True:
        time.sleep(_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def die_with_parent(parent: int | None = None) -> None:
    """Make this process exit when ``parent`` (default: the current parent) exits.

    Idempotent: the first call chooses the parent. A parent already gone exits at once.
    """
    global _installed
    if _installed:
        return
    parent = os.getppid() if parent is None else parent
    if parent <= 1:
        return  # no parent to follow (already re-parented to init, or a container's pid 1)
    _installed = True
    _set_pdeathsig()
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="shardwise-lifeline", daemon=True).start()
