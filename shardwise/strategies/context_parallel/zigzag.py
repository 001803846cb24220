"""The sequence split over ``cp`` ranks, zig-zag, and the model's output gathered back.

The sequence of length s is cut into ``2 * cp`` chunks; rank r keeps chunks r and 2cp-1-r, so every
rank holds as many early (cheap) as late (expensive) causal queries. The same split applies to every
per-token input (token ids, embeddings, position ids, labels already shifted by one), so position ids
(rotary, learned) stay the tokens' true positions and the loss covers each token once.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm.collectives import Group, all_gather
from shardwise.comm.recorder import Recorder


def positions(seq: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions rank ``rank`` holds, in its local order (chunk r, then chunk 2cp-1-r)."""
    c = seq // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def rank_order(seq: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of the whole sequence gathered in rank order (rank 0's, then rank 1's, ...)."""
    return torch.cat([positions(seq, cp, r, device) for r in range(cp)])


def split(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag share of ``t`` along ``dim`` (the sequence dimension)."""
    return t.index_select(dim, positions(t.shape[dim], cp, rank, t.device))


class GatherSequence(torch.autograd.Function):
    """All ranks' shares gathered to the whole sequence, in order; backward keeps this rank's share of
    the gradient, times cp: each cp rank computes the same loss from the whole output, and the data-parallel
    average over dp x cp ranks divides by cp once more than the sum over shares needs."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Group, recorder: Recorder | None) -> torch.Tensor:
        p, n = group.size, local.shape[1]
        parts = all_gather(local.contiguous(), group=group, recorder=recorder)
        gathered = torch.cat(parts, dim=1)
        order = rank_order(p * n, p, local.device)
        whole = torch.empty_like(gathered)
        whole[:, order] = gathered
        ctx.p, ctx.rank = p, group.rank
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return split(grad, ctx.p, ctx.rank) * ctx.p, None, None


def gather(local: torch.Tensor, group: Group, recorder: Recorder | None) -> torch.Tensor:
    """The whole sequence of a per-token output (dim 1) from every cp rank's share (`GatherSequence`)."""
    out: torch.Tensor = GatherSequence.apply(local, group, recorder)
    return out


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """transformers' causal-LM shift done before the split: position t is scored against token t+1,
    the last position against nothing (``ignore_index``)."""
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)
