"""The 0.1 import paths that step 1 of issue 38 moved still import, for a release, with a warning.

``shardwise/integrations/moved.py``: an old name gives the new module itself and a
DeprecationWarning that names the new path; a name that never existed is still a
ModuleNotFoundError; every entry of the table points at a module that exists.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardwise
from shardwise.integrations.moved import MOVED, SPLIT, MovedFinder, new_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def forget_old_names() -> Iterator[None]:
    """Each test imports the old names afresh (a name imported once is in sys.modules, and warns no more)."""

    def forget() -> None:
        for name in [n for n in sys.modules if new_name(n) is not None or n.split(".")[:2] == ["shardwise", "plan"]]:
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and child in vars(sys.modules[parent]):
                delattr(sys.modules[parent], child)

    forget()
    yield
    forget()


def test_import_shardwise_installs_the_finder_once() -> None:
    assert sum(isinstance(f, MovedFinder) for f in sys.meta_path) == 1
    importlib.reload(shardwise)
    assert sum(isinstance(f, MovedFinder) for f in sys.meta_path) == 1


def test_an_old_package_imports_as_the_new_one_and_warns_with_its_new_name() -> None:
    import shardwise.tools.recipes as new

    with pytest.warns(DeprecationWarning, match=r"shardwise\.recipes moved to shardwise\.tools\.recipes"):
        import shardwise.recipes as old
    assert old is new
    assert sys.modules["shardwise.recipes"] is sys.modules["shardwise.tools.recipes"]
    assert old.__name__ == "shardwise.tools.recipes"


def test_from_an_old_module_import_a_name() -> None:
    import shardwise.integrations.ray_train as new

    with pytest.warns(DeprecationWarning, match=r"shardwise\.ray_train moved to shardwise\.integrations\.ray_train"):
        from shardwise.ray_train import fit
    assert fit is new.fit
    assert sys.modules["shardwise.ray_train"] is new


def test_a_submodule_of_an_old_package_is_the_new_submodule_not_a_second_copy() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        import shardwise.recipes.charlm  # noqa: F401 - the import is the test
    assert [str(w.message).split(";")[0] for w in caught] == [
        "shardwise.recipes moved to shardwise.tools.recipes",
        "shardwise.recipes.charlm moved to shardwise.tools.recipes.charlm",
    ]
    from shardwise.tools.recipes import charlm

    assert sys.modules["shardwise.recipes.charlm"] is charlm
    from shardwise.recipes import digits  # through the package, already the new one: no second warning

    assert digits is importlib.import_module("shardwise.tools.recipes.digits")


def test_renamed_modules_and_the_split_plan_package() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        from shardwise.plan import cost, simulate
        from shardwise.strategies import zero
        from shardwise.trainer import lightning_compat
    assert cost is importlib.import_module("shardwise.strategies.cost.estimate")
    assert simulate is importlib.import_module("shardwise.tools.simulate.network")
    assert zero is importlib.import_module("shardwise.strategies.sharded.zero1")
    assert lightning_compat is importlib.import_module("shardwise.integrations.lightning")
    messages = " | ".join(str(w.message) for w in caught)
    assert "shardwise.plan was split" in messages and "shardwise.strategies.cost" in messages and "shardwise.tools.simulate" in messages
    assert "shardwise.strategies.zero moved to shardwise.strategies.sharded.zero1" in messages


def test_a_name_that_never_was_is_still_module_not_found() -> None:
    for name in ("shardwise.nothing_here", "shardwise.recipes.nothing_here", "shardwise.plan.nothing_here", "shardwise.strategies.nothing_here"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the old parent's own warning
            with pytest.raises(ModuleNotFoundError, match=rf"No module named '{re.escape(name)}'"):
                importlib.import_module(name)


def test_every_new_path_in_the_table_exists() -> None:
    """A module moved again without its entry here fails this test, not a user's import."""
    missing = [f"{old} -> {new}" for old, new in MOVED.items() if not _exists_on_disk(new)]
    assert not missing, missing
    assert all(old.startswith("shardwise.") for old in [*MOVED, *SPLIT])


def test_no_old_name_shadows_a_module_that_exists() -> None:
    present = [old for old in [*MOVED, *SPLIT] if new_name(old.rpartition(".")[0]) is None and _exists_on_disk(old)]
    assert not present, f"these old names are real modules again, drop them from MOVED: {present}"


def _exists_on_disk(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_a_user_script_sees_the_warning_by_default_and_import_shardwise_loads_nothing_it_names(tmp_path: Path) -> None:
    script = tmp_path / "old.py"
    script.write_text(
        "import sys\nimport shardwise\n"
        "loaded = sorted(n for n in sys.modules if n.startswith('shardwise.') and n != 'shardwise.integrations' and n != 'shardwise.integrations.moved')\n"
        "print('loaded:', loaded)\n"
        "from shardwise.recipes import digits\n"
        "print(digits.__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "loaded: []" in proc.stdout
    assert "shardwise.tools.recipes.digits" in proc.stdout
    assert f"{script}:5: DeprecationWarning: shardwise.recipes moved to shardwise.tools.recipes" in proc.stderr, proc.stderr
