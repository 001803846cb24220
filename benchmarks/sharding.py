"""Sharded data parallel side by side: per-rank model-state bytes (measured and the ZeRO formula)
and step time relative to ddp, for each stage at world sizes 1, 2 and 4, as one table.

The model is a stack of equal blocks (``--blocks`` x Linear(``--width``, ``--width``)), so
every tensor splits evenly and measured bytes should equal the formula exactly; fp32, AdamW.
Bytes are rank 0's, summed over its local tensors after the first optimizer step (the
moment parameters, gradients and optimizer state all exist). Step time is the median over
steps after ``--warmup`` (lazy initialisation and the first all-gathers excluded), on the
same machine in one run; on CPU with gloo it measures overhead, not a GPU cluster's speed.
The strategies run interleaved, ``--repeats`` rounds each in a rotated order (a machine that
slows down during the run weighs on every strategy alike); a strategy's step time is the
median over rounds, and its ratio to ddp the median of the per-round ratios (with their range).

    python benchmarks/sharding.py [--steps 30] [--width 512] [--blocks 8] [--worlds 1 2 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import shardwise
from shardwise.strategies.cost.memory import model_state_bytes, plain
from shardwise.strategies.sharded.zero1 import ModelStateProbe

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")


class Stack(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class StepTimer:
    """Times each step after the warm-up; for ddp (no memory section of its own) it measures the baseline bytes."""

    def __init__(self, warmup: int, baseline: bool) -> None:
        self.warmup, self.baseline = warmup, baseline
        self.times: list[float] = []
        self.last = 0.0
        self.probe = ModelStateProbe("ddp", 1)

    def on_fit_start(self, trainer: Any, engine: Any) -> None:
        if self.baseline:
            self.probe.attach(engine.unwrap(engine._model), engine._optimizer)
            self.probe.arm()
        self.last = time.perf_counter()

    def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        if step > self.warmup:
            self.times.append(now - self.last)
        self.last = now


def _run_world(width: int, blocks: int, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    world = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64 * 8, width, generator=g), torch.randint(0, width, (64 * 8,), generator=g))
    out: dict[str, Any] = {s: {"step_s": [], "world": world} for s in STRATEGIES}
    for round_ in range(repeats):
        shift = round_ % len(STRATEGIES)
        for strategy in STRATEGIES[shift:] + STRATEGIES[:shift]:
            timer = StepTimer(warmup, baseline=strategy == "ddp")
            trainer = shardwise.Trainer(strategy=strategy, optimizer=_adamw, loss_fn=_loss, global_batch_size=64, max_steps=steps,
                                        log_every=steps, progress_bar=False, callbacks=[timer])
            summary = trainer.fit(Stack(width, blocks), data)
            if "memory" not in out[strategy]:  # bytes do not depend on the round
                out[strategy]["memory"] = summary.get("memory_per_rank") or timer.probe.summary()["memory_per_rank"]
                out[strategy]["fsdp"] = summary.get("fsdp")
            out[strategy]["step_s"].append(statistics.median(timer.times))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every strategy (medians over rounds)")
    args = parser.parse_args()
    psi = args.blocks * (args.width * args.width + args.width)
    print(f"model: {args.blocks} x Linear({args.width}, {args.width}), Psi = {psi:,} parameters, fp32, AdamW; "
          f"baseline 16 Psi = {16 * psi / 2**20:.1f} MiB per rank; {torch.get_num_threads()} threads; torch {torch.__version__}")
    rows = []
    for world in args.worlds:
        result = shardwise.launch(_run_world, args.width, args.blocks, args.steps, args.warmup, args.repeats, nproc=world, threads_per_proc=1)[0]
        base = result["ddp"]["step_s"]
        for strategy in STRATEGIES:
            r = result[strategy]
            m = r["memory"]
            shape = f" {r['fsdp']['replicate']}x{r['fsdp']['shard']}" if strategy == "hsdp" else ""
            ratios = sorted(s / b for s, b in zip(r["step_s"], base))
            rows.append((world, strategy + shape, m["stage"], m["total"]["measured"], m["total"]["predicted"], m["total"]["ratio"],
                         m["params"]["measured"], m["grads"]["measured"], m["optimizer"]["measured"], statistics.median(r["step_s"]),
                         statistics.median(ratios), f"{ratios[0]:.2f}-{ratios[-1]:.2f}"))
    print()
    head = (f"{'world':>5} {'strategy':<10} {'stage':>5} {'measured MiB':>12} {'predicted MiB':>13} {'ratio':>6}   {'params':>7} {'grads':>7} {'optim':>7}"
            f"   {'step ms':>8} {'vs ddp':>7} {'range':>10}")
    print(head)
    print("-" * len(head))
    mib = 2**20
    for w, name, stage, meas, pred, ratio, p, g_, o, step_s, rel, spread in rows:
        print(f"{w:>5} {name:<10} {stage:>5} {meas / mib:>12.2f} {pred / mib:>13.2f} {ratio:>6.3f}   {p / mib:>7.2f} {g_ / mib:>7.2f} {o / mib:>7.2f}"
              f"   {step_s * 1e3:>8.1f} {rel:>6.2f}x {spread:>10}")
    # The formula the table is checked against (fp32 Adam, K = 8; zero2's shard is a master copy: K = 12).
    check = model_state_bytes(3, psi, 4, plain(4, 2))["total"] / mib
    print(f"\nZeRO-3 at N = 4 by formula: 16 Psi / 4 = {check:.2f} MiB")


if __name__ == "__main__":
    main()
