"""Token shards on disk (`shardwise.data.files`, `shardwise.data.order`): packing and labels against a
hand computation, dtypes and refusals, the document mask, the epoch order's properties, and the
loader over shards with 0 and 2 workers bitwise."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from shardwise.data import ShardedLoader, TokenShards, draws_no_randomness, seeded_fetch, write_token_shards
from shardwise.data.files import document_mask
from shardwise.data.order import BlockOrder
from shardwise.errors import ConfigError


def _docs(n: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 64, rng.integers(1, 12)).tolist() for _ in range(n)]


def test_a_small_corpus_packs_into_the_blocks_written_out_by_hand(tmp_path):
    index = write_token_shards([[1, 2, 3], [4, 5], [6, 7, 8, 9]], tmp_path, sep=0)
    assert index["shards"] == [{"file": "shard-00000.npy", "tokens": 12}] and index["dtype"] == "uint16" and index["sep"] == 0
    assert json.loads((tmp_path / "index.json").read_text()) == index
    assert np.load(tmp_path / "shard-00000.npy").tolist() == [1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 0]
    data = TokenShards(tmp_path, 3)  # blocks of 4 tokens every 3: [1 2 3 0] [0 4 5 0] [0 6 7 8]; 9 0 left out
    assert len(data) == 3 and data.tail_tokens == 2 and "2 tokens left out" in repr(data)
    x, y = data[1]
    assert x.tolist() == [0, 4, 5] and y.tolist() == [4, 5, 0] and x.dtype == torch.long
    hf = TokenShards(tmp_path, 3, labels="hf")[2]
    assert hf["input_ids"].tolist() == hf["labels"].tolist() == [0, 6, 7]


@pytest.mark.parametrize("fmt", ["npy", "bin"])
def test_shards_hold_the_documents_in_order_and_blocks_are_every_seq_len_tokens(tmp_path, fmt):
    docs, sep, seq = _docs(), 0, 8
    index = write_token_shards(iter(docs), tmp_path, sep=sep, shard_tokens=50, format=fmt)
    flat = [t for d in docs for t in [*d, sep]]
    read = [np.load(tmp_path / s["file"]) if fmt == "npy" else np.fromfile(tmp_path / s["file"], np.uint16) for s in index["shards"]]
    assert np.concatenate(read).tolist() == flat and [len(r) for r in read] == [s["tokens"] for s in index["shards"]]
    for shard in read[:-1]:  # closed at the first document end at or past 50 tokens: documents whole
        seps = np.flatnonzero(shard == sep)
        assert seps[-1] == len(shard) - 1 and len(shard) >= 50 and seps[-2] + 1 < 50
    data = TokenShards(tmp_path, seq)
    expected = [r[j * seq : j * seq + seq + 1].tolist() for r in read for j in range((len(r) - 1) // seq)]
    assert len(data) == len(expected) and data.tail_tokens == sum((len(r) - 1) % seq for r in read)  # blocks share their last token
    for i, block in enumerate(expected):
        x, y = data[i]
        assert x.tolist() == block[:-1] and y.tolist() == block[1:]


def test_dtype_widens_every_shard_when_an_id_needs_it_and_refusals_say_why(tmp_path):
    docs = [[1, 2, 3], [4, 5, 6], [70_000, 7]]
    index = write_token_shards(docs, tmp_path / "auto", sep=0, shard_tokens=3)
    assert index["dtype"] == "uint32" and len(index["shards"]) == 3
    for s in index["shards"]:
        assert np.load(tmp_path / "auto" / s["file"]).dtype == np.uint32
    assert TokenShards(tmp_path / "auto", 2)[2][0].tolist() == [70_000, 7]
    with pytest.raises(ConfigError, match="fit the shards' dtype uint16.*70000"):
        write_token_shards(docs, tmp_path / "fixed", sep=0, dtype="uint16")
    with pytest.raises(ConfigError, match="already holds token shards"):
        write_token_shards(docs, tmp_path / "auto", sep=0)
    raw = tmp_path / "raw"
    raw.mkdir()
    np.arange(20, dtype=np.uint32).tofile(raw / "a.bin")
    with pytest.raises(ConfigError, match=r"raw \.bin shard.*dtype="):
        TokenShards(raw, 4)
    assert TokenShards(raw, 4, dtype="uint32")[1][0].tolist() == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match="document_mask=True.*no sep"):
        TokenShards(raw, 4, dtype="uint32", document_mask=True)
    with pytest.raises(ConfigError, match="no shard has a block"):
        TokenShards(raw, 40, dtype="uint32")
    assert list((tmp_path / "fixed").iterdir()) == []  # the refused write left nothing half-written
    with pytest.raises(ConfigError, match="holds uint32 tokens and dtype=uint16 was given"):
        TokenShards(tmp_path / "auto", 2, dtype="uint16")
    write_token_shards([[], []], tmp_path / "empty", sep=0)
    with pytest.raises(ConfigError, match="lists no shards"):
        TokenShards(tmp_path / "empty", 2)


def test_the_document_mask_is_block_diagonal_causal_with_positions_restarting():
    x = torch.tensor([5, 6, 0, 7, 0, 8, 9, 10])  # documents [5 6 0] [7 0] [8 9 10]
    mask, positions = document_mask(x, 0)
    doc = [0, 0, 0, 1, 1, 2, 2, 2]
    want = torch.tensor([[doc[i] == doc[j] and j <= i for j in range(8)] for i in range(8)])
    assert mask.shape == (1, 8, 8) and mask.dtype == torch.bool and torch.equal(mask[0], want)
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]


def test_a_document_mask_sample_carries_the_mask_and_positions(tmp_path):
    write_token_shards([[5, 6], [7]], tmp_path, sep=0)  # 5 6 0 7 0
    x, mask, positions, y = TokenShards(tmp_path, 4, document_mask=True)[0]
    assert x.tolist() == [5, 6, 0, 7] and y.tolist() == [6, 0, 7, 0] and positions.tolist() == [0, 1, 2, 0]
    assert mask[0, 3].tolist() == [False, False, False, True]
    hf = TokenShards(tmp_path, 4, labels="hf", document_mask=True)[0]
    assert sorted(hf) == ["attention_mask", "input_ids", "labels", "position_ids"] and torch.equal(hf["attention_mask"], mask)


def test_the_dataset_pickles_without_open_files_and_reads_the_same(tmp_path):
    write_token_shards(_docs(), tmp_path, sep=0, shard_tokens=60)
    data = TokenShards(tmp_path, 8)
    first = data[5]
    assert data._fds  # opened on first read
    copy = pickle.loads(pickle.dumps(data))
    assert copy._fds == {} and all(torch.equal(a, b) for a, b in zip(copy[5], first, strict=True))


class Noisy(TokenShards):
    """An augmentation over the blocks: draws from torch's global generator."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x + torch.randint(0, 2, x.shape), y


