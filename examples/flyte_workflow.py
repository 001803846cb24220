"""shardwise inside Flyte: the digits recipe trained in a GPU task on interruptible (spot) nodes
(which starts its own 2 processes) and in an elastic task (torch's elastic agent starts 2
processes, flytekit's PyTorch plugin), each returning the run's summary and checkpoint directory.

Both are ``interruptible=True`` with ``retries=3``: a preempted attempt checkpoints (the pod's
SIGTERM stops every rank at the next log step with a checkpoint), raises a recoverable error, and
the retry, with the same inputs, resumes from the last checkpoint in ``out`` (``resume="auto"``).
``out`` is a task input, not the task's working directory: on a cluster it must be storage every
attempt sees (a volume mounted in the pod, a shared file system); locally, a local directory. The
GPU task asks Flyte for 2 GPUs and trains on them with NCCL; where torch sees fewer (a local run
on a CPU machine) it trains on the CPU with gloo, the same numbers within rounding.

Runs locally, no cluster: ``python examples/flyte_workflow.py OUT_DIR [MAX_STEPS]`` prints the
workflow's outputs. On a cluster: ``pyflyte run --remote examples/flyte_workflow.py digits``.
"""

import sys
from pathlib import Path
from typing import NamedTuple

from flytekit import Resources, task, workflow
from flytekit.types.directory import FlyteDirectory
from flytekitplugins.kfpytorch import Elastic

from shardwise import Trainer, seed_everything
from shardwise.integrations.flyte import TrainOutputs, accelerator, note_attempt, outputs
from shardwise.tools.recipes import get_recipe

NPROC = 2
"""Processes per task: one per GPU where the pod has them."""
RETRIES = 3
"""Attempts after the first failed with a recoverable error, which a preempted attempt raises (`outputs`)."""


def train_digits(out: str, strategy: str, max_steps: int, device: str = "auto") -> TrainOutputs:
    """The digits recipe as ``shardwise train --recipe digits --nproc 2`` trains it, resumed from ``out`` on a retry."""
    note_attempt(out)
    recipe = get_recipe("digits")
    seed_everything(0)  # the same initial model on every rank (0 is the Trainer's default seed)
    parts = recipe.parts()
    settings = {**recipe.trainer_defaults, "max_steps": max_steps}  # a checkpoint every 100 steps, and at a preemption
    # resume="auto": a retry continues from out/checkpoints (a finished run is reported as it is)
    pieces = {"optimizer": parts.optimizer, "loss_fn": parts.loss_fn, "metrics": parts.metrics}
    trainer = Trainer(**settings, **pieces, strategy=strategy, nproc=NPROC, accelerator=device, out=out, resume="auto")
    summary = trainer.fit(parts.model, parts.train, parts.val)
    return outputs(summary, out)  # a preempted run raises FlyteRecoverableException: Flyte retries the task


@task(requests=Resources(gpu=str(NPROC), cpu="4", mem="8Gi"), limits=Resources(gpu=str(NPROC)), interruptible=True, retries=RETRIES)
def train_gpu(out: str, strategy: str, max_steps: int) -> TrainOutputs:
    """A plain task on 2 GPUs of a spot node: Trainer(nproc=2) starts the 2 processes itself, on CUDA where
    torch sees the GPUs, else on the CPU."""
    return train_digits(out, strategy, max_steps, device=accelerator(NPROC))


# increase_shared_mem=False: the plugin's deprecated default (a pod setting; @task(shared_memory=True) replaces it).
@task(task_config=Elastic(nnodes=1, nproc_per_node=NPROC, increase_shared_mem=False), interruptible=True, retries=RETRIES)
def train_elastic(out: str, strategy: str, max_steps: int) -> TrainOutputs:
    """An elastic task: torch's elastic agent starts 2 processes; each one's Trainer joins them."""
    return train_digits(out, strategy, max_steps)


class Runs(NamedTuple):
    gpu_summary: dict
    gpu_checkpoints: FlyteDirectory
    elastic_summary: dict
    elastic_checkpoints: FlyteDirectory


@workflow
def digits(gpu_out: str, elastic_out: str, strategy: str = "ddp", max_steps: int = 20) -> Runs:
    gpu = train_gpu(out=gpu_out, strategy=strategy, max_steps=max_steps)
    elastic = train_elastic(out=elastic_out, strategy=strategy, max_steps=max_steps)
    return Runs(gpu.summary, gpu.checkpoints, elastic.summary, elastic.checkpoints)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/flyte").resolve()
    result = digits(gpu_out=str(out / "gpu"), elastic_out=str(out / "elastic"), max_steps=int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    for name, s, checkpoints in [("gpu", *result[:2]), ("elastic", *result[2:])]:
        print(f"{name}: world_size {s['world_size']}  steps {s['steps']}  train_loss {s['train_loss']:.4f}  val_accuracy {s['val_accuracy']:.4f}")
        print(f"{name}: checkpoints {sorted(p.name for p in Path(checkpoints.path).iterdir())}")
