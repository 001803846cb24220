"""What the per-step non-finite check costs (`shardwise.trainer.nonfinite`), measured side by side.

The digits recipe (its MLP, data, loss and optimizer) trained by the Trainer in one process, with the
check as it runs by default (the loss and every gradient through ``isfinite``; one read of a 3-number
tensor a step) and with the check replaced by one that returns at once. The two run interleaved,
``--repeats`` times (A B, then B A, ...), and the medians of the per-step times are printed with
their ratio. Printed, never asserted.

    python benchmarks/nonfinite.py [--steps 300] [--repeats 5] [--clip 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from shardwise import Trainer
from shardwise.tools.recipes import get_recipe
from shardwise.trainer import nonfinite


def _run(steps: int, clip: float | None) -> float:
    torch.manual_seed(0)
    parts = get_recipe("digits").parts(None)
    trainer = Trainer(
        optimizer=parts.optimizer,
        loss_fn=parts.loss_fn,
        global_batch_size=64,
        max_steps=steps,
        log_every=20,
        clip_grad_norm=clip,
        progress_bar=False,
        model_summary=False,
        announce_outputs=False,
    )
    summary = trainer.fit(parts.model, parts.train)
    return float(summary["train_s"]) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clip", type=float, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    real = nonfinite.NonFiniteCheck.verdict

    def off(self: Any, step: int, loss: torch.Tensor) -> None:
        return None

    on_times, off_times = [], []
    _run(20, args.clip)  # warm-up: first-call costs on neither side
    for r in range(args.repeats):
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            nonfinite.NonFiniteCheck.verdict = real if side == "on" else off  # type: ignore[method-assign]
            (on_times if side == "on" else off_times).append(_run(args.steps, args.clip))
    nonfinite.NonFiniteCheck.verdict = real  # type: ignore[method-assign]
    on, off_ = statistics.median(on_times), statistics.median(off_times)
    print(f"digits, 1 process, {args.steps} steps x {args.repeats} repeats, clip_grad_norm={args.clip}")
    print(f"  step with the check    {on * 1e6:8.1f} us  (range {min(on_times) * 1e6:.1f}-{max(on_times) * 1e6:.1f})")
    print(f"  step without it        {off_ * 1e6:8.1f} us  (range {min(off_times) * 1e6:.1f}-{max(off_times) * 1e6:.1f})")
    print(f"  cost of the check      {(on - off_) * 1e6:8.1f} us a step, ratio {on / off_:.3f}")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"  ({time.perf_counter() - start:.0f} s)")
