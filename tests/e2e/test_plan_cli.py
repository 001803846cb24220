"""``shardwise plan`` as a user runs it: a subprocess writing ``--json``, read back (ZeRO's table 1)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(200)]


def test_plan_json_holds_zero_table_1_and_every_candidates_fields(tmp_path):
    out = tmp_path / "out.json"
    png = tmp_path / "out.png"
    proc = shardwise(
        "plan", "--params", "7.5e9", "--nproc", "64", "--nodes", "8", "--device", "h100-80gb", "--precision", "bf16-mixed",
        "--global-batch", "512", "--seq", "2048", "--json", str(out), "--png", str(png), timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recommendation:" in proc.stdout
    doc = json.loads(out.read_text())
    by_label = {r["label"]: r for r in doc["candidates"]}
    # Rajbhandari et al. 2020, table 1 (GB = 1e9 bytes): baseline, P_os, P_os+g, P_os+g+p
    got = [f"{by_label[k]['memory_breakdown']['model_state'] / 1e9:.3g}" for k in ("ddp(allreduce=native)", "zero1", "zero2", "zero3")]
    assert got == ["120", "31.4", "16.6", "1.88"]
    for rec in doc["candidates"]:
        for key in ("strategy", "fits", "memory_per_rank_bytes", "comm_bytes_per_step", "step_time_s"):
            assert key in rec
        assert rec["fits"] or rec["reason"]
    assert png.stat().st_size > 10_000
