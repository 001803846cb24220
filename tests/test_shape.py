"""The codebase's shape, measured (issue 38): what a newcomer must read to find their way.

The limits: at most 14 entries at the package's top level; no file over 500 lines, no module
docstring over 40 lines, no function over 80 lines; at most 10 lines outside ``strategies/`` that
compare a strategy's name; at most 40 ``add_argument`` calls written by hand; the map
(``docs/architecture.md``) at most 250 lines. ``python -m tests.test_shape`` prints the figures.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise
from shardwise.strategies import available

PACKAGE = Path(shardwise.__file__).resolve().parent
ROOT = PACKAGE.parent
LIMITS = {"top": 14, "file": 500, "docstring": 40, "function": 80, "name_compares": 10, "add_argument": 40, "map": 250}


def _sources() -> list[tuple[Path, str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        out.append((path.relative_to(PACKAGE), text, ast.parse(text, str(path))))
    return out


def top_level() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))


def long_files() -> dict[str, int]:
    return {str(rel): n for rel, text, _ in _sources() if (n := len(text.splitlines())) > LIMITS["file"]}


def long_docstrings() -> dict[str, int]:
    out = {}
    for rel, _, tree in _sources():
        first = tree.body[0] if tree.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            n = (first.end_lineno or first.lineno) - first.lineno + 1
            if n > LIMITS["docstring"]:
                out[str(rel)] = n
    return out


def long_functions() -> dict[str, int]:
    out = {}
    for rel, _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > LIMITS["function"]:
                    out[f"{rel}:{node.lineno} {node.name}"] = n
    return out


def _names_in(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e, names) for e in node.elts)
    return False


def name_compares() -> list[str]:
    """Lines outside ``strategies/`` that branch on a strategy's name: a comparison with a name (or a
    collection of names), a ``startswith`` of one, a ``match`` case on one, or a dict keyed by names."""
    names = set(available()) | {"zero"}
    out = []
    for rel, _, tree in _sources():
        if rel.parts[0] == "strategies":
            continue
        lines = set()
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, ast.Compare):
                hit = any(_names_in(x, names) for x in [node.left, *node.comparators])
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("startswith", "endswith"):
                hit = any(_names_in(a, names) for a in node.args)
            elif isinstance(node, ast.match_case):
                hit = isinstance(node.pattern, ast.MatchValue) and _names_in(node.pattern.value, names)
            elif isinstance(node, ast.Dict):
                hit = sum(1 for k in node.keys if k is not None and _names_in(k, names)) >= 2
            if hit:
                lines.add(node.lineno)
        out += [f"{rel}:{n}" for n in sorted(lines)]
    return out


def add_arguments() -> list[str]:
    out = []
    for rel, _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                out.append(f"{rel}:{node.lineno}")
    return out


def map_lines() -> int:
    return len((ROOT / "docs" / "architecture.md").read_text().splitlines())


def test_top_level_has_at_most_14_entries() -> None:
    assert len(top_level()) <= LIMITS["top"], top_level()


def test_no_file_over_500_lines() -> None:
    assert not long_files(), long_files()


def test_no_module_docstring_over_40_lines() -> None:
    assert not long_docstrings(), long_docstrings()


def test_no_function_over_80_lines() -> None:
    assert not long_functions(), long_functions()


def test_at_most_10_lines_outside_strategies_compare_a_strategy_name() -> None:
    found = name_compares()
    assert len(found) <= LIMITS["name_compares"], found


def test_at_most_40_add_argument_calls() -> None:
    found = add_arguments()
    assert len(found) <= LIMITS["add_argument"], f"{len(found)}: {found}"


def test_the_map_is_at_most_250_lines() -> None:
    assert map_lines() <= LIMITS["map"]


def test_the_measures_catch_what_they_measure() -> None:
    """Each measure finds its target in a made-up module: a long function, a name comparison."""
    tree = ast.parse("def f():\n" + "    x = 1\n" * 90 + "\nif s == 'ddp' or s.startswith('zero'):\n    pass\n")
    assert (tree.body[0].end_lineno or 0) - tree.body[0].lineno + 1 > LIMITS["function"]
    compare = next(n for n in ast.walk(tree) if isinstance(n, ast.Compare))
    assert _names_in(compare.comparators[0], set(available()))


if __name__ == "__main__":
    print("top level:", len(top_level()), top_level())
    for title, found in [
        ("files over 500 lines", long_files()),
        ("docstrings over 40 lines", long_docstrings()),
        ("functions over 80 lines", long_functions()),
    ]:
        print(f"{title}: {len(found)}")
        for k, v in sorted(found.items(), key=lambda kv: -kv[1]):
            print(f"  {v:5d} {k}")
    nc = name_compares()
    print(f"strategy-name comparisons outside strategies/: {len(nc)}")
    for x in nc:
        print("  ", x)
    aa = add_arguments()
    from collections import Counter

    print(f"add_argument calls: {len(aa)}", dict(Counter(a.split(":")[0] for a in aa)))
    print("docs/architecture.md lines:", map_lines())
