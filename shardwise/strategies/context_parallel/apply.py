"""`apply_context_parallel`: the model's forward over this rank's zig-zag share of the sequence.

The forward is replaced on the instance (the module, its names and its state are unchanged, so any
data-parallel or tensor-parallel wrapping around it works as before): per-token inputs are split,
attention is routed (`hooks.py`), the output is gathered back to the whole sequence, and a loss the
model computes itself is made the loss of all tokens (its gradient summed over cp ranks, then averaged
with the data-parallel ranks: the data-parallel group of a cp run is dp x cp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.comm.collectives import Group, all_reduce
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies.context_parallel import zigzag
from shardwise.strategies.context_parallel.hooks import SEQUENCE_KEYS, CPState, position_hooks, route_hf, routed_sdpa


def sequence_length(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The sequence length of a call: dim 1 of the token ids (or embeddings), else of the first 2-D tensor argument."""
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return int(kwargs[key].shape[1])
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            return int(a.shape[1])
    raise ConfigError(
        "context parallelism found no sequence to split: the model is called without input_ids, inputs_embeds or a "
        "[batch, sequence, ...] tensor argument; cp splits token sequences only"
    )


def check_divisible(seq: int, cp: int) -> None:
    """A `ConfigError` unless ``seq`` splits into ``2 * cp`` equal chunks (the zig-zag's)."""
    if seq % (2 * cp):
        raise ConfigError(
            f"context parallelism over cp={cp} splits the sequence into 2 x cp = {2 * cp} equal chunks (the zig-zag that "
            f"balances causal work); the sequence length {seq} is not divisible by {2 * cp}. Pad or cut sequences to a multiple of {2 * cp}"
        )


def _split_kwargs(kwargs: dict[str, Any], seq: int, state: CPState) -> dict[str, Any]:
    cp, rank = state.cp, state.group.rank
    out = dict(kwargs)
    mask = out.pop("attention_mask", None)
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise ConfigError(
            "context parallelism got an attention_mask with padding (zeros): ring attention applies the causal pattern only. "
            "Pack sequences to full length without padding, or run without cp"
        )
    ref = next(out[k] for k in ("input_ids", "inputs_embeds") if isinstance(out.get(k), torch.Tensor))
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq, device=ref.device).expand(ref.shape[0], -1)
    for key in SEQUENCE_KEYS:
        if isinstance(out.get(key), torch.Tensor):
            out[key] = zigzag.split(out[key], cp, rank)
    labels = out.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.shape[1] == seq:
        shifted = zigzag.shift_labels(labels)
        out["shift_labels"] = zigzag.split(shifted, cp, rank)
        out["labels"] = zigzag.split(labels, cp, rank)
        # each rank's sum over its tokens divided by (all valid tokens / cp): the mean over cp is the loss of all tokens
        out["num_items_in_batch"] = (shifted != -100).sum().to(torch.float64) / cp
    out.setdefault("use_cache", False)
    return out


def _split_args(args: tuple[Any, ...], seq: int, state: CPState) -> tuple[Any, ...]:
    return tuple(zigzag.split(a, state.cp, state.group.rank) if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[1] == seq else a for a in args)


def _global_loss(loss: torch.Tensor, state: CPState) -> torch.Tensor:
    """``loss`` (this rank's share, scaled) with the value of the loss of all tokens, its gradient unchanged."""
    mean = loss.detach().clone().reshape(1)
    all_reduce(mean, "mean", group=state.group, recorder=state.recorder)
    return loss + (mean[0] - loss.detach())


def _finish(out: Any, n: int, state: CPState) -> Any:
    """The whole sequence of every per-token output; a returned loss made the loss of all tokens."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() >= 2 and t.shape[1] == n:
            return zigzag.gather(t, state.group, state.recorder)
        if t.dim() == 0 and t.is_floating_point():
            return _global_loss(t, state)
        return t

    if isinstance(out, torch.Tensor):
        return one(out)
    if isinstance(out, tuple) and not hasattr(out, "keys"):
        return type(out)(one(t) for t in out) if not hasattr(out, "_fields") else type(out)(*(one(t) for t in out))
    if hasattr(out, "logits") and isinstance(out.logits, torch.Tensor):
        out.logits = one(out.logits)
        if isinstance(getattr(out, "loss", None), torch.Tensor):
            out.loss = _global_loss(out.loss, state)
        return out
    return out


def local_call(original: Any, state: CPState, local: list[torch.Tensor], hf: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """``original`` run on this rank's share of the call's sequence (inputs split, positions set for the
    `position_hooks` of ``local``, attention routed): (its output, the local length). The cp forward's
    body, and the parent's emulated ranks' (`emulate.py`)."""
    seq = sequence_length(args, kwargs)
    check_divisible(seq, state.cp)
    state.seq = seq
    if hf and not args:
        kwargs = _split_kwargs(kwargs, seq, state)
    else:
        args = _split_args(args, seq, state)
    ref = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
    local[:] = [zigzag.positions(seq, state.cp, state.group.rank, ref.device)]
    try:
        with routed_sdpa(state):
            out = original(*args, **kwargs)
    finally:
        local.clear()
    return out, seq // state.cp


def wrap_forward(model: nn.Module, state: CPState, hf: bool) -> None:
    """Replace ``model.forward`` (on the instance) by its context-parallel version."""
    original = model.forward
    local: list[torch.Tensor] = []
    position_hooks(model, state, local)

    def forward(*args: Any, **kwargs: Any) -> Any:
        out, n = local_call(original, state, local, hf, args, kwargs)
        return _finish(out, n, state)

    model.forward = forward


def apply_context_parallel(model: nn.Module, group: Group, recorder: Recorder | None, style: str = "ring") -> CPState:
    """Make ``model`` run over this rank's share of each sequence of the cp ``group`` (in place).

    ``style``: ``"ring"`` (key/value blocks around the ring) or ``"ulysses"`` (all-to-all over heads).
    Returns the run's `CPState` (its attention call count, for tests and summaries)."""
    state = CPState(group, recorder, style)
    hf = route_hf(model, state) is not None
    wrap_forward(model, state, hf)
    return state


@contextlib.contextmanager
def _no_grad_eval(model: nn.Module) -> Any:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)
