"""A run's throughput: samples, tokens and model FLOPs per second of step time, and MFU.

The model's FLOPs are counted once, in the caller's process before launch (`count_for_fit`, on the meta
device: `shardwise.strategies.cost.flops.count`), through the Trainer's own loss path, and travel to
the workers with the trainer (``trainer._flops``). Each rank's `Rates` turns them into rates: every
rate divides by the step time, the training time less what ``torch.compile`` spent compiling
(`shardwise.strategies.compiling.Tracker.seconds`), the largest such time over the loop's ranks (a rank
that compiles faster waits for the slowest inside the first step). MFU is the achieved FLOP/s over the
peak of every device of the run (`shardwise.strategies.cost.flops.peak_for`), never above 1: a run that
does more than the peak says the peak is low (a CPU's measured under load), and the report raises it.

Token models (token ids in the batch) follow the batches actually trained: each step's tokens are this
rank's (B, T) summed over its micro-batches, times the global batch over this rank's samples, and the
FLOPs are the counted FLOPs per token times those tokens (exact for fixed-length data; approximate where
lengths vary, the attention term growing with T).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.data.batches import call_model
from shardwise.strategies.cost import flops as flopcount

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer

__all__ = ["Rates", "count_for_fit", "end_line"]


def count_for_fit(trainer: Trainer, model: nn.Module, sample: Any) -> dict[str, Any] | None:
    """The model's FLOPs per sample on ``sample`` (a batch of the training data) through the Trainer's loss
    path (``loss_fn``, a ``training_step``, or the model's own loss), as a dict for the workers; None
    without a sample (an empty data set, a stream read only in the workers). The step is built for the
    module it is called with (the meta copy): a ``training_step``'s ``self(...)`` calls the copy."""
    if sample is None:
        return None
    from shardwise.trainer.fit import make_step_fn  # fit imports this module

    def step(module: nn.Module, batch: Any) -> Any:
        if trainer.loss_fn is not None:
            # The user's loss_fn is not run here: it may act on what it is handed (a distillation loss moved its
            # teacher to the output's device: meta, in this process); its work is element-wise, which the
            # counter does not count. Backward from the outputs' sum costs what backward from the loss costs.
            return _output_sum(call_model(module, batch))
        return make_step_fn(None, module)(module, batch)

    return flopcount.count(model, sample, step).to_json()


def _output_sum(output: Any) -> torch.Tensor:
    """The sum of every floating tensor in a model's output (a tensor, a tuple, a dict, a ModelOutput)."""
    from torch.utils._pytree import tree_leaves

    leaves = [t for t in tree_leaves(dict(output) if isinstance(output, dict) else output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError(f"the model's output ({type(output).__name__}) holds no floating tensor to differentiate")
    return torch.stack([t.float().sum() for t in leaves]).sum()


class Rates:
    """One rank's rates: per log window (`window`) and for the whole run (`summary`). ``longest(seconds)``:
    the largest of every loop rank's ``seconds`` (one all-reduce; identity in one process)."""

    def __init__(
        self,
        counted: dict[str, Any] | None,
        peak: float | None,
        peak_source: str,
        devices: int,
        tracker: Any,
        global_batch: int,
        longest: Callable[[float], float] | None = None,
    ) -> None:
        self.counted, self.peak, self.peak_source = counted, peak, peak_source
        self.devices, self.tracker, self.global_batch = devices, tracker, global_batch
        self.longest = longest or (lambda s: s)
        self.per_sample = None if counted is None else counted["flops_per_sample"]
        self.seq0 = int(counted["tokens_per_sample"]) if counted is not None else 0  # T of the counted sample
        self.tokens = self.window_tokens = 0.0  # global tokens trained this run, and since the last log
        self.window_mark = self.start_mark = self.end_mark = self.compile_s()

    @classmethod
    def start(cls, trainer: Trainer, engine: Engine, global_batch: int) -> Rates:
        """The rates of a fit about to train: the trainer's count, this device's peak, the engine's compile tracker."""
        import torch

        def longest(seconds: float) -> float:
            return float(engine.all_reduce(torch.tensor([seconds], dtype=torch.float64, device=engine.device), "max").item())

        peak, source = flopcount.peak_for(engine.device, trainer.config.precision, trainer.config.peak_tflops)
        return cls(trainer._flops, peak, source, engine.world_size, engine.compiled, global_batch, longest)

    def compile_s(self) -> float:
        return float(self.tracker.seconds()) if self.tracker is not None else 0.0

    def saw(self, micro: list[Any]) -> None:
        """One step's micro-batches on this rank: its tokens, scaled to the global batch (every rank's T
        taken to be this rank's), where the batches hold token ids."""
        tokens = samples = 0
        for batch in micro:
            ids = flopcount.token_ids(batch)
            if ids is not None:
                tokens += ids.shape[0] * ids.shape[1]
                samples += ids.shape[0]
        if samples:
            step_tokens = self.global_batch * (tokens / samples)
            self.tokens += step_tokens
            self.window_tokens += step_tokens

    def stop(self) -> None:
        """The end of training: compile seconds after it (a final evaluation's) are no step's."""
        self.end_mark = self.compile_s()

    def _samples(self, steps: int, tokens: float) -> float:
        """Samples of the counted sample's length that ``steps`` steps of ``tokens`` tokens amount to: ``tokens / T``
        where the count and the steps had token ids (exactly the samples trained where lengths are fixed), else
        the samples trained."""
        return tokens / self.seq0 if self.seq0 and tokens else float(self.global_batch * steps)

    def _rates(self, steps: int, seconds: float, tokens: float) -> dict[str, Any]:
        """Rates of ``steps`` steps in ``seconds`` of step time that trained ``tokens`` tokens; an MFU above 1
        takes the achieved FLOP/s as the peak (`raised`)."""
        seconds = max(seconds, 1e-9)
        out: dict[str, Any] = {"samples_per_s": steps * self.global_batch / seconds, "tokens_per_s": tokens / seconds if tokens else None}
        flops_per_s = out["flops_per_s"] = self.per_sample * self._samples(steps, tokens) / seconds if self.per_sample is not None else None
        out["mfu"] = flops_per_s / self.raised(flops_per_s) if flops_per_s is not None and self.peak else None
        return out

    def raised(self, flops_per_s: float) -> float:
        """The run's peak (every device's) for a report of ``flops_per_s``: the achieved rate where it is more (the
        peak is at least what was done: a CPU's figure measured under load is low)."""
        return max((self.peak or 0.0) * self.devices, flops_per_s)

    def window(self, steps: int, seconds: float, compiled: float | None = None) -> dict[str, Any]:
        """A log record's rates: ``steps`` since the last log in ``seconds`` of wall time, less the window's
        compile seconds: ``compiled`` (the largest over the loop's ranks, where the caller reduced them), or
        this rank's (`window_compile`)."""
        own = self.window_compile()
        self.window_mark += own
        rates = self._rates(steps, _step_time(seconds, own if compiled is None else compiled, own), self.window_tokens)
        self.window_tokens = 0.0
        return {k: v for k, v in rates.items() if v is not None and k != "flops_per_s"}

    def window_compile(self) -> float:
        """This rank's compile seconds since the last log record."""
        return self.compile_s() - self.window_mark

    def summary(self, steps: int, train_s: float) -> dict[str, Any]:
        """The summary's keys: samples_per_s, tokens_per_s, flops_per_step, flops_method, flops_per_s, mfu,
        throughput. Collective: the compile seconds are the largest over the loop's ranks (`longest`)."""
        own = self.end_mark - self.start_mark
        compile_s = self.longest(own)
        step_s = _step_time(train_s, compile_s, own)
        rates = self._rates(steps, step_s, self.tokens)
        counted = self.counted or {}
        peak, source = self.peak, self.peak_source
        if rates["flops_per_s"] is not None and peak and rates["flops_per_s"] > peak * self.devices:
            peak = rates["flops_per_s"] / self.devices
            source += f"; raised to {peak:.4g} FLOP/s, what this run achieved per device (the figure was lower: measured under load, or not this device's)"
        per_step = self.tokens / steps if steps and self.tokens else None
        return {
            "samples_per_s": rates["samples_per_s"],
            "tokens_per_s": rates["tokens_per_s"],
            "flops_per_step": None if self.per_sample is None else self.per_sample * (self._samples(steps, self.tokens) / max(steps, 1)),
            "flops_method": counted.get("method", "not counted (no sample of the training data in the parent)"),
            "flops_per_s": rates["flops_per_s"],
            "mfu": rates["mfu"],
            "throughput": {
                "step_s": step_s,
                "compile_s": compile_s,
                "tokens_per_step": (int(per_step) if per_step.is_integer() else per_step) if per_step else None,
                "peak_flops_per_s": peak,
                "peak_source": source,
                "devices": self.devices,
                "count_s": counted.get("seconds"),
            },
        }


def _step_time(wall: float, compiled: float, own: float) -> float:
    """``wall`` less ``compiled`` (the slowest rank's compile seconds), or less this rank's ``own`` where the
    slowest's do not fit in this rank's ``wall`` (it started its clock after they began)."""
    return wall - compiled if wall - compiled > 0 else wall - own


def end_line(summary: dict[str, Any]) -> str:
    """The end-of-run line's rates: ``tokens_per_s ..  mfu 41.2%  (compile 12.3s)``, each where known."""
    parts = []
    if isinstance(summary.get("tokens_per_s"), float):
        parts.append(f"tokens_per_s {summary['tokens_per_s']:.4g}")
    if isinstance(summary.get("mfu"), float):
        parts.append(f"mfu {100 * summary['mfu']:.1f}%")
    compile_s = (summary.get("throughput") or {}).get("compile_s") or 0.0
    if summary.get("compile"):
        parts.append(f"(compile {compile_s:.1f}s)")
    return "  ".join(parts)
