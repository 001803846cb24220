"""Where each rank stands among its collectives, readable from outside the process.

A rank that skips a collective leaves the others waiting in it until the timeout, and the
timeout alone says only "Timed out" on the rank that waited. The ledger lets the parent say
who is where: every collective that goes through `shardwise.comm` (the strategies' own
all-reduces, broadcasts, barriers, point-to-point sends and the Engine's collectives) notes,
before it starts, its group, operation, its number in that group (1, 2, ... per group name),
and the call site (the first frame outside ``shardwise/comm`` and the Engine's wrappers), and marks it finished after.
The parent (`shardwise.launcher.spawn`) reads every rank's ledger when one fails and writes:

    rank 1 never reached world all_reduce #3 (train.py:41): it had finished world all_reduce #2 (train.py:41) and was outside any collective

The ledger is one small memory-mapped file per rank (``$SHARDWISE_LEDGER_DIR/rank-N``, set by
the launcher for the processes it starts); writing it is a slice assignment into the map, a few
microseconds per collective, and nothing at all when the variable is unset (torchrun, Slurm,
a process alone). Collectives torch issues by itself (DDP's gradient buckets, FSDP, DTensor)
do not pass through here: for those the stack dumps the launcher takes say where a rank is.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

ENV = "SHARDWISE_LEDGER_DIR"
_SIZE = 4096
_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
# the Engine's collectives are thin wrappers: name their caller
_ENGINE = tuple(os.path.join(os.path.dirname(_COMM_DIR), "engine", f) for f in ("engine.py", "collectives.py"))
_P2P = ("send", "recv", "isend", "irecv")


@dataclass(frozen=True)
class Position:
    """One rank's last collective as its ledger holds it."""

    inside: bool
    """True while the rank is in the collective (entered, not finished)."""
    group: str
    op: str
    seq: int
    """The collective's number in its group on this rank (1-based)."""
    site: str
    counts: dict[str, int]
    """Collectives entered so far, per group name."""

    def describe(self) -> str:
        return f"{self.group} {self.op} #{self.seq} ({self.site})"


class Ledger:
    """This process's ledger: a memory-mapped file that `enter` and `leave` rewrite in place."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w+b") as f:
            f.truncate(_SIZE)
            self._map = mmap.mmap(f.fileno(), _SIZE)
        self.counts: dict[str, int] = {}

    def enter(self, op: str, group: str) -> None:
        seq = self.counts.get(group, 0) + 1
        self.counts[group] = seq
        frame = sys._getframe(2)
        while frame.f_back is not None and (frame.f_code.co_filename.startswith(_COMM_DIR) or frame.f_code.co_filename in _ENGINE):
            frame = frame.f_back
        site = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        counts = ",".join(f"{g}={n}" for g, n in self.counts.items())
        record = f"1|{group}|{op}|{seq}|{site}|{counts}\n".encode()[: _SIZE - 1]
        self._map[: len(record)] = record

    def leave(self) -> None:
        self._map[0:1] = b"0"


_ledger: Ledger | None = None
_checked = False


def _current() -> Ledger | None:
    global _ledger, _checked
    if not _checked:
        _checked = True
        directory = os.environ.get(ENV)
        if directory:
            _ledger = Ledger(Path(directory) / f"rank-{os.environ.get('RANK', '0')}")
    return _ledger


def enter(op: str, group: str) -> None:
    """Note that this rank starts ``op`` on ``group`` (nothing when no ledger is set up)."""
    ledger = _ledger if _checked else _current()
    if ledger is not None:
        ledger.enter(op, group)


def leave() -> None:
    """Note that the collective `enter` noted has finished."""
    if _ledger is not None:
        _ledger.leave()


def read(path: Path) -> Position | None:
    """A rank's ledger as the parent reads it (None when the rank has entered no collective)."""
    try:
        raw = path.read_bytes().split(b"\n", 1)[0].decode(errors="replace")
    except OSError:
        return None
    parts = raw.split("|")
    if len(parts) != 6 or parts[0] not in ("0", "1"):
        return None
    counts = {}
    for item in parts[5].split(","):
        name, _, n = item.rpartition("=")
        if name:
            counts[name] = int(n)
    return Position(parts[0] == "1", parts[1], parts[2], int(parts[3]), parts[4], counts)


def whereabouts(positions: dict[int, Position | None], waiting: int, finished: set[int], dead: Collection[int] = ()) -> list[str]:
    """Lines naming who is where, given that rank ``waiting`` failed (timed out) in a collective:
    first the ranks that never reached its collective, then every rank's position (``dead``: ranks
    whose process died, so they are not "outside" anything: they are gone)."""
    lines = []
    mine = positions.get(waiting)
    if mine is not None and mine.inside and not mine.op.startswith(_P2P):  # point-to-point counts need not match
        for rank, pos in sorted(positions.items()):
            if rank == waiting:
                continue
            reached = pos.counts.get(mine.group, 0) if pos is not None else 0
            if pos is not None and mine.group not in pos.counts and mine.group != "world":
                continue  # not a member of that group, as far as its ledger says
            if reached < mine.seq:
                lines.append(f"rank {rank} never reached {mine.describe()}: {_state(pos, rank in finished, rank in dead)}")
    for rank, pos in sorted(positions.items()):
        lines.append(f"  rank {rank}: {_state(pos, rank in finished, rank in dead)}")
    return lines


def _state(pos: Position | None, finished: bool, dead: bool = False) -> str:
    if dead:
        if pos is None:
            return "its process died before any shardwise collective"
        return f"its process died {'inside' if pos.inside else 'after'} {pos.describe()}"
    if finished:
        return "it had returned from the function" if pos is None else f"it had returned from the function after {pos.describe()}"
    if pos is None:
        return "it had entered no shardwise collective"
    if pos.inside:
        return f"it was in {pos.describe()}"
    return f"it had finished {pos.describe()} and was outside any shardwise collective (its stack dump says where)"
