"""Optimizer state keyed by parameter name or by number, so checkpoints move between strategies
(a plain ``optimizer.state_dict()`` numbers parameters; torch.distributed.checkpoint names them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import CheckpointError


def parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its groups' order (the order its state_dict numbers them)."""
    names = {id(p): n for n, p in module.named_parameters()}
    try:
        return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    except KeyError:
        raise CheckpointError("the optimizer holds parameters that are not the model's; build it from the parameters engine.setup hands it") from None


def optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A plain ``optimizer.state_dict()`` (parameters numbered 0, 1, ... in group order) keyed by parameter name.

    The form ``torch.distributed.checkpoint.state_dict`` speaks, so state saved by a strategy
    that keeps whole tensors loads into a sharded one.
    """
    numbers = [i for g in state["param_groups"] for i in g["params"]]
    if len(numbers) != len(names):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(numbers)} parameters; this one has {len(names)}. Resume with the same model and optimizer factory"
        )
    to_name = dict(zip(numbers, names, strict=True))
    return {
        "state": {to_name[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [to_name[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def optimizer_state_by_number(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Inverse of `optimizer_state_by_name`: named optimizer state numbered in this optimizer's order."""
    saved = [n for g in state["param_groups"] for n in g["params"]]
    if sorted(saved) != sorted(names):
        missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        raise CheckpointError(f"the checkpoint's optimizer does not match this model's parameters (missing {missing[:3]}, unexpected {extra[:3]})")
    to_number = {n: i for i, n in enumerate(names)}
    return {
        "state": {to_number[n]: s for n, s in state["state"].items()},
        "param_groups": [{**g, "params": [to_number[n] for n in g["params"]]} for g in state["param_groups"]],
    }
