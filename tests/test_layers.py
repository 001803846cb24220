"""The package's shape, checked: layers import only downward, one door to the wire, no probing of strategies.

These read the source (no processes), so a new upward import, a raw ``torch.distributed``
collective outside ``comm/`` and ``launcher/``, or a ``getattr(strategy, ...)`` fails here
with the file and line, not months later as an unrecorded byte or an import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise

PACKAGE = Path(shardwise.__file__).resolve().parent

# Each top-level package's layer (docs/architecture.md, "Layers"): a module may import only
# from strictly lower layers (or from its own package).
LAYER = {
    "errors": -1,  # under config (0), which raises its ConfigError
    "config": 0,
    "comm": 1,
    "data": 1,
    "checkpoint": 2,
    "launcher": 2,
    "strategies": 3,
    "engine": 4,
    "trainer": 5,
    "tools": 6,
    "integrations": 6,
    "cli": 7,
    "__init__": 8,
    "__main__": 8,
}

# torch.distributed functions that put bytes on the wire or build groups: only comm/ and
# launcher/ may call them, so the recorder sees every byte (issue 18: "one door to the wire").
WIRE = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "P2POp",
    "barrier",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "send_object_list",
    "recv_object_list",
}
DOORS = ("comm", "launcher")


def _modules() -> list[tuple[str, Path, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        top = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name not in ("__init__.py", "__main__.py") else rel.stem
        out.append((top, rel, ast.parse(path.read_text(), str(path))))
    return out


def _imported_packages(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "shardwise":
                names = [a.name for a in node.names]
            elif node.module.startswith("shardwise."):
                names = [node.module.split(".")[1]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] if "." in a.name else "__init__" for a in node.names if a.name.split(".")[0] == "shardwise"]
        found += [(node.lineno, n) for n in names]
    return found


def test_every_package_has_a_layer() -> None:
    unknown = sorted({top for top, _, _ in _modules()} - set(LAYER))
    assert not unknown, f"packages without a layer: {unknown}; add them to LAYER here and to docs/architecture.md"


def test_layers_import_only_downward() -> None:
    bad = []
    for top, rel, tree in _modules():
        for line, target in _imported_packages(tree):
            if target == top or target not in LAYER:
                continue  # its own package; a public name of shardwise/__init__ is checked below
            if LAYER[target] >= LAYER[top]:
                bad.append(f"{rel}:{line} (layer {LAYER[top]}, {top}) imports {target} (layer {LAYER[target]})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def _dist_aliases(tree: ast.Module) -> set[str]:
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            aliases |= {a.asname or "distributed" for a in node.names if a.name == "distributed"}
    return aliases


def wire_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """Lines of ``tree`` that use a torch.distributed wire function (by alias, full path or import)."""
    aliases = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in WIRE:
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append((node.lineno, f"{base.id}.{node.attr}"))
            elif isinstance(base, ast.Attribute) and base.attr == "distributed" and isinstance(base.value, ast.Name) and base.value.id == "torch":
                found.append((node.lineno, f"torch.distributed.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if a.name in WIRE]
    return found


def test_the_wire_is_reached_only_through_comm() -> None:
    bad = [f"{rel}:{line}: {what}" for top, rel, tree in _modules() if top not in DOORS for line, what in wire_calls(tree)]
    assert not bad, "torch.distributed wire calls outside comm/ and launcher/ (route them through shardwise.comm so they are recorded):\n" + "\n".join(bad)


def test_the_wire_check_sees_each_spelling() -> None:
    """The checker itself: every way of writing a collective is found (a check that finds nothing proves nothing)."""
    src = (
        "import torch.distributed as dist\nimport torch\nfrom torch import distributed as d2\n"
        "from torch.distributed import all_reduce\n"
        "dist.barrier()\ntorch.distributed.send(x, 1)\nd2.all_gather_object(o, x)\ndist.get_rank()\n"
    )
    assert sorted(what for _, what in wire_calls(ast.parse(src))) == sorted(
        ["from torch.distributed import all_reduce", "dist.barrier", "torch.distributed.send", "d2.all_gather_object"]
    )


def test_no_strategy_is_probed_with_getattr() -> None:
    bad = []
    for _, rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and node.args:
                target = node.args[0]
                if isinstance(target, ast.Name) and target.id == "strategy" or isinstance(target, ast.Attribute) and target.attr == "strategy":
                    bad.append(f"{rel}:{node.lineno}")
    assert not bad, "getattr/hasattr on a strategy (every hook is part of the contract, shardwise/strategies/contract.py):\n" + "\n".join(bad)


# The strategy families (docs/strategies/): each a folder of strategies/ that
# imports no other family; families meet only in strategies/compose.py (torchtitan's order: tp
# inside the pipeline, data parallel around it), and the registry (strategies/__init__.py) names
# them as "module:Class" strings.
FAMILIES = ("data_parallel", "sharded", "tensor_parallel", "pipeline", "param_server", "replicas")
MEETING_POINTS = ("compose.py", "__init__.py")  # strategies/compose.py; the registry names modules, imports none


def families_imported(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, family) for every import in ``tree`` of a module of a strategy family, in any spelling."""
    return [(line, family) for line, family, _ in _family_imports(tree)]


