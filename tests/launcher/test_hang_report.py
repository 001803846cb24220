"""A rank that skips a collective is named, with where it was, when the rank that waited fails.

The launcher reads each rank's collective ledger (`shardwise.comm.ledger`) and, for ranks still
running, a stack dump, before it stops them; the report under the failure says who never reached
the collective the failed rank was in, and where every rank stood.
"""

from __future__ import annotations

import inspect
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from shardwise import Engine, launch
from shardwise.errors import CommError, LaunchError
from shardwise.trainer.callbacks import Callback

pytestmark = pytest.mark.dist


def _skip(kind: str) -> int:
    engine = Engine(strategy="ddp", accelerator="cpu")
    t = torch.ones(1)
    engine.all_reduce(t)
    if engine.rank < engine.world_size - 1:  # every rank but the last reaches the second all_reduce
        engine.all_reduce(t)
    elif kind == "sleep":
        time.sleep(120)  # alive, outside any collective: the launcher dumps its stack
    return engine.rank


def _skipped_line() -> int:
    """The line of the all_reduce rank 1 skips (the second one in `_skip`)."""
    lines, first = inspect.getsourcelines(_skip)
    return first + [i for i, x in enumerate(lines) if "engine.all_reduce(t)" in x][1]


SKIPPED_AT = _skipped_line()


def _report(kind: str, nproc: int = 2) -> str:
    with pytest.raises(CommError) as failed:
        launch(_skip, kind, nproc=nproc, collective_timeout_s=4, timeout=60)
    return failed.value.__cause__.tb


@pytest.mark.timeout(120)
def test_a_rank_that_returned_without_the_collective_is_named():
    # Three ranks: whichever of ranks 0 and 1 times out first, the other is blocked inside the same
    # all_reduce; it reached it, so only rank 2 is named as never reaching it.
    text = _report("return", nproc=3)
    named = f"rank 2 never reached world all_reduce #2 (test_hang_report.py:{SKIPPED_AT}): it had returned from the function after world all_reduce #1"
    assert named in text, text
    for rank in (0, 1):
        assert f"rank {rank}: it was in world all_reduce #2 (test_hang_report.py:{SKIPPED_AT})" in text, text
        assert f"rank {rank} never reached" not in text, text


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


def _swapped() -> None:
    engine = Engine(strategy="ddp", accelerator="cpu")
    a, b = torch.ones(2), torch.ones(3)
    first, second = (a, b) if engine.rank == 0 else (b, a)  # the same two all-reduces, in another order on rank 1
    engine.all_reduce(first)
    engine.all_reduce(second)


@pytest.mark.timeout(120)
def test_debug_collectives_names_a_swapped_order():
    with pytest.raises(CommError) as failed:
        launch(_swapped, nproc=2, collective_timeout_s=20, timeout=60, debug_collectives=True)
    text = str(failed.value)
    assert "mismatch between collectives" in text and "TensorShape=[2]" in text and "TensorShape=[3]" in text, text


def _mse(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch[1])


class _SlowRank1(Callback):
    def on_train_step_start(self, trainer, engine, step):
        if step == 2 and engine.rank == 1:
            time.sleep(8)  # rank 0 finishes step 2 and waits at the step's monitored barrier


@pytest.mark.timeout(120)
def test_the_step_barrier_of_debug_collectives_names_the_rank_that_did_not_come():
    from shardwise import Trainer

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = Trainer(
        strategy="local-sgd",  # no collective inside a step: only the barrier waits
        strategy_options={"sync_every": 100},
        nproc=2,
        max_steps=3,
        log_every=100,
        global_batch_size=8,
        timeout_s=3,
        debug_collectives=True,
        progress_bar=False,
        model_summary=False,
        loss_fn=_mse,
        callbacks=[_SlowRank1()],
    )
    with pytest.raises(CommError) as failed:
        trainer.fit(torch.nn.Linear(4, 1), data)
    text = str(failed.value)
    assert "at the barrier after step 2" in text and "Ranks 1 failed to pass monitoredBarrier" in text, text


def _die_in_the_middle(clock: str) -> int:
    engine = Engine(strategy="ddp", accelerator="cpu")
    t = torch.ones(1)
    engine.all_reduce(t)
    if engine.rank == 1:
        Path(clock).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no goodbye: a crash, an out-of-memory kill
    engine.all_reduce(t)  # rank 0 waits here for a peer that is gone
    return engine.rank


def _die_lines() -> tuple[int, int]:
    lines, first = inspect.getsourcelines(_die_in_the_middle)
    calls = [first + i for i, x in enumerate(lines) if "engine.all_reduce(t)" in x]
    return calls[0], calls[1]


_DIE_AT = _die_lines()


@pytest.mark.timeout(120)
def test_a_killed_rank_is_reported_dead_within_seconds_not_as_a_hang(tmp_path):
    # The collective timeout is 100 s: a report within seconds of the death comes from the launcher
    # seeing it, not from the waiting rank giving up. Timed from the death (process start-up on a
    # loaded machine is not what is measured).
    clock = tmp_path / "died-at"
    with pytest.raises(LaunchError) as failed:
        launch(_die_in_the_middle, str(clock), nproc=2, collective_timeout_s=100, timeout=110)
    took = time.time() - float(clock.read_text())
    text = str(failed.value)
    assert "rank 1 died with exit code -9" in text, text
    died_after = f"test_hang_report.py:{_DIE_AT[0]}"
    waiting_in = f"test_hang_report.py:{_DIE_AT[1]}"
    assert f"rank 0: it was in world all_reduce #2 ({waiting_in})" in text, text
    assert f"rank 1: its process died after world all_reduce #1 ({died_after})" in text, text
    assert took < 15, f"reported {took:.1f} s after the death"


def test_the_report_names_only_the_ranks_behind_the_collective():
    """`ledger.whereabouts` alone: a rank inside the collective the failed rank waits in reached it
    (it waits there too); a rank whose count in that group is lower never did; a rank outside the
    group is not asked about."""
    from shardwise.comm.ledger import Position, whereabouts

    def inside(group: str, seq: int, **counts: int) -> Position:
        return Position(True, group, "all_reduce", seq, "train.py:9", {group: seq, **counts})

    done = Position(False, "world", "all_reduce", 2, "train.py:8", {"world": 2})
    positions = {0: inside("world", 3), 1: inside("world", 3), 2: done, 3: inside("world", 3)}
    lines = whereabouts(positions, waiting=0, finished=set())
    assert [x for x in lines if "never reached" in x] == [
        "rank 2 never reached world all_reduce #3 (train.py:9): it had finished world all_reduce #2 (train.py:8) and was outside any shardwise collective "
        "(its stack dump says where)"
    ]
    assert "  rank 1: it was in world all_reduce #3 (train.py:9)" in lines and "  rank 3: it was in world all_reduce #3 (train.py:9)" in lines

    # A sub-group: rank 2 waits in dp0's second all_reduce; rank 0 is in it too, rank 3 (a member,
    # one behind) never reached it, rank 1 is not a member (no dp0 in its ledger).
    behind = Position(False, "dp0", "all_reduce", 1, "train.py:7", {"world": 1, "dp0": 1})
    positions = {0: inside("dp0", 2, world=1), 1: inside("world", 1), 2: inside("dp0", 2, world=1), 3: behind}
    lines = whereabouts(positions, waiting=2, finished={1})
    assert [x.split(":")[0] for x in lines if "never reached" in x] == ["rank 3 never reached dp0 all_reduce #2 (train.py"]
