"""Gradients of tensor-parallel modules: the partial sums sequence parallelism leaves, data
parallel over the dp dimension (an allreduce of local shards; FSDP2 for 2D is `compose.shard_data_parallel`), and the global
norm for clipping over gradients of any placement.

Sequence-parallel norm weights' gradients are partial sums over the sequence shards; Megatron
reduces them once per step, as `reduce_partial_grads` does (coalesced). Torch's DDP reducer does
not take DTensor parameters, so `replicate_grads` averages each gradient's local tensor over the
dp group in one flat buffer per dtype.

Every allreduce here goes through `shardwise.comm` (named after the mesh dimension it runs over),
so the run's `Recorder`, when one is passed, sees each byte.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardwise.comm.collectives import Group, all_reduce
from shardwise.comm.recorder import Recorder


def _dim_label(mesh: Any, dim: int) -> str:
    """What the recorder calls a DeviceMesh dimension: its name (``dp``, ``tp``), else ``tp``."""
    names = mesh.mesh_dim_names or ()
    return (names[dim] if dim < len(names) else None) or "tp"


# -- partial sums under sequence parallelism ---------------------------------------------------


def reduce_partial_grads(module: nn.Module, recorder: Recorder | None = None) -> int:
    """Allreduce the gradients DTensor left as partial sums (sequence-parallel norm weights: each tp
    rank's sum over its slice of the sequence), coalesced into one allreduce per (mesh, placements,
    dtype) and partial mesh dimension; they become replicated there. Returns how many were reduced."""
    from torch.distributed.tensor import DTensor, Replicate

    groups: dict[tuple[int, tuple[Any, ...], torch.dtype], list[nn.Parameter]] = {}
    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((id(g.device_mesh), tuple(g.placements), g.dtype), []).append(p)
    for params in groups.values():
        first = params[0].grad
        assert isinstance(first, DTensor)
        mesh, placements = first.device_mesh, list(first.placements)
        locals_ = [p.grad.to_local() for p in params]  # type: ignore[union-attr]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for d, pl in enumerate(placements):
            if not pl.is_partial():
                continue
            group = Group(_dim_label(mesh, d), mesh.get_group(d))
            all_reduce(flat, "mean" if getattr(pl, "reduce_op", "sum") == "avg" else "sum", group=group, recorder=recorder)
            placements[d] = Replicate()
        offset = 0
        for p, t in zip(params, locals_, strict=True):
            piece = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
            p.grad = DTensor.from_local(piece, mesh, placements, run_check=False)
    return sum(len(v) for v in groups.values()) + _sum_role_grads(module, recorder)


def _sum_role_grads(module: nn.Module, recorder: Recorder | None) -> int:
    """Sum over tp the gradients of the replicated parameters `roles.roles` lists (norms that saw a
    slice of the sequence, per-head norms a model declares): one coalesced allreduce per dtype."""
    from torch.distributed.tensor import DTensor

    # Found two ways: through the module parallelize() ran on (its names survive FSDP2, which
    # replaces the parameters), and by a mark on the parameters (a pipeline wrapper registers the
    # stage's layers, not the stage module).
    found: list[tuple[nn.Parameter, Any]] = []
    for part in module.modules():
        info = getattr(part, "_shardwise_tp", None) or {}
        found += [(part.get_parameter(n), info["mesh"]) for n in info.get("sum", ())]
    found += [(p, mesh) for p in module.parameters() if (mesh := getattr(p, "_shardwise_tp_sum", None)) is not None]
    if not found:
        return 0
    group = Group("tp", found[0][1].get_group())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for p, _ in found:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_dtype.setdefault(local.dtype, []).append(local)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        all_reduce(flat, "sum", group=group, recorder=recorder)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return sum(len(v) for v in by_dtype.values())


# -- data parallel over the dp dimension -------------------------------------------------------


def replicate_grads(module: nn.Module, dp_group: Any, recorder: Recorder | None = None) -> None:
    """Average every gradient over the data-parallel group (DDP's step for modules holding DTensors).

    Each gradient's local tensor (a DTensor's shard, or the plain tensor) is averaged over
    ``dp_group`` (a `shardwise.comm.Group`, or a ProcessGroup); gradients are packed into one
    buffer per dtype, so a step is one allreduce per dtype (recorded as ``dp/all_reduce``).
    Replicas of one tp rank hold the same shard layout, so the averaged shard is the shard of
    the averaged gradient.
    """
    from torch.distributed.tensor import DTensor

    group = dp_group if isinstance(dp_group, Group) else Group("dp", dp_group)
    if group.size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in module.parameters():
        if param.grad is None:
            continue
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        by_dtype.setdefault(local.dtype, []).append(local)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        all_reduce(flat, "mean", group=group, recorder=recorder)  # a sum, then a division by the group size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


# -- the global gradient norm ------------------------------------------------------------------


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, recorder: Recorder | None = None) -> torch.Tensor:
    """Clip by the global norm of gradients that are DTensors (any mesh, any placements) or plain tensors.

    A gradient's squared local norm counts once: summed over the mesh dimensions where it is
    sharded, and not over those where it is replicated (each replica holds the same values).
    Partial gradients must have been reduced first (`reduce_partial_grads`). One allreduce of
    a scalar per distinct (mesh dimension) that holds shards.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    total: torch.Tensor | None = None
    by_dims: dict[tuple[Any, ...], torch.Tensor] = {}
    meshes: dict[tuple[Any, ...], Any] = {}
    for p in params:
        g = p.grad
        key: tuple[Any, ...] = ()  # plain tensors: replicated wherever they live, counted once
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise ValueError("clip_grad_norm_ got a partial gradient; call reduce_partial_grads first")
            sq = g.to_local().double().pow(2).sum()
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())  # Shard, _StridedShard
            key = (id(g.device_mesh), dims)
            meshes[key] = g.device_mesh
        else:
            sq = g.double().pow(2).sum()  # type: ignore[union-attr]
        by_dims[key] = by_dims[key] + sq if key in by_dims else sq
    for key, sq in by_dims.items():
        if key:
            mesh, dims = meshes[key], key[1]
            for d in dims:
                all_reduce(sq, "sum", group=Group(_dim_label(mesh, d), mesh.get_group(d)), recorder=recorder)
        total = sq if total is None else total + sq
    assert total is not None
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.dtype))  # type: ignore[union-attr]
    return norm.to(params[0].dtype)
