"""The README's shell blocks, run line by line with ``bash -e`` in a fresh directory (a file of
their own so the test runner can run them beside the Python blocks; see test_readme.py)."""

from __future__ import annotations

import subprocess

import pytest

from tests.readme.test_readme import README, SHELL, env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.mark.parametrize("line,code", SHELL, ids=[f"line{line}" for line, _ in SHELL])
def test_shell_block_runs_as_written(tmp_path, line, code):
    (tmp_path / "examples").symlink_to(README.parent / "examples")  # commands run from the clone's root
    proc = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"README block at line {line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
