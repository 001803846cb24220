"""Compress a trained model for inference: int8 quantization, magnitude pruning, knowledge distillation.

- `shardwise.tools.compress.quantize`: post-training dynamic and static int8 of the Linear layers (CPU).
- `shardwise.tools.compress.prune`: global unstructured and structured (channel, head) magnitude pruning
  with ``torch.nn.utils.prune``, and `ModelPruning`, the Trainer callback that prunes while fine-tuning.
- `shardwise.tools.compress.distill`: `Distillation`, a Trainer loss that distills a frozen teacher into
  the model being trained, under any data-parallel strategy.
- `shardwise.tools.compress.commands`: ``shardwise compress quantize|prune|distill``, which load a
  recipe's checkpoint, compress it, and report size, latency and accuracy before and after.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Distillation": "distill",
    "distillation_loss": "distill",
    "ModelPruning": "prune",
    "make_permanent": "prune",
    "prune_to": "prune",
    "sparsity_of": "prune",
    "dynamic_int8": "quantize",
    "static_int8": "quantize",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Loaded on first use: `shardwise --help` builds this package's parser without importing torch.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise.tools.compress' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"shardwise.tools.compress.{_EXPORTS[name]}"), name)
