"""Preemption: a spot-instance notice or Slurm's ``--signal`` ends the run with a checkpoint, not a loss.

While ``Trainer.fit`` trains, SIGTERM and SIGUSR1 (``preempt_signals``) no longer end the process:
the handler notes the signal, and the next log step's reduction (the mean training loss every
``log_every`` steps, which carries one more number: did any rank get a signal?) tells every rank at
the same step. Every rank then stops after that step, the run's checkpoint is written (as at the
end of a run), ``summary.json`` records ``preempted`` (the signal and the step), and ``shardwise
train`` exits with `shardwise.errors.EXIT_PREEMPTED` (75, EX_TEMPFAIL of sysexits.h: "try again later"), a code a
Slurm batch script or a supervisor requeues on; the next start with ``--resume auto`` continues
bit-exact. The check costs nothing per step (it rides on a reduction the loop makes anyway), so the
run stops within ``log_every`` steps of the signal: keep ``log_every`` x step time under the
notice (about 30 s on some clouds, 2 minutes on others).

A signal only one rank receives is enough: the reduction carries it to the others. The launcher
(`shardwise.launch`, ``Trainer(nproc=N)``) passes the signals it receives on to its workers;
torchrun does so for SIGTERM itself, and ``shardwise run`` turns a SIGUSR1 to torchrun's agent into
that SIGTERM (torchrun alone would die on SIGUSR1 and leave its workers running) and exits 75.

Ctrl-C is not a preemption: the terminal sends SIGINT to the launcher and its ranks alike (one
process group), and each rank stops at once with ``KeyboardInterrupt``, as Python does. While
``fit`` runs, the first signal a process gets is the one it names, once, on rank 0 only (every rank
gets the same signal; two ranks writing the same line at once printed it twice on one line): so the
SIGTERM the launcher sends its ranks as it stops them after a Ctrl-C is not announced as a
preemption ("SIGTERM received" was what a Ctrl-C printed, twice, before).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = ("SIGTERM", "SIGUSR1")


class Preemption:
    """The signal this process got while training (None when none came)."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def note(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            _say(f"shardwise: {self.signal} received: stopping at the next log step with a checkpoint")

    def interrupt(self, signum: int, frame: Any) -> None:
        """Ctrl-C: stop now (``KeyboardInterrupt``), said once; a later signal (the launcher's SIGTERM
        to its ranks as it stops them) is not announced."""
        first = self.signal is None
        self.signal = self.signal or "SIGINT"
        if first:
            _say("shardwise: SIGINT received (Ctrl-C): stopping now, without a checkpoint")
        raise KeyboardInterrupt

    @contextmanager
    def installed(self, names: tuple[str, ...] = SIGNALS) -> Iterator[Preemption]:
        """Handle ``names`` while the block runs (main thread only: elsewhere signals stay as they were),
        then put back what was there (a handler installed outside Python, such as faulthandler's, is
        registered again)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        before: dict[signal.Signals, Any] = {}
        for name in names:
            sig = signal.Signals[name]
            before[sig] = signal.signal(sig, self.note)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the user chose otherwise
            before[signal.SIGINT] = signal.signal(signal.SIGINT, self.interrupt)
        try:
            yield self
        finally:
            for sig, old in before.items():
                if old is None:  # installed from C: faulthandler's dump on SIGTERM in a launched worker
                    import faulthandler

                    signal.signal(sig, signal.SIG_DFL)
                    faulthandler.register(sig, all_threads=True, chain=True)
                else:
                    signal.signal(sig, old)

    @property
    def flag(self) -> float:
        """1.0 once a preemption signal came (the number the log step's reduction carries), else 0.0."""
        return 0.0 if self.signal is None or self.signal == "SIGINT" else 1.0


def _say(text: str) -> None:
    # Every rank of a job gets the same signal (a terminal's process group, the launcher's relay): rank 0 says it.
    if os.environ.get("RANK", "0") == "0":
        print(text, flush=True)
