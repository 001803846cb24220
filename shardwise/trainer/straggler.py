"""A straggler on purpose: slow one rank down by a factor, to see what sync, async and ssp do about it.

``--straggler RANK:FACTOR`` (or ``Trainer(callbacks=[Straggler(1, 3.0)])``) makes rank RANK
take about FACTOR times as long per step: after each step it sleeps ``(FACTOR - 1)`` times
its fastest step so far. The fastest step, not the last one, so time spent waiting for
others (a synchronous strategy waiting on the straggler itself) is not multiplied.
Works with every strategy: it is a trainer callback, not a strategy feature.
"""

from __future__ import annotations

import time
from typing import Any

from shardwise.errors import ConfigError


def parse_straggler(spec: str) -> tuple[int, float]:
    """``"RANK:FACTOR"`` -> (rank, factor), or a ConfigError that shows the expected form."""
    rank_text, sep, factor_text = str(spec).partition(":")
    try:
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        rank, factor = -1, 0.0
    if not sep or rank < 0 or factor < 1.0:
        raise ConfigError(f"straggler takes RANK:FACTOR with RANK >= 0 and FACTOR >= 1 (e.g. '1:3' makes rank 1 three times slower); got {spec!r}")
    return rank, factor


class Straggler:
    """Trainer callback: rank ``rank`` runs ``factor`` times slower than it would."""

    def __init__(self, rank: int, factor: float) -> None:
        if rank < 0 or factor < 1.0:
            raise ConfigError(f"Straggler needs rank >= 0 and factor >= 1; got rank={rank}, factor={factor}")
        self.rank, self.factor = rank, factor
        self.fastest = float("inf")
        self._last: float | None = None
        self.slept_s = 0.0

    @classmethod
    def from_spec(cls, spec: str) -> Straggler:
        return cls(*parse_straggler(spec))

    def on_fit_start(self, trainer: Any, engine: Any) -> None:
        self._last = time.perf_counter()
        if self.rank >= engine.world_size:
            raise ConfigError(f"straggler rank {self.rank} does not exist in a world of {engine.world_size} processes")

    def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: Any) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.fastest = min(self.fastest, now - self._last)
        if engine.rank == self.rank and self.fastest < float("inf"):
            pause = (self.factor - 1.0) * self.fastest
            time.sleep(pause)
            self.slept_s += pause
        self._last = time.perf_counter()
