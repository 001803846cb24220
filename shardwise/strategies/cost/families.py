"""The strategy families' costs, found through the strategy registry: each registered strategy's family
folder (``shardwise.strategies.<family>``) may hold a ``cost.py`` (`shardwise.strategies.cost.family`).

The planner, the advisor and the calibration loop over these; none of them names a strategy.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

from shardwise.strategies.cost.family import Candidate, OptionCost, StrategyCost

if TYPE_CHECKING:
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.model_spec import ModelSpec


@functools.cache
def cost_modules() -> tuple[ModuleType, ...]:
    """Every family's ``cost`` module, in the order the planner lists their candidates (``PLAN_ORDER``)."""
    import pkgutil

    import shardwise.strategies as strategies
    from shardwise.strategies import _BUILTIN

    packages = dict.fromkeys(".".join(target.split(":")[0].split(".")[:3]) for target in _BUILTIN.values())
    # the families of options several strategies share (cp, ep): no registered name of their own
    packages.update(dict.fromkeys(f"{strategies.__name__}.{m.name}" for m in pkgutil.iter_modules(strategies.__path__) if m.ispkg))
    found = [importlib.import_module(f"{p}.cost") for p in packages if importlib.util.find_spec(f"{p}.cost") is not None]
    return tuple(sorted(found, key=lambda m: int(m.PLAN_ORDER)))


@functools.cache
def all_costs() -> dict[str, StrategyCost]:
    """Each costed strategy name's `StrategyCost`, family by family in plan order."""
    out: dict[str, StrategyCost] = {}
    for module in cost_modules():
        out.update(module.COSTS)
    return out


@functools.cache
def option_costs() -> tuple[OptionCost, ...]:
    """Every family's `OptionCost` s (its ``OPTIONS``: the options several strategies share, cp and ep), in plan order."""
    return tuple(o for module in cost_modules() for o in getattr(module, "OPTIONS", ()))


def cost_of(name: str) -> StrategyCost:
    """``name``'s `StrategyCost`; a plain replica's defaults for a strategy no family costs."""
    return all_costs().get(name) or StrategyCost(name)


def propose(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """Every family's candidates for ``cluster.nproc`` processes, family by family."""
    out: list[Candidate] = []
    for module in cost_modules():
        out += module.candidates(cluster, spec, global_batch, accumulate)
    return out
