"""Atomic checkpoints: a killed write, damaged and foreign files, another model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardwise import checkpoint as ckpt
from shardwise.engine import Engine
from shardwise.errors import CheckpointError


def _write(root: Path, step: int, value: float) -> Path:
    shared = {"model": {"w": torch.full((4,), value)}, "counters": {"step": step}}
    return ckpt.write(
        ckpt.step_dir(root, step), rank=0, world_size=1, shared=shared, own={"rng": ckpt.capture_rng()}, barrier=lambda: None, meta={"step": step}
    )


def test_write_then_read_round_trips_and_verifies(tmp_path):
    path = _write(tmp_path, 3, 1.5)
    shared, own, manifest = ckpt.read(path, rank=0)
    assert torch.equal(shared["model"]["w"], torch.full((4,), 1.5))
    assert manifest["step"] == 3 and set(manifest["files"]) == {"state.pt", "rank-00000.pt"}
    assert own is not None and "rng" in own
    assert not list(tmp_path.glob(".tmp-*"))


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from pathlib import Path
    from shardwise import checkpoint as ckpt
    root = Path(sys.argv[1])
    def write(step):
        return ckpt.write(ckpt.step_dir(root, step), rank=0, world_size=1,
                          shared={"model": {"w": torch.full((1000,), float(step))}},
                          own={"rng": ckpt.capture_rng()}, barrier=lambda: None, meta={"step": step})
    write(1)
    real_save = torch.save
    def dying_save(obj, f, *a, **k):
        if getattr(f, "name", "").endswith("state.pt"):
            f.write(b"PK\\x03\\x04 half a file")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *a, **k)
    torch.save = dying_save
    write(2)
    """
)


def test_a_write_killed_halfway_leaves_the_previous_checkpoint_and_auto_picks_it(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    assert (tmp_path / ".tmp-step-00000002").is_dir()  # the torn write stayed in its temporary directory
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001"]
    latest = ckpt.latest_valid(tmp_path)
    assert latest == tmp_path / "step-00000001"
    shared, _, _ = ckpt.read(latest, rank=0)
    assert torch.equal(shared["model"]["w"], torch.ones(1000))
    # The next write of step 2 replaces the torn temporary directory.
    _write(tmp_path, 2, 2.0)
    assert ckpt.latest_valid(tmp_path) == tmp_path / "step-00000002"


def test_a_checkpoint_damaged_after_writing_is_skipped_with_a_warning(tmp_path):
    _write(tmp_path, 1, 1.0)
    newest = _write(tmp_path, 2, 2.0)
    data = bytearray((newest / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "state.pt").write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match its checksum"):
        assert ckpt.latest_valid(tmp_path) == tmp_path / "step-00000001"


def test_truncated_and_foreign_files_are_clear_errors(tmp_path):
    path = _write(tmp_path, 1, 1.0)
    state = path / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"state.pt has 100 bytes, the manifest says \d+ \(truncated\?\)"):
        ckpt.read(path, rank=0)
    with pytest.raises(CheckpointError, match="cannot read .*truncated, damaged, or not a checkpoint"):
        ckpt.load_file(state)
    foreign = tmp_path / "foreign.pt"
    foreign.write_text("not a checkpoint at all")
    with pytest.raises(CheckpointError, match="cannot read"):
        ckpt.load_file(foreign)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        ckpt.read(tmp_path, rank=0)
    with pytest.raises(CheckpointError, match="not a directory"):
        ckpt.read(foreign, rank=0)
    (tmp_path / "manifest.json").write_text("[1, 2]")  # valid JSON, not an object
    with pytest.raises(CheckpointError, match="is damaged \\(it holds a JSON list, not an object\\)"):
        ckpt.read(tmp_path, rank=0)


def test_pickled_objects_are_refused_on_load(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"obj": Path("/")}, evil)  # a non-tensor object: weights_only must refuse it
    with pytest.raises(CheckpointError, match="cannot read"):
        ckpt.load_file(evil)


def test_a_checkpoint_from_another_model_is_a_clear_error(tmp_path):
    engine = Engine(strategy="single", accelerator="cpu")
    model, opt = engine.setup(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), lambda p: torch.optim.SGD(p, lr=0.1))
    engine.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    other = Engine(strategy="single", accelerator="cpu")
    m2, o2 = other.setup(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2)), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(CheckpointError, match=r"saved from another model: different shapes for 0.bias: checkpoint \(8,\) vs model \(16,\)"):
        other.load(tmp_path / "ck", {"model": m2, "optimizer": o2})
    m3, o3 = other.setup(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(CheckpointError, match="missing 2 .* unexpected 4"):
        other.load(tmp_path / "ck", {"model": m3, "optimizer": o3})


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in range(1, 6):
        _write(tmp_path, step, float(step))
    ckpt.prune(tmp_path, 2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    manifest = json.loads((tmp_path / "step-00000005" / "manifest.json").read_text())
    assert manifest["format"] == ckpt.FORMAT


def test_rng_streams_round_trip():
    import random

    import numpy as np

    state = ckpt.capture_rng()
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    ckpt.restore_rng(state)
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_a_checkpoint_whose_state_was_replaced_by_a_code_running_pickle_is_skipped(tmp_path):
    """Checksums rewritten to match: only loading weights-only tells. It is skipped, the previous one
    used, and the pickle's code never runs."""
    import hashlib
    import json
    import os

    _write(tmp_path, 1, 1.0)
    newest = _write(tmp_path, 2, 2.0)
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    torch.save({"model": Payload()}, newest / "state.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    data = (newest / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="skipping damaged checkpoint: cannot read .*state.pt"):
        assert ckpt.latest_valid(tmp_path) == tmp_path / "step-00000001"
    assert not marker.exists()