def _family_imports(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, family, module) for every import of a family's module (``module``: the dotted path under the family)."""
    found = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [f"{node.module}.{a.name}" for a in node.names] if node.module == "shardwise.strategies" else [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        for m in modules:
            parts = m.split(".")
            if parts[:2] == ["shardwise", "strategies"] and len(parts) > 2 and parts[2] in FAMILIES:
                found.append((node.lineno, parts[2], ".".join(parts[3:])))
    return found


def _strategy_modules() -> list[tuple[Path, ast.Module]]:
    return [(rel, tree) for top, rel, tree in _modules() if top == "strategies"]


def test_a_strategy_family_imports_no_other_family() -> None:
    bad = []
    for rel, tree in _strategy_modules():
        own = rel.parts[1] if len(rel.parts) > 2 and rel.parts[1] in FAMILIES else None
        if own is None:
            continue
        # A family's cost.py (its terms in the planner's cost model) may price another family's inside its
        # own through that family's cost.py, as compose.py composes their runs: pipeline's prices tp in its stages.
        pricing = rel.name == "cost.py"
        bad += [
            f"{rel}:{line} ({own}) imports {family}"
            for line, family, module in _family_imports(tree)
            if family != own and not (pricing and module.split(".")[0] == "cost")
        ]
    assert not bad, "a family importing another (compose them in shardwise/strategies/compose.py):\n" + "\n".join(bad)


def test_only_compose_references_several_families() -> None:
    bad = []
    for rel, tree in _strategy_modules():
        if rel.parts[1] in FAMILIES or rel.parts[1:] in [(m,) for m in MEETING_POINTS]:
            continue  # a family's own module (checked above), compose.py, the registry
        families = sorted({family for _, family in families_imported(tree)})
        if len(families) > 1:
            bad.append(f"{rel} imports {', '.join(families)}")
    assert not bad, "modules of strategies/ other than compose.py that reach several families:\n" + "\n".join(bad)


def test_the_family_check_sees_each_spelling() -> None:
    """The checker itself: every way of naming a family's module is found, a shared module is not."""
    src = (
        "from shardwise.strategies.tensor_parallel.relayout import fused_layout\n"
        "from shardwise.strategies import sharded\n"
        "import shardwise.strategies.pipeline.state\n"
        "from shardwise.strategies.compose import apply_data_parallel\n"
        "from shardwise.strategies import materialize, replicas\n"
    )
    assert sorted(f for _, f in families_imported(ast.parse(src))) == ["pipeline", "replicas", "sharded", "tensor_parallel"]
