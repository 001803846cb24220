"""A launch whose ranks' process group breaks while it forms (gloo's full-mesh connect: "Connection closed by peer",
seen now and then on a loaded machine) starts its ranks once more, on a new port, where no rank had got past the
join; any other failure, a second broken join, or a failure once the function ran is raised as before.

The failure is planted in rank 0 by the launched function's own module (tests/launcher/_flaky_join.py), whose
top-level code runs in each rank before the rank joins."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise import launch
from shardwise.errors import LaunchError
from tests.launcher import _flaky_join

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]
AGAIN = "starting them again on a new port"


def test_a_group_that_broke_while_forming_is_started_again_and_the_launch_returns(tmp_path: Path, monkeypatch, capfd) -> None:
    marker = tmp_path / "failed-once"
    monkeypatch.setenv("FLAKY_JOIN", f"once:{marker}")
    assert launch(_flaky_join.rank, nproc=2) == [0, 1]
    assert marker.exists()  # rank 0 of the first start did fail
    err = capfd.readouterr().err
    assert err.count(AGAIN) == 1, err
    assert "connectFullMesh" in err and "no rank had started the function" in err


def test_a_second_broken_join_is_raised_with_the_launcher_s_message(monkeypatch, capfd) -> None:
    monkeypatch.setenv("FLAKY_JOIN", "always")
    with pytest.raises(LaunchError, match="rank 0 of 2 could not join the process group at 127.0.0.1:.*connectFullMesh"):
        launch(_flaky_join.rank, nproc=2)
    assert capfd.readouterr().err.count(AGAIN) == 1  # once, not again and again


def test_a_join_that_failed_for_another_reason_is_not_started_again(monkeypatch, capfd) -> None:
    monkeypatch.setenv("FLAKY_JOIN", "other")
    with pytest.raises(LaunchError, match="could not join the process group.*getaddrinfo failed"):
        launch(_flaky_join.rank, nproc=2)
    assert AGAIN not in capfd.readouterr().err


def test_a_failure_after_the_join_is_never_started_again_even_if_it_reads_like_a_broken_join(monkeypatch, capfd) -> None:
    monkeypatch.delenv("FLAKY_JOIN", raising=False)
    with pytest.raises(LaunchError, match="connectFullMesh"):
        launch(_flaky_join.fails_after_joining, nproc=2)
    assert AGAIN not in capfd.readouterr().err  # the function had run: starting it again would repeat its work
