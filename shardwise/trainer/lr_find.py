"""The learning-rate range test: sweep the rate up over a short run, suggest where the loss falls fastest.

Smith (2017), "Cyclical Learning Rates for Training Neural Networks" (WACV; arXiv:1506.01186,
2015), section 3.3, estimates the usable learning rates by training a few iterations while the
rate rises from a low to a high value and reading off where the training curve starts to
improve and where it turns ragged or worse. We run that test on the Trainer's own fit loop:

- the rate rises geometrically, ``lr_i = min_lr * (max_lr / min_lr) ** (i / (steps - 1))`` for
  step ``i = 0 .. steps-1`` (Smith's section 3.3 raises it linearly; a geometric sweep gives
  every decade the same number of steps), through a ``LambdaLR`` scheduler on the optimizer the
  Trainer's factory builds, so it runs under every strategy, on every rank;
- each step's loss is the mean over the loop's ranks (one all-reduce, what the Trainer logs),
  smoothed by an exponential moving average with the bias correction of Kingma and Ba (2015),
  "Adam: A Method for Stochastic Optimization", section 3: ``m_t = b m_{t-1} + (1-b) loss_t``,
  ``smoothed_t = m_t / (1 - b^t)`` (so the first value is the first loss, not ``(1-b)`` of it);
- the run stops early once the smoothed loss exceeds ``diverge`` times its lowest value so far,
  or a loss is not finite (every rank decides the same from the same reduced numbers);
- the suggestion is the rate at the steepest descent of the smoothed loss against ``log10(lr)``
  (central differences), among the steps before the smoothed loss reached its lowest point and
  after the first ``skip_start`` (where the average still rests on a handful of losses).

Nothing of the caller's is changed: the sweep trains a fresh Trainer built from the caller's
settings (no run directory, no checkpoints, no validation, loggers or profiler, only the sweep's
callback), and the
model's parameters, buffers, gradients, ``training`` flags and the process's torch and Python
random states are put back afterwards, bit for bit. The Trainer's optimizer is a factory, so the
sweep's optimizer is its own and the caller's is built fresh by the next ``fit``.

>>> result = trainer.tune_lr(model, train_set, min_lr=1e-5, max_lr=1.0, steps=100, png="lr.png")  # doctest: +SKIP
>>> result.suggestion                                                                             # doctest: +SKIP
0.0034
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.launcher.env import detect_env

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer


def sweep_lrs(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """The rate of each step of the sweep: geometric from ``min_lr`` (step 0) to ``max_lr`` (the last)."""
    if steps == 1:
        return [min_lr]
    ratio = max_lr / min_lr
    return [min_lr * ratio ** (i / (steps - 1)) for i in range(steps)]


def smooth(losses: Sequence[float], beta: float) -> list[float]:
    """Exponential moving average with bias correction (Kingma and Ba 2015, section 3)."""
    out, avg = [], 0.0
    for t, loss in enumerate(losses, 1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta**t))
    return out


def slopes(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """dy/dx at each point: central differences inside, one-sided at the two ends."""
    n = len(xs)
    if n < 2:
        return [0.0] * n
    out = []
    for i in range(n):
        lo, hi = max(i - 1, 0), min(i + 1, n - 1)
        out.append((ys[hi] - ys[lo]) / (xs[hi] - xs[lo]))
    return out


def steepest_index(lrs: Sequence[float], smoothed: Sequence[float], skip_start: int) -> int:
    """Index of the steepest descent of ``smoothed`` against ``log10(lr)``, searched from ``skip_start``
    up to the lowest smoothed loss (a descent after the minimum is noise on a rising curve)."""
    if not smoothed:
        raise ValueError("no losses to choose from")
    lowest = min(range(len(smoothed)), key=lambda i: smoothed[i])
    start = min(skip_start, lowest)
    grads = slopes([math.log10(x) for x in lrs], smoothed)
    return min(range(start, lowest + 1), key=lambda i: grads[i])


def diverged(smoothed: float, best: float, diverge: float) -> bool:
    """The stop rule: a smoothed loss that is not finite, or above ``diverge`` times the best so far."""
    return not math.isfinite(smoothed) or smoothed > diverge * best


@dataclass(frozen=True)
class LRFindResult:
    """What the range test measured and suggests."""

    lrs: list[float]
    """The rate each recorded step trained with."""
    losses: list[float]
    """Each step's loss, the mean over the loop's ranks."""
    smoothed: list[float]
    """The bias-corrected moving average of ``losses``."""
    suggestion: float
    """The rate at the steepest descent of ``smoothed`` (against log10 of the rate)."""
    suggestion_index: int
    """Which step that is."""
    stopped_early: bool
    """True when the loss diverged before the last step of the sweep."""
    min_lr: float
    max_lr: float
    steps: int
    png: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ExponentialSweep:
    """Scheduler factory of the sweep (picklable: workers build it on their optimizer): a ``LambdaLR``
    that multiplies every group's starting rate so that group 0 trains at ``sweep_lrs(...)[i]`` at step i."""

    def __init__(self, min_lr: float, max_lr: float, steps: int) -> None:
        self.min_lr, self.max_lr, self.steps = min_lr, max_lr, steps
        self.optimizer: torch.optim.Optimizer | None = None

    def __call__(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        base = float(optimizer.param_groups[0]["lr"])
        if not base > 0:
            raise ConfigError(f"the learning-rate range test scales the optimizer's rate, which must be > 0; the optimizer factory gave lr={base}")
        self.optimizer = optimizer
        lo, ratio, last = self.min_lr, self.max_lr / self.min_lr, max(self.steps - 1, 1)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lo * ratio ** (min(i, last) / last) / base)

    def current_lr(self) -> float:
        assert self.optimizer is not None, "the sweep's scheduler was not built"
        return float(self.optimizer.param_groups[0]["lr"])


