"""How a pipeline composes with the other parallelisms, in torchtitan's order: tensor parallel
inside each stage (``_tensor_parallel``, applied in ``Pipeline.apply``), then the pipeline, then
data parallel over the mesh's ``dp`` dimension (``apply_data_parallel`` before the schedule,
``average_grads`` after it), and the global gradient norm over all of them (``clip_grad_norm``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from shardwise.comm import Group, Recorder, all_reduce
from shardwise.comm.mesh import Mesh
from shardwise.errors import ConfigError


def _tensor_parallel() -> Any:
    try:
        from shardwise.strategies import tensor_parallel
    except ImportError as exc:
        raise ConfigError("pipeline with tp > 1 needs shardwise.strategies.tensor_parallel, which this installation does not have; use tp=1") from exc
    return tensor_parallel


def apply_data_parallel(stage_mod: nn.Module, mesh: Mesh, dp_strategy: str, tp: int) -> nn.Module:
    """Data parallel last, over the mesh's dp dimension: FSDP2 (``dp_strategy="fsdp"``), or,
    with ``ddp``, the stage module as it is and its gradients averaged after the schedule
    (`average_grads`).

    Not torch's DistributedDataParallel: its reducer, fed one backward per micro-batch by the
    schedule, fails to rebuild its buckets after the first step (torch 2.13, gloo: "rebuilt
    parameter indices size is not same as original model parameters size")."""
    if mesh.size("dp") == 1 or dp_strategy == "ddp":
        return stage_mod
    if tp > 1:
        # One FSDP unit per stage (its "auto" units would pick the ModuleDict holding the stage's blocks).
        return cast(nn.Module, _tensor_parallel().shard_data_parallel(stage_mod, mesh.device_mesh("dp"), units="root"))
    from torch.distributed.fsdp import fully_shard

    return cast(nn.Module, fully_shard(stage_mod, mesh=mesh.device_mesh("dp")))


def average_grads(module: nn.Module, mesh: Mesh, *, dp_strategy: str, tp: int, sequence_parallel: bool, recorder: Recorder | None) -> None:
    """Partial gradients summed over tp, then every local gradient averaged across the
    data-parallel group: one flat allreduce per step.

    The tp sum runs whenever tp > 1, not only under sequence parallelism: a model's declared plan
    can leave replicated parameters that see one rank's heads (per-head q/k norms), whose gradients
    tp's roles mark for summing; with nothing marked or partial it sends nothing."""
    if tp > 1:
        _tensor_parallel().reduce_partial_grads(module, recorder)
    if mesh.size("dp") == 1 or dp_strategy != "ddp":
        return
    if tp > 1:  # gradients are DTensors: average their local shards
        _tensor_parallel().replicate_grads(module, mesh.group("dp"), recorder)
        return
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, "mean", group=mesh.group("dp"), recorder=recorder)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(
    model: nn.Module,
    max_norm: float,
    device: torch.device,
    pp_group: Group | None,
    skip: set[int] = frozenset(),  # type: ignore[assignment]
    recorder: Recorder | None = None,
) -> torch.Tensor:
    """Clip by the global norm: a gradient's squared norm counts once, summed over the tp ranks
    that hold shards of it and over the pp ranks (each parameter lives on one stage), never
    over replicas (dp, or tp for replicated tensors). Same coefficient as torch's
    ``clip_grad_norm_``: ``max_norm / (norm + 1e-6)``, at most 1.

    ``pp_group``: the pipeline group, None with one pipeline rank. ``skip``: ids of parameters whose
    gradient is scaled but not counted (the second copy of a weight tied across stages). The sums go
    through `shardwise.comm` (recorded under the mesh dimension's name: ``tp``, ``dp``, ``pp``)."""
    params = [p for p in model.parameters() if p.grad is not None]
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    sharded: dict[tuple[int, tuple[int, ...]], tuple[Any, torch.Tensor]] = {}  # (mesh, sharded dims) -> (mesh, sum of squares)
    locals_: list[torch.Tensor] = []
    for p in params:
        g: Any = p.grad
        local: torch.Tensor = g.to_local() if hasattr(g, "to_local") else g
        locals_.append(local)
        if id(p) in skip:
            continue
        sq = local.double().pow(2).sum()
        # Sharded along a mesh dim: any placement but Replicate and Partial (torch 2.13's
        # _StridedShard, which FSDP2 over TP produces, answers is_shard() False).
        dims = tuple(i for i, pl in enumerate(getattr(g, "placements", ())) if not (pl.is_replicate() or pl.is_partial()))
        if dims:
            key = (id(g.device_mesh), dims)
            mesh_, acc = sharded.get(key, (g.device_mesh, torch.zeros((), dtype=torch.float64, device=device)))
            sharded[key] = (mesh_, acc + sq)
        else:
            replicated = replicated + sq
    for (_, dims), (mesh_, acc) in sharded.items():
        names = mesh_.mesh_dim_names or ()
        for d in dims:  # tp shards, fsdp's dp shards: each piece counted once
            all_reduce(acc, "sum", group=Group(names[d] if d < len(names) else f"mesh{d}", mesh_.get_group(d)), recorder=recorder)
        replicated = replicated + acc
    total_sq = replicated.reshape(1)
    if pp_group is not None:
        all_reduce(total_sq, "sum", group=pp_group, recorder=recorder)
    norm = total_sq.sqrt()[0]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if locals_:
        torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
    dtype = locals_[0].dtype if locals_ else torch.float32
    return norm.to(dtype)
