"""This machine's alpha and beta, measured, for feeding `shardwise.tools.simulate.network` real numbers.

`time_allreduce` runs inside a process group (start it with ``shardwise.launch``): it times
`shardwise.comm.all_reduce` (the backend's own allreduce) over a few message sizes and returns
each size's median seconds. `fit_alpha_beta` fits the ring cost of Thakur, Rabenseifner & Gropp
2005 (section 4.4), ``t = 2(p-1) alpha + 2(p-1)/p N beta``, to those medians: least squares
weighted by ``1/t`` (so small and large messages count alike, as relative errors), constrained
to ``alpha, beta >= 0`` (a negative intercept from noise becomes alpha = 0 and a refit of beta
alone). Kept apart from the planner's own calibration on purpose: the simulator's check against
real runs should not share code with what it checks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float], p: int) -> tuple[float, float]:
    """``(alpha, beta)`` in seconds and seconds per byte from allreduce times at ``p`` ranks.

    >>> a, b = fit_alpha_beta([1e3, 1e6, 1e7], [2e-5 + 1e3 * 1e-9, 2e-5 + 1e6 * 1e-9, 2e-5 + 1e7 * 1e-9], 2)
    >>> round(a * 1e6, 3), round(b * 1e9, 3)
    (10.0, 1.0)
    """
    if p < 2 or len(sizes_bytes) != len(seconds) or len(seconds) < 2:
        raise ValueError(f"need p >= 2 and at least two (size, seconds) pairs; got p={p}, {len(sizes_bytes)} sizes, {len(seconds)} times")
    rounds = 2 * (p - 1)
    x = np.asarray(sizes_bytes, dtype=float) * 2 * (p - 1) / p
    t = np.asarray(seconds, dtype=float)
    w = 1 / t
    a, b = np.linalg.lstsq(np.stack([w, x * w], axis=1), t * w, rcond=None)[0]
    if a < 0:  # noise pushed the intercept below zero: latency 0, refit the slope through the origin
        a, b = 0.0, float((x * w * t * w).sum() / (x * w * x * w).sum())
    if b < 0:  # no visible bandwidth term: all latency
        a, b = float(statistics.median(t)), 0.0
    return float(a) / rounds, float(max(b, 0.0))


def time_allreduce(sizes_bytes: Sequence[int], repeats: int = 20) -> list[float]:
    """Median seconds of one float32 `shardwise.comm.all_reduce` per size, the slowest rank's
    (run on every rank of a process group; a barrier-free back-to-back loop after two warm-ups)."""
    import torch

    from shardwise.comm import collectives

    out = []
    for size in sizes_bytes:
        buf = torch.ones(max(1, size // 4))
        times = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            collectives.all_reduce(buf)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        med = torch.tensor([statistics.median(times)])
        collectives.all_reduce(med, "max")
        out.append(float(med.item()))
    return out
