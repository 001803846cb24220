"""``shardwise simulate`` as a user runs it: a subprocess writing JSON or a PNG, the pipeline mode, and bad flags' one-line errors."""

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


def test_plot_writes_a_real_png(tmp_path: Path) -> None:
    """The file starts with the 8-byte PNG signature and matplotlib reads it back as a non-empty image."""
    import matplotlib.image as mpimg  # a test extra: its absence fails this test, it does not skip it

    out = tmp_path / "sim.png"
    proc = _run("--workers", "1", "4", "16", "--params", "25e6", "--compute-ms", "100", "--steps", "2", "--plot", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = mpimg.imread(out)
    assert image.ndim == 3 and image.shape[0] > 0 and image.shape[1] > 0


def test_pipeline_mode_prints_and_writes_the_step(tmp_path: Path) -> None:
    """GPipe, 4 stages, 8 micro-batches of 10 + 20 ms, 16 MB sends at 100 Gbit/s and 5 us: each send
    costs c = 5 us + 16e6 x 8 / 100e9 s = 1.285 ms and the step (m + p - 1)(t_f + t_b) + 2 (p - 1) c."""
    out = tmp_path / "pipe.json"
    args = ["--pipeline", "gpipe", "--stages", "4", "--microbatches", "8", "--stage-ms", "10,20"]
    proc = _run(*args, "--activation-bytes", "16e6", "--bandwidth-gbps", "100", "--latency-us", "5", "--steps", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    c = 5e-6 + 16e6 * 8 / 100e9
    result = json.loads(out.read_text())["result"]
    assert result["step_s"] == pytest.approx(11 * 0.030 + 2 * 3 * c, rel=1e-9)
    assert result["peak_in_flight"] == [8.0] * 4
    assert f"step {(11 * 0.030 + 6 * c) * 1e3:.2f} ms" in proc.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--pipeline", "1f1b", "--stages", "4", "--microbatches", "8", "--stage-ms", "10,20", "--workers", "8"], "drop --workers or drop --pipeline"),
        (["--pipeline", "gpipe", "--stages", "4", "--microbatches", "8", "--stage-ms", "10"], "--stage-ms takes F,B"),
        (["--pipeline", "interleaved", "--stages", "4", "--microbatches", "6", "--chunks", "2", "--stage-ms", "10,20"], "use a multiple of 4"),
        (["--params", "1e6", "--compute-ms", "10", "--stages", "4"], "--stages describe a pipeline"),
    ],
)
def test_bad_pipeline_combination_is_one_line(args: list[str], fragment: str) -> None:
    proc = _run(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and fragment in proc.stderr
