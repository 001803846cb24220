"""Pipeline schedules as discrete events: GPipe, 1F1B and interleaved 1F1B over ``p`` stages.

What it answers: how long one training step of a pipeline takes, how much of it each stage sits
idle (the bubble), and how many micro-batches' activations each stage holds at its peak, when
stages are unequal, some straggle, or the point-to-point sends between stages cost time: the
cases the closed form of `shardwise.strategies.cost.bubble` (equal stages, free sends) does not cover.
``shardwise simulate --pipeline ...`` is its command (`shardwise.tools.simulate.commands`). The
model (chunks, sends, each schedule's order) and its sources: docs/simulator.md.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardwise.errors import ConfigError
from shardwise.strategies.cost.bubble import SCHEDULES, predicted_bubble
from shardwise.tools.simulate.network import Network, Straggler

_F, _B = 0, 1
Action = tuple[int, int, int]
"""(direction ``_F`` or ``_B``, local chunk, micro-batch)."""


@dataclass(frozen=True)
class PipelineResult:
    """One simulated pipeline configuration."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    step_s: float
    """Mean wall time of one step (each step is flushed before the next)."""
    bubble: list[float]
    """Per stage: the idle share of the steps, ``1 - busy / wall``."""
    peak_in_flight: list[float]
    """Per stage: most micro-batches whose activations are held at once."""
    predicted_bubble: float
    """`shardwise.strategies.cost.bubble.predicted_bubble` (equal stages, free sends), for comparison."""
    send_s: float
    """One send between adjacent ranks on different nodes (0 when none cross a node)."""


