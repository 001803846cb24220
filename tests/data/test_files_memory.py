"""The mechanism behind "resident memory stays flat as the corpus grows": reading every block of a
64 MB shard through `TokenShards` (os.pread) leaves this process's resident set (RssAnon + RssFile,
/proc/self/status) within 16 MB of where it was; the same walk through an ``np.memmap`` kept open,
for contrast, maps the file's pages into the process (RssFile grows by about the file)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from shardwise.data import TokenShards

MB = 1 << 20
STATUS = Path("/proc/self/status")
pytestmark = pytest.mark.skipif(not STATUS.exists(), reason="reads /proc/self/status (Linux)")


def _rss() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in STATUS.read_text().splitlines())
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}


def _grew(before: dict[str, int]) -> dict[str, int]:
    now = _rss()
    return {k: now[k] - before[k] for k in now}


def test_reading_every_block_of_a_64mb_shard_keeps_the_resident_set_flat(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50_000, 32 * MB, dtype=np.uint16)  # 64 MB of uint16
    np.save(tmp_path / "shard.npy", tokens)
    del tokens
    gc.collect()
    data = TokenShards(tmp_path, 4095)  # 8 KB a block
    before, total, peak = _rss(), 0, 0
    for i in range(len(data)):
        total += int(data.block(i)[-1])
        if i % 512 == 0:
            peak = max(peak, sum(_grew(before).values()))
    peak = max(peak, sum(_grew(before).values()))
    assert len(data) == (32 * MB - 1) // 4095 and total > 0
    print(f"pread: +{peak / MB:.1f} MB")
    assert peak < 16 * MB, f"reading 64 MB through pread grew the resident set by {peak / MB:.1f} MB"

    # The contrast: a memory map held while reading. Its touched pages count in RssFile (they
    # are mapped into this process) until the map goes: a long-lived map over a corpus grows RSS with it.
    before = _rss()
    mapped = np.load(tmp_path / "shard.npy", mmap_mode="r")
    for i in range(0, len(mapped) - 4096, 4095):
        total += int(mapped[i + 4095])
    grew = _grew(before)
    assert grew["RssFile"] > 32 * MB, grew  # about the 64 MB file, unless the kernel reclaimed some
    print(f"memmap: RssFile +{grew['RssFile'] / MB:.1f} MB")
    del mapped
