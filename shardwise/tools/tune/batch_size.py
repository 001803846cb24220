"""The batch-size finder: the largest micro-batch whose training steps fit a memory budget.

A micro-batch is what one rank feeds one forward and backward: the global batch divided by the
data-parallel degree (from the strategy's plan) and by ``accumulate``. Each size is tried in fresh
worker processes, a few training steps of the Trainer with the caller's model, data, loss,
optimizer and strategy, so nothing a larger trial allocated is still held when a smaller one is
measured (an allocator keeps freed memory; a fresh process starts clean):

- on a GPU, a size fits when no rank ran out of CUDA memory and, with a budget, every rank's peak
  of the memory the caching allocator held (``torch.cuda.max_memory_reserved``) is within it;
- on a CPU, the user gives the budget, and a size fits when every rank's peak resident memory
  (Linux ``VmHWM`` of ``/proc/self/status``, else ``getrusage``'s ``ru_maxrss``) is within it. That
  peak is the whole process (the interpreter, torch, the data set, the model state) plus the
  step's activations, which is what a machine's memory must hold.

Peaks of fresh processes at one size vary by a few MiB (the allocator's arenas and pages), so
near the budget's edge a size can fit where the next smaller one did not; the search assumes
fitting is monotone and reports every size it tried.

The search doubles the size from 1 until a size does not fit (or the data set caps it: one global
batch must not exceed the training set), then bisects between the last size that fit and the
first that did not, so the answer ``b`` fits and ``b + 1`` was tried and did not (unless capped).
Every trial also reports its throughput: samples per second over the steps after the first (the
first carries one-off costs such as allocator growth and lazy initialization).

>>> result = find_batch_size(trainer, model, train_set, memory_budget="2GB")   # doctest: +SKIP
>>> result.micro_batch, [(t.micro_batch, t.fits) for t in result.trials]          # doctest: +SKIP
(40, [(1, True), (2, True), ..., (64, False), (32, True), (48, False), (40, True), (44, False), ...])
"""

from __future__ import annotations

import contextlib
import io
import re
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.data import unpack_data
from shardwise.data.stream import is_stream, stream_length
from shardwise.errors import ConfigError
from shardwise.launcher.env import detect_env
from shardwise.launcher.spawn import launch
from shardwise.strategies import get_strategy
from shardwise.trainer import Trainer

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``"2GB"`` (decimal units), ``"1.5GiB"`` (binary units), ``"512MiB"``, or a number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"a memory budget is a number with a unit (B, KB, MB, GB, TB, or KiB, MiB, GiB, TiB), e.g. 2GB or 512MiB; got {text!r}")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"a memory budget must be more than 0 bytes; got {text!r}")
    return size


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class Trial:
    """One size tried."""

    micro_batch: int
    global_batch: int
    fits: bool
    peak_bytes: int | None
    """The largest peak over the ranks (resident memory on CPU, reserved CUDA memory on GPU); None when it ran out of memory."""
    samples_per_s: float | None
    """Throughput over the steps after the first; None when it did not run."""
    out_of_memory: bool = False


@dataclass(frozen=True)
class BatchSizeResult:
    micro_batch: int
    """The largest micro-batch per rank that fit."""
    global_batch: int
    """The global batch it makes: ``micro_batch x data-parallel degree x accumulate``."""
    device: str
    budget_bytes: int | None
    capped_by_data: bool
    """True when the search stopped at the largest global batch the training set holds, not at the budget."""
    trials: list[Trial] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        head = f"{'micro-batch':>11}  {'global':>7}  {'peak memory':>12}  {'samples/s':>10}  fits"
        lines = [head]
        for t in sorted(self.trials, key=lambda t: t.micro_batch):
            peak = "out of memory" if t.out_of_memory else format_bytes(t.peak_bytes or 0)
            rate = f"{t.samples_per_s:.4g}" if t.samples_per_s is not None else "-"
            lines.append(f"{t.micro_batch:>11}  {t.global_batch:>7}  {peak:>12}  {rate:>10}  {'yes' if t.fits else 'no'}")
        return "\n".join(lines)


class _StepClock:
    """The trial's callback: when each step ended (perf_counter), for the throughput."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_step_end(self, trainer: Trainer, engine: Any, step: int, loss: torch.Tensor) -> None:
        self.ends.append(time.perf_counter())


def peak_resident_bytes() -> int:
    """This process's peak resident memory (Linux ``VmHWM``; ``ru_maxrss`` elsewhere)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB on Linux


def _trial(template: Trainer, model: nn.Module, train_data: Any, global_batch: int, steps: int) -> dict[str, Any]:
    """One rank of one trial, in a fresh worker: a few training steps, then this process's peak memory."""
    clock = _StepClock()
    config = template.config.probe(steps, global_batch_size=global_batch)
    trainer = Trainer(config=config, optimizer=template.optimizer_factory, loss_fn=template.loss_fn, lr_scheduler=template.lr_scheduler, callbacks=[clock])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # a trial's log lines are noise here
        trainer.fit(model, train_data)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    peak = torch.cuda.max_memory_reserved() if cuda else peak_resident_bytes()
    timed = clock.ends
    rate = (len(timed) - 1) * global_batch / (timed[-1] - timed[0]) if len(timed) > 1 and timed[-1] > timed[0] else None
    return {"peak_bytes": int(peak), "samples_per_s": rate, "device": "cuda" if cuda else "cpu"}


