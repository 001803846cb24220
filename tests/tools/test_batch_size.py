"""The batch-size finder's search and its refusals, without processes (the trials themselves: tests/tools/test_tuners.py)."""

from __future__ import annotations

import pytest

from shardwise.errors import ConfigError
from shardwise.tools.tune.batch_size import format_bytes, largest_fitting, parse_bytes


def search(limit: int, cap: int) -> tuple[int, int | None, list[int]]:
    """``largest_fitting`` where sizes up to ``limit`` fit; also the sizes it tried, in order."""
    tried: list[int] = []

    def fits(size: int) -> bool:
        tried.append(size)
        return size <= limit

    lo, hi = largest_fitting(fits, cap)
    return lo, hi, tried


def test_doubling_then_bisecting_finds_the_largest_size_and_its_failing_neighbour():
    # By hand: 2 4 8 16 32 fit, 64 fails; bisecting 32..64: 48 fails, 40 fails, 36 fits, 38 fails, 37 fits.
    assert search(37, 1000) == (37, 38, [2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37])
    assert search(64, 1000) == (64, 65, [2, 4, 8, 16, 32, 64, 128, 96, 80, 72, 68, 66, 65])
    assert search(1, 1000) == (1, 2, [2])


def test_the_cap_ends_the_search_when_everything_fits():
    assert search(10**6, 100) == (100, None, [2, 4, 8, 16, 32, 64, 100])
    assert search(10**6, 1) == (1, None, [])
    assert search(70, 100) == (70, 71, [2, 4, 8, 16, 32, 64, 100, 82, 73, 68, 70, 71])


def test_budgets_read_as_decimal_or_binary_units():
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("2 gb") == 2 * 10**9
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("512MiB") == 2**29 and parse_bytes(4096) == 4096 and parse_bytes("4096") == 4096
    assert format_bytes(3 * 2**29) == "1.50 GiB" and format_bytes(100 * 10**6) == "95.37 MiB"


@pytest.mark.parametrize("text", ["2 parsecs", "GB", "-1GB", "0", ""])
def test_a_bad_budget_is_one_line(text):
    with pytest.raises(ConfigError, match="memory budget"):
        parse_bytes(text)
