"""Which submodules' weights a model's own code reads outside their module (`reads_outside`).

FSDP2 gathers a unit's parameters around that unit's ``forward`` only; outside it they are sharded
DTensors. A hand-written model that reads a submodule's weight in another module's code (a head tied by
``x @ self.emb.weight.t()`` in the root's ``forward``, a block reading ``self.parent_norm.weight``) would
mix a plain tensor with a sharded one and fail after launch. The model's methods are read, not run:
every ``self.<path>.<parameter>`` chain in the source of each module's class (its own methods and its
bases' outside torch) is resolved against the module tree, and a parameter or buffer reached through a
strict descendant is a read outside that descendant. Such a module must not be a unit of its own: it
stays with the unit around the code that reads it (the root's, for the root's ``forward``).
Construction and initialization code (``__init__``, ``reset_parameters``, ``*init*``) is skipped: it
runs before sharding. A class whose source cannot be read (built in a notebook's ``exec``) is skipped.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["reads_outside"]

_METADATA = frozenset({"shape", "dtype", "device", "ndim", "requires_grad", "size", "dim", "numel", "is_meta"})
"""Attributes of a parameter that are the same sharded or whole (a DTensor keeps its global shape)."""


def reads_outside(model: nn.Module) -> dict[str, str]:
    """``{submodule path: "Class.method reads path.weight"}`` for every submodule whose parameters or
    buffers the code of one of its ancestors reads directly (the first such read for each)."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        for where, chain in _self_chains(type(module)):
            target = _resolve(module, chain)
            if target is None:
                continue
            path, leaf = target
            full = f"{name}.{path}" if name else path
            found.setdefault(full, f"{where} reads {full}.{leaf}")
    return found


def _resolve(module: nn.Module, chain: tuple[str, ...]) -> tuple[str, str] | None:
    """(descendant path, parameter name) when ``self.<chain>`` names a descendant's parameter or buffer."""
    cursor, steps = module, []
    for i, part in enumerate(chain):
        child = cursor._modules.get(part)
        if child is not None:
            cursor = child
            steps.append(part)
            continue
        is_tensor = part in cursor._parameters or part in cursor._buffers
        if not steps or not is_tensor or (i + 1 < len(chain) and chain[i + 1] in _METADATA):
            return None
        return ".".join(steps), part
    return None


def _self_chains(cls: type) -> list[tuple[str, tuple[str, ...]]]:
    out: list[tuple[str, tuple[str, ...]]] = []
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object or klass.__module__.startswith("torch."):
            continue
        for attr, fn in vars(klass).items():
            if inspect.isfunction(fn) and attr != "__init__" and "init" not in attr.lower() and attr != "reset_parameters":
                out.extend((f"{cls.__name__}.{attr}", chain) for chain in _chains_of(fn))
    return out


@functools.lru_cache(maxsize=4096)
def _chains_of(fn: Any) -> tuple[tuple[str, ...], ...]:
    """Every maximal attribute/constant-subscript chain rooted at the function's first argument."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if func is None or not func.args.args:
        return ()
    me = func.args.args[0].arg
    chains: set[tuple[str, ...]] = set()
    inner: set[int] = set()
    for node in ast.walk(func):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and id(node) not in inner:
            chain = _chain(node, me, inner)
            if chain:
                chains.add(chain)
    return tuple(sorted(chains))


def _chain(node: ast.AST, me: str, inner: set[int]) -> tuple[str, ...] | None:
    parts: list[str] = []
    for step in _walk_down(node):
        if isinstance(step, ast.Name):
            return tuple(reversed(parts)) if step.id == me and parts else None
        if isinstance(step, ast.Attribute):
            parts.append(step.attr)
        elif isinstance(step, ast.Subscript) and isinstance(step.slice, ast.Constant) and isinstance(step.slice.value, (int, str)):
            parts.append(str(step.slice.value))
        else:
            return None
        if step is not node:
            inner.add(id(step))
    return None


def _walk_down(node: ast.AST) -> Iterator[ast.AST]:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        yield node
        node = node.value
    yield node
