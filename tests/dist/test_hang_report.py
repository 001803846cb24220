"""A rank that skips a collective is named, with where it was, when the rank that waited fails.

The launcher reads each rank's collective ledger (`shardwise.comm.ledger`) and, for ranks still
running, a stack dump, before it stops them; the report under the failure says who never reached
the collective the failed rank was in, and where every rank stood.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import pytest
import torch

from shardwise import Engine, launch
from shardwise.errors import CommError


def _skip(kind: str) -> int:
    engine = Engine(strategy="ddp", accelerator="cpu")
    t = torch.ones(1)
    engine.all_reduce(t)
    if engine.rank == 0:
        engine.all_reduce(t)
    elif kind == "sleep":
        time.sleep(120)  # alive, outside any collective: the launcher dumps its stack
    return engine.rank


def _skipped_line() -> int:
    """The line of the all_reduce rank 1 skips (the second one in `_skip`)."""
    lines, first = inspect.getsourcelines(_skip)
    return first + [i for i, x in enumerate(lines) if "engine.all_reduce(t)" in x][1]


SKIPPED_AT = _skipped_line()


def _report(kind: str) -> str:
    with pytest.raises(CommError) as failed:
        launch(_skip, kind, nproc=2, collective_timeout_s=4, timeout=60)
    return failed.value.__cause__.tb


@pytest.mark.timeout(120)
def test_a_rank_that_returned_without_the_collective_is_named():
    text = _report("return")
    named = f"rank 1 never reached world all_reduce #2 (test_hang_report.py:{SKIPPED_AT}): it had returned from the function after world all_reduce #1"
    assert named in text, text
    assert f"rank 0: it was in world all_reduce #2 (test_hang_report.py:{SKIPPED_AT})" in text, text


@pytest.mark.timeout(120)
def test_a_rank_busy_elsewhere_is_named_and_its_stack_saved():
    text = _report("sleep")
    assert "rank 1 never reached world all_reduce #2" in text and "was outside any shardwise collective" in text, text
    line = next(x for x in text.splitlines() if "stacks of the ranks still running" in x)
    stack = Path(line.split(": ", 1)[1].split(", ")[0])
    assert stack.name == "stack-rank-1.txt" and "_skip" in stack.read_text() and "test_hang_report.py" in stack.read_text()


def _skip_with_engine_timeout(flag: str) -> float:
    engine = Engine(strategy="ddp", accelerator="cpu", timeout_s=3)  # under launch's group (its own timeout 300 s)
    t = torch.ones(1)
    start = time.monotonic()
    if engine.rank == 0:
        try:
            engine.all_reduce(t)  # rank 1 never comes
        except CommError:
            Path(flag).write_text("timed out")
            return time.monotonic() - start
        return -1.0
    while not Path(flag).exists() and time.monotonic() - start < 40:  # rank 1 waits, outside any collective
        time.sleep(0.05)
    return 0.0


@pytest.mark.timeout(120)
def test_the_engine_s_timeout_holds_under_launch_s_group(tmp_path):
    # launch made the group with 300 s; the Engine asked for 3 s. Rank 1 stays until rank 0 gives
    # up (or 40 s): rank 0 waits about 3 s when the engine's timeout holds, 40 s or more when not.
    waited = launch(_skip_with_engine_timeout, str(tmp_path / "flag"), nproc=2, collective_timeout_s=300, timeout=90)
    assert 2.5 <= waited[0] < 20, waited
