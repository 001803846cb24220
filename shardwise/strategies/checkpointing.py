"""Activation checkpointing: blocks that run their forward again in backward instead of keeping what it saved.

Autograd keeps, for every block of a transformer, the tensors its backward needs (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", MLSys 2023: ``s h (34 + 5 a s / h)``
bytes a sample at 16 bits). A checkpointed block keeps only its inputs and runs its forward a second
time when backward reaches it (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016):
about one more forward of the checkpointed blocks per step, for their activations. The setting
(``TrainerConfig.activation_checkpointing``, ``--activation-checkpointing``, ``Engine(activation_checkpointing=)``):

- ``off`` (the default): nothing changes.
- ``blocks``: every block of the model's block list (the transformer layers of a Hugging Face model,
  the ``nn.ModuleList`` of a hand-written one), found as the pipeline finds it
  (`shardwise.strategies.pipeline.nested.find_blocks`: the model's own pipeline plan, else its largest
  list of same-class modules). Each keeps its inputs only.
- ``blocks:K``: every K-th block (blocks 0, K, 2K, ...), the others kept as usual: ``1/K`` of the
  recompute for a part of the saving (selective by layer, as Megatron's ``--recompute-num-layers``).
- ``ops``: every block, selective by operation (Korthikanti et al., section 5; torchtitan's op-level
  policy): the outputs of the linears (``mm``, ``addmm``) and of fused attention (scaled dot-product
  attention's kernels) are kept, everything else is recomputed: norms, activations, element-wise work,
  dropout, and an eager attention's ``s x s`` scores (its ``bmm``, softmax and dropout: Korthikanti's
  selective recomputation): part of the saving for a small part of the recompute
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``). ``ops:K``: every K-th block.

Mechanism: each chosen block gets an instance-level ``forward`` (a `Recompute`) that runs the class's
forward under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. No module is wrapped or
renamed, so parameter and module names, checkpoints, tp plans and pipeline splits are the same with and
without it; hooks on the block (FSDP2's gather, tp's input layouts, the pipeline's stage cuts) stay
outside the recomputed part and run once, as in torchtitan, where ``checkpoint_wrapper`` sits inside
``fully_shard``. fx traces blocks as leaves, so the pipeline's traced route keeps the patched call. The
RNG state is saved and restored around the recompute (``preserve_rng_state``), so dropout draws the
same mask twice and gradients equal the run without checkpointing, bit for bit. A block called with a
key/value cache (transformers' ``cache`` / ``past_key_values`` / ``layer_past`` and ``use_cache``) is
called without one, as transformers' own gradient checkpointing does: the recompute would write it
twice. Without gradients (evaluation, ``predict``) blocks run as usual.

The Engine applies this once per model in ``setup``, before the strategy (inside each worker: the
parent's model is not touched); ``Trainer._check`` refuses a bad value or a model without a block list
before launch (`check`).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardwise.errors import ConfigError
from shardwise.strategies.cost.saved import SavedBytes

MODES = ("off", "blocks", "blocks:K", "ops", "ops:K")
"""The values `parse` accepts (K a positive integer)."""

_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


@dataclass(frozen=True)
class Checkpointing:
    """A parsed ``activation_checkpointing`` value."""

    mode: str
    """``off``, ``blocks`` (recompute the whole block) or ``ops`` (keep matrix products, recompute the rest)."""
    every: int = 1
    """Checkpoint blocks ``0, every, 2 every, ...``."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def chosen(self, blocks: int) -> list[int]:
        """The indices of the checkpointed blocks among ``blocks``."""
        return list(range(0, blocks, self.every)) if self.enabled else []


def parse(value: str | Checkpointing | None) -> Checkpointing:
    """``"blocks:2"`` -> ``Checkpointing("blocks", 2)``; anything else a `ConfigError` naming the valid values."""
    if isinstance(value, Checkpointing):
        return value
    text = "off" if value in (None, "", False) else str(value).strip().lower()
    mode, colon, k = text.partition(":")
    try:
        every = int(k) if colon else 1
    except ValueError:
        every = 0
    if mode not in ("off", "blocks", "ops") or every < 1 or (mode == "off" and colon):
        raise ConfigError(
            f"activation_checkpointing={value!r} is not one of {', '.join(MODES)} (K a positive integer, e.g. 'blocks:2' "
            "for every second block); use 'blocks' to recompute every block in backward, 'ops' to keep its matrix products"
        )
    return Checkpointing(mode, every)


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's block list and its dotted path, found as the pipeline finds it, or a `ConfigError` saying how to get one."""
    from shardwise.strategies.pipeline.nested import find_blocks

    found = find_blocks(model)
    if found is None:
        lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        raise ConfigError(
            f"activation_checkpointing: {type(model).__name__} has no list of repeated blocks to checkpoint (an nn.ModuleList of "
            f"two or more modules of one class, or a transformers pipeline plan; its module lists: {lists or 'none'}); keep the "
            "model's layers in an nn.ModuleList (self.blocks = nn.ModuleList([...]) called in turn in forward), or "
            "activation_checkpointing='off'"
        )
    blocks = model.get_submodule(found)
    assert isinstance(blocks, nn.ModuleList)
    return found, blocks