class SweepMonitor:
    """The sweep's callback: every step, the loss reduced over the loop's ranks, the rate it trained
    with, the smoothed loss and the stop rule. Every rank keeps the rows (they are the same
    numbers everywhere); rank 0 also appends them to ``path`` for a parent that launched workers."""

    def __init__(self, path: str | None, beta: float, diverge: float) -> None:
        self.path, self.beta, self.diverge = path, beta, diverge
        self.rows: list[tuple[float, float]] = []
        self._avg, self._best, self._lr = 0.0, math.inf, 0.0

    def _sweep(self, trainer: Trainer) -> ExponentialSweep:
        sweep = trainer.lr_scheduler
        assert isinstance(sweep, ExponentialSweep), "the sweep's Trainer runs the sweep's scheduler"
        return sweep

    def on_fit_start(self, trainer: Trainer, engine: Engine) -> None:
        self._lr = self._sweep(trainer).current_lr()  # the rate of the first step (the scheduler set it)

    def on_train_step_end(self, trainer: Trainer, engine: Engine, step: int, loss: torch.Tensor) -> None:
        value = float(engine.all_reduce(loss.detach().double().reshape(1).to(engine.device), "mean").item())
        used, self._lr = self._lr, self._sweep(trainer).current_lr()  # the scheduler has stepped: that is the next step's rate
        self.rows.append((used, value))
        if self.path is not None and engine.is_rank_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "lr": used, "loss": value if math.isfinite(value) else None}) + "\n")
        t = len(self.rows)
        self._avg = self.beta * self._avg + (1 - self.beta) * value
        smoothed = self._avg / (1 - self.beta**t)
        if diverged(smoothed, self._best, self.diverge):
            trainer.should_stop = True
        self._best = min(self._best, smoothed)


