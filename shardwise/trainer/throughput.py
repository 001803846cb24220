"""A run's throughput: samples, tokens and model FLOPs per second of step time, and MFU.

The model's FLOPs are counted once, in the caller's process before launch (`count_for_fit`, on the meta
device: `shardwise.strategies.cost.flops.count`), through the Trainer's own loss path, and travel to
the workers with the trainer (``trainer._flops``). Each rank's `Rates` turns them into rates: every
rate divides by the step time, the training time less what ``torch.compile`` spent compiling
(`shardwise.strategies.compiling.Tracker.seconds`), and a log window's rates less the window's
compile seconds. MFU is the achieved FLOP/s over the peak of every device of the run
(`shardwise.strategies.cost.flops.peak_for`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.strategies.cost import flops as flopcount

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer

__all__ = ["Rates", "count_for_fit", "end_line"]


def count_for_fit(trainer: Trainer, model: nn.Module, sample: Any) -> dict[str, Any] | None:
    """The model's FLOPs per sample on ``sample`` (a batch of the training data) through the Trainer's loss
    path (``loss_fn``, a ``training_step``, or the model's own loss), as a dict for the workers; None
    without a sample (an empty data set, a stream read only in the workers)."""
    if sample is None:
        return None
    from shardwise.trainer.fit import make_step_fn  # fit imports this module

    return flopcount.count(model, sample, make_step_fn(trainer.loss_fn, model)).to_json()


class Rates:
    """One rank's rates: per log window (`window`) and for the whole run (`summary`)."""

    def __init__(self, counted: dict[str, Any] | None, peak: float | None, peak_source: str, devices: int, tracker: Any, global_batch: int) -> None:
        self.counted, self.peak, self.peak_source = counted, peak, peak_source
        self.devices, self.tracker, self.global_batch = devices, tracker, global_batch
        self.flops_per_step = None if counted is None or counted["flops_per_sample"] is None else counted["flops_per_sample"] * global_batch
        self.window_mark = self.start_mark = self.end_mark = self.compile_s()

    @classmethod
    def start(cls, trainer: Trainer, engine: Engine, global_batch: int) -> Rates:
        """The rates of a fit about to train: the trainer's count, this device's peak, the engine's compile tracker."""
        peak, source = flopcount.peak_for(engine.device, trainer.config.precision, trainer.config.peak_tflops)
        return cls(trainer._flops, peak, source, engine.world_size, engine.compiled, global_batch)

    def compile_s(self) -> float:
        return float(self.tracker.seconds()) if self.tracker is not None else 0.0

    def stop(self) -> None:
        """The end of training: compile seconds after it (a final evaluation's) are no step's."""
        self.end_mark = self.compile_s()

    def _rates(self, steps: int, seconds: float, seq: int) -> dict[str, Any]:
        """Rates of ``steps`` steps in ``seconds`` of step time; ``seq``: tokens per sample of the batches trained on."""
        seconds = max(seconds, 1e-9)
        out: dict[str, Any] = {"samples_per_s": steps * self.global_batch / seconds}
        tokens = self.tokens_per_step(seq)
        out["tokens_per_s"] = steps * tokens / seconds if tokens else None
        flops_per_s = steps * self.flops_per_step / seconds if self.flops_per_step is not None else None
        out["flops_per_s"] = flops_per_s
        out["mfu"] = flops_per_s / (self.peak * self.devices) if flops_per_s is not None and self.peak else None
        return out

    def tokens_per_step(self, seq: int) -> int:
        """Global batch x T where the batch's input is token ids (padding counts), else 0."""
        has_ids = self.counted["tokens_per_sample"] > 0 if self.counted is not None else seq > 0
        return self.global_batch * seq if has_ids else 0

    def window(self, steps: int, seconds: float, seq: int) -> dict[str, Any]:
        """A log record's rates: ``steps`` since the last log in ``seconds`` of wall time, less the window's compile."""
        now = self.compile_s()
        compiled, self.window_mark = now - self.window_mark, now
        rates = self._rates(steps, seconds - compiled, seq)
        return {k: v for k, v in rates.items() if v is not None and k != "flops_per_s"}

    def summary(self, steps: int, train_s: float, seq: int) -> dict[str, Any]:
        """The summary's keys: samples_per_s, tokens_per_s, flops_per_step, flops_method, flops_per_s, mfu, throughput."""
        compile_s = self.end_mark - self.start_mark
        step_s = train_s - compile_s
        rates = self._rates(steps, step_s, seq)
        counted = self.counted or {}
        return {
            "samples_per_s": rates["samples_per_s"],
            "tokens_per_s": rates["tokens_per_s"],
            "flops_per_step": self.flops_per_step,
            "flops_method": counted.get("method", "not counted (no sample of the training data in the parent)"),
            "flops_per_s": rates["flops_per_s"],
            "mfu": rates["mfu"],
            "throughput": {
                "step_s": step_s,
                "compile_s": compile_s,
                "tokens_per_step": self.tokens_per_step(seq) or None,
                "peak_flops_per_s": self.peak,
                "peak_source": self.peak_source,
                "devices": self.devices,
                "count_s": counted.get("seconds"),
            },
        }


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
