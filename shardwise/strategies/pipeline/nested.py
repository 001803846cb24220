"""Pipeline stages of a nested model: Hugging Face transformers, nanoGPT-style GPTs, any model
whose forward runs a list of repeated blocks somewhere inside it.

Such a model is not a sequence of top-level children (``model.model.layers`` sits two levels
down, a ``ModuleDict`` holds the blocks, the forward builds rotary embeddings and masks between
the embedding and the first block). Rather than re-implement each family's forward, every stage
runs **the model's own forward** on a pruned copy of the model:

- **the block list** (found from the model's own pipeline plan, transformers' ``_pp_plan`` /
  ``config.base_model_pp_plan``; else the user's ``layers="model.layers"``; else the largest
  ``ModuleList`` of same-class modules) is cut into contiguous runs, one per stage, each block
  keeping its original name;
- modules with parameters declared **before** the block list in their parent (the embeddings:
  the *prelude*) belong to the first stage, those declared **after** it (final norm, pooler,
  head: the *postlude*) to the last; a stage that does not own one holds a stand-in without
  parameters; modules without parameters (rotary embeddings, dropout) stay on every stage;
- on a stage after the first, a pre-hook on its first block replaces the block's input hidden
  states with the activation received from the previous stage (whatever the stand-ins computed
  is discarded), so masks, positions and rotary tables are computed by the model itself from
  the micro-batch, which every stage receives as keyword arguments;
- on a stage before the last, a hook on its last block stops the forward there and returns the
  hidden states (a plain tensor, the only thing that crosses a stage boundary);
- the last stage returns the model's output tensor (``logits``) and keeps the whole output
  (``loss`` included, when the batch holds ``labels``) for the loss of that micro-batch.

Tied weights (GPT-2's and nanoGPT's ``lm_head`` = token embedding) are found by identity. On
one stage they stay one ``Parameter``; across stages each owner holds a copy of the one
logical weight: the copies start equal (broadcast from the first owner), their gradients are
summed over the owners before clipping, the norm counts the weight once, and checkpoints hold
it under every name the model has (as ``single``'s state dict does), with one optimizer state.
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardwise.errors import ConfigError
from shardwise.strategies.pipeline.stand_ins import (
    _Elsewhere,
    _hidden_of,
    _Holder,
    _Incoming,
    _NotHere,
    _output_tensor,
    _replace_first_tensor,
    _StageExit,
)


@dataclass(frozen=True)
class NestedLayout:
    """Where a nested model's blocks are, and what comes before and after them."""

    blocks: str
    """Dotted path of the block list (``model.layers``, ``transformer.h``)."""
    prelude: tuple[str, ...]
    """Modules with parameters that run before the blocks (first stage)."""
    postlude: tuple[str, ...]
    """Modules with parameters that run after the blocks (last stage)."""
    source: str
    """How the block list was found: the model's pp plan, the user's ``layers``, or the heuristic."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied parameter names: every other name of a shared parameter -> its first name."""


def _plan_blocks(model: nn.Module) -> str | None:
    """The block list named by the model's own pipeline plan (transformers), if any."""
    plan = getattr(model, "_pp_plan", None) or {}
    for name in plan:
        try:
            if isinstance(model.get_submodule(name), nn.ModuleList):
                return str(name)
        except AttributeError:
            continue
    base_plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    for name in base_plan:
        for full in (f"{prefix}.{name}" if prefix else name, name):
            try:
                if isinstance(model.get_submodule(full), nn.ModuleList):
                    return full
            except AttributeError:
                continue
    return None


def _heuristic_blocks(model: nn.Module) -> str | None:
    """The ModuleList of same-class modules with the most items (then the most parameters)."""
    best: tuple[int, int, str] | None = None
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 2 or not name:
            continue
        if len({type(x) for x in m}) != 1:
            continue
        key = (len(m), sum(p.numel() for p in m.parameters()), name)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


def find_blocks(model: nn.Module) -> str | None:
    """The dotted path of the model's block list as `nested_layout` finds it without a ``layers`` option
    (its pipeline plan, else the heuristic), or None; activation checkpointing picks its blocks here too."""
    return _plan_blocks(model) or _heuristic_blocks(model)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every other name of a parameter shared by identity -> its first name (``named_parameters`` order)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def check_layers(model: nn.Module, layers: str) -> None:
    """A ``layers=`` path that names no module list of ``model`` is a `ConfigError` naming the lists it has."""
    try:
        found = model.get_submodule(layers)
    except AttributeError:
        raise ConfigError(
            f"layers={layers!r} is not a module of {type(model).__name__}; its module lists are "
            f"{[n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)] or 'none'}"
        ) from None
    if not isinstance(found, nn.ModuleList):
        raise ConfigError(f"layers={layers!r} in {type(model).__name__} is a {type(found).__name__}, not an nn.ModuleList of blocks")


