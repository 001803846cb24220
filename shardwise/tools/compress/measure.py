"""What a compressed model is measured by: bytes on disk, latency per batch, loss and metrics.

Sizes are the bytes ``torch.save`` writes for the state dict (what a user ships). Latency is the
median over repeats of one forward pass of one batch under ``torch.inference_mode``, after
warm-up, at a given number of intra-op threads (1, and every core torch uses by default). The
validation figures are sample-weighted means over the whole validation set, batch by batch, with
the recipe's own loss and metrics.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader


def saved_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of ``torch.save(state)``."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getbuffer().nbytes


def batches(data: Any, batch_size: int) -> list[Any]:
    """The validation set as a list of batches, in order (no shuffling)."""
    return list(DataLoader(data, batch_size=batch_size, shuffle=False))


@torch.inference_mode()
def evaluate(model: nn.Module, data: Iterable[Any], loss_fn: Callable[[Any, Any], Any], metrics: Mapping[str, Callable[[Any, Any], Any]]) -> dict[str, float]:
    """``{"val_loss": ..., "val_<metric>": ...}``: sample-weighted means over the batches."""
    model.eval()
    totals: dict[str, float] = {}
    n = 0
    for batch in data:
        out = model(batch[0])
        size = len(batch[0])
        values = {"val_loss": loss_fn(out, batch), **{f"val_{k}": fn(out, batch) for k, fn in metrics.items()}}
        for k, v in values.items():
            totals[k] = totals.get(k, 0.0) + float(v) * size
        n += size
    return {k: v / n for k, v in totals.items()}


@torch.inference_mode()
def latency_ms(model: nn.Module, inputs: torch.Tensor, threads: int, repeats: int = 30, warmup: int = 5) -> float:
    """Median milliseconds of ``model(inputs)`` over ``repeats`` runs at ``threads`` intra-op threads."""
    model.eval()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(warmup):
            model(inputs)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(inputs)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 1000 * statistics.median(times)