def test_only_the_class_that_reads_the_blocks_skips_the_per_sample_seeding(tmp_path):
    write_token_shards(_docs(), tmp_path, sep=0)
    assert draws_no_randomness(TokenShards(tmp_path, 4)) and not draws_no_randomness(Noisy(tmp_path, 4))
    noisy = Noisy(tmp_path, 4)
    a, b, c = (seeded_fetch(noisy, [3, 5, 7], None, 0, e)[0] for e in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)  # a function of (seed, epoch, index), as any dataset's


# -- the epoch order ------------------------------------------------------------------------------


COUNTS = [7, 0, 12, 3, 9]  # an empty shard too


def test_each_epoch_visits_every_block_once_and_seed_and_epoch_change_the_order():
    orders = {(s, e): list(BlockOrder(COUNTS, s, e, 5)) for s in (0, 1) for e in (0, 1)}
    for order in orders.values():
        assert sorted(order) == list(range(31))
    assert len({tuple(o) for o in orders.values()}) == 4
    one = [list(BlockOrder([30], 0, e, 30)) for e in (0, 1)]  # one shard: only the window can change it
    assert sorted(one[0]) == sorted(one[1]) and one[0] != one[1]


def test_a_window_shuffles_only_inside_a_run_of_the_concatenated_shards():
    plain = list(BlockOrder(COUNTS, 3, 2, 1))  # window 1: the shuffled shards, each in file order
    starts = np.concatenate([[0], np.cumsum(COUNTS)[:-1]])
    runs, at = [], 0
    while at < len(plain):
        k = int(np.searchsorted(starts, plain[at], side="right")) - 1
        while k < len(COUNTS) and COUNTS[k] == 0:
            k += 1
        assert plain[at : at + COUNTS[k]] == list(range(starts[k], starts[k] + COUNTS[k]))
        runs.append(k)
        at += COUNTS[k]
    assert sorted(runs) == [0, 2, 3, 4] and runs != [0, 2, 3, 4]
    window = 4
    order = BlockOrder(COUNTS, 3, 2, window)
    for w in range(0, 31, window):
        assert sorted(order[w : w + window]) == sorted(plain[w : w + window])
    assert list(order) != plain


