"""benchmarks/stream_memory.py at a tiny size, so that it cannot rot: two corpora written, a 2-process ddp run
over each in its own launching process, every process's peak read from summary.json, the table printed, the
corpora deleted."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.dist


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("stream_memory", Path(__file__).resolve().parents[2] / "benchmarks" / "stream_memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_memory_benchmark_runs_at_a_tiny_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _bench().main(["--big-gb", str(1 / 1024), "--small-mb", "0.5", "--seq", "64", "--batch", "8", "--fraction", "0.02", "--dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "corpora: 0.5 MB (262,145 tokens) and 1.0 MB (524,289 tokens)" in text, text
    rows = [line.split("|") for line in text.splitlines() if line.count("|") == 3 and "process" not in line]
    assert [r[0].strip() for r in rows] == ["rank 0", "rank 1", "launcher"], text
    assert all(float(r[1]) > 100 and float(r[2]) > 100 for r in rows), text  # an interpreter with torch: peaks of 100s of MB
    assert "every difference within 200 MB: yes" in text
    assert not list(tmp_path.iterdir())  # the corpora and the runs went with the temporary directory
