"""Applying a tensor-parallel plan on DTensor: Megatron's split, sequence parallelism's region, and
dropout masks that agree across the tp ranks where the activation is replicated.

Megatron-LM (Shoeybi et al. 2019): the first linear of a pair is split by output columns
(``ColwiseParallel``), the second by input rows (``RowwiseParallel``); between them nothing is
communicated. Megatron's ``f`` (identity forward, allreduce backward) is ``PrepareModuleInput`` on
a sublayer whose input feeds several column-split linears (q, k, v: their input gradients are
summed once), ``g`` (allreduce forward, identity backward) is the row-split linear's output.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") shards what lies between the pairs (layer norms, dropout, the residual
stream) along the sequence: ``f`` becomes an all-gather (backward: reduce-scatter) and ``g`` a
reduce-scatter (backward: all-gather), the same bytes as the allreduce they replace, with
``1/tp`` of the activation memory outside the pairs. Norm weights stay replicated; their
gradients, partial sums over the sequence shards, are reduced by `reduce_partial_grads`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.strategies.tensor_parallel.plan import _join, _sequence_blocks, _sublayers, resolve_plan

_NORMS: tuple[type[nn.Module], ...] = (nn.LayerNorm,) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def parallelize(module: nn.Module, tp_mesh: Any, plan: dict[str, str] | None = None, sequence_parallel: bool = False) -> nn.Module:
    """Split ``module``'s linear pairs across ``tp_mesh`` (a 1D DeviceMesh), in place; returns it.

    ``plan``: ``None`` for the automatic plan, or module name / fnmatch pattern -> ``"colwise"`` |
    ``"rowwise"``. Works on part of a model (a pipeline stage holding blocks 2-3): names are the
    module's own, so a stage built by deleting the other children keeps the original names.
    Parameters of split linears become DTensors (colwise: ``Shard(0)`` weight and bias; rowwise:
    ``Shard(1)`` weight, replicated bias); everything else stays a plain tensor, replicated, except
    under ``sequence_parallel``, where the norms inside blocks hold replicated DTensors.

    With ``sequence_parallel``, activations are sequence-sharded (dim 1) from the first block's
    input to the last block's output (registration order); the module's input and output stay
    whole, so a pipeline stage exchanges whole activations.

    >>> tp_mesh = init_device_mesh("cpu", (2,))                               # doctest: +SKIP
    >>> parallelize(model, tp_mesh, sequence_parallel=True)                  # doctest: +SKIP
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    tp = tp_mesh.size()
    resolved = resolve_plan(module, plan, tp)
    styles: dict[str, Any] = {}
    for name, style in resolved.items():
        if style == "colwise":
            styles[name] = ColwiseParallel()
        else:
            styles[name] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    blocks: list[str] = []
    if sequence_parallel:
        blocks = _sequence_blocks(module, resolved)
        for sub in _sublayers(resolved):
            styles[sub] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False)
        for block in blocks:
            for name, m in module.get_submodule(block).named_modules():
                if isinstance(m, _NORMS) and not any(_join(block, name).startswith(s + ".") or _join(block, name) == s for s in _sublayers(resolved)):
                    styles[_join(block, name)] = SequenceParallel()
    else:
        for sub, cols in _sublayers(resolved).items():
            if len(cols) > 1:  # q, k, v share one input: sum their input gradients once (Megatron's f)
                styles[sub] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False)
    if "" in styles:  # a sublayer at the root: PrepareModuleInput on the module itself
        root_style = styles.pop("")
        parallelize_module(module, tp_mesh, root_style)
    parallelize_module(module, tp_mesh, styles)
    if sequence_parallel:
        _sequence_boundaries(module, tp_mesh, blocks)
    synchronize_dropout(module, tp_mesh, blocks if sequence_parallel else [])
    module._shardwise_tp = {"plan": resolved, "sequence_parallel": sequence_parallel, "degree": tp}  # type: ignore[assignment]
    return module


def _sequence_boundaries(module: nn.Module, tp_mesh: Any, blocks: list[str]) -> None:
    """Enter the sequence-sharded region at the first block (a local slice: no communication
    forward, an all-gather of the gradient backward) and leave it after the last (an all-gather
    forward, a slice of the gradient backward)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = tp_mesh.size()

    def enter(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if x.dim() < 2 or x.shape[1] % tp:
            # Uneven shards would give the ranks different global shapes at the next gather (a hang).
            raise ValueError(
                f"sequence parallelism splits dim 1 (the sequence) of the blocks' input across tp={tp} ranks; got shape "
                f"{tuple(x.shape)}: use sequences whose length is a multiple of {tp}, or turn sequence_parallel off"
            )
        if isinstance(x, DTensor):
            dx = x.redistribute(tp_mesh, (Shard(1),))
        else:
            dx = DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False).redistribute(tp_mesh, (Shard(1),))
        return (dx.to_local(), *args[1:])

    def leave(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        dx = out if isinstance(out, DTensor) else DTensor.from_local(out, tp_mesh, (Shard(1),), run_check=False)
        return dx.redistribute(tp_mesh, (Replicate(),)).to_local()

    module.get_submodule(blocks[0]).register_forward_pre_hook(enter)
    module.get_submodule(blocks[-1]).register_forward_hook(leave)


def synchronize_dropout(module: nn.Module, tp_mesh: Any, sharded_blocks: Sequence[str] = ()) -> int:
    """Make the ``nn.Dropout`` modules of ``module`` draw the same masks on every tp rank where
    their input is replicated, and different ones where it is sequence-sharded.

    Ranks draw from their own RNG streams (the trainer seeds each rank differently), so a dropout
    on a replicated activation (the embedding's, or the MLP's after its row-split linear) would
    drop different elements on each tp rank and the replicas of the residual stream would drift
    apart silently. Each dropout therefore runs on a forked RNG seeded from a seed shared by the
    tp group (tp rank 0's ``torch.initial_seed()``, broadcast once), the module's index and its
    call count; inside ``sharded_blocks`` (sequence parallelism: every dropout there sees this
    rank's slice of the sequence) the tp rank is mixed in. Dropout inside attention
    (``scaled_dot_product_attention``'s ``dropout_p``) acts on this rank's own heads and keeps
    the rank's stream. Returns how many modules were synchronized.
    """
    drops = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if not drops:
        return 0
    pg = tp_mesh.get_group()
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=tp_mesh.device_type)
    dist.broadcast(seed, src=dist.get_global_rank(pg, 0), group=pg)
    base, rank = int(seed.item()), dist.get_rank(pg)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    for index, (name, drop) in enumerate(drops):
        sharded = any(name.startswith(b + ".") for b in sharded_blocks)
        state = {"calls": 0, "fork": None}

        def before(m: nn.Module, args: Any, index: int = index, sharded: bool = sharded, state: dict[str, Any] = state) -> None:
            if not m.training:
                return
            fork = torch.random.fork_rng(devices=devices)
            fork.__enter__()
            state["fork"] = fork
            torch.manual_seed((base + 1_000_003 * index + 7_919 * state["calls"] + (104_729 * (rank + 1) if sharded else 0)) % 2**63)
            state["calls"] += 1

        def after(m: nn.Module, args: Any, out: Any, state: dict[str, Any] = state) -> None:
            fork = state.pop("fork", None)
            state["fork"] = None
            if fork is not None:
                fork.__exit__(None, None, None)

        drop.register_forward_pre_hook(before)
        drop.register_forward_hook(after)
    return len(drops)
