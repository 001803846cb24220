"""Which modules become FSDP2 units (`auto_wrap_units`, `resolve_units`), and `apply_fsdp`: ``fully_shard``
on each unit and the root, over the shard mesh (`shard_mesh`; 2D for hsdp).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from shardwise.comm.mesh import Mesh
from shardwise.errors import ConfigError
from shardwise.strategies.sharded.reads import reads_outside

_MP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
MixedPrecision = Literal["bf16", "bfloat16", "fp16", "float16"]
"""The parameter dtypes FSDP2 may all-gather in for compute (gradients are reduced in fp32)."""


# -- which modules become FSDP units ---------------------------------------------------------


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def auto_wrap_units(model: nn.Module, min_fraction: float = 0.05) -> list[str]:
    """Names of the submodules to shard as their own units (the root is always one).

    A model with a ``ModuleList`` of blocks (transformers, ResNet stages) gets one unit per
    block of the largest such list: gathering one block at a time bounds the peak to a block.
    Otherwise the root's large children (at least ``min_fraction`` of the parameters) are
    units, looking through containers that hold a single child with parameters
    (``Model.net = Sequential(...)``).
    """
    return _read_inside(model, _auto_units(model, min_fraction))


def _auto_units(model: nn.Module, min_fraction: float) -> list[str]:
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if lists:
        name, blocks = max(lists, key=lambda item: _numel(item[1]))
        if _numel(blocks) > 0:
            return _unshared(model, [f"{name}.{i}" for i, b in enumerate(blocks) if _numel(b) > 0] + _large_leaves(model, name, min_fraction))
    prefix, node = "", model
    while True:
        with_params = [(n, c) for n, c in node.named_children() if _numel(c) > 0]
        if len(with_params) != 1:
            break
        prefix, node = f"{prefix}{with_params[0][0]}.", with_params[0][1]
    total = max(_numel(model), 1)
    return _unshared(model, [f"{prefix}{n}" for n, c in node.named_children() if _numel(c) >= min_fraction * total])


def _read_inside(model: nn.Module, units: list[str]) -> list[str]:
    """``units`` less those whose weights the model's code reads outside them (`reads.reads_outside`: a head
    tied by ``x @ self.emb.weight.t()`` in the root's forward); such a module stays with the root."""
    outside = reads_outside(model)
    return [u for u in units if not any(p == u or p.startswith(u + ".") for p in outside)]


def _unshared(model: nn.Module, units: list[str]) -> list[str]:
    """``units`` less those holding a parameter another unit holds too (a module shared by every block
    of a hand-written model): one unit must own each parameter, so a shared one stays with the root."""
    seen: dict[int, int] = {}
    for name in units:
        for p in model.get_submodule(name).parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    return [n for n in units if all(seen[id(p)] == 1 for p in model.get_submodule(n).parameters())]


def _large_leaves(model: nn.Module, blocks: str, min_fraction: float) -> list[str]:
    """Modules outside the block list that hold their own large weights (an untied embedding, the head):
    units of their own, so each is gathered only while it runs, not for the whole step with the root
    (a 32000-word Llama's embedding and head are a third of its parameters). A weight shared with another
    module (a tied head) stays with the root: one unit must own it."""
    total = max(_numel(model), 1)
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    out: list[str] = []
    for n, m in model.named_modules():
        if not n or n == blocks or n.startswith(blocks + ".") or not any(True for _ in m.parameters(recurse=False)):
            continue
        own = list(m.parameters())
        if sum(p.numel() for p in own) >= min_fraction * total and all(owners.get(id(p), 0) == 1 for p in own) and not any(n.startswith(u + ".") for u in out):
            out.append(n)
    return out


def resolve_units(model: nn.Module, wrap: str | Sequence[str]) -> list[str]:
    """``wrap``: ``"auto"``, ``"root"`` (one unit), or submodule names / class names to shard as units."""
    if wrap == "auto":
        return auto_wrap_units(model)
    if wrap == "root":
        return []
    wanted = [wrap] if isinstance(wrap, str) else list(wrap)
    names = [n for n, m in model.named_modules() if n and (n in wanted or type(m).__name__ in wanted)]
    unknown = [w for w in wanted if not any(n == w or type(model.get_submodule(n)).__name__ == w for n in names)]
    if unknown:
        raise ConfigError(
            f"wrap={wanted!r}: {unknown} match no submodule name or class of {type(model).__name__}; "
            "use 'auto', 'root', or names from model.named_modules() (e.g. 'layers.0') or class names (e.g. 'Block')"
        )
    outside = reads_outside(model)
    read = {u: next(w for p, w in outside.items() if p == u or p.startswith(u + ".")) for u in names if any(p == u or p.startswith(u + ".") for p in outside)}
    if read:
        unit, where = next(iter(read.items()))
        raise ConfigError(
            f"wrap={wanted!r}: {unit!r} cannot be a unit of its own: {where}, outside {unit}'s forward, where FSDP keeps "
            f"its parameters sharded. Leave {sorted(read)} out of wrap (they stay with the root, gathered for its forward), or use wrap='auto'"
        )
    return names


# -- applying FSDP2 -------------------------------------------------------------------------


def shard_mesh(mesh: Mesh, replicate: int = 1) -> Any:
    """A DeviceMesh over the data-parallel ranks: 1D ``(shard,)``, or 2D ``(replicate, shard)`` for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = mesh.size("dp")
    if dp != mesh.world_size:
        raise ConfigError(f"sharded data parallel composes with pp/tp in a later release; got degrees {mesh.degrees}. Use dp only")
    if replicate == 1:
        return init_device_mesh(mesh.device.type, (dp,), mesh_dim_names=("shard",))
    return init_device_mesh(mesh.device.type, (replicate, dp // replicate), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(
    model: nn.Module,
    device_mesh: Any,
    *,
    units: Sequence[str],
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    offload: bool = False,
    ignored: set[nn.Parameter] | None = None,
) -> nn.Module:
    """``fully_shard`` each unit, then the root (bottom-up, as FSDP2 requires); returns the root.

    ``mixed_precision="bf16"`` all-gathers parameters in bf16 for compute while gradients are
    reduced and master weights kept in fp32 (``MixedPrecisionPolicy``). ``offload`` keeps the
    shards (parameters, gradients, optimizer state) in CPU memory; pinned memory only where
    CUDA exists (without it, pinning raises "Cannot access accelerator device"). ``ignored``:
    parameters FSDP2 leaves alone (expert parallelism's expert slices, reduced by it).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if mixed_precision is not None:
        mp = MixedPrecisionPolicy(param_dtype=_MP_DTYPES[mixed_precision], reduce_dtype=torch.float32)
    off = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for name in sorted(units, key=lambda n: -n.count(".")):  # innermost first
        fully_shard(
            model.get_submodule(name), mesh=device_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=off, ignored_params=ignored
        )
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=off, ignored_params=ignored)
    return model


def fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def regather(model: nn.Module) -> None:
    """Drop the gathered parameters and gather the current shards again (zero2, after each step)."""
    for m in fsdp_modules(model):
        m.reshard()
    for m in fsdp_modules(model):
        m.unshard()
