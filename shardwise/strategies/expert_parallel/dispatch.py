"""Token dispatch and combine over the ``ep`` ranks, with all-to-all (GShard, Lepikhin et al., 2020).

Each rank holds experts ``[r * n, (r + 1) * n)`` of an experts layer (n = E / ep). A forward on T
local tokens routed top-k (the model's own router, replicated, untouched) makes S = T x k
(token, expert) pairs:

1. the pairs sorted by expert (stable), so the pairs for rank j are one contiguous block;
2. ``counts`` (E int64, how many pairs go to each expert) exchanged by an all-to-all of equal pieces
   (n counts to each rank): each rank learns how many rows it receives and for which local expert;
3. the pairs' hidden rows (H values each) sent to the experts' owners (all-to-all, autograd);
4. the owner runs the model's own experts forward on them (its slice of the stacked parameters,
   each row to its local expert, routing weight 1), so gating, biases and activation stay the model's;
5. the outputs sent back (all-to-all, autograd), put back in pair order, multiplied by the routing
   weights and summed over k: the layer's output, as the model computes it. Dropless, as the
   transformers families are: every pair reaches its expert.

Bytes per layer per forward, rank r (row = H x element size): counts (ep - 1) x n x 8 sent and
received; dispatch sends the rows of pairs whose expert is elsewhere and receives the rows other
ranks route to r's experts; combine the reverse. Backward repeats both row exchanges (not counts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.comm import Group, Recorder, all_to_all, all_to_all_autograd
from shardwise.errors import ConfigError
from shardwise.strategies.expert_parallel.detect import INTERFACE


def _take_three(names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """The three experts arguments, by position or by the module's own names, and the positional rest."""
    rest = list(args)
    three = [rest.pop(0) if rest else kwargs.pop(n, None) for n in names[:3]]
    return three, tuple(rest)


def check_call(name: str, hidden: Any, index: Any, weights: Any) -> None:
    """The experts' call has the interface ep splits (`detect.INTERFACE`), or a `ConfigError` naming what came."""
    ok = all(isinstance(t, torch.Tensor) for t in (hidden, index, weights))
    ok = ok and hidden.dim() == 2 and index.dim() == 2 and not index.is_floating_point() and weights.is_floating_point()
    ok = ok and index.shape[0] == hidden.shape[0] and tuple(weights.shape) == tuple(index.shape)
    if not ok:
        got = ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in (hidden, index, weights))
        raise ConfigError(f"ep: the experts layer '{name}' was called with ({got}); ep needs {INTERFACE}; use ep=1 for this model")


def dispatch_forward(
    module: nn.Module, inner: Callable[..., torch.Tensor], group: Group, recorder: Recorder | None, experts: int, name: str = "", names: tuple[str, ...] = ()
) -> Callable[..., torch.Tensor]:
    """The forward that replaces ``module.forward``: routes to the owners of the experts, runs
    ``inner`` (the model's own experts forward, bound to the local slice) on what arrives, combines."""
    ep = group.size
    local = experts // ep
    names = names or ("hidden_states", "top_k_index", "top_k_weights")

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        (hidden_states, top_k_index, top_k_weights), args = _take_three(names, args, kwargs)
        check_call(name, hidden_states, top_k_index, top_k_weights)
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=experts)
        rows = hidden_states.repeat_interleave(k, dim=0)[order]
        send = counts.view(ep, local).sum(1).tolist()
        got = all_to_all(counts, group=group, recorder=recorder).view(ep, local)  # from rank j: its counts for my experts
        recv = got.sum(1).tolist()
        arrived = all_to_all_autograd(rows, send, recv, group=group, recorder=recorder)
        which = torch.arange(local, device=ids.device).repeat(ep).repeat_interleave(got.reshape(-1))
        ones = torch.ones(arrived.shape[0], 1, dtype=top_k_weights.dtype, device=arrived.device)
        out = inner(arrived, which[:, None], ones, *args, **kwargs)
        if not out.requires_grad and arrived.requires_grad:
            out = out + 0 * arrived  # no local expert hit: keep the backward all-to-all symmetric across ranks
        back = all_to_all_autograd(out, recv, send, group=group, recorder=recorder)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        pairs = back[inverse]  # back in pair order: token-major, k fastest
        y = (pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(1)
        return y.to(hidden_states.dtype)

    return forward