def test_any_position_of_the_order_is_the_same_from_a_fresh_object_as_from_a_walk():
    walk = list(BlockOrder(COUNTS, 9, 4, 6))
    for i in (30, 0, 17, 6, 5, -1):
        assert BlockOrder(COUNTS, 9, 4, 6)[i] == walk[i]
    assert BlockOrder(COUNTS, 9, 4, 6)[11:23] == walk[11:23] and BlockOrder(COUNTS, 9, 4, 6)[1:30:7] == walk[1:30:7]
    with pytest.raises(IndexError):
        BlockOrder(COUNTS, 9, 4, 6)[31]


def test_the_loader_trains_the_datasets_own_order_at_any_world_size(tmp_path):
    write_token_shards(_docs(60), tmp_path, sep=0, shard_tokens=40)
    data = TokenShards(tmp_path, 4, shuffle_window=8)
    order = data.epoch_order(seed=2, epoch=1)
    for world in (1, 2, 4):
        loaders = [ShardedLoader(data, global_batch=8, world_size=world, rank=r, seed=2) for r in range(world)]
        for ld in loaders:
            ld.epoch = 1
        plans = [list(ld.index_plan()) for ld in loaders]
        for s in range(len(plans[0])):
            assert sorted(i for p in plans for micro in p[s] for i in micro) == sorted(order[s * 8 : (s + 1) * 8])


def _batches(data: TokenShards, workers: int, rank: int) -> list[torch.Tensor]:
    loader = ShardedLoader(data, global_batch=8, world_size=2, rank=rank, accumulate=2, seed=4, num_workers=workers)
    out: list[torch.Tensor] = []
    try:
        for _ in range(2):  # two epochs, one pool of workers
            out.extend(torch.cat(micro) for step in loader for micro in step)
    finally:
        loader.close()
    return out


def test_zero_and_two_workers_hand_out_the_same_batches_bitwise(tmp_path):
    write_token_shards(_docs(60), tmp_path, sep=0, shard_tokens=40)
    data = TokenShards(tmp_path, 4, shuffle_window=8)
    for rank in (0, 1):
        plain, pooled = _batches(data, 0, rank), _batches(data, 2, rank)
        assert len(plain) == len(pooled) > 8 and all(torch.equal(a, b) for a, b in zip(plain, pooled, strict=True))


def test_a_resume_whose_order_would_differ_is_refused(tmp_path):
    """The position is a place in one order: resumed with another shuffle window (or other shards) the rest of the
    epoch would train some blocks twice and skip others; refused, naming what to keep. The same order resumes."""
    write_token_shards(_docs(), tmp_path, sep=1, shard_tokens=200)
    first = ShardedLoader(TokenShards(tmp_path, 8, shuffle_window=32), global_batch=4)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    assert "window=32" in state["order_key"]
    same = ShardedLoader(TokenShards(tmp_path, 8, shuffle_window=32), global_batch=4)
    same.load_state_dict(state)
    assert same.step_in_epoch == 2
    other = ShardedLoader(TokenShards(tmp_path, 8, shuffle_window=16), global_batch=4)
    with pytest.raises(ConfigError, match=r"would not follow \(window 32 -> 16\).*twice.*same shards and shuffle_window"):
        other.load_state_dict(state)
