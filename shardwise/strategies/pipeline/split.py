"""Splitting a model into pipeline stages: its sequence of layers, stages balanced by parameter
count or started at named ``split_points``, and stage modules that keep the original names.

Used by ``pipeline`` (one group of stages per rank) and ``naive_mp`` (every stage in one process,
on its own device). No process group here: the Trainer runs these checks in the parent
(``Pipeline.plan``) before any process starts.

>>> from torch import nn
>>> runs = split_layers(sequence_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))), 2)
>>> [[n for n, _ in run] for run in runs]
[['0', '1'], ['2']]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from shardwise.errors import ConfigError


def sequence_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in order, by original name: top-level children, ModuleLists expanded.

    >>> [n for n, _ in sequence_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))]
    ['0', '1']
    """
    own_params = [n for n, _ in model.named_parameters(recurse=False)]
    own_buffers = [n for n, _ in model.named_buffers(recurse=False)]
    if own_params or own_buffers:
        raise ConfigError(
            f"cannot split {type(model).__name__} into pipeline stages: it holds tensors of its own "
            f"({', '.join(own_params + own_buffers)}) outside its layers; move them into a child module"
        )
    layers: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            layers.extend((f"{name}.{i}", sub) for i, sub in child.named_children())
        elif isinstance(child, nn.ModuleDict):
            raise ConfigError(
                f"cannot split {type(model).__name__}: child {name!r} is a ModuleDict, whose order of use "
                "the pipeline cannot know; use a ModuleList or an nn.Sequential"
            )
        else:
            layers.append((name, child))
    if not layers:
        raise ConfigError(f"cannot split {type(model).__name__}: it has no child modules (a pipeline splits a sequence of layers)")
    return layers


def balance(weights: Sequence[int], parts: int) -> list[int]:
    """Start index of each of ``parts`` contiguous runs of ``weights`` (every run with a
    positive total) that minimise the largest run, then the sum of squared totals.

    >>> balance([4, 1, 1, 1, 1], 2)
    [0, 1]
    """
    n = len(weights)
    positive = sum(1 for w in weights if w > 0)
    if positive < parts:
        raise ValueError(f"{positive} layers with parameters cannot fill {parts} stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    # best[j][i]: (max, sum of squares) splitting the first i layers into j runs; cut[j][i]: last run's start.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, parts + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):
                prev = best[j - 1][s]
                run = prefix[i] - prefix[s]
                if prev == inf or run <= 0:
                    continue
                cand = (max(prev[0], run), prev[1] + run * run)
                if cand <= best[j][i]:  # ties: the later cut (a layer without parameters stays with the one before)
                    best[j][i], cut[j][i] = cand, s
    starts, i = [], n
    for j in range(parts, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def split_layers(layers: Sequence[tuple[str, nn.Module]], stages: int, split_points: Sequence[str] | None = None) -> list[list[tuple[str, nn.Module]]]:
    """Cut ``layers`` into ``stages`` contiguous runs: balanced by parameter count, or starting
    at the layers named in ``split_points`` (the first layer always starts stage 0)."""
    names = [n for n, _ in layers]
    counts = [sum(p.numel() for p in m.parameters()) for _, m in layers]
    if split_points:
        unknown = [s for s in split_points if s not in names]
        if unknown:
            raise ConfigError(f"split_points {unknown} are not layers of the model; its layers are {names}")
        starts = sorted({names.index(s) for s in split_points} | {0})
        if [names.index(s) for s in split_points if s != names[0]] != starts[1:]:
            raise ConfigError(f"split_points must name layers in model order, each once; got {list(split_points)} (layer order: {names})")
        if len(starts) != stages:
            raise ConfigError(
                f"split_points {list(split_points)} make {len(starts)} stages but the pipeline has {stages} (pp x virtual stages); "
                f"name {stages - 1} layers that start stages 1..{stages - 1}"
            )
    else:
        if sum(1 for c in counts if c > 0) < stages:
            raise ConfigError(
                f"the model has {len(layers)} layers ({sum(1 for c in counts if c > 0)} with parameters: {names}) "
                f"but the pipeline needs {stages} stages (pp x virtual stages), each with parameters; "
                "use fewer stages or a model with more layers"
            )
        starts = balance(counts, stages)
    bounds = starts + [len(layers)]
    runs = [list(layers[bounds[i] : bounds[i + 1]]) for i in range(stages)]
    for i, run in enumerate(runs):
        if not any(p.requires_grad for _, m in run for p in m.parameters()):
            raise ConfigError(f"pipeline stage {i} ({[n for n, _ in run]}) has no trainable parameters; move its split point")
    return runs


def _register(owner: nn.Module, name: str, layer: nn.Module) -> None:
    """Register ``layer`` on ``owner`` under its original dotted name (``blocks.2`` -> a ModuleDict ``blocks`` with key ``2``)."""
    parent, _, leaf = name.rpartition(".")
    if not parent:
        owner.add_module(name, layer)
        return
    if parent not in owner._modules:
        owner.add_module(parent, nn.ModuleDict())
    container = owner._modules[parent]
    assert isinstance(container, nn.ModuleDict)
    container[leaf] = layer


class StageModule(nn.Module):
    """A contiguous run of the model's layers under their original names; ``forward`` applies them in order."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.layer_names = [n for n, _ in layers]
        for name, layer in layers:
            _register(self, name, layer)
        self._layers = [layer for _, layer in layers]  # a plain list: the modules are registered above

    def forward(self, *x: Any) -> Any:
        out = self._layers[0](*x)
        for layer in self._layers[1:]:
            out = layer(out)
        return out
