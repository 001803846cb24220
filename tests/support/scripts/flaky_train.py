"""A user's script run by `shardwise run`: rank 1 crashes on the first attempt; the restart finishes."""

import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import shardwise


class CrashOnce:
    def on_train_step_end(self, trainer, engine, step, loss):
        crash = "--no-crash" not in sys.argv
        if crash and step == 3 and engine.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise RuntimeError("simulated crash of rank 1")


def loss_fn(output, batch):
    return F.cross_entropy(output, batch[1])


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    trainer = shardwise.Trainer(
        strategy="ddp",
        global_batch_size=32,
        max_steps=8,
        checkpoint_every=2,
        out=out,
        resume="auto",
        loss_fn=loss_fn,
        callbacks=[CrashOnce()],
        progress_bar=False,
        log_every=2,
        timeout_s=60,
    )
    summary = trainer.fit(model, data)
    if trainer.engine is None and summary["world_size"] != int(os.environ["WORLD_SIZE"]):
        raise SystemExit("the Trainer did not join the launcher's job")


if __name__ == "__main__":
    main()
