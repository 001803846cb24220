"""A model whose ``training_step`` calls its own forward (``logits, loss = self(x, y)``, as nanoGPT's
``GPT`` does: ``forward(idx, targets=None)`` returns the loss when given targets).

The pipeline runs the model's forward in stages, so the loss is computed on the last stage, where
the model's own forward computes it when the targets reach it. `probe_call` runs the
``training_step`` on a micro-batch up to its ``self(...)`` call (the forward is replaced by a recorder
that stops it there) and reads which elements of the batch the call takes, positionally and by
keyword (`Call`); every stage then receives those elements (`Call.stage_kwargs`) and calls the
model's forward with them, so the last stage's forward returns what ``self(x, y)`` returns on the
whole model. On the last stage the ``training_step`` runs again for the schedule's loss, with
``self(...)`` answered by that output (`run_own_step`). A call that is not made of the batch's own
elements (``self(x.long(), y)``), or a step that never calls ``self``, is a `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.data.batches import own_call, run_own_step
from shardwise.errors import ConfigError

__all__ = ["Call", "has_own_step", "probe_call", "run_own_step"]


def has_own_step(model: nn.Module) -> bool:
    """Whether ``model`` defines ``training_step`` (the Trainer then computes the loss through it)."""
    return callable(getattr(model, "training_step", None))


@dataclass(frozen=True)
class Call:
    """How ``training_step`` calls the model: each argument an element of the batch (an index of a
    tuple batch, a key of a dict batch) or a constant that is not a tensor."""

    args: tuple[tuple[str, Any], ...]
    """Positional arguments: ("batch", index or key), ("whole", None) (a tensor batch) or ("const", value)."""
    kwargs: dict[str, tuple[str, Any]] = field(default_factory=dict)
    """Keyword arguments, the same way."""

    def bind(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments for ``batch`` (a micro-batch, or a sample)."""

        def value(ref: tuple[str, Any]) -> Any:
            return batch if ref[0] == "whole" else batch[ref[1]] if ref[0] == "batch" else ref[1]

        return tuple(value(r) for r in self.args), {k: value(r) for k, r in self.kwargs.items()}

    def stage_kwargs(self, batch: Any) -> dict[str, Any]:
        """The keywords every nested stage receives (positional arguments as ``_arg{i}``)."""
        args, kwargs = self.bind(batch)
        clash = [k for k in kwargs if k.startswith("_arg")]
        if clash:
            raise ConfigError(f"training_step calls the model with keywords {clash}, which the pipeline uses for positional arguments")
        return {**{f"_arg{i}": a for i, a in enumerate(args)}, **kwargs}


def probe_call(model: nn.Module, batch: Any) -> Call:
    """How ``model.training_step(batch)`` calls the model (see the module); stops at that call."""
    name = type(model).__name__

    try:
        called = own_call(model, batch)
    except Exception as exc:
        raise ConfigError(
            f"{name}.training_step raised {type(exc).__name__} before calling the model ({exc}); under the pipeline the "
            "step must call the model itself (self(x) or self(x, y)), whose forward runs in stages; pass loss_fn=... instead"
        ) from None
    if called is not None:
        args, kwargs = called
        return Call(tuple(_ref(a, batch, name) for a in args), {k: _ref(v, batch, name) for k, v in kwargs.items()})
    raise ConfigError(
        f"{name}.training_step returned without calling the model (self(...)); the pipeline runs the model's forward in "
        "stages and computes the loss on the last one from what self(...) returns there; call self(x) or self(x, y) in "
        "training_step, or pass loss_fn=... to the Trainer"
    )


def _ref(value: Any, batch: Any, name: str) -> tuple[str, Any]:
    if not isinstance(value, torch.Tensor):
        return ("const", value)
    if value is batch:
        return ("whole", None)
    keys = list(batch) if isinstance(batch, Mapping) else list(range(len(batch))) if isinstance(batch, (tuple, list)) else []
    for k in keys:
        if batch[k] is value:
            return ("batch", k)
    raise ConfigError(
        f"{name}.training_step calls the model with a tensor that is not an element of the batch (shape "
        f"{tuple(value.shape)}, computed in training_step): the pipeline hands each stage the batch's own elements, "
        "cut into micro-batches; compute it in the data set (or in forward), or pass loss_fn=... to the Trainer"
    )