def largest_fitting(fits: Callable[[int], bool], cap: int) -> tuple[int, int | None]:
    """The largest size ``<= cap`` for which ``fits`` holds, given that 1 fits and that fitting is
    monotone: double from 1 until a size fails (or ``cap`` is reached), then bisect. Returns it and
    the smallest size tried that failed (None when every size tried fit, up to ``cap``)."""
    lo, hi = 1, None
    while lo < cap:
        size = min(2 * lo, cap)
        if not fits(size):
            hi = size
            break
        lo = size
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def _uses_cuda(accelerator: str) -> bool:
    return accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())


def _check_settings(accelerator: str, memory_budget: str | int | None, steps: int) -> tuple[bool, int | None]:
    """Whether the trials run on GPU and the budget in bytes; a `ConfigError` for what cannot run."""
    on_gpu = _uses_cuda(accelerator)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    if budget is None and not on_gpu:
        raise ConfigError("on a CPU the batch-size finder needs a memory budget (memory_budget='2GB', --memory-budget 2GB): peak resident memory per process")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ConfigError(f"the batch-size finder needs steps >= 2 per trial (the first is not timed); got {steps!r}")
    if detect_env().distributed:
        raise ConfigError("the batch-size finder starts fresh processes for every size it tries; run it alone (not under torchrun, srun or another launcher)")
    return on_gpu, budget


def _data_cap(dataset: Any, per_micro: int, max_batch: int | None) -> tuple[int | None, int]:
    """(the data's size or None for a stream without ``__len__``, the largest micro-batch the data allows)."""
    size = stream_length(dataset) if is_stream(dataset) else len(dataset)
    if size is None and max_batch is None:
        raise ConfigError(
            f"the training data is a stream without __len__ ({type(dataset).__name__}): the finder cannot cap the micro-batch by the "
            "data's size; give max_batch=N (the largest micro-batch per rank to try)"
        )
    cap = size // per_micro if size is not None else max_batch
    assert cap is not None
    return size, cap


def find_batch_size(
    trainer: Trainer,
    model: nn.Module,
    train_data: Any,
    *,
    memory_budget: str | int | None = None,
    steps: int = 8,
    max_batch: int | None = None,
    verbose: bool = True,
) -> BatchSizeResult:
    """The largest micro-batch per rank whose steps fit ``memory_budget`` (see the module docstring).

    ``memory_budget``: bytes or a string such as ``"2GB"``; required on CPU, optional on GPU
    (without it a size fits when it does not run out of CUDA memory). ``steps``: training steps
    per trial (at least 2: the first is not timed). ``max_batch``: the largest micro-batch to try.
    """
    cfg = trainer.config
    on_gpu, budget = _check_settings(cfg.accelerator, memory_budget, steps)
    dataset, _, _, _ = unpack_data(train_data)
    layout = get_strategy(cfg.strategy, **cfg.strategy_options).plan(cfg.nproc, model=model, mesh=cfg.mesh)
    per_micro = layout.data_parallel * cfg.accumulate  # samples in a global batch per sample of a micro-batch
    size, cap = _data_cap(dataset, per_micro, max_batch)
    if max_batch is not None:
        cap = min(cap, max_batch)
    if cap < 1:
        raise ConfigError(f"the training set has {size} samples, fewer than one micro-batch per rank ({per_micro} ranks x accumulate); use more data")
    trials: dict[int, Trial] = {}
    errors = Path(tempfile.mkdtemp(prefix="shardwise-batch-size-"))

    def fits(micro: int) -> bool:
        global_batch = micro * per_micro
        try:
            ranks = launch(
                _trial,
                trainer,
                model,
                train_data,
                global_batch,
                steps,
                nproc=cfg.nproc,
                accelerator="cpu" if cfg.accelerator == "cpu" else "auto",
                collective_timeout_s=cfg.timeout_s,
                error_dir=errors,
            )
        except torch.OutOfMemoryError:
            trials[micro] = Trial(micro, global_batch, False, None, None, out_of_memory=True)
        else:
            done = [r for r in ranks if r is not None]
            peak = max(r["peak_bytes"] for r in done)
            rate = done[0]["samples_per_s"]
            trials[micro] = Trial(micro, global_batch, budget is None or peak <= budget, peak, rate)
        if verbose:
            t = trials[micro]
            peak_text = "out of memory" if t.out_of_memory else f"peak {format_bytes(t.peak_bytes or 0)}"
            rate_text = f", {t.samples_per_s:.4g} samples/s" if t.samples_per_s is not None else ""
            print(f"micro-batch {micro:>6} (global {global_batch}): {peak_text}{rate_text}: {'fits' if t.fits else 'does not fit'}", flush=True)
        return trials[micro].fits

    try:
        if not fits(1):
            t = trials[1]
            what = "runs out of CUDA memory" if t.out_of_memory else f"peaks at {format_bytes(t.peak_bytes or 0)} per process"
            raise ConfigError(
                f"the memory budget {memory_budget} ({format_bytes(budget or 0)}) is too small for a micro-batch of 1, which {what}; "
                "raise the budget, or shrink the model (a smaller width, fewer layers) or shard it (--strategy zero3)"
            )
        lo, hi = largest_fitting(fits, cap)
    finally:
        shutil.rmtree(errors, ignore_errors=True)
    return BatchSizeResult(
        micro_batch=lo,
        global_batch=lo * per_micro,
        device="cuda" if on_gpu else "cpu",
        budget_bytes=budget,
        capped_by_data=hi is None and size is not None and lo == size // per_micro,
        trials=[trials[k] for k in trials],
    )
