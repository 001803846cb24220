"""No rank of a launch starts its function before every rank has joined the process group (`env.all_joined`).

Gloo's full-mesh connect can return on one rank while its peer is still completing its side; a rank that went on,
ran a function with no collective and exited closed the connection under that peer, which then failed to join
("Connection closed by peer"): the zygote tests' recurring failure in full suites. Here rank 0's join is made
1.5 s slow (tests/launcher/_slow_join.py, run in the rank before it joins); rank 1 must not start before it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise import launch
from tests.launcher import _slow_join

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def test_no_rank_starts_its_function_before_every_rank_joined(tmp_path: Path, monkeypatch) -> None:
    joined = tmp_path / "rank-0-joined"
    monkeypatch.setenv("SLOW_JOIN", str(joined))
    starts = launch(_slow_join.started, nproc=2)
    rank0_joined = float(joined.read_text())
    assert starts[0] >= rank0_joined
    assert starts[1] >= rank0_joined, f"rank 1 started {rank0_joined - starts[1]:.2f}s before rank 0 had joined"


def test_launches_whose_functions_run_no_collective_all_return() -> None:
    """Many short launches in a row, each function only reading the rank (the zygote tests' shape)."""
    for _ in range(5):
        assert launch(_slow_join.started, nproc=2)[1] > 0
