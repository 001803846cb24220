"""Fused q|k|v weights in the original layout outside the run, and the replica check.

A stacked q|k|v projection is permuted once at the split (`styles.fused_permutation`) so that each
rank's contiguous shard holds whole heads. Checkpoints and exports must not see that permutation:
`to_original` inverts it in a state dict (model and optimizer state, by parameter name) before
saving, and `to_run` applies it to a loaded state before it is set, so a tp checkpoint resumes
under `single` and a consolidated state dict loads into the original model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardwise.comm.collectives import Group, all_gather
from shardwise.comm.recorder import Recorder
from shardwise.strategies.tensor_parallel.apply import tp_info
from shardwise.strategies.tensor_parallel.styles import fused_permutation, out_dim


def _fused_tensors(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> (dimension of the output features, parts) for every permuted parameter."""
    info = tp_info(model) or {}
    out: dict[str, tuple[int, int]] = {}
    for name, parts in (info.get("fused") or {}).items():
        mod = model.get_submodule(name)
        for pname, _ in mod.named_parameters(recurse=False):
            out[f"{name}.{pname}"] = (out_dim(mod) if pname == "weight" else 0, parts)
    out.update(info.get("fused_params") or {})  # experts' packed gate|up weights (experts.shard)
    return out


def fused_layout(*modules: nn.Module) -> Any:
    """For `materialize.fill_share`: a whole fused q|k|v value (original layout) -> the permuted one the run holds
    (``modules``: the split model, or a pipeline rank's stages)."""
    fused = {k: v for m in modules for k, v in _fused_tensors(m).items()}
    infos = [info for m in modules if (info := tp_info(m)) is not None]
    if not fused or not infos:
        return None
    tp: int = infos[0]["degree"]

    def transform(name: str, full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if name not in fused or full.dim() <= fused[name][0]:
            return full
        dim, parts = fused[name]
        return full.index_select(dim, fused_permutation(full.shape[dim] // parts, parts, tp))

    return transform


def _apply(t: Any, dim: int, parts: int, tp: int, invert: bool, like: Any = None) -> Any:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(t, torch.Tensor) or t.dim() <= dim:
        return t
    full = t.full_tensor() if isinstance(t, DTensor) else t
    perm = fused_permutation(full.shape[dim] // parts, parts, tp).to(full.device)
    index = torch.argsort(perm) if invert else perm
    moved = full.index_select(dim, index)
    ref = t if isinstance(t, DTensor) else like
    if isinstance(ref, DTensor):
        return distribute_tensor(moved, ref.device_mesh, ref.placements, src_data_rank=None)
    return moved


def _walk(model: nn.Module, state: dict[str, Any], invert: bool) -> dict[str, Any]:
    fused = _fused_tensors(model)
    info = tp_info(model)
    if not fused or info is None:
        return state
    tp: int = info["degree"]
    params = dict(model.named_parameters())
    out = dict(state)
    if "model" in out:
        out["model"] = dict(out["model"])
        for name, (dim, parts) in fused.items():
            if name in out["model"]:
                out["model"][name] = _apply(out["model"][name], dim, parts, tp, invert, params[name].data)
    osd = out.get("optimizer")
    if isinstance(osd, dict) and isinstance(osd.get("state"), dict):
        osd = dict(osd)
        osd["state"] = dict(osd["state"])
        for name, (dim, parts) in fused.items():
            entry = osd["state"].get(name)
            if isinstance(entry, dict):
                osd["state"][name] = {
                    k: _apply(v, dim, parts, tp, invert, params[name].data) if isinstance(v, torch.Tensor) and v.dim() > dim else v for k, v in entry.items()
                }
        out["optimizer"] = osd
    return out


def to_original(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (``{"model", "optimizer"}``, by parameter name) with fused weights in the model's own layout."""
    return _walk(model, state, invert=True)


def to_run(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `to_original`: a saved state laid out for this run's split."""
    return _walk(model, state, invert=False)


def relayout_whole(modules: Iterable[nn.Module], model_state: dict[str, Any], optimizer_state: dict[str, Any] | None, *, invert: bool) -> None:
    """Whole tensors of fused q|k|v projections (split by heads under tp, so permuted in the run)
    moved in place between the run's layout and the model's (``invert``: run -> model), by name.

    `to_original` / `to_run` re-shard what they move; a pipeline state holds whole tensors of a
    pipeline rank's stages (``modules``), so the same permutation is applied to plain tensors here."""
    for mod in modules:
        info = tp_info(mod)
        if not info or not (info.get("fused") or info.get("fused_params")):
            continue
        for name, (dim, parts) in _fused_tensors(mod).items():
            if name in model_state:
                model_state[name] = _apply(model_state[name], dim, parts, info["degree"], invert)
            entry = (optimizer_state or {}).get("state", {}).get(name)
            if isinstance(entry, dict):
                for k, v in entry.items():
                    if isinstance(v, torch.Tensor) and v.dim() > dim:
                        entry[k] = _apply(v, dim, parts, info["degree"], invert)


def check_replicas(model: nn.Module, group: Any, *, recorder: Recorder | None = None) -> None:
    """Hash every replicated (plain) parameter and compare across ``group`` (the tp ranks: a
    `shardwise.comm.Group`, or a ProcessGroup), in registration order; raise ``RuntimeError``
    naming the first that differs. A debug check: one all-gather of the digests (8 bytes per
    parameter), recorded on ``recorder`` when given."""
    from torch.distributed.tensor import DTensor

    names, digests = [], []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) or isinstance(getattr(p, "data", None), DTensor):
            continue
        h = hashlib.sha256(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).digest()[:8]
        names.append(name)
        digests.append(int.from_bytes(h, "little", signed=True))
    if not names:
        return
    mine = torch.tensor(digests, dtype=torch.int64)
    tp_group = group if isinstance(group, Group) else Group("tp", group)
    gathered = all_gather(mine, group=tp_group, recorder=recorder)
    size = len(gathered)
    for i, name in enumerate(names):
        values = {int(g[i]) for g in gathered}
        if len(values) > 1:
            raise RuntimeError(f"replicated parameter {name} differs across the {size} tp ranks (check_replicas): a rule for its gradient is missing or wrong")
