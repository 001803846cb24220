"""The README's Trainer example as a user saves it: no `if __name__ == "__main__":` guard.

Usage: python unguarded_trainer.py OUT [STEPS]. Prints "fit done" once (the parent only).
"""

import sys

import torch
from torch import nn

import shardwise


class TinyNet(nn.Module):  # defined in __main__: the workers must find it
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def loss_fn(output, batch):
    return nn.functional.cross_entropy(output, batch[1])


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
trainer = shardwise.Trainer(strategy="ddp", nproc=2, global_batch_size=8, max_steps=steps, log_every=1, loss_fn=loss_fn, out=sys.argv[1], progress_bar=False)
model = TinyNet()
summary = trainer.fit(model, data)
print(f"fit done {summary['steps']} {summary['world_size']}", flush=True)  # one write: torchrun processes share stdout
