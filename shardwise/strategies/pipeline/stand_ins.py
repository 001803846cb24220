"""What a nested model's pipeline stage holds in place of what another stage owns, and how a stage
ends: the stand-ins for the prelude (`_Incoming`: the received activation), the postlude
(`_NotHere`: never reached) and the blocks of other stages (`_Elsewhere`: they pass the hidden
states through, so the forward's loop still counts every block and a per-layer pattern, a mask
kind or a per-layer input picked by the block's index, goes to the right block), the exception
that stops a stage after its last block, and the tensors a stage reads from a block's or the
model's output (`nested.NestedStage` uses them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError


class _Holder:
    """The activation a stage received, read by its stand-ins and its first block's pre-hook."""

    tensor: torch.Tensor | None = None
    started: bool = False
    """Whether this forward has reached the stage's first block (a prelude stand-in must not run after it)."""
    active: bool = False
    """Whether this stage's forward is running (the hooks on the shared blocks act only then)."""
    skipped: bool = False
    """Whether this forward ran a stand-in for another stage's block (`_Elsewhere`)."""


class _Incoming(nn.Module):
    """Stands in for a prelude module on a later stage: returns the received activation (which the
    first block's pre-hook puts in place anyway), so the model's forward runs on shapes that fit.
    Attributes the forward reads (ViT reads its patch projection's dtype) come from the module it
    stands for, whose parameters it does not register."""

    def __init__(self, holder: _Holder, original: nn.Module | None = None, name: str = "", blocks: str = "") -> None:
        super().__init__()
        self._holder = holder
        self.__dict__["_original"] = original
        self._name, self._blocks = name, blocks

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None:
                raise
            return getattr(original, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._holder.started:
            # never train a model with a layer silently skipped: the split was wrong for this forward
            raise ConfigError(
                f"the pipeline took {self._name} for a module that runs before the blocks ({self._blocks}) and gave it to "
                "the first stage, but the forward ran it after them; pass layers=... and split_points=..., or use another strategy"
            )
        received = self._holder.tensor
        shape = _meta_shape(self.__dict__.get("_original"), args, kwargs)
        if received is None or shape is None or shape == tuple(received.shape):
            return received
        # the module's output is not the shape the blocks pass on (DeepSeek-V4 widens the embedding into
        # hidden streams after it): what the forward computes from it is replaced at the first block anyway
        return received.new_zeros(shape)


def _meta_shape(module: nn.Module | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape of ``module``'s output for these inputs, from a run on meta tensors (None if it cannot tell)."""
    if module is None:
        return None
    from torch.func import functional_call

    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    try:
        state = {k: meta(v) for k, v in {**dict(module.named_parameters()), **dict(module.named_buffers())}.items()}
        out = functional_call(module, state, tuple(meta(a) for a in args), {k: meta(v) for k, v in kwargs.items()})
    except Exception:
        return None
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


class _NotHere(nn.Module):
    """Stands in for a postlude module on a stage before the last (its forward stops earlier)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"the pipeline took {self._name} for a module that runs after the blocks (it is declared after them), "
            "but the forward ran it before them (a module whose output feeds every block, as per-layer input embeddings "
            "do, cannot be split: a stage boundary carries the hidden states only); pass layers=... if the block list is "
            "another, or use another strategy (ddp, fsdp)"
        )


class _StageExit(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stage exit")
        self.hidden = hidden


def _hidden_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise ConfigError(f"a pipeline block returned {type(output).__name__}; the pipeline carries one tensor (the hidden states) between stages")


def _output_tensor(output: Any) -> torch.Tensor:
    """The tensor a last stage hands the schedule: the logits of a ModelOutput, the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConfigError(f"the model's output {type(output).__name__} holds no tensor the pipeline can return (logits, or a tensor)")


def _replace_first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args and isinstance(args[0], torch.Tensor):
        return (hidden,) + tuple(args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": hidden}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return args, {**kwargs, k: hidden}
    raise ConfigError("the pipeline could not find the hidden states among the first block's inputs")


class _Elsewhere(nn.Module):
    """Stands in for a block another stage owns: the stage's block list keeps every key, so the
    forward's loop counts the blocks as the whole model does (``for i, layer in enumerate(self.layers)``
    picks ``config.layer_types[i]``, a mask kind or a per-layer input by ``i``: with only this stage's
    blocks in the list, the second stage's first block got the pattern of block 0). It passes the
    hidden states on unchanged (the first owned block's pre-hook puts the received activation in place
    anyway); attributes the forward reads (``attention_type``) come from the block it stands for, whose
    parameters it does not register."""

    def __init__(self, holder: _Holder, original: nn.Module, name: str) -> None:
        super().__init__()
        self._holder = holder
        self.__dict__["_original"] = original
        self._name = name

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_original"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._holder.started:
            raise ConfigError(
                f"the pipeline stage's forward ran block {self._name}, owned by a later stage, after this stage's own blocks "
                "(the model calls its blocks out of order, or one twice); pass layers=... and split_points=..., or use another strategy"
            )
        self._holder.skipped = True
        if self._holder.tensor is not None:
            return self._holder.tensor
        return _hidden_in(args, kwargs)


def _hidden_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states among a block's inputs: the first positional tensor, else ``hidden_states``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for k in ("hidden_states", *kwargs):
        if isinstance(kwargs.get(k), torch.Tensor) and kwargs[k].is_floating_point():
            return kwargs[k]
    raise ConfigError("the pipeline could not find the hidden states among a block's inputs")
