"""A recipe's model with a checkpoint's weights, whole, in this process (what `shardwise compress` starts from).

The source is a run directory (its newest valid checkpoint), one checkpoint directory (sharded
ones are assembled from every rank's files) or a ``.safetensors`` file written by ``shardwise
export``. The recipe builds the model (its options as ``--set recipe.KEY=VALUE``, as for
``shardwise train``) and the weights are checked against it before anything else runs, so a
checkpoint of another model is one clear error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.tools.recipes import RecipeParts, get_recipe


def checkpoint_path(source: str | os.PathLike[str]) -> Path:
    """The checkpoint a source names: itself (a checkpoint or a .safetensors file) or a run directory's newest valid one."""
    from shardwise.checkpoint.files import latest_valid

    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run directory (--out of shardwise train), a checkpoint directory or a .safetensors file")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ConfigError(f"{path} is a file but not a .safetensors export; give a run directory, a checkpoint directory or a .safetensors file")
        return path
    if (path / "manifest.json").exists():
        return path
    found = latest_valid(path / "checkpoints") if (path / "checkpoints").is_dir() else None
    if found is None:
        raise ConfigError(f"{path} holds no checkpoint (no manifest.json, no valid checkpoints/step-*); train with --out, or give a checkpoint directory")
    return found


def load_weights(path: Path, key: str = "model") -> dict[str, torch.Tensor]:
    """The model state (whole tensors) of a checkpoint directory or a .safetensors file."""
    from shardwise.checkpoint.export import model_weights

    if path.is_file():
        try:
            from safetensors.torch import load_file as load_safetensors
        except ImportError:
            raise ConfigError("reading a .safetensors file needs the safetensors package; install it with: pip install safetensors") from None
        return dict(load_safetensors(str(path)))
    return model_weights(path, key)


def load_recipe_model(source: str | os.PathLike[str], recipe: str, options: Mapping[str, Any] | None = None) -> tuple[nn.Module, RecipeParts, Path]:
    """(model with the checkpoint's weights, in eval mode; the recipe's parts; the checkpoint read).

    A checkpoint whose tensors do not match the recipe's model (another recipe, other options)
    raises `CheckpointError` naming the differences, before any work.
    """
    from shardwise.checkpoint.files import check_model_state

    path = checkpoint_path(source)
    parts = get_recipe(recipe).parts(options)
    weights = load_weights(path)
    model = parts.model
    expected = model.state_dict()
    fix = (
        f"It does not hold the model recipe {recipe!r} builds with options {dict(options or {})}: pass the --recipe and the "
        "--set recipe.KEY=VALUE it was trained with"
    )
    check_model_state(expected, weights, path, fix=fix)
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()})
    return model.eval(), parts, path
