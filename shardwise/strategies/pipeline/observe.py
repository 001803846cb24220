"""What a pipeline step costs: each forward and backward action timed (``_Clock``), the measured
bubble next to the predicted one (``bubble_section``), and the timeline of one step as JSON and
a PNG (``write_timeline``).

A stage's bubble is ``1 - busy / wall``: busy is the time inside ``forward_one_chunk`` and
``backward_one_chunk`` (waiting for activations and gradients happens outside them), wall runs
from the earliest rank's start to the latest rank's end, on ``perf_counter`` clocks aligned at
setup. Predicted: ``shardwise.strategies.cost.bubble`` (Narayanan et al. 2021, section 2.2).

The activations and gradients a stage sends to its neighbours are posted by
``torch.distributed.pipelining`` itself (its schedule batches them as ``isend``/``irecv``), so
``record_stage_traffic`` counts them where the stage builds them: every ``P2POp`` its
``get_fwd_send_ops``, ``get_bwd_send_ops``, ``get_fwd_recv_ops`` and ``get_bwd_recv_ops`` return
becomes one ``pp/send`` or ``pp/recv`` event of that tensor's bytes (the local shard of a
DTensor, the dtype autocast gave it, the zeros sent for an input without a gradient: what goes
on the wire, not what a formula expects). Untimed: the schedule waits on them later, among
other work. torch's own one-time shape exchange on the first step (pickled metadata, a few
hundred bytes) is not counted.

>>> round(bubble_section([[(4.0, 10.0, 16.0), (4.0, 10.0, 15.0)]], schedule="gpipe", pp=2, microbatches=2,
...                virtual_stages=1, num_stages=2, stage_layers=None, warmup_steps=0)["bubble_measured"], 3)
0.333
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.comm import CommEvent, Group, Recorder, all_gather, barrier, wire_bytes
from shardwise.errors import ConfigError
from shardwise.strategies.cost.bubble import predicted_bubble, step_bubbles


class _Clock:
    """Busy time of each forward and backward action, per step, on a clock shared by the group."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, str, float, float]] = []  # (stage, micro-batch, F|B, start, end)
        self.offset = 0.0

    def instrument(self, stage: Any) -> None:
        """Time the stage's ``forward_one_chunk`` and ``backward_one_chunk`` (the schedule's compute
        actions; waiting for activations and gradients happens outside them)."""
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        idx = stage.stage_index

        def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fwd(chunk, *args, **kwargs)
            finally:
                self.events.append((idx, chunk, "F", t0, time.perf_counter()))

        def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return bwd(chunk, *args, **kwargs)
            finally:
                self.events.append((idx, chunk, "B", t0, time.perf_counter()))

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk

    def align(self, group: Group, recorder: Recorder | None = None, device: torch.device | None = None) -> None:
        """Offset of this rank's ``perf_counter`` from the group's first rank (everyone leaves a barrier together)."""
        if group.size == 1:
            return
        barrier(group=group, recorder=recorder)
        now = time.perf_counter()
        got = all_gather(torch.tensor([now], dtype=torch.float64, device=device), group=group, recorder=recorder)
        self.offset = now - float(got[0])


def record_stage_traffic(stage: Any, group: Group, recorder: Recorder) -> None:
    """Record every activation and gradient ``stage`` sends or receives across ranks (see the module's docstring)."""

    def counted(build: Any, op: str) -> Any:
        def ops(chunk: int, *args: Any, **kwargs: Any) -> Any:
            built = build(chunk, *args, **kwargs)
            for p2p in built:
                n = p2p.tensor.numel() * p2p.tensor.element_size()
                sent, received = wire_bytes(op, n, group.size)
                recorder.add(CommEvent(op, group.name, group.size, n, sent, received, None))  # waited on later, by the schedule
            return built

        return ops

    stage.get_fwd_send_ops = counted(stage.get_fwd_send_ops, "send")
    stage.get_bwd_send_ops = counted(stage.get_bwd_send_ops, "send")
    stage.get_fwd_recv_ops = counted(stage.get_fwd_recv_ops, "recv")
    stage.get_bwd_recv_ops = counted(stage.get_bwd_recv_ops, "recv")


_KINDS = ("F", "B")


