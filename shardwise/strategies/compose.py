"""Where the strategy families meet: every composition of one family with another goes through here.

torchtitan's order (its ``parallelize``): tensor parallel inside each pipeline stage
(`require_tensor_parallel`, `parallelize_stage`, `fused_layout`, `relayout_whole`), then the pipeline,
then data parallel over the mesh's ``dp`` dimension (`apply_data_parallel` before the schedule,
`average_grads` after it), and the global gradient norm over all of them (`clip_grad_norm`). Tensor
parallel over FSDP2 (`shard_data_parallel`) and zero1's optimizer over DDP (`replicate_with_ddp`) are
compositions too. A family module imports no other family (tests/test_layers.py); the families are
imported here when a composition is used, so this module stays importable on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from shardwise.comm import Group, Recorder, all_reduce
from shardwise.comm.mesh import Mesh
from shardwise.errors import ConfigError


def require_tensor_parallel() -> Any:
    """The tensor-parallel package (`shardwise.strategies.tensor_parallel`), or a `ConfigError` saying tp > 1 needs it."""
    try:
        from shardwise.strategies import tensor_parallel
    except ImportError as exc:
        raise ConfigError("pipeline with tp > 1 needs shardwise.strategies.tensor_parallel, which this installation does not have; use tp=1") from exc
    return tensor_parallel


# -- tensor parallel inside a pipeline stage ---------------------------------------------------------


def check_tp_fits(model: nn.Module, plan: dict[str, str] | None, tp: int, sequence_parallel: bool, dp_strategy: str) -> tuple[str, ...]:
    """The linears tensor parallelism splits in ``model`` (tp's plan resolved and checked), or tp's `ConfigError`."""
    return tuple(require_tensor_parallel().check_model_fits(model, plan, tp, sequence_parallel, dp_strategy))


def parallelize_stage(stage_mod: nn.Module, mesh: Mesh, plan: dict[str, str] | None, sequence_parallel: bool) -> None:
    """Tensor parallel first, inside a pipeline stage, in place (original names: the plan matches as on the whole model)."""
    require_tensor_parallel().parallelize(stage_mod, mesh.device_mesh("tp"), plan=plan, sequence_parallel=sequence_parallel)


def fused_layout(*modules: nn.Module) -> Any:
    """For `materialize.fill_share`: tp's fused q|k|v permutation over a pipeline rank's stages (None: nothing fused)."""
    return require_tensor_parallel().relayout.fused_layout(*modules)


def relayout_whole(modules: Iterable[nn.Module], model_state: dict[str, Any], optimizer_state: dict[str, Any] | None, *, invert: bool) -> None:
    """Whole tensors of tp's fused q|k|v projections moved in place between the run's layout and the
    model's (``invert``: run -> model), by name: a pipeline state holds whole tensors (`tensor_parallel.relayout.relayout_whole`)."""
    from shardwise.strategies.tensor_parallel.relayout import relayout_whole as tp_relayout_whole

    tp_relayout_whole(modules, model_state, optimizer_state, invert=invert)


# -- data parallel around tensor parallel, the pipeline, or a sharded optimizer -----------------------


def shard_data_parallel(module: nn.Module, dp_mesh: Any, units: str | Sequence[str] = "auto") -> nn.Module:
    """FSDP2 ``fully_shard`` of ``module`` over the data-parallel DeviceMesh ``dp_mesh``, in place.

    Apply after tensor parallelism's ``parallelize``: parameters that are tp DTensors become 2D (dp
    ``Shard(0)``, tp's own placement) when ``dp_mesh`` and the tp mesh are slices of one DeviceMesh
    (``mesh["dp"]``, ``mesh["tp"]``). ``units``: ``"auto"`` (one unit per block, as ``zero3``),
    ``"root"``, or names.
    """
    from shardwise.strategies.sharded.units import apply_fsdp, resolve_units

    return apply_fsdp(module, dp_mesh, units=resolve_units(module, units))


def replicate_with_ddp(model: nn.Module, mesh: Mesh, recorder: Recorder, **ddp_kwargs: Any) -> Any:
    """``model`` (on its device) in ddp's DistributedDataParallel over the mesh's dp group, its
    bucket reductions recorded (`data_parallel.ddp.apply_ddp`): what zero1 shards its optimizer under."""
    from shardwise.strategies.data_parallel.ddp import apply_ddp

    return apply_ddp(model, mesh, recorder, **ddp_kwargs)


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
        return shard_data_parallel(stage_mod, mesh.device_mesh("dp"), units="root")
    from torch.distributed.fsdp import fully_shard

    return cast(nn.Module, fully_shard(stage_mod, mesh=mesh.device_mesh("dp")))


def average_grads(module: nn.Module, mesh: Mesh, *, dp_strategy: str, tp: int, sequence_parallel: bool, recorder: Recorder | None) -> None:
    """Partial gradients summed over tp, then every local gradient averaged across the
    data-parallel group: one flat allreduce per step.

    The tp sum runs whenever tp > 1, not only under sequence parallelism: a model's declared plan
    can leave replicated parameters that see one rank's heads (per-head q/k norms), whose gradients
    tp's roles mark for summing; with nothing marked or partial it sends nothing."""
    if tp > 1:
        require_tensor_parallel().reduce_partial_grads(module, recorder)
    if mesh.size("dp") == 1 or dp_strategy != "ddp":
        return
    if tp > 1:  # gradients are DTensors: average their local shards
        require_tensor_parallel().replicate_grads(module, mesh.group("dp"), recorder)
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


# -- expert parallelism inside the data-parallel dimension --------------------------------------------


def check_expert_parallel(model: nn.Module | None, ep: int, dp: int) -> None:
    """In the parent: ``ep`` divides ``dp`` and, given the model, its experts layers (`expert_parallel.check_model`)."""
    from shardwise.strategies.expert_parallel import check_model

    if model is None:
        if ep < 1 or dp % ep:
            raise ConfigError(f"ep={ep} does not divide the data-parallel degree {dp}; choose an ep that divides {dp}")
        return
    check_model(model, ep, dp)


def expert_parallel(model: nn.Module, ep: int, mesh: Mesh, recorder: Recorder | None) -> Any:
    """``model``'s experts split over ep groups of the mesh's dp dimension, in place: an
    `expert_parallel.ExpertParallel` (reduce_grads, clip_grad_norm, whole_state, local_state)."""
    from shardwise.strategies.expert_parallel import expert_parallel as apply_ep

    return apply_ep(model, ep, mesh, recorder)


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


# -- context parallelism under data or tensor parallelism ---------------------------------------------


def check_context_parallel_options(strategy: str, cp: int, style: str) -> None:
    """A `ConfigError` for a bad ``cp`` degree or ``cp_style`` (`context_parallel.check_options`)."""
    from shardwise.strategies.context_parallel import check_options

    check_options(strategy, cp, style)


def context_parallel_layout(plan: Any, world_size: int, cp: int, strategy: str) -> Any:
    """``plan(world_size // cp)``'s layout with ``cp`` in its mesh (`context_parallel.cp_layout`); ``plan(world_size)`` for cp 1."""
    if cp == 1:
        return plan(world_size)
    from shardwise.strategies.context_parallel import cp_layout

    return cp_layout(plan, world_size, cp, strategy)


def check_context_parallel(model: nn.Module, batch: Any, cp: int, style: str, strategy: str) -> None:
    """In the parent: the sequence splits, and every attention of ``model`` is reached and exact (`context_parallel.check_model`)."""
    if cp == 1:
        return
    from shardwise.strategies.context_parallel import check_model

    check_model(model, batch, cp, style, strategy)


def apply_context_parallel(model: nn.Module, mesh: Mesh, recorder: Recorder, style: str) -> Mesh:
    """Context parallelism first (the sequence over the mesh's ``cp`` ranks, in place); returns the
    mesh the data- or tensor-parallel strategy then runs on: ``dp x cp`` folded into its ``dp``."""
    if mesh.size("cp") == 1:
        return mesh
    from shardwise.strategies.context_parallel import apply_context_parallel as apply_cp

    apply_cp(model, mesh.group("cp"), recorder, style)
    return mesh.fold_cp()
