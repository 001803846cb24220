"""Data loading with 0, 1 and 2 worker processes: the Trainer against a plain DataLoader loop.

The digits recipe's data (scikit-learn's bundled digits) served sample by sample through a
map-style Dataset with a light augmentation (noise drawn in ``__getitem__``), as user data sets
are; the recipe's MLP, AdamW, global batch 64, one process. For each worker count, the
Trainer (``num_workers=N``) and a hand-written loop over ``DataLoader(num_workers=N,
persistent_workers=N > 0)`` run alternately ``--repeats`` times; the ratio of their median
samples per second is printed (1.00 = as fast as the plain loop; the Trainer also seeds each
sample so the run is the same with any number of workers, which the plain loop does not).

The streaming reader (issue 41): a corpus of token shards written by ``write_token_shards`` into a
temporary directory, read as blocks of ``--seq`` + 1 tokens, global batch 32, by (a) a plain
``DataLoader(shuffle=True)`` over a map-style dataset of ``np.memmap`` blocks, the way people write it
(the baseline), (b) ``TokenShards`` through shardwise's loader (``ShardedLoader``, the Trainer's), (c)
the same blocks as a stream (an ``IterableDataset`` yielding them in file order) through
``StreamLoader``, with 0 and 2 workers, alternately ``--repeats`` times: samples per second side by
side, each over the plain one; the loader alone (every batch fetched and collated, no model), and a
training step of a tiny language model (the Trainer against a plain loop). Then the packing cost:
``TokenShards(document_mask=True)`` (position ids and a block-diagonal mask per sample) over ``False``.

    python benchmarks/dataloading.py [--steps 300] [--repeats 3] [--parts digits,files]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

import shardwise
from shardwise.tools.recipes.digits import DigitsMLP, load_digits_split

BATCH = 64


class Digits(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.x, self.y = load_digits_split()[0].tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.05 * torch.randn(self.x.shape[1]), self.y[i]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-3)


def trainer_run(data: Dataset, steps: int, workers: int) -> float:
    torch.manual_seed(0)
    summary = _quiet_fit(
        optimizer=_optimizer,
        loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
        global_batch_size=BATCH,
        max_steps=steps,
        num_workers=workers,
        progress_bar=False,
        log_every=50,
        model=DigitsMLP(),
        data=data,
    )
    return float(summary["samples_per_s"])


def _quiet_fit(model: torch.nn.Module, data: Any, **settings: Any) -> dict[str, Any]:
    """``Trainer(**settings).fit(model, data)`` with its printed lines (settings, memory table) dropped: they would bury the table."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return shardwise.Trainer(**settings).fit(model, data)


def plain_run(data: Dataset, steps: int, workers: int) -> float:
    torch.manual_seed(0)
    model = DigitsMLP()
    opt = _optimizer(model.parameters())
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True, num_workers=workers, persistent_workers=workers > 0)
    done, start = 0, time.perf_counter()
    while done < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done % 50 == 0:
                loss.item()
            if done >= steps:
                break
    return steps * BATCH / (time.perf_counter() - start)


VOCAB, TOKEN_BATCH = 512, 32


