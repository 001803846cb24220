"""shardwise.launch: results per rank, failures raised in the parent, hangs stopped."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shardwise import launch
from shardwise.errors import ConfigError, LaunchError


def _rank_and_sum() -> tuple[int, int, float, int]:
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t[0].item(), torch.get_num_threads()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    # Rank 0 waits in a collective its peer never joins: launch must stop it.
    dist.all_reduce(torch.ones(1))


def _sleep_forever() -> None:
    time.sleep(600)


def test_results_come_back_per_rank_with_one_thread_each():
    results = launch(_rank_and_sum, nproc=2, threads_per_proc=1)
    assert results == [(0, 2, 3.0, 1), (1, 2, 3.0, 1)]


def test_a_failing_rank_raises_its_own_exception_in_the_parent():
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank one") as info:
        launch(_fail_on_rank_one, nproc=2)
    assert "rank 1 failed" in str(info.value.__cause__)
    assert time.monotonic() - start < 60  # the peer blocked in all_reduce was stopped, not waited for


def test_a_hang_is_stopped_and_names_the_ranks():
    with pytest.raises(LaunchError, match=r"timed out after 3s; ranks still running: \[0, 1\]"):
        launch(_sleep_forever, nproc=2, timeout=3)


def test_bad_nproc_and_unpicklable_functions_are_clear_errors():
    with pytest.raises(ConfigError, match="nproc must be a whole number >= 1; got 0"):
        launch(_rank_and_sum, nproc=0)
    with pytest.raises(LaunchError, match="picklable"):
        launch(lambda: 1, nproc=1)
