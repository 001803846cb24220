"""The parameter-server, local-SGD and straggler flags of ``shardwise train``, in a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import shardwise


# The straggler slows rank 1 down; no assertion depends on by how much (the bound holds by construction).
# The time limits are safety nets for a loaded machine.
@pytest.mark.timeout(600)
def test_ps_ssp_with_a_straggler_trains_digits_keeps_its_bound_and_checkpoints_its_server(tmp_path):
    out = tmp_path / "run"
    proc = shardwise(
        "train",
        "--recipe",
        "digits",
        "--strategy",
        "ps",
        "--nproc",
        "3",
        "--servers",
        "1",
        "--mode",
        "ssp",
        "--staleness",
        "2",
        "--straggler",
        "1:3",
        "--max-steps",
        "100",
        "--out",
        str(out),
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    ps = summary["ps"]
    assert summary["strategy"] == "ps" and summary["world_size"] == 3 and summary["steps"] == 100
    assert ps["workers"] == 2 and ps["mode"] == "ssp" and ps["updates_per_server"] == [200]
    assert ps["max_staleness"] <= 2 and ps["lost_workers"] == []
    assert summary["val_accuracy"] > 0.85
    manifest = json.loads((out / "checkpoints" / "step-00000100" / "manifest.json").read_text())
    assert "server-000.pt" in manifest["files"]  # the server's shard and optimizer state, hashed with the rest


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "ps", "--nproc", "2", "--servers", "2"], "servers=2 leaves no worker in a world of 2 processes"),
        (["--strategy", "ps", "--nproc", "3", "--mode", "ssp"], "mode='ssp' needs a staleness bound"),
        (["--strategy", "ps", "--nproc", "3", "--mode", "ssp", "--staleness", "-1"], "staleness must be a whole number of steps >= 0"),
        (["--strategy", "local-sgd", "--nproc", "2", "--sync-every", "0"], "sync_every must be a whole number of steps >= 1"),
        (["--strategy", "ddp", "--nproc", "2", "--straggler", "1"], "straggler takes RANK:FACTOR"),
    ],
)
def test_bad_flags_are_one_clear_line_and_exit_code_2(args, message):
    proc = shardwise("train", "--recipe", "digits", *args, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
