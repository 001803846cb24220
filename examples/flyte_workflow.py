"""shardwise inside Flyte: the digits recipe trained in a plain task (which starts its own 2
processes) and in an elastic task (torch's elastic agent starts 2 processes, flytekit's PyTorch
plugin), each returning the run's summary and checkpoint directory.

Runs locally, no cluster: ``python examples/flyte_workflow.py OUT_DIR [MAX_STEPS]`` prints the
workflow's outputs. On a cluster: ``pyflyte run --remote examples/flyte_workflow.py digits``.
"""

import sys
from pathlib import Path
from typing import NamedTuple

from flytekit import task, workflow
from flytekit.types.directory import FlyteDirectory
from flytekitplugins.kfpytorch import Elastic

from shardwise import Trainer, seed_everything
from shardwise.integrations.flyte import TrainOutputs, outputs
from shardwise.tools.recipes import get_recipe


def train_digits(out: str, strategy: str, max_steps: int) -> TrainOutputs:
    """The digits recipe as ``shardwise train --recipe digits --nproc 2`` trains it."""
    recipe = get_recipe("digits")
    seed_everything(0)  # the same initial model on every rank (0 is the Trainer's default seed)
    parts = recipe.parts()
    settings = {**recipe.trainer_defaults, "max_steps": max_steps}
    # a second run of the example moves the first aside (out/replaced-<time>/; nothing is deleted)
    trainer = Trainer(**settings, strategy=strategy, nproc=2, optimizer=parts.optimizer, loss_fn=parts.loss_fn, metrics=parts.metrics, out=out, overwrite=True)
    summary = trainer.fit(parts.model, parts.train, parts.val)
    return outputs(summary, out)


@task
def train_plain(out: str, strategy: str, max_steps: int) -> TrainOutputs:
    """A plain task: Trainer(nproc=2) starts the 2 processes itself."""
    return train_digits(out, strategy, max_steps)


# increase_shared_mem=False: the plugin's deprecated default (a pod setting; @task(shared_memory=True) replaces it).
@task(task_config=Elastic(nnodes=1, nproc_per_node=2, increase_shared_mem=False))
def train_elastic(out: str, strategy: str, max_steps: int) -> TrainOutputs:
    """An elastic task: torch's elastic agent starts 2 processes; each one's Trainer joins them."""
    return train_digits(out, strategy, max_steps)


class Runs(NamedTuple):
    plain_summary: dict
    plain_checkpoints: FlyteDirectory
    elastic_summary: dict
    elastic_checkpoints: FlyteDirectory


@workflow
def digits(plain_out: str, elastic_out: str, strategy: str = "ddp", max_steps: int = 20) -> Runs:
    plain = train_plain(out=plain_out, strategy=strategy, max_steps=max_steps)
    elastic = train_elastic(out=elastic_out, strategy=strategy, max_steps=max_steps)
    return Runs(plain.summary, plain.checkpoints, elastic.summary, elastic.checkpoints)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/flyte").resolve()
    result = digits(plain_out=str(out / "plain"), elastic_out=str(out / "elastic"), max_steps=int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    for name, s, checkpoints in [("plain", *result[:2]), ("elastic", *result[2:])]:
        print(f"{name}: world_size {s['world_size']}  steps {s['steps']}  train_loss {s['train_loss']:.4f}  val_accuracy {s['val_accuracy']:.4f}")
        print(f"{name}: checkpoints {sorted(p.name for p in Path(checkpoints.path).iterdir())}")
