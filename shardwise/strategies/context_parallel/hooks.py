"""Where context parallelism meets the model: its attention, its positions, its inputs and outputs.

- Hugging Face models: an attention function registered with transformers' ``AttentionInterface``
  and named in ``config._attn_implementation`` (transformers builds no mask for a name its mask
  interface does not know: the causal pattern is the ring's own).
- A plain model calling ``F.scaled_dot_product_attention``: the function is routed while the cp
  forward runs (causal, no mask, no dropout; anything else is an error naming the call).
- Positions: transformers' models take ``position_ids`` (the rank's true positions are passed); a
  model that builds ``arange(t)`` for its position embedding has that ``nn.Embedding``'s input
  replaced by the rank's positions.
- The forward: per-token inputs split zig-zag, labels shifted before the split (transformers'
  ``shift_labels``), per-token outputs gathered back to the whole sequence (`zigzag.gather`), a loss
  the model returns scaled so the data-parallel average over cp ranks is the loss of all tokens.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies.context_parallel import zigzag
from shardwise.strategies.context_parallel.ring import SDPA, ring_attention, ulysses_attention

SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "token_type_ids", "position_ids")
"""Keyword inputs split along the sequence (dim 1)."""
_NAMES = itertools.count()


@dataclass
class CPState:
    """One run's context parallelism: its group, its style, and the forward in progress (``seq``)."""

    group: Group
    recorder: Recorder | None
    style: str = "ring"
    seq: int = 0
    calls: int = 0
    reached: set[int] = field(default_factory=set)

    @property
    def cp(self) -> int:
        return self.group.size

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence ([b, h, n, d] in and out)."""
        self.calls += 1
        if self.cp == 1:  # the probe in the parent: plain causal attention
            return SDPA(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if self.style == "ulysses":
            return ulysses_attention(q, k, v, scale, self.group, self.recorder, zigzag.rank_order(self.seq, self.cp, q.device))
        return ring_attention(q, k, v, scale, self.group, self.recorder)


def _refuse(where: str, why: str) -> ConfigError:
    return ConfigError(f"context parallelism cannot be exact for {where}: {why}. Run without cp (strategy_options cp=1), or remove it from the model")


def hf_attention(state: CPState) -> Callable[..., tuple[torch.Tensor, None]]:
    """transformers' attention signature over `CPState.attend`."""

    def attention(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        where = type(module).__name__
        if attention_mask is not None:
            raise _refuse(where, "the model built an attention mask of its own (padding, a custom pattern); ring attention applies the causal pattern only")
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            raise _refuse(where, "its attention is not causal")
        window = kwargs.get("sliding_window")
        if window is not None and window < state.seq:
            raise _refuse(where, f"sliding-window attention (window {window} < sequence {state.seq})")
        if kwargs.get("softcap") is not None:
            raise _refuse(where, "softcapped attention scores")
        dropout = kwargs.get("dropout", args[0] if args else 0.0)
        if dropout:
            raise _refuse(where, f"attention dropout {dropout}")
        scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        state.reached.add(id(module))
        return state.attend(query, key, value, scale).transpose(1, 2).contiguous(), None

    return attention


def route_hf(model: nn.Module, state: CPState) -> str | None:
    """Register `hf_attention` and point every config of ``model`` at it; the name, or None for a model without one."""
    configs: dict[int, Any] = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    if not configs:
        return None
    from transformers import AttentionInterface

    name = f"shardwise_cp_{next(_NAMES)}"
    AttentionInterface.register(name, hf_attention(state))
    for cfg in configs.values():
        cfg._attn_implementation = name
    return name


@contextlib.contextmanager
def routed_sdpa(state: CPState) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` through `CPState.attend` while the block runs."""
    original = F.scaled_dot_product_attention  # restored as found (another routing may be active)

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **kw: Any,
    ) -> torch.Tensor:
        if attn_mask is not None or not is_causal or dropout_p:
            raise _refuse(
                "a scaled_dot_product_attention call",
                f"attn_mask {'given' if attn_mask is not None else 'None'}, is_causal={is_causal}, dropout_p={dropout_p}; "
                "only causal attention without mask or dropout splits",
            )
        return state.attend(query, key, value, scale if scale is not None else query.shape[-1] ** -0.5)

    F.scaled_dot_product_attention = sdpa  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def position_hooks(model: nn.Module, state: CPState, local: list[torch.Tensor]) -> list[Any]:
    """On every ``nn.Embedding``: an input equal to ``arange(n)`` (a position embedding's, n the local length)
    becomes the rank's true positions (``local[0]``, set by the forward)."""

    def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not local:
            return None
        idx, pos = args[0], local[0]
        if not isinstance(idx, torch.Tensor) or idx.shape[-1] != pos.numel() or idx.dim() > 2:
            return None
        if torch.equal(idx.reshape(-1, pos.numel()), torch.arange(pos.numel(), device=idx.device).expand(idx.numel() // pos.numel(), -1)):
            return (pos.expand_as(idx),)
        return None

    return [m.register_forward_pre_hook(pre) for m in model.modules() if isinstance(m, nn.Embedding)]