def gather_events(
    events: Sequence[tuple[int, int, str, float, float]], group: Group, recorder: Recorder | None, device: torch.device
) -> list[tuple[int, int, str, float, float]]:
    """Every rank's timeline events (stage, micro-batch, F|B, start, end), as float64 rows (collective over ``group``)."""
    from shardwise.strategies.pipeline.exchange import all_gather_varlen

    rows = torch.tensor([[st, mb, _KINDS.index(k), s, e] for st, mb, k, s, e in events], dtype=torch.float64).reshape(-1)
    out = []
    for part in all_gather_varlen(rows, group=group, recorder=recorder, device=device):
        for st, mb, k, s, e in part.cpu().reshape(-1, 5).tolist():
            out.append((int(st), int(mb), _KINDS[int(k)], s, e))
    return out


def bubble_section(
    steps: Sequence[Sequence[tuple[float, float, float]]],
    *,
    schedule: str,
    pp: int,
    microbatches: int,
    virtual_stages: int,
    num_stages: int,
    stage_layers: list[list[str]] | None,
    warmup_steps: int,
) -> dict[str, Any]:
    """The ``pipeline`` summary section from each step's per-rank ``(busy, start, end)`` times:
    the bubble measured over the steps after ``warmup_steps`` (all of them if none are left), and
    the predicted one."""
    measured_steps = steps[warmup_steps:] or steps
    per_stage: list[list[float]] = [[] for _ in range(pp)]
    busy: list[list[float]] = [[] for _ in range(pp)]
    walls, step_means = [], []
    for rows in measured_steps:
        wall, bubbles = step_bubbles([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        walls.append(wall)
        step_means.append(sum(bubbles) / len(bubbles))
        for i, b in enumerate(bubbles):
            per_stage[i].append(b)
            busy[i].append(rows[i][0])
    section: dict[str, Any] = {
        "schedule": schedule,
        "pp": pp,
        "microbatches": microbatches,
        "virtual_stages": virtual_stages,
        "stages": num_stages,
        "stage_layers": stage_layers,
        "bubble_measured": mean([mean(s) for s in per_stage]) if measured_steps else None,
        # The median step resists a step the OS stalled (shared machines); the mean is the headline.
        "bubble_measured_median_step": statistics.median(step_means) if step_means else None,
        "bubble_predicted": predicted_bubble(schedule, pp, microbatches, virtual_stages),
        "bubble_formula": "(p-1)/(v*m+p-1)" if schedule == "interleaved" else "(p-1)/(m+p-1)",
        "bubble_source": "Narayanan et al. 2021 (Megatron-LM, SC'21), section 2.2",
        "steps_measured": len(measured_steps),
        "step_wall_s": mean(walls),
        "per_stage": [{"rank": i, "stages": list(range(i, num_stages, pp)), "bubble": mean(per_stage[i]), "busy_s": mean(busy[i])} for i in range(pp)],
    }
    return section


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def write_timeline(path: str, events: list[tuple[int, int, str, float, float]], pp: int, schedule: str) -> str:
    """A PNG of which stage ran which micro-batch's forward (F) and backward (B) when, one row per
    rank, and the events as JSON next to it (``<path>.json``); returns the PNG's path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = min((e[3] for e in events), default=0.0)
    rows: list[dict[str, Any]] = [
        {"stage": st, "rank": st % pp, "microbatch": mb, "kind": k, "start_s": s - t0, "end_s": e - t0}
        for st, mb, k, s, e in sorted(events, key=lambda e: e[3])
    ]
    out.with_suffix(out.suffix + ".json").write_text(json.dumps({"schedule": schedule, "pp": pp, "events": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("the pipeline timeline PNG needs matplotlib (pip install 'shardwise[plot]'); the events were written as JSON") from exc
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * pp))
    stages = max((r["stage"] for r in rows), default=0) + 1
    cmap = plt.get_cmap("tab10")
    for r in rows:
        shade = 0.35 if r["kind"] == "F" else 0.85
        color = cmap(r["stage"] // pp % 10)
        ax.barh(
            r["rank"], (r["end_s"] - r["start_s"]) * 1e3, left=r["start_s"] * 1e3, height=0.8, color=color, alpha=shade + 0.15, edgecolor="black", linewidth=0.3
        )
        ax.text((r["start_s"] + r["end_s"]) / 2 * 1e3, r["rank"], f"{r['kind']}{r['microbatch']}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {i}" for i in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first action")
    ax.set_title(f"{schedule}: {stages} stages on {pp} ranks (F light, B dark; colour = model chunk)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)
