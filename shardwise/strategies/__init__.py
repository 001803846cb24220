"""Layer 3: one module per strategy, looked up by name in one registry.

The registry maps a name to ``"module:Class"`` and imports the module on first
use, so ``import shardwise`` stays light and a strategy's dependencies load only
when it is chosen. ``register_strategy`` adds one from outside the package.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from shardwise.errors import ConfigError
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, StepFn, Strategy

_BUILTIN: dict[str, str] = {
    "single": "shardwise.strategies.data_parallel.single:Single",
    "ddp": "shardwise.strategies.data_parallel.ddp:DDP",
    "dp": "shardwise.strategies.data_parallel.dp:DataParallel",
    "local-sgd": "shardwise.strategies.replicas.local_sgd:LocalSGD",
    "diloco": "shardwise.strategies.replicas.diloco:DiLoCo",
    "gossip": "shardwise.strategies.replicas.gossip:Gossip",
    "ps": "shardwise.strategies.param_server:PS",
    "central": "shardwise.strategies.param_server:Central",
    "zero1": "shardwise.strategies.sharded.zero1:Zero1",
    "zero2": "shardwise.strategies.sharded.fsdp:Zero2",
    "zero3": "shardwise.strategies.sharded.fsdp:FSDP",
    "fsdp": "shardwise.strategies.sharded.fsdp:FSDP",
    "hsdp": "shardwise.strategies.sharded.fsdp:HSDP",
    "pipeline": "shardwise.strategies.pipeline:Pipeline",
    "tp": "shardwise.strategies.tensor_parallel:TensorParallel",
    "naive-mp": "shardwise.strategies.pipeline.naive_mp:NaiveModelParallel",
}
_EXTRA: dict[str, Callable[..., Any]] = {}


def available() -> list[str]:
    """Names of every registered strategy."""
    return sorted({*_BUILTIN, *_EXTRA})


def register_strategy(name: str, factory: Callable[..., Strategy]) -> None:
    """Make ``factory(**options)`` available as ``strategy=name``."""
    if name in _BUILTIN:
        raise ConfigError(f"strategy name {name!r} is built in; choose another name")
    _EXTRA[name] = factory


def _edits(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) from ``a`` to ``b``."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def _closest(name: str, known: list[str]) -> list[str]:
    """The known names fewest edits away (2 at most; all of them when tied: 'dpp' is one edit from
    both 'dp' and 'ddp'), else difflib's closest."""
    distance = {k: _edits(name, k) for k in known}
    best = min(distance.values())
    if best <= 2:
        return [k for k in known if distance[k] == best][:3]
    return difflib.get_close_matches(name, known, n=1)


def check_name(name: str) -> None:
    """A `ConfigError` naming the closest known strategies when ``name`` is none of them."""
    if name in _EXTRA or name in _BUILTIN:
        return
    known = available()
    if name.lower() in known:
        hint = f" Did you mean {name.lower()!r}? (strategy names are lower case)"
    else:
        close = _closest(name.lower(), known)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"unknown strategy {name!r}.{hint} Known strategies: {', '.join(known)}")


def _factory(name: str) -> Callable[..., Any]:
    check_name(name)
    if name in _EXTRA:
        return _EXTRA[name]
    module, attr = _BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def get_strategy(spec: str | Strategy, **options: Any) -> Strategy:
    """A strategy object from its name (and options), or the object itself."""
    if not isinstance(spec, str):
        if options:
            raise ConfigError("strategy options go with a strategy name, not with a strategy object")
        return _contract(spec)
    factory = _factory(spec)
    if dataclasses.is_dataclass(factory):
        # The constructor's own names: a strategy may also accept an old name of an option (tp's plan=).
        fields = [n for n in inspect.signature(factory).parameters]
        unknown = [k for k in options if k not in fields]
        if unknown:
            hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(k, fields, n=1)) else "") for k in unknown]
            from shardwise.strategies.options import not_composed

            why = not_composed(spec, unknown)
            raise ConfigError(f"strategy {spec!r} has no option {', '.join(hints)}{why}; its options are: {', '.join(fields) or 'none'}")
    try:
        return _contract(factory(**options))
    except TypeError as exc:
        raise ConfigError(f"bad options for strategy {spec!r}: {exc}") from None


def _contract(strategy: Any) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    raise ConfigError(
        f"a strategy must be a shardwise.strategies.Strategy (a frozen dataclass of options with plan() and apply(); "
        f"see docs/architecture.md, 'How to add a strategy'); got {type(strategy).__name__}"
    )


__all__ = ["Batch", "Layout", "OptimizerFactory", "Parallel", "StepFn", "Strategy", "available", "get_strategy", "register_strategy"]
