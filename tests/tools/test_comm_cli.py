"""``shardwise train --allreduce/--compression`` as a user runs it: the compressed exchange shows in summary.json.

One training run (ddp, 2 processes, 60 steps on digits, fp16 buckets over our ring
allreduce) checks that the ``comm`` section records the compressed exchange with the
bytes the formula gives (`shardwise.comm.compressed.compressed_traffic`); bad
algorithm and codec names stop before any process starts, with exit code 2 and one
line naming what was wrong, the known names and the closest match (or, for a ratio
out of range, the valid range and an example). Other bad names and combinations are
unit-tested (tests/comm/test_codecs.py); each case here costs a Python start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardwise.comm.codecs import get_codec
from shardwise.comm.compressed import compressed_traffic

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

DIGITS_PARAMS = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
"""The digits recipe's MLP (64 -> 128 -> 128 -> 10): one DDP bucket of this many float32 gradients."""


def shardwise(*args: str, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_ddp_with_fp16_over_our_ring_records_the_compressed_bytes(tmp_path):
    steps = 60
    proc = shardwise(
        "train",
        "--recipe",
        "digits",
        "--strategy",
        "ddp",
        "--nproc",
        "2",
        "--max-steps",
        str(steps),
        "--allreduce",
        "ring",
        "--compression",
        "fp16",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ddp"]["allreduce"] == "ring" and summary["ddp"]["compression"] == "fp16"
    comm = summary["comm"]
    assert comm["steps"] == steps
    by_op = comm["by_op"]
    assert "dp/all_reduce" not in by_op  # every bucket went through the compressed exchange, none through native
    fp16 = by_op["dp/compressed:fp16"]
    dense = DIGITS_PARAMS * 4
    assert fp16["count"] == steps and fp16["payload_bytes"] == steps * dense
    # Rank 0's bytes over the ring at 2 bytes an element, 2(p-1) = 2 rounds a bucket: half of fp32's 2(p-1)/p n.
    want = compressed_traffic(get_codec("fp16"), DIGITS_PARAMS, torch.float32, 2, 0, "ring")
    assert (fp16["sent_bytes"], fp16["received_bytes"], fp16["steps"]) == (steps * want.sent, steps * want.received, steps * want.steps)
    assert want.sent * 2 == dense  # p = 2: fp32 ring sends n * 4 bytes, fp16 half that
    assert comm["sent_bytes_per_step"] >= want.sent
    assert summary["val_accuracy"] > 0.9


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (["--allreduce", "rign"], ["unknown allreduce algorithm 'rign'", "Did you mean 'ring'?", "Known algorithms: ring, recursive-doubling"]),
        (["--compression", "topk:1.5"], ["ratio of codec 'topk' must be in (0, 1]", "e.g. 'topk:0.01'", "got 1.5 in 'topk:1.5'"]),
    ],
)
def test_bad_algorithm_or_codec_is_one_clear_line_and_exit_code_2(tmp_path, args, parts):
    proc = shardwise("train", "--recipe", "digits", "--strategy", "ddp", "--nproc", "2", "--max-steps", "2", *args, "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    assert not (tmp_path / "summary.json").exists()
