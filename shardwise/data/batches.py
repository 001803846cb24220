"""How a batch becomes a model call and a loss, for every kind of batch users feed.

Three shapes of batch are common, and each calls the model the way its users expect:

- a tuple or list ``(x, y)`` (or ``(x1, x2, ..., y)``): ``model(x)``, every element but the
  last (the target) positional;
- a mapping (what a collated Hugging Face data set gives: ``input_ids``, ``attention_mask``,
  ``labels``, ...): ``model(**batch)``, every key a keyword;
- a lone tensor: ``model(batch)``.

Without a ``loss_fn`` or a ``training_step``, the loss is the one the model returns: the
``loss`` of a ``ModelOutput`` (or of a dict), as transformers' models give when the batch
holds ``labels``. This is a side module below the strategies, so the pipeline's last stage and
the Trainer call the model the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError


def model_args(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments the model is called with for ``batch``."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return (tuple(batch[:-1]) if len(batch) > 1 else tuple(batch)), {}
    return (batch,), {}


def model_inputs(batch: Any) -> tuple[Any, ...]:
    """The positional inputs of a tuple/list or tensor batch (kept for callers that take no keywords)."""
    return model_args(batch)[0]


def call_model(model: Any, batch: Any) -> Any:
    """``model(x)`` for ``(x, y)``, ``model(**batch)`` for a mapping, ``model(batch)`` for a tensor."""
    args, kwargs = model_args(batch)
    return model(*args, **kwargs)


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned itself (``output.loss`` or ``output["loss"]``), or None."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def loss_from_output(output: Any, batch: Any) -> torch.Tensor:
    """The model's own loss, or a ConfigError saying how to get one."""
    loss = output_loss(output)
    if loss is None:
        keys = sorted(batch) if isinstance(batch, Mapping) else None
        held = f"a batch with keys {keys}" if keys is not None else f"a {type(batch).__name__} batch"
        raise ConfigError(
            f"no loss: the model returned {type(output).__name__} without a `loss` for {held}. Pass "
            "loss_fn=... (a function of the output and the batch) to the Trainer, define training_step(batch) "
            "on the model, or put the targets in the batch under the key the model's forward takes "
            "(transformers' models compute their loss when the batch holds `labels`)"
        )
    return loss


def returns_own_loss(model: nn.Module) -> bool:
    """Whether ``model`` computes a loss itself from a batch key (transformers' ``labels``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "labels" in params


def check_batch_fits(model: nn.Module, batch: Any) -> None:
    """A ConfigError before launch when the batch cannot be passed to ``model.forward``.

    Binds the arguments ``call_model`` would pass against the forward's signature without
    running it, so a mapping given to ``forward(x)`` or a key the forward does not take names
    both sides instead of failing with a raw ``TypeError`` in every worker.
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    args, kwargs = model_args(batch)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        takes = ", ".join(str(p) for p in signature.parameters.values())
        if isinstance(batch, Mapping):
            holds = f"a mapping with keys {sorted(batch)} (passed as model(**batch))"
        elif isinstance(batch, (tuple, list)):
            holds = f"a {type(batch).__name__} of {len(batch)} elements (passed as model(*batch[:-1]); the last element is the target)"
        else:
            holds = f"a {type(batch).__name__} (passed as model(batch))"
        raise ConfigError(
            f"the batch does not fit {type(model).__name__}.forward({takes}): the batch is {holds}, and binding "
            f"it fails with: {exc}. Make the data set's samples match the forward (a dict whose keys are the "
            "forward's parameter names, or an (inputs..., target) tuple), or define training_step(batch) on the model"
        ) from None
    check_mask_kind(model, batch)


def check_mask_kind(model: nn.Module, batch: Any) -> None:
    """A bool attention mask of one row per query (``TokenShards(document_mask=True)``'s block-diagonal one)
    given to a transformers model whose attention is ``eager``: eager adds the mask to its scores, so True
    and False would add 1 and 0 and mask nothing (sdpa reads a bool mask as "may attend"). A ConfigError."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() >= 4 and attn == "eager":
        raise ConfigError(
            f"{type(model).__name__} runs eager attention, which adds attention_mask to its scores, and the batch's "
            f"attention_mask is a bool {tuple(mask.shape)} mask (a document mask): added, it would mask nothing. Load the "
            "model with attn_implementation='sdpa', or turn the mask additive in a collate_fn "
            "(shardwise.data.files.additive_mask(mask, dtype))"
        )


class _Called(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("training_step called the model")
        self.args, self.kwargs = args, kwargs


def run_own_step(model: nn.Module, batch: Any, forward: Any) -> Any:
    """``model.training_step(batch)`` with the model's ``self(...)`` answered by ``forward`` (an
    instance attribute for the call's duration: ``nn.Module.__call__`` reads ``self.forward``)."""
    had = "forward" in model.__dict__
    saved = model.__dict__.get("forward")
    model.__dict__["forward"] = forward
    try:
        return model.training_step(batch)  # type: ignore[operator]
    finally:
        if had:
            model.__dict__["forward"] = saved
        else:
            model.__dict__.pop("forward", None)


def own_call(model: nn.Module, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments of the first ``self(...)`` that ``model.training_step(batch)`` makes (the step is
    stopped there, the forward never runs), or None when it returns without calling the model; an
    exception the step raises before the call propagates. Shared by the pipeline (`own_step`) and
    context parallelism's parent check, which both need the forward's own arguments."""

    def record(*args: Any, **kwargs: Any) -> Any:
        raise _Called(args, kwargs)

    try:
        run_own_step(model, batch, record)
    except _Called as called:
        return called.args, called.kwargs
    return None
