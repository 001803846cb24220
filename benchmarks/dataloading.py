"""Data loading with 0, 1 and 2 worker processes: the Trainer against a plain DataLoader loop.

The digits recipe's data (scikit-learn's bundled digits) served sample by sample through a
map-style Dataset with a light augmentation (noise drawn in ``__getitem__``), as user data sets
are; the recipe's MLP, AdamW, global batch 64, one process. For each worker count, the
Trainer (``num_workers=N``) and a hand-written loop over ``DataLoader(num_workers=N,
persistent_workers=N > 0)`` run alternately ``--repeats`` times; the ratio of their median
samples per second is printed (1.00 = as fast as the plain loop; the Trainer also seeds each
sample so the run is the same with any number of workers, which the plain loop does not).

    python benchmarks/dataloading.py [--steps 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

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
    summary = shardwise.Trainer(
        optimizer=_optimizer, loss_fn=lambda out, b: F.cross_entropy(out, b[1]), global_batch_size=BATCH,
        max_steps=steps, num_workers=workers, progress_bar=False, log_every=50,
    ).fit(DigitsMLP(), data)
    return float(summary["samples_per_s"])


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="0,1,2")
    args = parser.parse_args()
    torch.set_num_threads(1)
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


if __name__ == "__main__":
    main()
