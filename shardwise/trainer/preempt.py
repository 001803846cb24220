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
"""

from __future__ import annotations

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
            print(f"shardwise: {self.signal} received: stopping at the next log step with a checkpoint", flush=True)

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
        """1.0 once a signal came (the number the log step's reduction carries), else 0.0."""
        return 0.0 if self.signal is None else 1.0
