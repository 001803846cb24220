"""Atomic, verifiable checkpoints and exact resume.

A checkpoint is a directory ``step-00000100/``: ``state.pt`` (rank 0's shared state),
``rank-00000.pt`` ... (each rank's RNG streams), ``dcp/`` for sharded strategies, and
``manifest.json`` (fingerprint, checksums) written last; written in a hidden directory and
renamed, so a crash leaves the whole checkpoint or none. The package: `files` (the directory on
disk), `sharded` (DCP and the one DTensor test), `names` (optimizer state by parameter name or
number), `parts` (a checkpoint written in parts), `export` (safetensors), `pretrained`
(`shardwise.init_from`), `rundir` (one run per directory). Design notes (the protocol, sharded
checkpoints and how each loads into another strategy): docs/checkpoint.md.
"""

from __future__ import annotations

from shardwise.checkpoint.export import export_safetensors
from shardwise.checkpoint.files import (
    FORMAT,
    SHARDED_DIR,
    capture_rng,
    check_model_state,
    fingerprint,
    is_finite,
    latest_valid,
    list_checkpoints,
    load_file,
    load_shared,
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
from shardwise.checkpoint.parts import PARTS
from shardwise.checkpoint.parts import join as join_parts
from shardwise.checkpoint.parts import merge as merge_parts
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
    "is_finite",
    "latest_valid",
    "list_checkpoints",
    "load_file",
    "load_shared",
    "optimizer_state_by_name",
    "optimizer_state_by_number",
    "parameter_names",
    "prune",
    "read",
    "read_manifest",
    "PARTS",
    "join_parts",
    "merge_parts",
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
