"""One attempt of examples/flyte_workflow.py's GPU task, run as a Flyte retry runs one: a new process,
the task's same inputs, FLYTE_ATTEMPT_NUMBER set by the caller (flytekit's local execution runs no retries).

Usage: python flyte_attempt.py OUT MAX_STEPS LOG_EVERY [PREEMPT_AFTER]. LOG_EVERY replaces the recipe's 20 (the
log step is where a preemption stops the run; it changes no weight). With PREEMPT_AFTER, rank 0 gets a SIGTERM
(a spot node's notice) after that step, as the kubelet's would reach it through the launcher.
Prints the task's outputs' summary as JSON on its last line.
"""

import json
import os
import signal
import sys
from pathlib import Path

import shardwise
from shardwise.trainer.callbacks import Callback

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "flyte_workflow.py"


class PreemptAfter(Callback):
    """Rank 0 sends itself SIGTERM after step ``step``: the run stops at the next log step with a checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer, engine, step, loss):
        if step == self.step and engine.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


sys.path.insert(0, str(EXAMPLE.parent))  # flytekit finds a task by its module's name, as `pyflyte run` imports the file
import flyte_workflow as example  # noqa: E402

if __name__ == "__main__":  # the task once, in this process (its workers stop at their fit call either way)
    preempt = [PreemptAfter(int(sys.argv[4]))] if len(sys.argv) > 4 else []

    def trainer(**settings):
        return shardwise.Trainer(**{**settings, "log_every": int(sys.argv[3])}, callbacks=preempt)

    example.Trainer = trainer
    result = example.train_gpu(out=sys.argv[1], strategy="ddp", max_steps=int(sys.argv[2]))  # the task, through flytekit's local execution
    print(json.dumps(result.summary), flush=True)
