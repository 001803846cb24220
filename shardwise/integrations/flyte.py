"""Flyte: the Trainer inside a Flyte task, its summary and checkpoint directory as the task's outputs.

A Flyte task is a Python function; the Trainer runs inside it as it runs anywhere:

- **a plain ``@task``** calls ``Trainer(nproc=2).fit``: the task's process starts the workers
  itself (``shardwise.launch``), waits for them and returns rank 0's summary;
- **an elastic task** (``@task(task_config=Elastic(nnodes=1, nproc_per_node=2))`` from
  flytekit's PyTorch plugin, ``flytekitplugins-kfpytorch``) is started by torch's elastic agent
  once per process; each process's Trainer joins that job (torchrun's variables) and the plugin
  returns rank 0's value. Every rank must write into the same ``out``, so the directory is a
  task input (each elastic worker has its own Flyte working directory).

`TrainOutputs` is the task's output type (``summary``: the run's summary.json; ``checkpoints``:
the run's ``out/checkpoints/`` as a ``FlyteDirectory``, uploaded by Flyte like any directory
output), and `outputs` builds it from what ``fit`` returned. ``examples/flyte_workflow.py``
holds both tasks in a workflow that runs locally (``python examples/flyte_workflow.py``)
with no cluster; on a cluster the same file registers with ``pyflyte register``.

On GPUs and spot nodes (``@task(requests=Resources(gpu=...), interruptible=True, retries=N)``):
`accelerator` picks CUDA when torch sees a GPU per process, else the CPU (a local run); ``out`` is a
task input on storage every attempt sees, so a retry's ``Trainer(resume="auto")`` continues from
its last checkpoint; `outputs` turns a preempted run (the pod's SIGTERM: checkpoint, then stop)
into ``FlyteRecoverableException``, which Flyte retries; `note_attempt` says when a retry found
nothing to resume. flytekit's local execution runs no retries: a test runs the attempts itself.

Needs flytekit (``pip install 'shardwise[flyte]'``, which also installs the elastic plugin).
This module keeps real annotations (no postponed ones): flytekit reads `TrainOutputs`' field
types at run time to build the task's interface.
"""

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from shardwise.errors import ConfigError

try:
    from flytekit.exceptions.user import FlyteRecoverableException
    from flytekit.types.directory import FlyteDirectory
except ImportError:  # pragma: no cover - depends on the installation
    raise ConfigError("the Flyte integration needs flytekit, which is not installed: pip install 'shardwise[flyte]'") from None

__all__ = ["TrainOutputs", "accelerator", "note_attempt", "outputs"]


class TrainOutputs(NamedTuple):
    """A training task's outputs."""

    summary: dict  # flytekit maps a bare dict to a JSON value; dict[str, Any] it cannot
    """The run's summary (summary.json), JSON values only."""
    checkpoints: FlyteDirectory
    """The run's checkpoint directory (``out/checkpoints``)."""


def outputs(summary: dict[str, Any] | None, out: str | os.PathLike[str]) -> TrainOutputs:
    """The task's outputs from ``fit``'s summary and the run's ``out`` directory.

    The summary goes through JSON (as summary.json does), so the task's output holds only what
    Flyte can store. ``fit`` returns None on a rank other than 0 under an elastic task; the
    plugin keeps rank 0's value, so those ranks return an empty summary. A run stopped by a
    preemption notice (``summary["preempted"]``) has no outputs: it raises
    ``FlyteRecoverableException``, so Flyte retries the task instead of passing a half-trained
    model downstream.
    """
    checkpoints = Path(out) / "checkpoints"
    if summary is not None and summary.get("preempted"):
        stop = summary["preempted"]
        # Recoverable: Flyte retries the task (retries=N); the retry's resume="auto" continues from this checkpoint.
        raise FlyteRecoverableException(
            f"preempted ({stop['signal']}) at step {stop['step']}: the run's checkpoint is {summary.get('last_checkpoint')}; "
            f"a retry of this task with the same out ({out}) and resume='auto' continues from it"
        )
    if summary is not None and not checkpoints.is_dir():
        raise ConfigError(f"the run in {out} wrote no checkpoints/ to return; keep checkpoint_every (the default saves at the end) or return only the summary")
    return TrainOutputs(summary=json.loads(json.dumps(summary or {}, default=str)), checkpoints=FlyteDirectory(str(checkpoints)))


def accelerator(nproc: int) -> str:
    """Where a task's ``nproc`` processes train: ``"cuda"`` when torch sees a GPU for each (what the task's
    ``Resources(gpu=...)`` gave the pod), else ``"cpu"``, said in one line (a local run, a CPU node)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= nproc:
        return "cuda"
    print(f"shardwise: torch sees {count} CUDA device{'s' if count != 1 else ''} for {nproc} processes: training on the CPU (gloo)", flush=True)
    return "cpu"


def note_attempt(out: str | os.PathLike[str]) -> int:
    """This task's attempt (Flyte's ``FLYTE_ATTEMPT_NUMBER``, 0 the first; 0 in a local run); on a retry that finds no
    checkpoint in ``out`` it says so: the run starts from step 0 because ``out`` is not storage every attempt sees."""
    from shardwise.checkpoint.files import list_checkpoints

    raw = os.environ.get("FLYTE_ATTEMPT_NUMBER", "0")
    attempt = int(raw) if raw.isdigit() else 0
    if attempt > 0 and not list_checkpoints(Path(out) / "checkpoints"):
        print(
            f"shardwise: Flyte attempt {attempt} of this task found no checkpoint in {out}/checkpoints and starts from step 0; "
            "give the task an `out` every attempt sees (a volume mounted in the pod, a shared file system), not the pod's own disk",
            flush=True,
        )
    return attempt
