"""The README's Trainer example with the `if __name__ == "__main__":` guard (python guarded_trainer.py OUT)."""

import sys

import torch
from torch import nn

import shardwise


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def loss_fn(output, batch):
    return nn.functional.cross_entropy(output, batch[1])


if __name__ == "__main__":
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = shardwise.Trainer(strategy="ddp", nproc=2, global_batch_size=8, max_steps=4, loss_fn=loss_fn, out=sys.argv[1], progress_bar=False)
    summary = trainer.fit(TinyNet(), data)
    print(f"fit done {summary['steps']} {summary['world_size']}", flush=True)  # one write