def nested_layout(model: nn.Module, layers: str | None = None) -> NestedLayout:
    """Find the block list, the prelude and the postlude of ``model`` (no process group)."""
    blocks: str | None
    if layers:
        check_layers(model, layers)
        blocks, source = layers, "layers option"
    else:
        planned = _plan_blocks(model)
        blocks, source = (planned, "the model's pipeline plan") if planned else (_heuristic_blocks(model), "the largest list of repeated blocks")
        if blocks is None:
            raise ConfigError(
                f"cannot split {type(model).__name__} into pipeline stages: it has no list of repeated blocks "
                "(an nn.ModuleList of modules of one class) and no pipeline plan; pass layers='path.to.blocks'"
            )
    prelude: list[str] = []
    postlude: list[str] = []
    parts = blocks.split(".")
    for depth in range(len(parts)):
        parent_name = ".".join(parts[:depth])
        parent = model.get_submodule(parent_name) if parent_name else model
        if any(True for _ in parent.named_parameters(recurse=False)):
            own = [n for n, _ in parent.named_parameters(recurse=False)]
            raise ConfigError(
                f"cannot split {type(model).__name__}: {parent_name or 'the model'} holds parameters of its own "
                f"({', '.join(own)}) beside the path to its blocks ({blocks}); no stage can own them"
            )
        seen_path = False
        for child_name, child in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if child_name == parts[depth]:
                seen_path = True
                continue
            if not any(True for _ in child.parameters()):
                continue  # rotary embeddings, dropout, activations: every stage keeps them
            after = runs_after(model, full, ".".join(parts[: depth + 1]))
            (postlude if (seen_path if after is None else after) else prelude).append(full)
    return NestedLayout(blocks=blocks, prelude=tuple(prelude), postlude=tuple(postlude), source=source, aliases=tied_aliases(model))


def _dotted(node: ast.AST) -> str | None:
    """``self.a.b`` for an attribute chain rooted at a name, else None."""
    bits: list[str] = []
    while isinstance(node, ast.Attribute):
        bits.append(node.attr)
        node = node.value
    return ".".join([node.id] + bits[::-1]) if isinstance(node, ast.Name) else None


def _as_attribute(full: str, prefix: str) -> str:
    """How the forward of the module at ``prefix`` spells the submodule ``full``: ``self.`` and the rest."""
    return "self." + (full[len(prefix) + 1 :] if prefix else full)


