"""The step profiler (``Trainer(profile=True)``, ``shardwise train --profile``): torch.profiler
over a window of steps on every rank, a Chrome trace per rank, and where each step's time went.

Window: ``profile_skip`` steps are left out (the first steps pay one-time costs), one step warms
the profiler up, then ``profile_steps`` steps are recorded (a shorter run shrinks the window).
Each rank writes ``out/profile/rank-RRRRR.json`` (open it in chrome://tracing or Perfetto).

The breakdown is read from the trace, on the loop's thread, per recorded step. The loop marks
its phases (``shardwise/data``, ``shardwise/forward_backward``, ``shardwise/optimizer``) with
``torch.profiler.record_function``; inside them the trace's own events say the rest:

- **communication, exposed**: time the loop's thread spent in a collective or point-to-point call
  (``c10d::*``), and time covered by a pending transfer (``gloo:*``, ``nccl:*``) while the
  thread ran no operator and no backward function: waiting for the wire;
- **communication, total**: every communication event on any thread (gloo runs collectives on
  its own threads, overlapped with the backward), merged; not a part of the sum, as it overlaps;
- **backward**: the autograd engine's functions (``autograd::engine::evaluate_function``) less
  exposed communication; **forward**: the rest of forward_backward (the forward, the loss, and
  the strategy's work around them);
- **data loading**, **optimizer** (clip, step, zero_grad, scheduler): their phases less exposed
  communication;
- **idle**: the rest of the step (logging, callbacks, evaluation, checkpoints, the loop itself).

These are a partition of each step's span in the trace (each instant counted once), so their
sum is the step's traced length; the measured step time (``time.perf_counter`` between step
starts, outside the profiler) is reported beside it, per step (``steps``, and each rank's in
``per_rank``) and on average. The two differ by the profiler's own step call: a few microseconds,
or a scheduler's time slice when a loaded machine parks the process in it (tested on ddp and
pipeline: the median step within 5%). On CUDA the phases end with a device synchronize inside the window
only, so the CPU-side phases include their kernels.

Off (the default), the loop runs no profiler code: no ``torch.profiler`` object exists and the
phase markers are one shared ``nullcontext``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from shardwise.engine import Engine
from shardwise.trainer.config import TrainerConfig

PARTS = ("data", "forward", "backward", "comm_exposed", "optimizer", "idle")
"""The parts of a step that sum to its length, in the order they are shown."""

Interval = tuple[float, float]


# -- interval sets (microseconds) --------------------------------------------------------------


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, merged, non-empty intervals."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    out = []
    for a, b in x:
        for c, d in y:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    return union(out)


def subtract(x: list[Interval], y: list[Interval]) -> list[Interval]:
    out = []
    for a, b in x:
        pieces = [(a, b)]
        for c, d in y:
            pieces = [p for lo, hi in pieces for p in ((lo, min(hi, c)), (max(lo, d), hi)) if p[1] > p[0]]
        out.extend(pieces)
    return union(out)


def length(x: list[Interval]) -> float:
    return sum(b - a for a, b in x)


# -- the breakdown of a trace -------------------------------------------------------------------

COMM_CALL = ("c10d::",)
COMM_WORK = ("gloo:", "nccl:", "mpi:", "ucc:")
BACKWARD = "autograd::engine::evaluate_function"


def breakdown(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per recorded step (``ProfilerStep#N`` events), the parts in seconds, plus ``comm_total`` and
    ``traced_step``; from a Chrome trace's complete events (``ph == "X"``)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in complete if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not steps:
        return []
    main = steps[0]["tid"]

    def spans(select: Any, thread: Any = main) -> list[Interval]:
        chosen = [e for e in complete if (thread is None or e["tid"] == thread) and select(str(e["name"]))]
        return union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in chosen])

    data = spans(lambda n: n == "shardwise/data")
    fb = spans(lambda n: n == "shardwise/forward_backward")
    opt = spans(lambda n: n == "shardwise/optimizer")
    calls = spans(lambda n: n.startswith(COMM_CALL))
    work = spans(lambda n: n.startswith(COMM_WORK))
    backward = spans(lambda n: n.startswith(BACKWARD))
    operators = spans(lambda n: n.startswith("aten::"))
    every_comm = spans(lambda n: n.startswith(COMM_CALL + COMM_WORK), thread=None)
    # Waiting for the wire: inside a communication call, or a transfer in flight on any thread
    # while this thread runs no operator and no backward function (e.g. DDP's wait for its last
    # bucket at the end of backward, a pipeline stage waiting for its activation).
    exposed_all = union(calls + subtract(union(work + every_comm), union(backward + operators)))
    out = []
    for e in steps:
        span = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]))]
        exposed = intersect(exposed_all, span)
        parts = {
            "data": length(subtract(intersect(data, span), exposed)),
            "forward": length(subtract(subtract(intersect(fb, span), backward), exposed)),
            "backward": length(subtract(intersect(intersect(fb, backward), span), exposed)),
            "comm_exposed": length(exposed),
            "optimizer": length(subtract(intersect(opt, span), exposed)),
            "idle": length(subtract(span, union(data + fb + opt + exposed))),
        }
        row = {k: v / 1e6 for k, v in parts.items()}
        row["comm_total"] = length(intersect(every_comm, span)) / 1e6
        row["traced_step"] = float(e["dur"]) / 1e6
        out.append(row)
    return out


# -- the profiler the loop drives -------------------------------------------------------------


class StepProfiler:
    """torch.profiler over a window of steps of one rank's loop; `finish` returns the breakdown."""

    def __init__(self, config: TrainerConfig, engine: Engine, out: Path | None, start_step: int, total: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.engine = engine
        left = max(0, total - start_step)
        active = max(1, min(config.profile_steps, left - 1))
        skip = max(0, min(config.profile_skip, left - 1 - active))
        warmup = 1 if left > active else 0
        self.window = (start_step + skip + warmup + 1, start_step + skip + warmup + active)
        """First and last recorded step (1-based, as ``trainer.step`` counts)."""
        self.cuda = engine.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.dir = out / "profile" if out is not None else None
        self.trace: Path | None = None
        self.events: list[dict[str, Any]] = []
        self.prof = profile(activities=activities, schedule=schedule(wait=skip, warmup=warmup, active=active, repeat=1), on_trace_ready=self._ready)
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self._started = False
        self._open: int | None = None
        self._continue = False

    def _ready(self, prof: Any) -> None:
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"rank-{self.engine.rank:05d}.json"
        else:
            handle, name = tempfile.mkstemp(suffix=".json")
            os.close(handle)
            path = Path(name)
        prof.export_chrome_trace(str(path))
        self.events = json.loads(path.read_text()).get("traceEvents", [])
        if self.dir is None:
            path.unlink()
        else:
            self.trace = path

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.engine.device)

    def step_start(self, step: int) -> None:
        """Before step ``step``'s data: a new ``ProfilerStep`` (the previous one ends here). The
        measured step runs from after the profiler's own step call to before the next one."""
        if self._continue and step == self._open:
            self._continue = False  # the same step, after an epoch that had none left: one ProfilerStep
            return
        self._sync()
        if self._open is not None:
            self.ends[self._open] = time.perf_counter()
        if not self._started:
            self.prof.start()
            self._started = True
        else:
            self.prof.step()
        self._open = step
        self.starts[step] = time.perf_counter()

    def step_abort(self) -> None:
        """The epoch had no step left: the step that began goes on in the next epoch (its
        ``step_start`` again is no new step, so the trace's steps stay the loop's)."""
        self._continue = True

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self._phase(name)

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"shardwise/{name}"):
            yield
            self._sync()

    def finish(self) -> dict[str, Any] | None:
        """Stop the profiler; the breakdown of this rank and every rank's (one all-reduce)."""
        if not self._started:
            return None
        self._sync()
        if self._open is not None:
            self.ends[self._open] = time.perf_counter()
        self.prof.stop()
        steps = sorted(s for s in self.starts if s in self.ends)
        measured = {s: self.ends[s] - self.starts[s] for s in steps}
        rows = breakdown(self.events)
        first, last = self.window
        recorded = [s for s in steps if first <= s <= last][: len(rows)]
        keys = (*PARTS, "comm_total", "traced_step", "measured_step")
        mine = [0.0] * len(keys)
        for step, row in zip(recorded, rows, strict=False):
            row["measured_step"] = measured[step]
            for i, k in enumerate(keys):
                mine[i] += row[k] / max(1, len(recorded))
        # every rank's averages and, step by step, its traced and measured lengths (one all-reduce)
        width = last - first + 1
        table = torch.zeros((self.engine.world_size, len(keys) + 2 * width + 1), dtype=torch.float64, device=self.engine.device)
        steps_of = [(r["traced_step"], r["measured_step"]) for r in rows[: len(recorded)]]
        table[self.engine.rank, : len(keys)] = torch.tensor(mine, dtype=torch.float64)
        for i, (traced, wall) in enumerate(steps_of[:width]):
            table[self.engine.rank, len(keys) + 2 * i : len(keys) + 2 * i + 2] = torch.tensor([traced, wall], dtype=torch.float64)
        table[self.engine.rank, -1] = len(steps_of[:width]) + 1
        self.engine.all_reduce(table, "sum")
        per_rank: list[dict[str, Any] | None] = []
        for row in table.cpu().tolist():
            if row[-1] <= 0:
                per_rank.append(None)
                continue
            pairs = [row[len(keys) + 2 * i : len(keys) + 2 * i + 2] for i in range(int(row[-1]) - 1)]
            per_rank.append({**dict(zip(keys, row[: len(keys)], strict=True)), "steps": [{"traced_step": t, "measured_step": w} for t, w in pairs]})
        this = dict(zip(keys, mine, strict=True))
        return {
            "window": [recorded[0], recorded[-1]] if recorded else [],
            "steps_recorded": len(recorded),
            "per_step_s": this,
            "steps": [{**r, "step": s} for s, r in zip(recorded, rows, strict=False)],
            "parts": list(PARTS),
            "parts_sum_s": sum(this[k] for k in PARTS),
            "per_rank": per_rank,
            "traces": str(self.dir) if self.dir is not None else None,
        }


def format_breakdown(section: dict[str, Any]) -> str:
    """The breakdown as a few lines for the screen (rank 0's step, and each rank's total)."""
    step = section["per_step_s"]
    measured = step["measured_step"]
    lines = [f"profile: steps {section['window'][0]}-{section['window'][-1]} (per step, rank 0)" if section["window"] else "profile: no step recorded"]
    for k in PARTS:
        share = 100 * step[k] / measured if measured > 0 else 0.0
        lines.append(f"  {k:<13} {1e3 * step[k]:9.3f} ms  {share:5.1f}%")
    lines.append(f"  {'sum':<13} {1e3 * section['parts_sum_s']:9.3f} ms   measured step {1e3 * measured:.3f} ms")
    lines.append(f"  {'comm total':<13} {1e3 * step['comm_total']:9.3f} ms  (overlapped or not)")
    ranks = "  ".join(f"rank {i}: {1e3 * r['measured_step']:.2f} ms" for i, r in enumerate(section["per_rank"]) if r is not None)
    lines.append(f"  step time per rank: {ranks}")
    if section.get("traces"):
        lines.append(f"  Chrome traces: {section['traces']}/rank-*.json")
    return "\n".join(lines)
