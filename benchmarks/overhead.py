"""What shardwise costs over hand-written PyTorch, measured side by side in one run.

1. Trainer vs a hand-written loop: the digits MLP, 1 process (target <= 1.05x).
2. Trainer with ddp on 2 processes vs a hand-written DDP loop (target <= 1.03x).
3. ``from shardwise import Trainer, Engine, launch`` vs ``import torch`` (target <= +0.15 s).
4. The profiler when off (the default): what the loop's off-path adds to a step (its per-step
   checks and three shared ``nullcontext`` phase markers, timed in a loop of 100,000) against
   the Trainer's measured step (target <= 1.001x); and, for scale, the Trainer with
   ``profile=True`` (a 3-step window traced) against it off.

Each pair runs interleaved, ``--repeats`` times (A B, then B A, ...: a machine that slows
down or speeds up during the run weighs on both sides alike), and the ratio of medians is
printed with the median and range of the per-pair ratios.
Times cover the training loop only (steps, logging every 20 steps); both sides start
from the same model, data, optimizer and batch order rule (a fresh permutation each epoch).

    python benchmarks/overhead.py [--steps 600] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.tools.recipes.digits import DigitsMLP, accuracy, cross_entropy, load_digits_split

BATCH = 64
LOG_EVERY = 20


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-3, weight_decay=1e-4)


def hand_loop(steps: int, rank: int = 0, world: int = 1, ddp: bool = False) -> float:
    """The loop a careful user writes by hand: index the tensors, step, log now and then."""
    torch.manual_seed(0)
    train, _ = load_digits_split()
    x, y = train.tensors
    model: torch.nn.Module = DigitsMLP()
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = _optimizer(model.parameters())
    per_rank = BATCH // world
    per_epoch = len(x) // BATCH
    step, epoch = 0, 0
    start = time.perf_counter()
    recent: list[torch.Tensor] = []
    while step < steps:
        g = torch.Generator().manual_seed(epoch)
        perm = torch.randperm(len(x), generator=g)
        for i in range(per_epoch):
            idx = perm[i * BATCH + rank * per_rank : i * BATCH + (rank + 1) * per_rank]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            recent.append(loss.detach())
            step += 1
            if step % LOG_EVERY == 0:
                mean = torch.stack(recent).mean().reshape(1)
                if ddp:
                    dist.all_reduce(mean)
                _ = mean.item()
                recent.clear()
            if step >= steps:
                break
        epoch += 1
    return time.perf_counter() - start


def trainer_loop(steps: int, strategy: str = "single", **settings: Any) -> float:
    torch.manual_seed(0)
    train, _ = load_digits_split()
    trainer = shardwise.Trainer(
        strategy=strategy, global_batch_size=BATCH, max_steps=steps, log_every=LOG_EVERY,
        optimizer=_optimizer, loss_fn=cross_entropy, metrics={"accuracy": accuracy}, progress_bar=False, **settings,
    )
    summary = trainer.fit(DigitsMLP(), train)
    return float(summary["train_s"])


def _ddp_pair(steps: int, trainer_first: bool) -> tuple[float, float]:
    """Runs inside each of 2 launched processes: the hand DDP loop and the Trainer's, in the order given."""
    times = {}
    for side in (("ours", "hand") if trainer_first else ("hand", "ours")):
        dist.barrier()
        times[side] = trainer_loop(steps, "ddp") if side == "ours" else hand_loop(steps, dist.get_rank(), dist.get_world_size(), ddp=True)
    return times["hand"], times["ours"]


def profiler_off_path_s(n: int = 100_000) -> float:
    """Seconds per step of what the Trainer's loop runs for the profiler when it is off: two
    ``if profiler is not None`` checks and the three phase markers (the loop's own `_no_phase`)."""
    from shardwise.trainer.loop import _no_phase

    profiler = None
    phase = _no_phase
    start = time.perf_counter()
    for _ in range(n):
        if profiler is not None:
            raise AssertionError
        with phase("data"):
            pass
        with phase("forward_backward"):
            pass
        with phase("optimizer"):
            pass
        if profiler is not None:
            raise AssertionError
    return (time.perf_counter() - start) / n