def runs_after(model: nn.Module, name: str, path: str) -> bool | None:
    """Whether the forward that uses module ``name`` calls it after it reaches ``path`` (the
    branch holding the blocks), read from that forward's source: the nearest ancestor of both with
    a forward of its own (a ModuleDict has none; nanoGPT's root runs ``self.transformer.ln_f``).

    Declaration order is not execution order (OPT declares ``final_layer_norm`` before ``layers``
    and runs it after them). None when the source cannot be read or does not name both; the caller
    then keeps the declaration order, and the stand-ins fail loudly if it was wrong."""
    bits = name.split(".")
    for depth in range(len(bits) - 1, -1, -1):
        owner = model.get_submodule(".".join(bits[:depth])) if depth else model
        if isinstance(owner, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).forward)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            return None
        prefix = ".".join(bits[:depth])
        mine, blocks = _as_attribute(name, prefix), _as_attribute(path, prefix)
        called: list[tuple[int, int]] = []
        used: list[tuple[int, int]] = []
        reached: list[tuple[int, int]] = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or (dotted := _dotted(node)) is None:
                continue
            where = (node.lineno, node.col_offset)
            if dotted == blocks or dotted.startswith(blocks + "."):
                reached.append(where)
            if dotted == mine:
                used.append(where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _dotted(node.func) == mine:
                called.append((node.lineno, node.col_offset))
        first = min(called or used, default=None)
        if first is None or not reached:
            return None
        return first > min(reached)
    return None


def block_list(model: nn.Module, layout: NestedLayout) -> nn.ModuleList:
    """The model's list of repeated blocks, the one `nested_layout` found."""
    blocks = model.get_submodule(layout.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"{layout.blocks} in {type(model).__name__} is a {type(blocks).__name__}, not an nn.ModuleList of blocks")
    return blocks


def check_nested(model: nn.Module, layout: NestedLayout, stages: int, microbatches: int) -> None:
    """Refuse what a pipeline cannot run exactly on this model, with the reason for this model."""
    n = len(block_list(model, layout))
    if n < stages:
        raise ConfigError(
            f"{type(model).__name__} has {n} blocks in {layout.blocks} but the pipeline needs {stages} stages "
            "(pp x virtual stages), each with at least one block; use fewer stages or a model with more blocks"
        )
    stacks = [
        f"{p}.{n}"
        for p in layout.prelude
        for n, m in model.get_submodule(p).named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(x) for x in m}) == 1 and any(True for _ in m[0].children())
    ]  # blocks: modules of modules (Gemma3n's list of altup projections, plain linears, is not a stack)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) or stacks:
        raise ConfigError(
            f"{type(model).__name__} runs a second stack of blocks before {layout.blocks} "
            f"({', '.join(stacks) or 'it is an encoder-decoder model'}) whose output every block of {layout.blocks} reads "
            "(cross-attention); a pipeline stage boundary carries one tensor, so stages after the first would not have it. "
            "Encoder-decoder models are not split by the pipeline; use a data-parallel strategy (ddp, zero3) or tp"
        )
    norms = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if norms and microbatches > 1:
        raise ConfigError(
            f"{type(model).__name__} has BatchNorm layers ({norms[0]}, ...): a pipeline runs each of its "
            f"{microbatches} micro-batches through them alone, so they normalize with micro-batch statistics, "
            "not the batch's, and the model trained differs from the one trained unsplit; use a data-parallel "
            "strategy (ddp, zero3 with sync_batchnorm=True), or microbatches=1"
        )


def split_blocks(model: nn.Module, layout: NestedLayout, stages: int, split_points: Sequence[str] | None = None) -> list[list[str]]:
    """Contiguous runs of block indices (as strings, the ModuleList keys), one per stage."""
    from shardwise.strategies.pipeline.split import balance

    blocks = block_list(model, layout)
    keys = list(blocks._modules)
    if split_points:
        names = [f"{layout.blocks}.{k}" for k in keys]
        unknown = [s for s in split_points if s not in names]
        if unknown or len(split_points) != stages - 1:
            raise ConfigError(f"split_points must name {stages - 1} blocks that start stages 1..{stages - 1}, from {names}; got {list(split_points)}")
        starts = [0] + sorted(names.index(s) for s in split_points)
    else:
        starts = balance([max(1, sum(p.numel() for p in blocks[i].parameters())) for i in range(len(keys))], stages)
    bounds = starts + [len(keys)]
    return [keys[bounds[i] : bounds[i + 1]] for i in range(stages)]