def check(model: nn.Module, value: str | Checkpointing | None) -> Checkpointing:
    """What ``Trainer._check`` calls in the parent before launch: the value parses and, when on, the model has blocks."""
    policy = parse(value)
    if policy.enabled:
        find_block_list(model)
    return policy


def apply(model: nn.Module, value: str | Checkpointing | None) -> list[str]:
    """Checkpoint the chosen blocks of ``model`` in place (see the module); the names of those blocks.

    Idempotent: a block that already recomputes gets the new policy, not a second layer of checkpointing."""
    policy = parse(value)
    if not policy.enabled:
        return []
    path, blocks = find_block_list(model)
    names = []
    for i in policy.chosen(len(blocks)):
        block = blocks[i]
        block.forward = Recompute(block, ops=policy.mode == "ops")
        names.append(f"{path}.{i}")
    return names


def checkpointed(model: nn.Module) -> list[str]:
    """The names of the modules of ``model`` whose forward recomputes (what `apply` patched)."""
    return [name for name, m in model.named_modules() if isinstance(m.__dict__.get("forward"), Recompute)]


class Recompute:
    """A block's instance-level ``forward``: the class's forward under non-reentrant checkpointing.

    An object rather than a closure so that the module stays picklable and ``copy.deepcopy`` (the
    pipeline's stages) binds the copy to the copied block, not the original."""

    def __init__(self, module: nn.Module, ops: bool = False) -> None:
        self.module = module
        self.ops = ops
        self.cache_at = _cache_positions(type(module).forward)
        """Where the forward takes a key/value cache positionally (GPT-2's blocks get ``cache`` second)."""

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # no backward: nothing to keep, nothing to recompute
            return self._forward(*args, **kwargs)
        # the recompute would append to a key/value cache a second time: none, as transformers' own checkpointing does
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = None
        if any(i < len(args) and args[i] is not None for i in self.cache_at):
            args = tuple(None if i in self.cache_at else a for i, a in enumerate(args))
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if self.ops:
            return checkpoint(self._forward, *args, use_reentrant=False, context_fn=_keep_matmuls, **kwargs)
        return checkpoint(self._forward, *args, use_reentrant=False, **kwargs)  # no context_fn: torch.compile traces no other

    def __repr__(self) -> str:
        return f"Recompute({type(self.module).__name__}, {'ops' if self.ops else 'blocks'})"


def _cache_positions(forward: Callable[..., Any]) -> tuple[int, ...]:
    """The positions (after ``self``) of a forward's key/value cache parameters."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    return tuple(i for i, p in enumerate(params) if p.name in _CACHE_KWARGS and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _kept_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = (
        "mm.default",
        "addmm.default",
        "_scaled_dot_product_flash_attention.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
    )
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and hasattr(op, overload):
            found.append(getattr(op, overload))
    return frozenset(found)


KEPT_OPS = _kept_ops()
"""The operations whose outputs ``ops`` keeps (the linears' products, fused attention); the rest is recomputed."""


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_matmuls() -> tuple[Any, Any]:
    """torch's selective-checkpoint contexts, their cache counted by `SavedBytes` probes (it holds real
    activations that no saved-tensor hook sees). The cache is the two modes' ``storage`` dict, so the
    one they share is swapped for one that reports what it keeps; left as torch made it if that changes."""
    caching, cached = create_selective_checkpoint_contexts(_policy)
    if isinstance(getattr(caching, "storage", None), dict) and getattr(cached, "storage", None) is caching.storage:
        caching.storage = cached.storage = collections.defaultdict(_ReportedEntries)
    return caching, cached


class _ReportedEntries(dict):
    """One operation's cached outputs (index -> entry); each entry's tensors counted while the entry lives."""

    def __setitem__(self, key: Any, entry: Any) -> None:
        super().__setitem__(key, entry)
        for wrapper in tree_leaves(entry):
            value = getattr(wrapper, "val", None)  # torch's _VersionWrapper around the detached output
            if isinstance(value, torch.Tensor):
                SavedBytes.kept(value, wrapper)