def schedule_order(schedule: str, p: int, m: int, v: int, s: int) -> list[Action]:
    """Rank ``s``'s actions in order (see the module docstring).

    >>> [("FB"[d], j) for d, _, j in schedule_order("1f1b", 3, 4, 1, 0)]
    [('F', 0), ('F', 1), ('F', 2), ('B', 0), ('F', 3), ('B', 1), ('B', 2), ('B', 3)]
    """
    if schedule == "gpipe":
        return [(_F, 0, j) for j in range(m)] + [(_B, 0, j) for j in range(m)]

    def fwd(k: int) -> Action:
        return (_F, (k // p) % v, (k // (p * v)) * p + k % p)

    def bwd(k: int) -> Action:
        return (_B, v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)

    total = v * m
    if schedule == "1f1b":
        fwd, bwd = (lambda k: (_F, 0, k)), (lambda k: (_B, 0, k))  # noqa: E731
        warm = min(p - s - 1, total)
    else:
        warm = min((v - 1) * p + 2 * (p - s - 1), total)
    order = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        order += [fwd(warm + i), bwd(i)]
    return order + [bwd(k) for k in range(total - warm, total)]


def check_pipeline(schedule: str, p: int, m: int, v: int) -> None:
    """Refuse a schedule the simulator (and the pipeline strategy) cannot run, in one line."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline {schedule!r} is not a schedule; choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"--stages, --microbatches and --chunks must be >= 1; got {p}, {m}, {v}")
    if schedule == "1f1b" and m < p:
        raise ConfigError(f"--pipeline 1f1b needs at least as many micro-batches as stages; got --microbatches {m} < --stages {p}; use >= {p} or gpipe")
    if schedule == "interleaved":
        if v < 2 or p < 2:
            raise ConfigError(f"--pipeline interleaved needs --chunks >= 2 and --stages >= 2; got --chunks {v}, --stages {p}; use 1f1b for one chunk per rank")
        if m % p:
            raise ConfigError(f"--pipeline interleaved runs micro-batches in groups of --stages {p}; got --microbatches {m}; use a multiple of {p}")
    elif v != 1:
        raise ConfigError(f"--chunks {v} needs --pipeline interleaved; {schedule} runs one chunk per rank")


def simulate_pipeline(
    schedule: str,
    stages: int,
    microbatches: int,
    *,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    chunks: int = 1,
    activation_bytes: float = 0.0,
    net: Network | None = None,
    straggler: Straggler | None = None,
    steps: int = 1,
    seed: int = 0,
) -> PipelineResult:
    """Simulate ``steps`` flushed steps of ``schedule`` (see the module docstring).

    ``forward_s`` / ``backward_s``: one micro-batch through a whole stage, one number for every
    stage or one per stage. ``net``: the links (default: sends cost nothing).

    >>> r = simulate_pipeline("1f1b", 4, 8, forward_s=1.0, backward_s=2.0)
    >>> r.step_s, round(r.bubble[0], 4), r.peak_in_flight
    (33.0, 0.2727, [4.0, 3.0, 2.0, 1.0])
    """
    p, m, v = stages, microbatches, chunks
    check_pipeline(schedule, p, m, v)
    t_f, t_b = _per_stage("forward", forward_s, p), _per_stage("backward", backward_s, p)
    if not activation_bytes >= 0:
        raise ConfigError(f"--activation-bytes must be >= 0; got {activation_bytes}")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1; got {steps}")
    net = net or Network(alpha_s=0.0, beta_s_per_byte=0.0)
    orders = [schedule_order(schedule, p, m, v, s) for s in range(p)]
    factors = (straggler or Straggler()).factors(steps * m, p, np.random.default_rng(seed)).reshape(steps, m, p)
    walls, busy, peak = [], np.zeros(p), np.zeros(p)
    for k in range(steps):
        wall, b, pk = _play(orders, t_f[None, :] * factors[k] / v, t_b[None, :] * factors[k] / v, v, activation_bytes, net)
        walls.append(wall)
        busy += b
        peak = np.maximum(peak, pk / v)
    g = net.gpus_per_node
    crossing = any(s // g != (s + 1) // g for s in range(p - 1)) or (v > 1 and p > g)
    return PipelineResult(
        schedule=schedule,
        stages=p,
        microbatches=m,
        chunks=v,
        step_s=float(np.mean(walls)),
        bubble=[float(max(0.0, 1 - x / sum(walls))) for x in busy],
        peak_in_flight=[float(x) for x in peak],
        predicted_bubble=predicted_bubble(schedule, p, m, v),
        send_s=net.alpha_s + activation_bytes * net.beta_s_per_byte if crossing else 0.0,
    )


def _per_stage(name: str, value: float | Sequence[float], p: int) -> np.ndarray:
    out = np.full(p, float(value)) if isinstance(value, (int, float)) else np.asarray(value, dtype=float)
    if out.shape != (p,) or not (out > 0).all():
        raise ConfigError(f"the {name} time must be one positive number or one per stage ({p}); got {value!r}")
    return out


def _play(orders: list[list[Action]], fwd: np.ndarray, bwd: np.ndarray, v: int, nbytes: float, net: Network) -> tuple[float, np.ndarray, np.ndarray]:
    """One step: (wall time, each rank's busy time, each rank's peak chunk-micro-batches held).

    ``fwd[j, s]``, ``bwd[j, s]``: rank ``s``'s time for one chunk of micro-batch ``j``."""
    p = len(orders)
    last = p * v - 1
    g = net.gpus_per_node
    nxt, running = [0] * p, [False] * p
    free, busy, held, peak = np.zeros(p), np.zeros(p), np.zeros(p), np.zeros(p)
    arrived: dict[tuple[int, int, int], float] = {(_F, 0, j): 0.0 for j in range(len(fwd))}  # the inputs are there at 0
    link_free: dict[tuple[int, int], float] = {}
    heap: list[tuple[float, int, int, int, int, int]] = []
    seq = 0

    def try_start(s: int) -> None:
        nonlocal seq
        if running[s] or nxt[s] == len(orders[s]):
            return
        d, c, j = orders[s][nxt[s]]
        ready = arrived.get((d, c * p + s, j))
        if ready is None:
            return
        dur = float((fwd if d == _F else bwd)[j, s])
        running[s], nxt[s] = True, nxt[s] + 1
        if d == _F:
            held[s] += 1
            peak[s] = max(peak[s], held[s])
        seq += 1
        heapq.heappush(heap, (max(free[s], ready) + dur, seq, s, d, c * p + s, j))

    def send(t: float, src: int, dst: int) -> float:
        if src == dst:
            return t
        cross = src // g != dst // g
        alpha, beta = (net.alpha_s, net.beta_s_per_byte) if cross else (net.a_in, net.b_in)
        start = max(t, link_free.get((src, dst), 0.0))
        link_free[(src, dst)] = start + nbytes * beta
        return start + alpha + nbytes * beta

    for s in range(p):
        try_start(s)
    while heap:
        t, _, s, d, gc, j = heapq.heappop(heap)
        busy[s] += float((fwd if d == _F else bwd)[j, s])
        running[s], free[s] = False, t
        if d == _B:
            held[s] -= 1
        if d == _F and gc < last:
            dst = (gc + 1) % p
            arrived[(_F, gc + 1, j)] = send(t, s, dst)
            try_start(dst)
        elif d == _F:
            arrived[(_B, gc, j)] = t
        elif gc > 0:
            dst = (gc - 1) % p
            arrived[(_B, gc - 1, j)] = send(t, s, dst)
            try_start(dst)
        try_start(s)
    assert all(n == len(o) for n, o in zip(nxt, orders, strict=True)), "pipeline schedule deadlocked"
    return float(free.max()), busy, peak
