"""Weights tied across pipeline stages (a token embedding on the first stage shared with the
head on the last): one logical weight held as a copy by each owning rank.

The copies start equal (broadcast from the owner of the weight's first name), after each
backward their gradients are summed over the owners (so each copy gets the whole gradient the
shared weight gets in the unsplit model), the global norm counts the weight once (on its first
owner), and both copies take the same optimizer step, so they stay equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.comm import Group, Recorder, all_reduce, broadcast


@dataclass(frozen=True)
class Tie:
    name: str
    """The weight's first name (``named_parameters`` order): the name its optimizer state has."""
    owners: tuple[int, ...]
    """Pipeline ranks holding a copy."""
    first: int
    """The pipeline rank holding the first name: its copy is the reference, its norm counts."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def _owner_stage(name: str, layout: Any, block_runs: Sequence[Sequence[str]]) -> int:
    for s, run in enumerate(block_runs):
        for k in run:
            if name.startswith(f"{layout.blocks}.{k}."):
                return s
    if any(name.startswith(p + ".") for p in layout.prelude):
        return 0
    return len(block_runs) - 1


def _cross_stage_ties(model: nn.Module, layout: Any, block_runs: Sequence[Sequence[str]], pp: int) -> list[Tie]:
    """The model's shared parameters whose names land on stages of different pipeline ranks."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    ties = []
    for pid, group in names.items():
        if len(group) < 2:
            continue
        ranks = [_owner_stage(n, layout, block_runs) % pp for n in group]
        if len(set(ranks)) > 1:
            shared = params[pid]
            ties.append(Tie(group[0], tuple(sorted(set(ranks))), ranks[0], tuple(shared.shape), shared.dtype))
    return ties


def _find_param(stages: dict[int, nn.Module], name: str, aliases: dict[str, str]) -> nn.Parameter | None:
    """This rank's copy of the tied weight ``name`` (under any of its names), or None."""
    wanted = {name} | {a for a, c in aliases.items() if c == name}
    for stage in stages.values():
        for n, p in stage.named_parameters():
            if n in wanted:
                return p
    return None


def sync_tied(
    ties: Sequence[Tie], params: dict[str, nn.Parameter | None], group: Group, me: int, *, grads: bool, device: torch.device, recorder: Recorder | None = None
) -> None:
    """Start the copies equal (``grads=False``) or sum their gradients over the owners (``grads=True``).

    One collective per tied weight over the pipeline group: ranks that hold no copy take part
    with zeros (a sum) or a scratch buffer (a broadcast)."""
    for tie in ties:
        p = params.get(tie.name)
        if grads:
            g = p.grad if p is not None and p.grad is not None else None
            buf = g if g is not None else torch.zeros(tie.shape, dtype=tie.dtype, device=device)
            all_reduce(buf, "sum", group=group, recorder=recorder)
            if p is not None and g is None:
                p.grad = buf
        else:
            buf = p.data if p is not None else torch.empty(tie.shape, dtype=tie.dtype, device=device)
            with torch.no_grad():
                broadcast(buf, src=tie.first, group=group, recorder=recorder)
