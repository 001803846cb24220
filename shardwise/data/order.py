"""An epoch's order over a corpus of shards, without O(corpus) memory (`TokenShards.epoch_order`).

``ShardedLoader`` shuffles a map-style dataset with ``randperm(n)``: 8 bytes a sample, and for a
corpus of billions of tokens in blocks of 1,024 that is tens of MB per rank, regenerated each epoch.
`BlockOrder` is the order of a sharded corpus computed instead of stored: the shards in a
permutation seeded by (seed, epoch), each shard's blocks in file order after one another, then
windows of ``window`` consecutive positions, each permuted by a generator seeded by
(seed, epoch, window index). Every block appears exactly once per epoch; memory is O(window +
shards); any position costs one window's permutation (O(window)), cached, so a resume at any
position is O(1) in the corpus size and a sequential walk costs O(1) a position.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


def _rng(*key: int) -> np.random.Generator:
    """A NumPy generator seeded by a tuple of integers (any sign): the same key, the same stream."""
    return np.random.default_rng([k & 0xFFFFFFFFFFFFFFFF for k in key])


class BlockOrder:
    """Epoch ``epoch``'s order of the blocks of shards holding ``counts[k]`` blocks each.

    ``order[i]`` is the global block id (shards numbered in their given order, blocks
    consecutively) trained at position ``i``; ``order[a:b]`` a list. ``window=1`` keeps the
    blocks of each shard in file order (only the shards are shuffled)."""

    def __init__(self, counts: Sequence[int], seed: int, epoch: int, window: int) -> None:
        counts_arr = np.asarray(counts, dtype=np.int64)
        self.n = int(counts_arr.sum())
        self.seed, self.epoch, self.window = int(seed), int(epoch), max(1, int(window))
        starts = np.concatenate([[0], np.cumsum(counts_arr)[:-1]])  # first global id of each shard
        shards = _rng(self.seed, self.epoch).permutation(len(counts_arr))
        self._shard_start = starts[shards]  # the global id of each position-shard's first block
        self._ends = np.cumsum(counts_arr[shards])  # where each shard ends in the concatenation
        self._cached: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.n

    def _concatenated(self, p: np.ndarray) -> np.ndarray:
        """Global ids at positions ``p`` of the shuffled shards' blocks, concatenated (no window)."""
        k = np.searchsorted(self._ends, p, side="right")
        before = np.where(k > 0, self._ends[np.maximum(k - 1, 0)], 0)
        return self._shard_start[k] + (p - before)

    def _window(self, w: int) -> np.ndarray:
        """Positions (in the concatenation) that window ``w`` visits, in its permuted order."""
        if self._cached is not None and self._cached[0] == w:
            return self._cached[1]
        start = w * self.window
        size = min(self.window, self.n - start)
        visit = start + _rng(self.seed, self.epoch, w, 1).permutation(size)
        self._cached = (w, visit)
        return visit

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            return self._run(start, stop) if step == 1 else [self._at(j) for j in range(start, stop, step)]
        j = int(i) + self.n if int(i) < 0 else int(i)
        if not 0 <= j < self.n:
            raise IndexError(f"position {i} of an epoch of {self.n} blocks")
        return self._at(j)

    def _at(self, j: int) -> int:
        w, r = divmod(j, self.window)
        return int(self._concatenated(self._window(w)[r : r + 1])[0])

    def _run(self, start: int, stop: int) -> list[int]:
        """Positions ``[start, stop)``: a slice of at most two windows for a micro-batch, vectorized."""
        parts, j = [], start
        while j < stop:
            w, r = divmod(j, self.window)
            take = min(stop - j, self.window - r)
            parts.append(self._window(w)[r : r + take])
            j += take
        return [int(x) for x in self._concatenated(np.concatenate(parts))] if parts else []

    def __iter__(self) -> Iterator[int]:
        for w in range(-(-self.n // self.window)):
            yield from (int(x) for x in self._concatenated(self._window(w)))

    def __repr__(self) -> str:
        return f"BlockOrder({self.n} blocks, {len(self._ends)} shards, seed={self.seed}, epoch={self.epoch}, window={self.window})"
