"""Any checkpoint's model, whole, to one safetensors file (``shardwise export``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.files import load_shared, verify
from shardwise.checkpoint.sharded import read_sharded_full
from shardwise.errors import CheckpointError


def export_safetensors(path: str | os.PathLike[str], out: str | os.PathLike[str], *, key: str = "model") -> tuple[int, int]:
    """Write a checkpoint's model weights, whole, to one safetensors file; returns (tensors, bytes).

    Works for every strategy's checkpoint (sharded ones are assembled from all ranks' files
    in this one process). The file holds plain tensors under the module's own parameter
    names, loadable with ``safetensors.torch.load_file`` and ``model.load_state_dict``
    without shardwise. Needs the safetensors package (``pip install safetensors``; in a clone of
    shardwise, ``pip install -e '.[export]'``). The file's mode follows the umask, as any file
    the user writes does.

    >>> export_safetensors("runs/x/checkpoints/step-00000300", "model.safetensors")  # doctest: +SKIP
    (6, 84520)
    """
    try:
        from safetensors.torch import save_file
    except ImportError:
        from shardwise.errors import ConfigError

        raise ConfigError("exporting to safetensors needs the safetensors package; install it with: pip install safetensors") from None
    path = Path(path)
    manifest = verify(path)
    # Independent, contiguous tensors: safetensors refuses views that share storage (tied weights).
    tensors = {k: v.contiguous().clone() for k, v in model_weights(path, key, manifest).items()}
    meta = {"format": "pt", "source": str(path), "step": str(manifest.get("step")), "strategy": str(manifest.get("strategy"))}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o666 & ~umask)  # safetensors creates its file 0600; a user's export is theirs to share
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def model_weights(path: str | os.PathLike[str], key: str = "model", manifest: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's model state, whole, on the CPU: any strategy's (sharded ones are assembled from
    every rank's files in this process); verified against its manifest unless ``manifest`` is given."""
    path = Path(path)
    manifest = verify(path) if manifest is None else manifest
    if key in manifest.get("sharded", {}).get("keys", []):
        weights = read_sharded_full(path)[key]
    else:
        state = load_shared(path)
        if key not in state or not isinstance(state[key], dict):
            held = sorted(k for k, v in state.items() if isinstance(v, dict) and not k.startswith("__"))
            raise CheckpointError(f"checkpoint {path} has no model state {key!r}; it holds {held} (choose one with --key)")
        weights = state[key]
    return {k: v.detach().cpu() for k, v in weights.items() if isinstance(v, torch.Tensor)}
