"""`BlockOrder`'s windows are shuffled each by a permutation of its own: the same local shuffle in every window
(a seed that leaves out the window) still visits every block once, but it is a weaker, periodic shuffle."""

from __future__ import annotations

from shardwise.data.order import BlockOrder


def test_each_window_has_its_own_permutation() -> None:
    order = BlockOrder([64], seed=3, epoch=0, window=16)  # one shard: the concatenation is the file order
    offsets = [tuple(b - 16 * w for b in order[16 * w : 16 * (w + 1)]) for w in range(4)]
    assert sorted(offsets[0]) == list(range(16))
    assert len(set(offsets)) == 4, f"windows share one permutation: {offsets}"