def check_settings(min_lr: float, max_lr: float, steps: int, beta: float, diverge: float) -> None:
    """The range test's settings, refused in one line each before anything runs."""
    if not 0 < min_lr < max_lr:
        raise ConfigError(f"the range test needs 0 < min_lr < max_lr; got min_lr={min_lr}, max_lr={max_lr}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 3:
        raise ConfigError(f"the range test needs steps >= 3 to find a slope; got {steps!r}")
    if not 0 <= beta < 1:
        raise ConfigError(f"smoothing must be in [0, 1) (the moving average's weight of the past); got {beta}")
    if not diverge > 1:
        raise ConfigError(f"diverge must be > 1 (stop when the smoothed loss exceeds diverge x its best); got {diverge}")


class _Snapshot:
    """The model's tensors (their dtype and device too), gradients, modes, and the random states."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {n: (p.data.clone(), None if p.grad is None else p.grad.clone(), p.requires_grad) for n, p in model.named_parameters()}
        self.buffers = {n: b.clone() for n, b in model.named_buffers()}
        self.modes = {n: m.training for n, m in model.named_modules()}
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        self.py_rng = random.getstate()

    def restore(self, model: nn.Module) -> None:
        for n, p in model.named_parameters():
            data, grad, requires_grad = self.params[n]
            p.data = data
            p.grad = grad
            p.requires_grad_(requires_grad)
        for n, b in model.named_buffers():
            b.data = self.buffers[n]
        for n, m in model.named_modules():
            m.training = self.modes[n]
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)


def lr_find(
    trainer: Trainer,
    model: nn.Module,
    train_data: Any,
    *,
    min_lr: float = 1e-6,
    max_lr: float = 1.0,
    steps: int = 100,
    smoothing: float = 0.9,
    diverge: float = 4.0,
    skip_start: int | None = None,
    png: str | None = None,
) -> LRFindResult:
    """Run the learning-rate range test with ``trainer``'s settings and strategy; see the module docstring.

    ``smoothing`` is the moving average's ``b`` (0.9: about the last ten steps count);
    ``skip_start`` the first steps left out of the search (default ``steps // 10``); ``png`` a
    picture of loss against rate (needs matplotlib, the ``plot`` extra; drawn on rank 0). The
    model and the process's random states are left as they were.
    """
    check_settings(min_lr, max_lr, steps, smoothing, diverge)
    if png is not None:
        _pyplot()  # a missing matplotlib is said before the sweep runs, not after
    snapshot = _Snapshot(model)
    with tempfile.TemporaryDirectory(prefix="shardwise-lr-find-") as tmp:
        rows_path = str(Path(tmp) / "rows.jsonl")
        monitor = SweepMonitor(rows_path, smoothing, diverge)
        config = trainer.config.probe(steps)
        sweep = type(trainer)(  # a fresh Trainer of the caller's class (this module is imported by the loop, not the other way)
            config=config,
            optimizer=trainer.optimizer_factory,
            loss_fn=trainer.loss_fn,
            lr_scheduler=ExponentialSweep(min_lr, max_lr, steps),
            callbacks=[monitor],
        )
        try:
            sweep.fit(model, train_data)
        finally:
            snapshot.restore(model)
        rows = monitor.rows or _read_rows(rows_path)  # in this process, or written by the workers' rank 0
    if not rows:
        raise ConfigError("the range test recorded no step (an empty data set?)")
    result = summarize(
        [lr for lr, _ in rows], [loss for _, loss in rows], min_lr=min_lr, max_lr=max_lr, steps=steps, smoothing=smoothing, skip_start=skip_start
    )
    if png is not None and detect_env().rank == 0:
        result = LRFindResult(**{**result.to_dict(), "png": plot_lr_find(result, png)})
    return result


def _read_rows(path: str) -> list[tuple[float, float]]:
    if not Path(path).exists():
        return []
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(float(r["lr"]), math.nan if r["loss"] is None else float(r["loss"])) for r in rows]


def summarize(
    lrs: Sequence[float], losses: Sequence[float], *, min_lr: float, max_lr: float, steps: int, smoothing: float, skip_start: int | None = None
) -> LRFindResult:
    """The result of a sweep from its per-step rates and losses (a trailing non-finite loss dropped)."""
    finite = [i for i, loss in enumerate(losses) if math.isfinite(loss)]
    keep = finite[-1] + 1 if finite else 0
    if keep == 0 or not all(math.isfinite(x) for x in losses[:keep]):
        raise ConfigError(f"the range test's loss was not finite from the start ({list(losses[:3])}); lower min_lr")
    lrs, losses = list(lrs[:keep]), list(losses[:keep])
    smoothed = smooth(losses, smoothing)
    index = steepest_index(lrs, smoothed, steps // 10 if skip_start is None else skip_start)
    return LRFindResult(
        lrs=lrs,
        losses=losses,
        smoothed=smoothed,
        suggestion=lrs[index],
        suggestion_index=index,
        stopped_early=keep < steps,
        min_lr=min_lr,
        max_lr=max_lr,
        steps=steps,
    )


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("the range test's PNG needs matplotlib (pip install 'shardwise[plot]'); without png=... (--png '') it needs nothing") from None
    return plt


def plot_lr_find(result: LRFindResult, path: str) -> str:
    """Loss against learning rate (log x): each step's loss, the smoothed loss, the suggestion marked."""
    plt = _pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(result.lrs, result.losses, color="0.7", linewidth=1, label="loss per step")
    ax.plot(result.lrs, result.smoothed, color="tab:blue", linewidth=2, label="smoothed loss")
    i = result.suggestion_index
    ax.axvline(result.suggestion, color="tab:red", linestyle="--", linewidth=1)
    ax.plot([result.suggestion], [result.smoothed[i]], "o", color="tab:red", label=f"suggested lr {result.suggestion:.2g} (steepest descent)")
    ax.set_xscale("log")
    # The diverging tail would flatten the useful part: cap the view a little above the start.
    top = max(result.smoothed[: max(i, 1)] + [result.smoothed[0]]) * 1.25
    bottom = min(result.smoothed + result.losses)
    ax.set_ylim(bottom - 0.05 * (top - bottom), top)
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("training loss")
    stop = ", stopped early: the loss diverged" if result.stopped_early else ""
    ax.set_title(f"learning-rate range test: {len(result.lrs)} of {result.steps} steps{stop}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)
