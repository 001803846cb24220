"""Every code block of the README runs as written, in a fresh directory, with a timeout.

Python blocks run as a user runs them after saving them to a file (``python mine.py``), once as
written and, for the first block that starts shardwise's processes with ``Trainer(nproc=...)`` and
the first with ``launch(...)``, once with the statements after the last definition moved under an
``if __name__ == "__main__":`` guard (both must work: the workers stop at the launch call). What a
guard changes is the same for every block (the workers skip those statements); a later block could
only differ if its definitions read a name that those statements assign, and a test below checks
that none does (a guarded run of each cost up to 46 s of the suite).
Shell blocks run line by line with ``bash -e``; ``make demo`` and ``make test`` (the first block)
are what CI and a new user run themselves, so they are left out here (make test runs this file), as
is a block that another test runs as written and checks further (``RUN_ELSEWHERE``).
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
    # The Ray Train block's local Ray instance: on loopback (a single-machine cluster), no usage report,
    # and Ray Train's controller polling its workers every 0.5 s rather than 2 s (27 s rather than 35 s
    # on an idle machine here; the run is the same).
    e.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"})
    root = str(README.parent)
    e["PYTHONPATH"] = root + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


PYTHON = blocks("python")
RUN_ELSEWHERE = {
    "torchx run -s local_cwd ": "tests/integrations/test_orchestrators.py",
    "python examples/flyte_workflow.py ": "tests/integrations/test_orchestrators.py",
    "shardwise bench scaling --recipe digits ": "tests/tools/test_bench_scaling.py",
    "python benchmarks/gpu_step.py --size small ": "tests/tools/test_bench_gpu_step.py",
    "python benchmarks/compile_speedup.py ": "tests/tools/test_bench_compile.py",
}
"""Shell blocks that another test runs as written and checks further (there, the torchx job's and
the Flyte workflow's outputs against `shardwise train`'s, bench scaling's rows): not run a second time
here (~11 s, ~50 s and ~30 s)."""
SHELL = [(line, code) for line, code in blocks("bash") if not code.lstrip().startswith("make demo") and not any(k in code for k in RUN_ELSEWHERE)]


def test_the_readme_has_the_blocks_this_file_runs():
    assert len(PYTHON) >= 3 and len(SHELL) >= 3
    first = BLOCK.search(README.read_text())
    assert first is not None and "make demo" in first.group(2) and "make test" in first.group(2)
    for command, test_file in RUN_ELSEWHERE.items():
        assert sum(command in code for _, code in blocks("bash")) == 1, f"one README block runs {command!r}"
        assert "RUN_ELSEWHERE" in (README.parent / test_file).read_text(), f"{test_file} runs the README's {command!r} block"


def _starts_processes(code: str) -> bool:
    """Whether a block starts shardwise's own processes (``nproc=``, ``launch(``): only there can a
    main guard change what runs (the workers re-run the script up to the launch call)."""
    return "nproc=" in code or "launch(" in code


def _how_it_starts(code: str) -> str:
    return "launch" if "launch(" in code else "Trainer"


GUARDED = {min(line for line, code in PYTHON if _starts_processes(code) and _how_it_starts(code) == how) for how in ("Trainer", "launch")}
"""The blocks that also run with a main guard: the first of each way to start processes."""

CASES = [(line, code, guard) for line, code in PYTHON for guard in ((False, True) if line in GUARDED else (False,))]


def _hidden_by_a_guard(code: str) -> set[str]:
    """What a worker would miss if the statements after the block's last definition were under a
    main guard: names those statements assign that the definitions above read, and functions or
    classes defined among those statements (their pickles name ``__main__``)."""
    tree = ast.parse(code)
    cut = max((i for i, node in enumerate(tree.body) if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))), default=-1) + 1
    head, tail = tree.body[:cut], tree.body[cut:]

    def bound(nodes: list[ast.stmt], top: bool) -> set[str]:
        out: set[str] = set()
        for stmt in nodes:
            for node in [stmt] if top and isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) else ast.walk(stmt):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    out.add(node.id)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.add(node.name)
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    out.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        return out

    in_head, in_tail = bound(head, top=True), bound(tail, top=False)

    def free(scope: ast.AST, body: list[ast.stmt]) -> set[str]:
        """Names a function (or a class body) reads and does not take or assign itself."""
        nodes = [n for stmt in body for n in ast.walk(stmt)] + ([scope.args] if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else [])
        local = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        local |= {a.arg for n in nodes if isinstance(n, ast.arguments) for a in (*n.posonlyargs, *n.args, *n.kwonlyargs, n.vararg, n.kwarg) if a}
        return {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local

    read: set[str] = set()
    for node in head:
        if isinstance(node, ast.ClassDef):
            read |= free(node, [stmt for stmt in node.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))])
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            for scope in ast.walk(node):
                if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    read |= free(scope, scope.body)
    defined_in_tail = {n.name for stmt in tail for n in ast.walk(stmt) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return ((read & in_tail) - in_head) | defined_in_tail


def test_a_main_guard_would_hide_nothing_the_workers_need():
    assert sorted(_how_it_starts(code) for line, code in PYTHON if line in GUARDED) == ["Trainer", "launch"]
    # The check itself: it sees a definition reading a name assigned below it, and a class defined there.
    assert _hidden_by_a_guard("import torch\ndef opt(p):\n    return torch.optim.SGD(p, lr=LR)\nLR = 0.1\n") == {"LR"}
    assert _hidden_by_a_guard("import torch\nif True:\n    class Data: pass\n") == {"Data"}
    assert _hidden_by_a_guard("class M:\n    def f(self, x):\n        return x\n    def g(self):\n        return x\nx = 1\n") == {"x"}
    for line, code in PYTHON:
        if _starts_processes(code):
            assert _hidden_by_a_guard(code) == set(), f"README block at line {line}: under a main guard its workers would miss these"


@pytest.mark.parametrize("line,code,guard", CASES, ids=[f"line{line}-{'with-guard' if g else 'as-written'}" for line, _, g in CASES])
def test_python_block_runs_as_written(tmp_path, line, code, guard):
    script = tmp_path / "mine.py"
    script.write_text(guarded(code) if guard else code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"README block at line {line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
