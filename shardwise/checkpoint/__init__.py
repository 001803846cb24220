"""Atomic, verifiable checkpoints and exact resume.

A checkpoint is a directory ``step-00000100/`` holding:

- ``state.pt``: the job's shared state (model, optimizer, scheduler, scaler,
  data position, counters), written by rank 0;
- ``rank-00000.pt`` ...: each rank's own state (its RNG streams);
- ``manifest.json``: step, world size, a fingerprint of the model's parameter
  names and shapes, and the sha256 and size of every file. Written last.

Sharded strategies (zero2, zero3/fsdp, hsdp) add ``dcp/``: model and optimizer state
written by every rank with ``torch.distributed.checkpoint`` (DCP), each its own shards,
keyed by parameter name. The manifest then says ``"sharded": {"dir": "dcp", "keys": [...]}``
and ``state.pt`` holds the rest. DCP re-partitions on load, so such a checkpoint resumes at
another world size, and `read_sharded_full` reads it whole for strategies that do not shard.

Writing goes to a hidden ``.tmp-step-...`` directory; every file is fsynced, then
the directory is renamed into place and its parent fsynced. A crash at any point
leaves either the complete new checkpoint or none, never a damaged one under a
final name; ``latest_valid`` also re-checks the checksums and skips (with a
warning) a checkpoint damaged afterwards. Files load with ``weights_only=True``:
nothing but tensors and plain containers is unpickled.

The package: `files` (the directory on disk), `sharded` (DCP and the one DTensor test),
`names` (optimizer state by parameter name or number), `export` (safetensors).
"""

from __future__ import annotations

from shardwise.checkpoint.export import export_safetensors
from shardwise.checkpoint.files import (
    FORMAT,
    SHARDED_DIR,
    capture_rng,
    check_model_state,
    fingerprint,
    latest_valid,
    list_checkpoints,
    load_file,
    prune,
    read,
    read_manifest,
    restore_rng,
    run_id_of,
    sha256,
    step_dir,
    verify,
    write,
    write_file,
)
from shardwise.checkpoint.names import (
    optimizer_state_by_name,
    optimizer_state_by_number,
    parameter_names,
)
from shardwise.checkpoint.sharded import (
    dtensor_state_dict,
    full_tensor,
    has_dtensor,
    is_dtensor,
    read_sharded,
    read_sharded_full,
    sharded_shapes,
    split_state,
)

__all__ = [
    "FORMAT",
    "SHARDED_DIR",
    "capture_rng",
    "check_model_state",
    "dtensor_state_dict",
    "export_safetensors",
    "fingerprint",
    "full_tensor",
    "has_dtensor",
    "is_dtensor",
    "latest_valid",
    "list_checkpoints",
    "load_file",
    "optimizer_state_by_name",
    "optimizer_state_by_number",
    "parameter_names",
    "prune",
    "read",
    "read_manifest",
    "read_sharded",
    "read_sharded_full",
    "restore_rng",
    "run_id_of",
    "sha256",
    "sharded_shapes",
    "split_state",
    "step_dir",
    "verify",
    "write",
    "write_file",
]
