"""`Engine.loader` over a stream, as the README writes a loop of one's own: each of 2 processes trains its share
of each global batch, the loader's position is saved with the model and loaded into a fresh loop, which
continues to the weights of an uninterrupted one, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import IterableDataset

from shardwise import Engine, launch


class Tokens(IterableDataset):
    """A stream of 36 samples (id, x, y): 4 steps of 8 an epoch, 4 left out."""

    def __iter__(self):
        for i in range(36):
            x = torch.randn(4, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            yield torch.tensor(i), x, x.sum()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1).double()


def step_fn(model: nn.Module, batch) -> torch.Tensor:
    _, x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).mean()


def train(engine: Engine, model, opt, loader, steps: int) -> list[list[int]]:
    seen = []
    for step, micro in enumerate(loader):  # one epoch's steps: each a list of `accumulate` micro-batches
        micro = [engine.to_device(b) for b in micro]
        seen.append([i for b in micro for i in b[0].tolist()])
        engine.forward_backward(model, micro, step_fn)
        engine.step(opt)
        opt.zero_grad()
        if step + 1 == steps:
            break
    return seen


def main(out: str) -> tuple[list[list[int]], bool]:
    engine = Engine(strategy="ddp", accelerator="cpu", precision="64")
    sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    model, opt = engine.setup(make_model(), sgd)
    whole = train(engine, model, opt, engine.loader(Tokens(), global_batch=8, accumulate=2), 4)

    model2, opt2 = engine.setup(make_model(), sgd)
    loader = engine.loader(Tokens(), global_batch=8, accumulate=2)
    first = train(engine, model2, opt2, loader, 2)
    engine.save(Path(out) / "ck", {"model": model2, "optimizer": opt2, "loader": loader})
    model3, opt3 = engine.setup(make_model(), sgd)
    again = engine.loader(Tokens(), global_batch=8, accumulate=2)
    engine.load(Path(out) / "ck", {"model": model3, "optimizer": opt3, "loader": again})
    rest = train(engine, model3, opt3, again, 2)
    same = all(torch.equal(a, b) for a, b in zip(engine.unwrap(model).state_dict().values(), engine.unwrap(model3).state_dict().values(), strict=True))
    engine.close()
    assert first + rest == whole
    return whole, same


def test_engine_loader_resumes_a_stream_bitwise_in_a_loop_of_ones_own(tmp_path):
    results = launch(main, str(tmp_path), nproc=2)
    for rank, (seen, same) in enumerate(results):
        assert same
        # rank r's micro-batch k of step s: samples s*8 + r + 2*j, j in [2k, 2k+2)
        assert seen == [[s * 8 + rank + 2 * j for j in range(4)] for s in range(4)]