def _prune(module: nn.Module, prefix: str, keep: dict[str, nn.Module | None], path: set[str]) -> nn.Module:
    """A shallow copy of ``module`` whose children on ``path`` are pruned copies and whose children
    named in ``keep`` are replaced (the same parameters are shared, nothing is copied)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._forward_hooks = type(module._forward_hooks)()
    clone._forward_pre_hooks = type(module._forward_pre_hooks)()
    for name, child in module._modules.items():
        full = f"{prefix}.{name}" if prefix else name
        if full in keep:
            clone._modules[name] = keep[full]
        elif full in path and child is not None:
            clone._modules[name] = _prune(child, full, keep, path)
    return clone


class NestedStage(nn.Module):
    """One pipeline stage of a nested model: the model's own forward on a pruned copy.

    The stage's children are the pruned copy's, so its parameters keep the model's own names
    (``model.layers.2.mlp.up_proj.weight``); ``owned`` lists the modules this stage owns."""

    _last_block: nn.Module
    """The last of this stage's blocks, kept in ``__dict__``: not a child, it is one of the blocks already."""

    def __init__(self, model: nn.Module, layout: NestedLayout, block_keys: Sequence[str], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last, self.layout = first, last, layout
        self._holder = _Holder()
        blocks = block_list(model, layout)
        own = nn.ModuleList()
        # every key, in order: the forward's loop counts the blocks as the whole model does (an index picks
        # a per-layer pattern); another stage's blocks are stand-ins without parameters (original names)
        mine = set(block_keys)
        own._modules = {k: m if k in mine or m is None else _Elsewhere(self._holder, m, f"{layout.blocks}.{k}") for k, m in blocks._modules.items()}
        keep: dict[str, nn.Module | None] = {layout.blocks: own}
        for name in layout.prelude:
            if not first:
                keep[name] = _Incoming(self._holder, model.get_submodule(name), name, layout.blocks)
        for name in layout.postlude:
            if not last:
                keep[name] = _NotHere(name)
        path: set[str] = set()
        for name in keep:
            bits = name.split(".")
            path |= {".".join(bits[:i]) for i in range(1, len(bits))}
        clone = _prune(model, "", keep, path)
        self.__dict__["_clone"] = clone  # not a child: its children are this stage's (same names)
        self._modules = clone._modules
        self.owned = [f"{layout.blocks}.{k}" for k in block_keys]
        self.owned += list(layout.prelude) if first else []
        self.owned += list(layout.postlude) if last else []
        self.layer_names = list(self.owned)
        self.output: Any = None
        """The whole output of the last forward on the last stage (a ModelOutput with ``loss``)."""
        blocks_list = [own._modules[k] for k in block_keys]
        if not first:
            blocks_list[0].register_forward_pre_hook(self._take_input, with_kwargs=True, prepend=True)
            blocks_list[0].register_forward_hook(self._check_passed_on)
        self.__dict__["_last_block"] = blocks_list[-1]  # not a child: it is one of the blocks already
        self._stop_handle: Any = None
        if not last:
            self.stop_after_other_hooks()

    def stop_after_other_hooks(self) -> None:
        """(Re-)register the hook that ends a stage before the last at its last block, after every
        other forward hook there: tensor parallelism's, registered later, gathers a
        sequence-parallel output back to the whole sequence, which is what the next stage takes."""
        if self.last:
            return
        if self._stop_handle is not None:
            self._stop_handle.remove()
        self._stop_handle = self._last_block.register_forward_hook(self._stop)

    def _take_input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._holder.active:
            return None  # the blocks are the user's model's too: its own forward runs them unchanged
        if self._holder.tensor is None:
            raise ConfigError("a pipeline stage after the first ran without the previous stage's activation")
        self._holder.started = True
        return _replace_first_tensor(args, kwargs, self._holder.tensor)

    def _check_passed_on(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._holder.active and self._holder.skipped and not isinstance(output, torch.Tensor):
            raise ConfigError(
                f"{type(module).__name__} returns {type(output).__name__}, not the hidden states tensor: the stand-ins for the "
                f"blocks of earlier pipeline stages ({self.layout.blocks}) pass on a tensor, which this model's loop would read "
                "differently; the pipeline splits models whose blocks return their hidden states; use another strategy"
            )

    def _stop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._holder.active:
            raise _StageExit(_hidden_of(output))

    def forward(self, *received: torch.Tensor, **batch: Any) -> torch.Tensor:
        self._holder.tensor = received[0] if received else None
        self._holder.started, self._holder.active, self._holder.skipped = False, True, False
        args, kwargs = _call_args(batch)
        try:
            output = self.__dict__["_clone"](*args, **kwargs)
        except _StageExit as stop:
            return stop.hidden
        finally:
            self._holder.tensor, self._holder.active = None, False
        self.output = output
        return _output_tensor(output)


def _call_args(batch: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's call for a micro-batch passed as keywords (a tuple batch's inputs travel as ``_arg{i}``)."""
    n = sum(1 for k in batch if k.startswith("_arg"))
    return tuple(batch[f"_arg{i}"] for i in range(n)), {k: v for k, v in batch.items() if not k.startswith("_arg")}


def batch_kwargs(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A model call's arguments as the keywords every stage receives (positional ones as ``_arg{i}``)."""
    if args and kwargs:
        raise ConfigError("a pipeline stage takes a batch of keywords (a dict batch) or of positional inputs, not both")
    return dict(kwargs) if kwargs else {f"_arg{i}": x for i, x in enumerate(args)}


def is_nested(model: nn.Module, layers: str | None) -> bool:
    """Whether to split ``model`` by its block list (nested) rather than by its top-level children."""
    if layers or _plan_blocks(model) is not None or tied_aliases(model):
        return True
    from shardwise.strategies.pipeline.split import sequence_layers

    try:
        sequence_layers(model)
    except ConfigError:
        return _heuristic_blocks(model) is not None
    # transformers' models are never a plain sequence of children (their forward builds masks)
    return hasattr(model, "config") and _heuristic_blocks(model) is not None
