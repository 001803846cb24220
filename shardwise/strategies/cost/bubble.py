"""Pipeline bubble: the share of a step a stage sits idle, predicted and measured.

Predicted (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC 2021, section 2.2): with ``p`` stages, ``m`` micro-batches per step and
equal per-stage forward and backward times ``t_f``, ``t_b``, GPipe and 1F1B both leave
``(p - 1)(t_f + t_b)`` of idle time on each stage in a step of ``(m + p - 1)(t_f + t_b)``::

    bubble = (p - 1) / (m + p - 1)

(1F1B changes how many activations are kept, not the bubble). The interleaved schedule gives
each rank ``v`` model chunks, each ``1/v`` of its layers, so the fill and drain shrink by ``v``:
idle ``(p - 1)(t_f + t_b) / v`` next to ``m (t_f + t_b)`` of work, a fraction of the step::

    bubble = (p - 1) / (v m + p - 1)

(the paper states the ratio of idle to busy time, ``(1/v)(p - 1)/m``; the fractions above are the
same quantities over the whole step, so they can be compared with a measured idle share).

Measured: a stage's busy time is the sum of its forward and backward actions; its idle time
is the step's wall time (from the first rank's start to the last rank's end) minus that.
"""

from __future__ import annotations

from collections.abc import Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def predicted_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step for each stage (see the module docstring for the formulas).

    >>> predicted_bubble("gpipe", 4, 8)
    0.2727272727272727
    >>> predicted_bubble("interleaved", 4, 8, v=2)
    0.15789473684210525
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1; got p={p}, m={m}, v={v}")
    if schedule != "interleaved":
        v = 1
    return (p - 1) / (v * m + p - 1)


def idle_to_busy(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The paper's form: idle time over busy time, ``(p - 1)/m`` (``(1/v)(p - 1)/m`` interleaved)."""
    if schedule != "interleaved":
        v = 1
    return (p - 1) / (v * m)


def measured_bubble(busy_s: float, wall_s: float) -> float:
    """One stage's idle share of one step: ``1 - busy / wall`` (0 when the step took no time)."""
    if wall_s <= 0:
        return 0.0
    return max(0.0, 1.0 - busy_s / wall_s)


def step_bubbles(busy_s: Sequence[float], starts: Sequence[float], ends: Sequence[float]) -> tuple[float, list[float]]:
    """(wall time, each stage's bubble) for one step, from every stage's busy seconds and its
    step start and end on a common clock; the wall is from the earliest start to the latest end."""
    wall = max(ends) - min(starts)
    return wall, [measured_bubble(b, wall) for b in busy_s]