def write_corpus(directory: Path, tokens: int, shards: int = 8) -> list[str]:
    """``tokens`` random token ids in documents of 50..2000 tokens, in ``shards`` shards; the shard files."""
    from shardwise.data.files import write_token_shards

    rng = np.random.default_rng(0)

    def docs() -> Iterator[np.ndarray]:
        left = tokens
        while left > 0:
            n = min(left, int(rng.integers(50, 2000)))
            yield rng.integers(1, VOCAB, size=n, dtype=np.int64)
            left -= n + 1

    index = write_token_shards(docs(), directory, sep=0, shard_tokens=max(1, tokens // shards))
    return [str(directory / s["file"]) for s in index["shards"]]


class MemmapBlocks(Dataset):  # type: ignore[type-arg]
    """The baseline: blocks of seq + 1 tokens over np.memmap'd shards, as a user writes it by hand."""

    def __init__(self, files: list[str], seq: int) -> None:
        self.arrays = [np.load(f, mmap_mode="r") for f in files]
        self.seq = seq
        self.ends = np.cumsum([(len(a) - 1) // seq for a in self.arrays])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = int(np.searchsorted(self.ends, i, side="right"))
        start = (i - (int(self.ends[k - 1]) if k else 0)) * self.seq
        block = torch.from_numpy(self.arrays[k][start : start + self.seq + 1].astype(np.int64))
        return block[:-1], block[1:]


class BlockStream(IterableDataset):  # type: ignore[type-arg]
    """The same blocks as a stream: every block of the shards, in file order (drawing nothing random)."""

    draws_no_randomness = True

    def __init__(self, blocks: Dataset) -> None:  # type: ignore[type-arg]
        self.blocks = blocks

    def __iter__(self) -> Iterator[Any]:
        return (self.blocks[i] for i in range(len(self.blocks)))  # type: ignore[arg-type]


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, *_: Any) -> torch.Tensor:
        return self.out(self.emb(x))  # type: ignore[no-any-return]


def lm_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), batch[-1].flatten())


def _timed(batches: Iterator[Any], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return steps * TOKEN_BATCH / (time.perf_counter() - start)


def _endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def plain_loader(files: list[str], seq: int, steps: int, workers: int, train: bool) -> float:
    loader = DataLoader(MemmapBlocks(files, seq), batch_size=TOKEN_BATCH, shuffle=True, drop_last=True, num_workers=workers, persistent_workers=workers > 0)
    if not train:
        return _timed(_endless(loader), steps)
    torch.manual_seed(0)
    model = TinyLM()
    opt = _optimizer(model.parameters())

    def stepped() -> Iterator[None]:
        for batch in _endless(loader):
            lm_loss(model(batch[0]), batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            yield None

    return _timed(stepped(), steps)


def shardwise_loader(data: Any, steps: int, workers: int, train: bool) -> float:
    from shardwise.data import ShardedLoader

    if train:
        summary = _quiet_fit(
            optimizer=_optimizer,
            loss_fn=lm_loss,
            global_batch_size=TOKEN_BATCH,
            max_steps=steps,
            num_workers=workers,
            progress_bar=False,
            log_every=50,
            model_summary=False,
            model=TinyLM(),
            data=data,
        )
        return float(summary["samples_per_s"])
    if isinstance(data, IterableDataset):
        from shardwise.data.stream import StreamLoader

        loader: Any = StreamLoader(data, global_batch=TOKEN_BATCH, num_workers=workers)
    else:
        loader = ShardedLoader(data, global_batch=TOKEN_BATCH, num_workers=workers)
    try:
        return _timed(_endless(loader), steps)
    finally:
        loader.close()


def _median_rates(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):  # alternately, so that a slow spell of a shared machine hits every contender
        for name, run in runs.items():
            rates[name].append(run())
    return {k: statistics.median(v) for k, v in rates.items()}


def files_part(args: argparse.Namespace) -> None:
    from shardwise.data.files import TokenShards

    with tempfile.TemporaryDirectory(prefix="sw-bench-") as tmp:
        files = write_corpus(Path(tmp), args.tokens)
        shards, packed = TokenShards(tmp, args.seq), TokenShards(tmp, args.seq, document_mask=True)
        stream = BlockStream(shards)
        print(
            f"\ntoken shards: {args.tokens:,} tokens in {len(files)} .npy shards, {len(shards):,} blocks of {args.seq}+1, batch {TOKEN_BATCH}, "
            f"{args.repeats} repeats (median samples/s; x = over the plain DataLoader over np.memmap)"
        )
        print(f"{'mode':>6} {'workers':>7} | {'plain':>8} | {'TokenShards':>11} {'x':>5} | {'StreamLoader':>12} {'x':>5}")
        for mode, steps in (("loader", args.file_steps), ("train", args.train_steps)):
            train = mode == "train"
            for w in (int(v) for v in args.workers.split(",")):
                r = _median_rates(
                    {
                        "plain": lambda w=w, s=steps, t=train: plain_loader(files, args.seq, s, w, t),
                        "files": lambda w=w, s=steps, t=train: shardwise_loader(shards, s, w, t),
                        "stream": lambda w=w, s=steps, t=train: shardwise_loader(stream, s, w, t),
                    },
                    args.repeats,
                )
                p = r["plain"]
                print(f"{mode:>6} {w:>7} | {p:>8.0f} | {r['files']:>11.0f} {r['files'] / p:>5.2f} | {r['stream']:>12.0f} {r['stream'] / p:>5.2f}", flush=True)
        print(f"\npacking cost (the loader alone, TokenShards through ShardedLoader, seq {args.seq}): document_mask off / on")
        for w in (int(v) for v in args.workers.split(",")):
            r = _median_rates(
                {"off": lambda w=w: shardwise_loader(shards, args.file_steps, w, False), "on": lambda w=w: shardwise_loader(packed, args.file_steps, w, False)},
                args.repeats,
            )
            print(f"workers {w}: off {r['off']:.0f}  on {r['on']:.0f} samples/s  (on / off {r['on'] / r['off']:.2f})", flush=True)


def digits_part(args: argparse.Namespace) -> None:
    data = Digits()
    print(f"digits, {len(data)} samples, batch {BATCH}, {args.steps} steps, {args.repeats} repeats (median)")
    print(f"{'workers':>7} | {'plain samples/s':>15} | {'trainer samples/s':>17} | trainer / plain")
    for w in (int(v) for v in args.workers.split(",")):
        plain, ours = [], []
        for _ in range(args.repeats):
            plain.append(plain_run(data, args.steps, w))
            ours.append(trainer_run(data, args.steps, w))
        p, o = statistics.median(plain), statistics.median(ours)
        print(f"{w:>7} | {p:>15.0f} | {o:>17.0f} | {o / p:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--parts", default="digits,files", help="digits (the Trainer against a plain loop), files (the streaming reader)")
    parser.add_argument("--tokens", type=int, default=1 << 25, help="corpus size of the files part, in tokens")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--file-steps", type=int, default=400, help="global batches the loader alone hands out per run")
    parser.add_argument("--train-steps", type=int, default=40, help="training steps per run of the files part")
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    if "digits" in parts:
        digits_part(args)
    if "files" in parts:
        files_part(args)


if __name__ == "__main__":
    main()
