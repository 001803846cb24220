"""Sharded state: DTensors (zero2, zero3/fsdp, hsdp, tp) written by every rank with
torch.distributed.checkpoint (DCP) under ``dcp/``, re-partitioned on load, or read whole in one
process for strategies that keep whole tensors and for export.

The one place that asks "is this a DTensor" (`is_dtensor`, `has_dtensor`, `full_tensor`), and the
one place that decides which part of a checkpoint's state goes to DCP (`split_state`) and how
it comes back (`read_sharded`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.files import SHARDED_DIR
from shardwise.checkpoint.names import optimizer_state_by_number, parameter_names
from shardwise.errors import CheckpointError


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (a sharded or replicated tensor over a device mesh)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def has_dtensor(state: Any) -> bool:
    """Whether a flat state dict holds any DTensor (then it is saved through DCP)."""
    return isinstance(state, dict) and any(is_dtensor(v) for v in state.values())


def full_tensor(value: Any) -> Any:
    """A DTensor gathered whole (a collective every rank of its mesh calls); anything else as it is."""
    return value.full_tensor() if is_dtensor(value) else value


def dtensor_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Model (and optimizer) state of a module whose parameters are DTensors (FSDP2, tensor
    parallel), under the original names, as torch.distributed.checkpoint reads and writes it."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def split_state(state: dict[str, Any], strategy_state: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(shared state for ``state.pt``, sharded state for DCP or None) of a checkpoint's ``state``.

    ``state`` maps names to the model and optimizer, to objects with ``state_dict()`` and to plain
    values; ``strategy_state()`` returns the strategy's ``{"model": ..., "optimizer": ...}`` (called
    once, only when a model or optimizer is saved: under a sharded strategy it is collective). When
    the model state holds DTensors, model and optimizer go to DCP (every rank writes its shards).
    """
    shared: dict[str, Any] = {}
    sharded: dict[str, Any] = {}
    strat: dict[str, Any] | None = None
    for key, value in state.items():
        if isinstance(value, (nn.Module, torch.optim.Optimizer)):
            if strat is None:
                strat = strategy_state()
            part = strat["model"] if isinstance(value, nn.Module) else strat["optimizer"]
            (sharded if has_dtensor(strat["model"]) else shared)[key] = part
        elif hasattr(value, "state_dict"):
            shared[key] = value.state_dict()
        else:
            shared[key] = value
    return shared, (sharded or None)


def read_sharded(
    path: Path, template: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer | None, model_key: str, optim_key: str | None
) -> dict[str, Any]:
    """Model (and optimizer) state from a sharded checkpoint, in the form the running strategy loads.

    ``template`` is the strategy's own ``state_dict``. A sharding strategy gets its own shards
    (DCP re-partitions to this world size); one that keeps whole tensors gets them whole, with the
    optimizer renumbered the way ``optimizer.state_dict()`` numbers the parameters of ``module``.
    """
    import torch.distributed.checkpoint as dcp

    if has_dtensor(template["model"]):
        wanted = {model_key: template["model"]}
        if optim_key is not None and optimizer is not None:
            wanted[optim_key] = template["optimizer"]
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(str(path / SHARDED_DIR)))
        return {"model": wanted[model_key], **({"optimizer": wanted[optim_key]} if optim_key in wanted else {})}
    full = read_sharded_full(path)
    sub: dict[str, Any] = {"model": full[model_key]}
    if optimizer is not None and optim_key is not None:
        sub["optimizer"] = optimizer_state_by_number(full[optim_key], parameter_names(module, optimizer))
    return sub


def sharded_shapes(path: Path, key: str) -> dict[str, torch.Tensor]:
    """Shapes of the tensors stored under ``key`` in a sharded checkpoint, as meta tensors (no data read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(Path(path) / SHARDED_DIR)).read_metadata()
    prefix = f"{key}."
    return {
        k[len(prefix) :]: torch.empty(tuple(v.size), device="meta")
        for k, v in meta.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


def read_sharded_full(path: Path) -> dict[str, Any]:
    """Every value of a sharded checkpoint's ``dcp/`` whole, in this process alone (no collectives).

    For strategies that keep whole tensors (single, ddp, zero1) and for export: DCP
    assembles each tensor from all the ranks' files.
    """
    import torch.distributed.checkpoint as dcp

    # What torch's own dcp_to_torch_save does (format_utils), without the temporary file: the
    # public dcp.load only fills keys the caller already has; this planner builds them all.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        reader = dcp.FileSystemReader(str(Path(path) / SHARDED_DIR))
        planner = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]  # torch leaves its __init__ unannotated
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except Exception as exc:  # DCP wraps every reader failure in its own exception types
        raise CheckpointError(
            f"cannot read the sharded state of {path}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
        ) from None
    return state
