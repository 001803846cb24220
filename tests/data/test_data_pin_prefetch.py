"""The loader's data path: ``prefetch_factor`` bounds what a data-loading worker has fetched ahead of
the step, ``pin_memory`` pins only where CUDA exists (`pinning` says why not elsewhere), and bad
values are one clear error. Pinned batches on a GPU: tests/gpu/test_pinned.py."""

from __future__ import annotations

import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from shardwise.data import ShardedLoader, loader_options, pin, pinning
from shardwise.errors import ConfigError


class Logged(Dataset):
    """Appends each index it serves to a file: what the data-loading worker has fetched so far."""

    def __init__(self, path: Path, n: int = 96) -> None:
        self.path, self.n = path, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return torch.tensor([float(i)]), torch.tensor(i)


def _fetched(path: Path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


@pytest.mark.parametrize("k", [1, 3])
def test_prefetch_factor_bounds_the_micro_batches_a_worker_fetches_ahead(tmp_path, k):
    # One worker, micro-batches of 4 samples. Once the first micro-batch is taken, the worker has been
    # asked for that one and K more: exactly K + 1 micro-batches get fetched, and no more while the
    # step does not ask (torch's default of 2 would make it 3: K=1 sees too many, K=3 too few).
    log = tmp_path / "fetched.txt"
    loader = ShardedLoader(Logged(log), global_batch=4, num_workers=1, prefetch_factor=k, shuffle=False)
    try:
        first = next(iter(loader))
        assert first[0][1].tolist() == [0, 1, 2, 3]
        want = 4 * (k + 1)
        deadline = time.monotonic() + 30
        while _fetched(log) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # time for a worker that was asked for more to fetch it
        assert _fetched(log) == want, f"prefetch_factor={k}: fetched {_fetched(log)} samples, expected {want} (K+1 micro-batches of 4)"
    finally:
        loader.close()


def test_prefetch_factor_and_workers_are_checked_with_the_fix_named():
    data = TensorDataset(torch.zeros(8, 2))
    with pytest.raises(ConfigError, match=r"prefetch_factor=2 .* num_workers is 0: there are no workers .* Set num_workers >= 1"):
        ShardedLoader(data, global_batch=4, prefetch_factor=2)
    for bad in (0, -1, True, 2.5, "2"):
        with pytest.raises(ConfigError, match=rf"prefetch_factor must be a whole number >= 1 .*; got {bad!r}"):
            ShardedLoader(data, global_batch=4, num_workers=1, prefetch_factor=bad)
    with pytest.raises(ConfigError, match="num_workers must be a whole number >= 0"):
        ShardedLoader(data, global_batch=4, num_workers=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only machine's behaviour")
def test_pin_memory_without_cuda_is_ignored_and_the_batches_are_the_same():
    data = TensorDataset(torch.randn(16, 3), torch.arange(16))
    pinned, plain = ShardedLoader(data, global_batch=4, pin_memory=True), ShardedLoader(data, global_batch=4)
    assert pinned.pin_memory is False  # what the loader does: nothing to pin for
    for a, b in zip(pinned, plain, strict=True):
        assert all(torch.equal(x, y) and not x.is_pinned() for x, y in zip(a[0], b[0], strict=True))


def test_pinning_says_why_a_request_is_ignored(monkeypatch):
    assert pinning(False, torch.device("cpu")) == (False, None)
    assert pinning(True, torch.device("cuda", 0)) == (True, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pinning(True, torch.device("cpu")) == (False, "pin_memory needs CUDA; this machine has none, batches are not pinned")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine running on the CPU
    pinned, note = pinning(True, torch.device("cpu"))
    assert not pinned and note is not None and "trains on cpu (accelerator='cpu')" in note


def test_pin_follows_the_batch_structure(monkeypatch):
    # Without CUDA nothing can be page-locked: a stand-in for Tensor.pin_memory shows which tensors were
    # pinned and that tuples, named tuples, lists, dicts and objects with their own pin_memory keep their shape.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self + 100)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)

    class Own:
        def pin_memory(self) -> str:
            return "pinned"

    Pair = namedtuple("Pair", "x y")
    got = pin({"a": (torch.zeros(1), [torch.ones(1)]), "b": Pair(torch.zeros(1), 7), "c": Own(), "d": "text", "e": torch.zeros(1, device="meta")})
    assert isinstance(got["a"], tuple) and isinstance(got["a"][1], list) and isinstance(got["b"], Pair)
    assert got["a"][0].item() == 100 and got["a"][1][0].item() == 101 and got["b"].x.item() == 100 and got["b"].y == 7
    assert got["c"] == "pinned" and got["d"] == "text" and got["e"].device.type == "meta"  # only CPU tensors are pinned


def test_a_dataloaders_own_pin_memory_and_prefetch_factor_are_read():
    data = TensorDataset(torch.zeros(8, 2))
    assert loader_options(data) == (False, None)
    assert loader_options(DataLoader(data, batch_size=4)) == (False, None)
    assert loader_options(DataLoader(data, batch_size=4, num_workers=2, prefetch_factor=5)) == (False, 5)
    assert loader_options(DataLoader(data, batch_size=4, num_workers=2)) == (False, 2)  # torch's default
