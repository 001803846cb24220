"""Every code block of the README runs as written, in a fresh directory, with a timeout.

Python blocks run as a user runs them after saving them to a file (``python mine.py``), once as
written and, when the block starts shardwise's processes, once with the statements after the last
definition moved under an ``if __name__ == "__main__":`` guard (both must work: the workers stop at
the launch call).
Shell blocks run line by line with ``bash -e``; ``make demo`` and ``make test`` (the first block)
are what CI and a new user run themselves, so they are left out here (make test runs this file).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(language: str) -> list[tuple[int, str]]:
    text = README.read_text()
    out = []
    for m in BLOCK.finditer(text):
        if m.group(1) == language:
            out.append((text[: m.start()].count("\n") + 1, m.group(2)))
    return out


def guarded(code: str) -> str:
    """The same program with everything after its last top-level def/class under a main guard."""
    tree = ast.parse(code)
    last_def = max((i for i, node in enumerate(tree.body) if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))), default=-1)
    lines = code.splitlines()
    cut = tree.body[last_def].end_lineno if last_def >= 0 else 0
    head, tail = lines[:cut], lines[cut:]
    return "\n".join(head + ['if __name__ == "__main__":'] + ["    " + line if line.strip() else "" for line in tail]) + "\n"


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")  # `shardwise` and `python` of this venv
    # The Ray Train block's local Ray instance: on loopback (a single-machine cluster), no usage report.
    e.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})
    root = str(README.parent)
    e["PYTHONPATH"] = root + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


PYTHON = blocks("python")
SHELL = [(line, code) for line, code in blocks("bash") if not code.lstrip().startswith("make demo")]


def test_the_readme_has_the_blocks_this_file_runs():
    assert len(PYTHON) >= 3 and len(SHELL) >= 3
    first = BLOCK.search(README.read_text())
    assert first is not None and "make demo" in first.group(2) and "make test" in first.group(2)


def _starts_processes(code: str) -> bool:
    """Whether a block starts shardwise's own processes (``nproc=``, ``launch(``): only there can a
    main guard change what runs (the workers re-run the script up to the launch call)."""
    return "nproc=" in code or "launch(" in code


CASES = [(line, code, guard) for line, code in PYTHON for guard in ((False, True) if _starts_processes(code) else (False,))]


@pytest.mark.parametrize("line,code,guard", CASES, ids=[f"line{line}-{'with-guard' if g else 'as-written'}" for line, _, g in CASES])
def test_python_block_runs_as_written(tmp_path, line, code, guard):
    script = tmp_path / "mine.py"
    script.write_text(guarded(code) if guard else code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"README block at line {line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
