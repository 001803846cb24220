"""One trial of ``shardwise tune hparams``: a ``shardwise train`` process of its own, watched.

The trial's command runs with its own ``--out`` (``trial-NNNN/`` under the search's directory),
its output in ``output.log`` there. While it runs, the new lines of its ``metrics.jsonl`` are read
as the run appends them (whole lines only) and each value of the searched metric goes to the
study's pruner (``trial.report(value, step)``); when the pruner says stop, the process gets SIGTERM,
by its own pid: ``shardwise train`` treats it as a preemption (every rank stops after the next
logged step, the checkpoint is written, exit 75: the trial's run could go on with ``--resume
auto``; the search has its runs log every ``report_every`` steps, so a run stops within that many
steps of the decision), and after ``grace_s`` without an exit, SIGKILL (its ranks die with it,
launcher/lifeline.py). A value at the run's last step prunes nothing: stopping it would save nothing. A complete trial's value is the
metric of its ``summary.json`` (the end-of-run evaluation), else the last value it logged.
"""

from __future__ import annotations

import json
import math
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATES = ("complete", "pruned", "fail")


class TrialFailed(Exception):
    """A trial's run ended with an error (the study records it as failed and goes on)."""


@dataclass
class HparamTrial:
    """One row of the search's table: what was tried and how it ended."""

    number: int
    params: dict[str, Any]
    out: str
    command: list[str]
    state: str = "running"
    """'complete', 'pruned' (stopped by the pruner) or 'fail' (the run ended with an error)."""
    value: float | None = None
    """The metric: the run's final one when complete, the one that pruned it when pruned."""
    pruned_at: int | None = None
    """The step whose value made the pruner stop the run (it stops within ``log_every`` steps after)."""
    steps: int = 0
    """Steps the run made."""
    seconds: float = 0.0
    started: float = 0.0
    """When the run's process started and ended (``time.time()``): which trials overlapped."""
    ended: float = 0.0
    intermediate: dict[int, float] = field(default_factory=dict)
    """Every value of the metric the run logged, by step (what the pruner saw)."""
    pid: int | None = None
    returncode: int | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "trial": self.number,
            "state": self.state,
            "value": self.value,
            "params": self.params,
            "steps": self.steps,
            "pruned_at": self.pruned_at,
            "seconds": round(self.seconds, 3),
            "started": self.started,
            "ended": self.ended,
            "out": self.out,
            "intermediate": {str(k): v for k, v in sorted(self.intermediate.items())},
            "pid": self.pid,
            "returncode": self.returncode,
            "error": self.error,
        }


class MetricsTail:
    """The lines a run has appended to its ``metrics.jsonl`` since the last read (whole lines only)."""

    def __init__(self, path: Path, metric: str) -> None:
        self.path, self.metric, self.offset, self.last_step = path, metric, 0, 0

    def read(self) -> list[tuple[int, float]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        found = []
        for line in chunk[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            step = record.get("step")
            if isinstance(step, int):
                self.last_step = max(self.last_step, step)
                value = record.get(self.metric)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    found.append((step, float(value)))
        return found


def stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the trial's process (by its pid), SIGKILL if it has not ended within ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_trial(
    record: HparamTrial, trial: Any, *, metric: str, env: dict[str, str], cwd: str, max_steps: int | None = None, grace_s: float = 60.0, poll_s: float = 0.2
) -> float:
    """Run ``record.command``, report the metric to ``trial`` (an Optuna trial) as it is logged, stop
    the run when the pruner says so; fill ``record`` and return the final value. Raises
    ``optuna.TrialPruned`` for a pruned trial and `TrialFailed` for a run that failed."""
    import optuna

    out = Path(record.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(shlex.join(record.command) + "\n")
    tail = MetricsTail(out / "metrics.jsonl", metric)
    start, record.started = time.perf_counter(), time.time()
    with open(out / "output.log", "wb") as log:
        proc = subprocess.Popen(record.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    record.pid = proc.pid
    try:
        while record.pruned_at is None:
            done = proc.poll() is not None
            for step, value in tail.read():
                record.intermediate[step] = value
                if record.pruned_at is not None:
                    continue  # logged in the same read as the value that pruned it: kept, not reported
                trial.report(value, step)
                # a finished run (done, or at its last step) has nothing left to save by stopping it
                if not done and (max_steps is None or step < max_steps) and trial.should_prune():
                    record.pruned_at = step
            if done:
                break
            time.sleep(poll_s)
    finally:  # pruned, or this thread leaves on an exception (Ctrl-C): the run does not outlive it
        stop(proc, grace_s)
        record.returncode = proc.wait()
        record.seconds, record.ended = time.perf_counter() - start, time.time()
    for step, value in tail.read():  # what it logged while it stopped: shown, not reported
        record.intermediate.setdefault(step, value)
    summary = _summary(out)
    record.steps = int(summary.get("steps") or tail.last_step)
    if record.pruned_at is not None and (record.returncode != 0 or summary.get("preempted")):
        record.state = "pruned"
        record.value = record.intermediate[record.pruned_at]
        raise optuna.TrialPruned(f"pruned at step {record.pruned_at}")
    record.pruned_at = None  # the run had ended before the signal: it is complete
    if record.returncode != 0:
        return _fail(record, error_line(out / "output.log", record.returncode))
    final = summary.get(metric)
    if isinstance(final, (int, float)):
        value = float(final)
    elif record.intermediate:
        value = record.intermediate[max(record.intermediate)]
    else:
        return _fail(record, f"the run logged no {metric} (see {out / 'metrics.jsonl'})")
    if not math.isfinite(value):
        return _fail(record, f"{metric} is {value} at the end of the run")
    record.state, record.value = "complete", value
    return value


def _fail(record: HparamTrial, error: str) -> float:
    record.state, record.error = "fail", error
    raise TrialFailed(error)


def _summary(out: Path) -> dict[str, Any]:
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def error_line(log: Path, returncode: int) -> str:
    """What ended a failed run, in one line: its ``shardwise: error:`` line, else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    said = [i for i, line in enumerate(lines) if line.startswith("shardwise: ")]
    last = lines[said[-1]] if said else (lines[-1] if lines else "no output")
    if said and last.endswith(":") and said[-1] + 1 < len(lines):  # "a worker failed:" and the worker's exception
        last += " " + lines[said[-1] + 1]
    code = f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}"
    return f"{code}: {last[:300]} (whole output: {log})"


__all__ = ["STATES", "HparamTrial", "MetricsTail", "TrialFailed", "error_line", "run_trial", "stop"]
