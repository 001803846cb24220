"""A worker's failure in a few lines: the rank, the exception, and the user's own frame.

The full traceback goes to a file (``<out>/errors/rank-N.txt``, or a temporary directory)
whose path the short report names; a traceback of 50-100 lines per rank is what users
scroll past.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

# Frames inside these directories are library code; the user's frame is the deepest outside them.
_LIBRARY_DIRS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {
        str(Path(__file__).resolve().parents[1]),  # the shardwise package (no upward import of it)
        os.path.dirname(torch.__file__),
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    }
)


@dataclass(frozen=True)
class Failure:
    """What a worker reports about its exception (picklable, no exception object needed)."""

    rank: int
    kind: str
    """The exception's type name."""
    message: str
    where: str
    """``file:line in function`` of the user's own frame, or '' when every frame is library code."""
    traceback: str
    """The full traceback text."""
    at: float = 0.0
    """When it was caught (``time.time()``): the first failure is the cause, later ones are
    usually peers that lost it in a collective."""


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):
        return True  # <frozen runpy>, <string>
    path = str(Path(filename).resolve())
    return path.startswith(_LIBRARY_DIRS) or "site-packages" in path


def user_frame(tb: TracebackType | None) -> str:
    """``file:line in function`` of the deepest frame that is not shardwise, torch, the
    standard library or an installed package; '' if there is none."""
    found = ""
    for frame in traceback.extract_tb(tb):
        if not _is_library(frame.filename):
            found = f"{_short_path(frame.filename)}:{frame.lineno} in {frame.name}"
    return found


def _short_path(filename: str) -> str:
    try:
        return os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename


def describe(rank: int, exc: BaseException) -> Failure:
    """The failure report of ``exc``, caught in ``rank``."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Failure(rank, type(exc).__name__, str(exc), user_frame(exc.__traceback__), text, time.time())


def write_tracebacks(failures: list[Failure], directory: Path) -> dict[int, Path]:
    """Write each failure's full traceback to ``directory/rank-N.txt``; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for f in failures:
        path = directory / f"rank-{f.rank}.txt"
        path.write_text(f"rank {f.rank} failed:\n{f.traceback}")
        paths[f.rank] = path
    return paths


def summarize(failures: list[Failure], paths: dict[int, Path]) -> str:
    """One short block: the first failure (ranks with the same error share it), then one line
    naming the ranks that failed after it with another error (usually a lost peer)."""
    failures = sorted(failures, key=lambda f: f.at)
    first = failures[0]
    same = [f for f in failures if (f.kind, f.message, f.where) == (first.kind, first.message, first.where)]
    later = [f for f in failures if f not in same]
    groups: dict[tuple[str, str, str], list[int]] = {}
    for f in same:
        groups.setdefault((f.kind, f.message, f.where), []).append(f.rank)
    lines = []
    for (kind, message, where), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        first_line = message.splitlines()[0] if message else ""
        lines.append(f"{who} failed: {kind}: {first_line}".rstrip(": "))
        if where:
            lines.append(f"  at {where}")
    if later:
        lines.append("  then: " + ", ".join(f"rank {f.rank} ({f.kind})" for f in later))
    lines.append("  full traceback: " + ", ".join(str(paths[f.rank]) for f in failures))
    return "\n".join(lines)


def to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
