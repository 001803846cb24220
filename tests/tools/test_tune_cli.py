"""``shardwise tune lr`` and ``shardwise tune batch-size`` as a user runs them, in a subprocess."""

from __future__ import annotations

import json
import math

import matplotlib.image
import pytest

from shardwise.trainer.lr_find import smooth, steepest_index, sweep_lrs
from tests.cli.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_the_range_test_under_ddp_writes_its_png_and_its_numbers(tmp_path):
    png, doc = tmp_path / "lr.png", tmp_path / "lr.json"
    proc = shardwise("tune", "lr", "--recipe", "digits", "--strategy", "ddp", "--nproc", "2", "--steps", "60", "--png", str(png), "--json", str(doc))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(doc.read_text())
    n = len(result["lrs"])
    # The rates are the geometric sweep from 1e-6 to 10 in 60 steps; the first loss is a fresh
    # 10-class classifier's, about ln 10.
    assert result["lrs"] == pytest.approx(sweep_lrs(1e-6, 10.0, 60)[:n], rel=1e-9)
    assert result["losses"][0] == pytest.approx(math.log(10), abs=0.15)
    # The suggestion, recomputed from the recorded losses with the defaults (smoothing 0.9, skip 60 // 10).
    smoothed = smooth(result["losses"], 0.9)
    assert result["smoothed"] == pytest.approx(smoothed)
    assert result["suggestion"] == result["lrs"][steepest_index(result["lrs"], smoothed, 6)]
    assert f"suggested learning rate: {result['suggestion']:.3g}" in proc.stdout and "ddp on 2 processes" in proc.stdout
    assert result["stopped_early"] == (n < 60) and (f"stopped at step {n} of 60" in proc.stdout) == result["stopped_early"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(str(png)).shape[:2] == (504, 840)


def test_the_batch_size_finder_reports_every_size_it_tried(tmp_path):
    doc = tmp_path / "bs.json"
    proc = shardwise("tune", "batch-size", "--recipe", "digits", "--memory-budget", "2GB", "--max-batch", "2", "--steps", "3", "--json", str(doc))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(doc.read_text())
    assert [(t["micro_batch"], t["fits"]) for t in result["trials"]] == [(1, True), (2, True)]
    assert result["micro_batch"] == 2 and result["budget_bytes"] == 2 * 10**9 and result["device"] == "cpu"
    assert "largest micro-batch per rank that fits within 2GB (1.86 GiB): 2 (global batch 2)" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["batch-size", "--recipe", "digits", "--memory-budget", "100MB", "--steps", "2"], "budget 100MB (95.37 MiB) is too small for a micro-batch of 1"),
        (["batch-size", "--recipe", "digits"], "on a CPU the batch-size finder needs a memory budget"),
        (["batch-size", "--recipe", "digits", "--memory-budget", "lots"], "a memory budget is a number with a unit"),
        (["lr", "--recipe", "digits", "--min-lr", "1", "--max-lr", "0.1"], "the range test needs 0 < min_lr < max_lr"),
        (["lr", "--recipe", "digitz"], "unknown recipe 'digitz'. Did you mean 'digits'?"),
    ],
)
def test_bad_input_is_one_line(args, message):
    proc = shardwise("tune", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
