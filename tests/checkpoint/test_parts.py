"""Checkpoints in parts (`shardwise.checkpoint.parts`): every rank's share merged into the state
``single`` would have written, without processes."""

from __future__ import annotations

import torch

from shardwise.checkpoint.parts import merge


def test_parts_merge_in_the_models_key_order_and_a_tied_tensor_keeps_the_first_ranks_copy() -> None:
    # A model written the way many are: the head declared before the blocks, so its state-dict order
    # (embed, head, blocks) is not the stages' order (rank 0: embed, block 0; rank 1: block 1, head).
    order = ["embed.weight", "head.weight", "blocks.0.weight", "blocks.1.weight"]
    tied = torch.ones(2)
    parts = [
        {"model": {"embed.weight": tied, "blocks.0.weight": torch.zeros(2)}},
        {"model": {"blocks.1.weight": torch.full((2,), 2.0), "head.weight": tied.clone().add_(1), "embed.weight": tied.clone().add_(1)}},
    ]
    whole = merge(parts, names=[], order=order)["model"]
    assert list(whole) == order
    assert whole["embed.weight"] is tied  # rank 0's copy of a tensor two ranks hold
    # Keys the order does not name (a buffer added after the order was taken) follow, in rank order.
    parts[1]["model"]["extra"] = torch.zeros(1)
    assert list(merge(parts, names=[], order=order)["model"]) == [*order, "extra"]
