"""The import paths of 0.1 that redesign step 1 (issue 38) moved, kept importing for a release.

``import shardwise.recipes`` or ``from shardwise.ray_train import fit`` still work: a finder on
``sys.meta_path`` (installed by ``shardwise/__init__.py``, which imports nothing it names) maps
the old dotted name to the new one, warns once per name with a ``DeprecationWarning`` naming the
new path, and hands back the new module itself, so both names are one module object (pickles of
``shardwise.recipes.charlm.X`` load too). It lives with the integrations because it adapts code
written against the old layout; it imports no shardwise module until an old name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:  # importlib.abc costs 10 ms at import: the loaders below follow its protocol instead
    from _typeshed.importlib import LoaderProtocol

# Old dotted path -> new one. A package's entry covers its submodules (shardwise.recipes.charlm ->
# shardwise.tools.recipes.charlm); the longest matching entry wins.
MOVED = {
    "shardwise.advisor": "shardwise.tools.advisor",
    "shardwise.batches": "shardwise.data.batches",
    "shardwise.bench": "shardwise.tools.bench",
    "shardwise.compress": "shardwise.tools.compress",
    "shardwise.flyte": "shardwise.integrations.flyte",
    "shardwise.loggers": "shardwise.engine.loggers",
    "shardwise.memory": "shardwise.launcher.memory",
    "shardwise.mesh": "shardwise.comm.mesh",
    "shardwise.plan.bubble": "shardwise.strategies.cost.bubble",
    "shardwise.plan.cluster": "shardwise.strategies.cost.cluster",
    "shardwise.plan.cost": "shardwise.strategies.cost.estimate",
    "shardwise.plan.memory": "shardwise.strategies.cost.memory",
    "shardwise.plan.model_spec": "shardwise.strategies.cost.model_spec",
    "shardwise.plan.peak": "shardwise.strategies.cost.peak",
    "shardwise.plan.saved": "shardwise.strategies.cost.saved",
    "shardwise.plan.simulate": "shardwise.tools.simulate.network",
    "shardwise.plan.simulate_cli": "shardwise.tools.simulate.commands",
    "shardwise.plan.simulate_events": "shardwise.tools.simulate.events",
    "shardwise.plan.simulate_measure": "shardwise.tools.simulate.measure",
    "shardwise.plan.simulate_pipeline": "shardwise.tools.simulate.pipeline",
    "shardwise.plan.simulate_presets": "shardwise.tools.simulate.presets",
    "shardwise.plot": "shardwise.tools.plot",
    "shardwise.precision": "shardwise.strategies.precision",
    "shardwise.predict": "shardwise.tools.predict",
    "shardwise.preprocess": "shardwise.tools.preprocess",
    "shardwise.ray_train": "shardwise.integrations.ray_train",
    "shardwise.recipes": "shardwise.tools.recipes",
    "shardwise.rundir": "shardwise.checkpoint.rundir",
    "shardwise.strategies.ddp": "shardwise.strategies.data_parallel.ddp",
    "shardwise.strategies.fsdp": "shardwise.strategies.sharded.fsdp",
    "shardwise.strategies.naive_mp": "shardwise.strategies.pipeline.naive_mp",
    "shardwise.strategies.pipeline.compose": "shardwise.strategies.compose",
    "shardwise.strategies.single": "shardwise.strategies.data_parallel.single",
    "shardwise.strategies.tensor_parallel.counting": "shardwise.strategies.counting",
    "shardwise.strategies.zero": "shardwise.strategies.sharded.zero1",
    "shardwise.torchx": "shardwise.integrations.torchx",
    "shardwise.trainer.lightning_compat": "shardwise.integrations.lightning",
    "shardwise.tune": "shardwise.tools.tune",
}

# Old packages whose modules went to several places: the old name is an empty package whose
# submodules are the entries of MOVED above (``from shardwise.plan import cost`` still works).
SPLIT = {"shardwise.plan": "the cost model to shardwise.strategies.cost, the simulator to shardwise.tools.simulate"}


def new_name(old: str) -> str | None:
    """Where the module once importable as ``old`` lives now, or None if it did not move."""
    head = old
    while head.startswith("shardwise."):
        if head in MOVED:
            return MOVED[head] + old[len(head) :]
        head = head.rpartition(".")[0]
    return None


class _Alias:
    """The loader of an old name: the new module, imported and returned as it is."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there ({spec.name} goes in a later release)",
            DeprecationWarning,
            stacklevel=2,  # the frame that imported it (warnings skips importlib's own frames)
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        return None  # the new module ran when it was imported


class _Split:
    """The loader of an old package that was split: an empty package, its modules found by name."""

    def __init__(self, where: str) -> None:
        self.where = where

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} was split: {self.where} ({spec.name} goes in a later release)", DeprecationWarning, stacklevel=2)
        return ModuleType(spec.name, f"Moved: {self.where}.")

    def exec_module(self, module: ModuleType) -> None:
        module.__path__ = []  # a package, whose submodules only this finder knows


class MovedFinder:
    """On ``sys.meta_path``: finds the old names of moved modules, nothing else."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("shardwise."):
            return None
        if fullname in SPLIT:
            return importlib.util.spec_from_loader(fullname, cast("LoaderProtocol", _Split(SPLIT[fullname])), is_package=True)
        if (new := new_name(fullname)) is None:
            return None
        parent = fullname.rpartition(".")[0]
        if new_name(parent) is None and importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
            return None  # a module of that name exists again: it wins
        if importlib.util.find_spec(new) is None:
            return None  # an old name that never was (shardwise.recipes.nothing): ModuleNotFoundError
        return importlib.util.spec_from_loader(fullname, cast("LoaderProtocol", _Alias(new)))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): before the path finder, which would
    otherwise load a moved package's submodules a second time under the old name."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
