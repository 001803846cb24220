"""``shardwise simulate`` as a user runs it: a subprocess writing JSON, and a bad flag's one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "shardwise", "simulate", *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def test_simulate_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    proc = _run(
        "--algorithm",
        "ring",
        "--workers",
        "1",
        "4",
        "16",
        "--params",
        "25e6",
        "--compute-ms",
        "100",
        "--bandwidth-gbps",
        "25",
        "--latency-us",
        "0",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    rows = {r["workers"]: r for r in doc["results"]}
    assert rows[1]["efficiency"] == pytest.approx(1.0)
    ring16 = 2 * 15 / 16 * 100e6 * 8 / 25e9  # 2(p-1)/p N beta, latency 0
    assert rows[16]["step_s"] == pytest.approx(0.1 + ring16, rel=1e-6)
    assert doc["inputs"]["exchange"]["algorithm"] == "ring"
    assert "16" in proc.stdout


def test_preset_prints_the_published_figure() -> None:
    proc = _run("--preset", "goyal-2017", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "published 0.90" in proc.stdout and "arXiv:1706.02677" in proc.stdout


def test_bad_flag_is_one_line() -> None:
    proc = _run("--params", "1e6", "--compute-ms", "10", "--algorithm", "butterfly")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "choose one of ring" in proc.stderr
