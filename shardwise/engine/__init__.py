"""Layer 4: the bring-your-own-loop API (in the spirit of Lightning Fabric and Accelerate).

Inside any process of a job (started by ``shardwise.launch``, ``shardwise run``,
torchrun, Slurm, or alone), an `Engine` joins the process group, places the model
with the chosen strategy, and gives the loop what it needs:

>>> import torch
>>> from shardwise import Engine
>>> engine = Engine(strategy="single", accelerator="cpu")
>>> model, opt = engine.setup(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
>>> loss = model(torch.randn(8, 4)).pow(2).mean()
>>> engine.backward(loss)
>>> engine.step(opt)
True

The `Trainer` is built on this class and nothing else.
"""

from shardwise.engine.engine import Engine, call_through, seed_everything

__all__ = ["Engine", "call_through", "seed_everything"]
