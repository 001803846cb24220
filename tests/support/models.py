"""Tiny models and data shared by the multi-process tests (module level, so they pickle)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def mlp(seed: int = 0, dropout: float = 0.0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3)).to(dtype)


def classification(n: int = 96, seed: int = 1, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=dtype)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)


def ce(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


def accuracy(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return (output.argmax(-1) == batch[1]).double().mean()


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


class WithTrainingStep(nn.Module):
    """A module that computes its own loss (Lightning style)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any) -> torch.Tensor:
        return ce(self(batch[0]), batch)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_traced_steps_are_the_loop_steps(steps: list[dict[str, Any]]) -> None:
    """Each recorded step's trace span against the loop's own clock around it: within 5% on the
    median step. A step's two clocks differ by the profiler's own step call, a few microseconds, unless
    the scheduler parks the process right there (a loaded machine): one such step is left out by the
    median, a window shifted by a step or a trace missing part of it is not."""
    gaps = sorted(abs(s["traced_step"] - s["measured_step"]) / s["measured_step"] for s in steps)
    assert gaps[(len(gaps) - 1) // 2] <= 0.05, steps
