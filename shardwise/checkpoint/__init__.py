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

Design notes: checkpoints
=========================

A checkpoint is `checkpoints/step-NNNNNNNN/` with `state.pt` (rank 0: model, optimizer,
scheduler, grad scaler, loader position, counters), `rank-RRRRR.pt` (each rank's RNG streams:
python, numpy, torch, CUDA) and `manifest.json` (format, step, world size, strategy, model
fingerprint, sha256 and size of every file). Protocol:

1. rank 0 makes `.tmp-step-N/`; barrier;
2. every rank writes and fsyncs its files; barrier;
3. rank 0 hashes, writes the manifest last, fsyncs, renames into place, fsyncs the parent;
4. barrier; rank 0 prunes to the last `keep_last`.

A crash leaves only a `.tmp-` directory, which readers ignore and the next write replaces.
`resume="auto"` takes the newest checkpoint whose files match their checksums and warns about
each damaged one it skips. Files load with `weights_only=True`; a truncated or foreign file is a
`CheckpointError`, and so is a checkpoint whose parameter names or shapes do not match the model
(listing what is missing, unexpected, or differently shaped). Checkpoints of several machines
need a shared file system (rank 0 writes the manifest after every rank wrote).

**Sharded checkpoints.** The engine asks the run (`Parallel.state_dict`) for its state; when the model state holds
DTensors (zero2, zero3/fsdp, hsdp), the model and optimizer go to `dcp/` through
`torch.distributed.checkpoint`: every rank writes its own shards (`dcp/__R_0.distcp`, rank 0
the `.metadata`) inside the same `.tmp-` directory, in step 2 of the protocol above, so the
rename publishes them atomically with the rest; the manifest lists and hashes every file under
`dcp/` too and records `"sharded": {"dir": "dcp", "keys": ["model", "optimizer"]}`. `state.pt`
keeps the rest (scheduler, loader, counters, scaler). The state is keyed by parameter name:
`torch.distributed.checkpoint.state_dict.get_state_dict` names optimizer state by the parameter's
FQN, not by position. No protocol change was needed: `sharded.split_state` chooses DCP by looking at what
`state_dict` returned. Loading:

| checkpoint | strategy now | how |
| --- | --- | --- |
| sharded | sharded | DCP loads into this run's own DTensor shards (re-partitioned to this world size), then `set_state_dict` |
| sharded | single, ddp, zero1 | `read_sharded_full` assembles every tensor in one process (DCP's empty-state planner, no collectives); the named optimizer state is renumbered in this optimizer's order |
| plain | sharded | the whole tensors go to `set_state_dict(full_state_dict=True)`, which keeps each rank's shard; the numbered optimizer state is first named |

zero1 writes the plain format (its optimizer state is consolidated on rank 0 first), so it
reads and writes like ddp. `Engine.consolidated_state_dict(model)` returns the whole weights
(DTensors gathered with `full_tensor()`, a collective every rank calls); `Trainer.fit` uses it
to hand the trained weights back to the parent process. The model fingerprint is the same for every strategy (global shapes).
`export_safetensors` / `shardwise export CKPT OUT.safetensors` writes any checkpoint's model whole
to one safetensors file under the module's names (safetensors is the optional `export` extra,
imported only there). DCP's `.metadata` is a pickle written by torch's DCP; shardwise reads only
checkpoints it verified against their manifest.
"""  # noqa: E501 - a Markdown table keeps each row on one line

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