def profiled_loop(steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        return trainer_loop(steps, profile=True, out=out)


def import_time(statement: str) -> float:
    """Seconds ``statement`` takes in a fresh interpreter (one run)."""
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def interleaved(a: Any, b: Any, repeats: int) -> tuple[list[float], list[float]]:
    """Run ``a()`` and ``b()`` ``repeats`` times each, alternating which goes first; their times."""
    ta: list[float] = []
    tb: list[float] = []
    for i in range(repeats):
        if i % 2 == 0:
            ta.append(a())
            tb.append(b())
        else:
            tb.append(b())
            ta.append(a())
    return ta, tb


def paired(ours: list[float], base: list[float]) -> str:
    """Median and range of the per-pair ratios ours / base."""
    r = sorted(o / b for o, b in zip(ours, base))
    return f"pairs: median {statistics.median(r):.3f}x, range {r[0]:.3f}-{r[-1]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []

    trainer_loop(50), hand_loop(50)  # warm up (first-call costs)
    hand_t, ours_t = interleaved(lambda: hand_loop(args.steps), lambda: trainer_loop(args.steps), args.repeats)
    rows.append(("Trainer vs hand loop, 1 process", ours_t, hand_t, "<= 1.05x"))

    hand_d, ours_d = [], []
    for i in range(args.repeats):
        # Inside each launch the two loops alternate which runs first, launch by launch.
        results = shardwise.launch(_ddp_pair, args.steps, i % 2 == 1, nproc=2, threads_per_proc=1)
        hand_d.append(max(r[0] for r in results))
        ours_d.append(max(r[1] for r in results))
    rows.append(("Trainer ddp vs hand DDP, 2 processes", ours_d, hand_d, "<= 1.03x"))

    off_path = statistics.median(profiler_off_path_s() for _ in range(5))
    step_s = statistics.median(ours_t) / args.steps
    plain_p, prof_p = interleaved(lambda: trainer_loop(args.steps), lambda: profiled_loop(args.steps), args.repeats)
    rows.append(("Trainer profile=True vs off, 1 process", prof_p, plain_p, "(for scale)"))

    # `import shardwise` alone loads nothing (public names are lazy); what a user pays is
    # torch plus the trainer stack, so that is what is compared with `import torch`.
    torch_i, ours_i = interleaved(lambda: import_time("import torch"), lambda: import_time("from shardwise import Trainer, Engine, launch"), args.repeats)
    torch_s, ours_s = statistics.median(torch_i), statistics.median(ours_i)
    extra = sorted(o - t for o, t in zip(ours_i, torch_i))

    print(f"\n{args.steps} steps, global batch {BATCH}, median of {args.repeats} interleaved runs, 1 thread per process\n")
    print(f"{'comparison':40s} {'shardwise s':>12s} {'hand s':>10s} {'ratio':>8s}  target")
    for name, ours, hand, target in rows:
        o, h = statistics.median(ours), statistics.median(hand)
        print(f"{name:40s} {o:12.3f} {h:10.3f} {o / h:7.3f}x  {target}  ({paired(ours, hand)})")
    print(f"{'profiler off: its checks in a step':40s} {step_s + off_path:12.6f} {step_s:10.6f} {(step_s + off_path) / step_s:7.4f}x  <= 1.001x"
          f"  ({off_path * 1e9:.0f} ns a step, against the Trainer's {step_s * 1e3:.3f} ms step)")
    print(f"{'from shardwise import Trainer vs torch':40s} {ours_s:12.3f} {torch_s:10.3f} {ours_s - torch_s:+7.3f}s  <= +0.15 s"
          f"  (pairs: median {statistics.median(extra):+.3f}s, range {extra[0]:+.3f} to {extra[-1]:+.3f}s)")


if __name__ == "__main__":
    main()
