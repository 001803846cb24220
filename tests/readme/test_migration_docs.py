"""docs/migrating-from-accelerate.md: the Engine side of the side-by-side example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "migrating-from-accelerate.md"


def test_the_engine_side_of_the_accelerate_migration_runs(tmp_path):
    text = DOC.read_text()
    marked = re.search(r"<!-- tests/readme/test_migration_docs.py runs this block.*?-->\n```python\n(.*?)^```", text, re.S | re.M)
    assert marked, "the Engine block is marked for this test"
    script = tmp_path / "train.py"
    script.write_text(marked.group(1))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 37 evaluation samples, each counted once (a gather that kept the sampler's padding counts 38),
    # and the line the doc quotes.
    claimed = re.search(r"It prints `(accuracy .*? samples)`", text)
    assert claimed and claimed.group(1) in proc.stdout, proc.stdout
    assert proc.stdout.count("on 37 samples") == 1, proc.stdout
