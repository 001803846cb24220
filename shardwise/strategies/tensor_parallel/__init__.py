"""``tp``: Megatron tensor parallelism on DTensor, optionally with sequence parallelism and data parallel.

Megatron-LM (Shoeybi et al. 2019) splits each transformer block's two matrix products inside
the layer: the first linear of a pair by output columns (``ColwiseParallel``: every rank holds
``1/tp`` of the output features, for attention whole heads), the second by input rows
(``RowwiseParallel``: every rank computes a partial sum, added across ranks). Between them no
communication is needed; each pair costs Megatron's ``f`` (identity forward, allreduce backward)
before the column-split linears and ``g`` (allreduce forward, identity backward) after the
row-split one. A block (attention + MLP) is therefore exactly 2 allreduces forward and 2
backward (tested). Here ``f`` and ``g`` are DTensor's own: ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``, and ``PrepareModuleInput`` on a sublayer whose input
feeds several column-split linears (q, k, v), so the three input gradients are summed once.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") shards what lies between the pairs (layer norms, dropout, the residual
stream) along the sequence: ``f`` becomes an all-gather (backward: reduce-scatter) and ``g`` a
reduce-scatter (backward: all-gather), the same bytes as the allreduce they replace, with
``1/tp`` of the activation memory outside the pairs. Norm weights stay replicated; their
gradients, partial sums over the sequence shards, are allreduced once per step (coalesced).

Plans (``auto_plan``): in every module, the ``nn.Linear`` children named like the first linear
of a pair are column-split and the one named like the second is row-split, when both are
present:

========= ============================================================ =====================
role      child names                                                  style
========= ============================================================ =====================
attention ``q k v query key value q_proj k_proj v_proj wq wk wv``      colwise (by heads)
          ``out o_proj proj out_proj wo c_proj``                       rowwise
MLP       ``fc fc1 c_fc up_proj gate_proj w1 w3``                      colwise
          ``proj fc2 down_proj w2 c_proj``                             rowwise
========= ============================================================ =====================

A module with column-style children but not exactly one row-style child (or the reverse) is left
whole. Fused projections (``qkv``, ``c_attn``, ``Wqkv``, ``query_key_value``, ``qkv_proj``)
are refused: splitting q|k|v stacked by columns would hand a rank all of q and none of v; split
them into three linears or pass a plan for a model whose forward expects the split. Attention
is split by heads: the head count (``out_features // head_dim`` with a ``head_dim`` attribute on
the attention module, or its ``n_heads``/``num_heads``/``n_head``/``num_attention_heads``) must be
divisible by ``tp``. Embeddings, the final norm and the output head stay replicated (every tp
rank computes them whole on the same batch); a plan that finds nothing is a `ConfigError`.

A user plan maps module names or fnmatch patterns (``"layers.*.mlp.w1"``) to ``"colwise"`` or
``"rowwise"``; each must match at least one ``nn.Linear``.

Building blocks, for compositions with pipeline parallelism (stable signatures):

- `parallelize(module, tp_mesh, plan=None, sequence_parallel=False)`: in place, on a module whose
  submodules keep their original names (a whole model or a pipeline stage).
- `replicate_grads(module, dp_group, recorder=None)`: average every gradient's local tensor over
  the data-parallel group (one coalesced allreduce per dtype): data parallel for DTensor modules.
- `shard_data_parallel(module, dp_mesh, units="auto")`: FSDP2 ``fully_shard`` over the dp mesh
  (2D with tp when ``dp_mesh`` and the tp mesh are slices of one DeviceMesh).
- `clip_grad_norm_(parameters, max_norm, recorder=None)`: the global norm over DTensor (any mesh,
  any placements) and plain gradients.
- `reduce_partial_grads(module, recorder=None)`: after backward under sequence parallelism, the
  norm weights' partial gradients summed over tp (one coalesced allreduce).
- `count_collectives(recorder=None, **groups)`: count (and record) DTensor's and FSDP2's collectives.

Dropout on replicated activations draws the same mask on every tp rank (`synchronize_dropout`).
fp16 with a grad scaler is refused (torch's GradScaler cannot unscale mixed DTensor and plain
gradients); bf16-mixed runs.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import time
from collections import Counter
from typing import Any, ClassVar, ContextManager, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.precision import Precision
from shardwise.strategies.common import accumulate_backward
from shardwise.strategies.protocol import OptimizerFactory, StepFn

STYLES = ("colwise", "rowwise")

ATTN_COLWISE = frozenset({"q", "k", "v", "query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv"})
ATTN_ROWWISE = frozenset({"out", "o_proj", "proj", "out_proj", "wo", "c_proj"})
MLP_COLWISE = frozenset({"fc", "fc1", "c_fc", "up_proj", "gate_proj", "w1", "w3"})
MLP_ROWWISE = frozenset({"proj", "fc2", "down_proj", "w2", "c_proj"})
FUSED = frozenset({"qkv", "c_attn", "wqkv", "query_key_value", "qkv_proj", "in_proj"})
_HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "heads")
_NORMS: tuple[type[nn.Module], ...] = (nn.LayerNorm,) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


# -- plans: which linears split how (no process group needed) --------------------------------


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def auto_plan(module: nn.Module) -> dict[str, str]:
    """The Megatron plan for a module whose linears follow the usual names (see the module docstring).

    >>> from shardwise.recipes.charlm import CharGPT
    >>> auto_plan(CharGPT(11, 8, 16, 2, 1))
    {'blocks.0.attn.q': 'colwise', 'blocks.0.attn.k': 'colwise', 'blocks.0.attn.v': 'colwise', 'blocks.0.attn.proj': 'rowwise', 'blocks.0.mlp.fc': 'colwise', 'blocks.0.mlp.proj': 'rowwise'}
    """
    plan: dict[str, str] = {}
    for prefix, parent in module.named_modules():
        linears = {n: c for n, c in parent.named_children() if isinstance(c, nn.Linear)}
        fused = [n for n in linears if n.lower() in FUSED]
        if fused:
            raise ConfigError(
                f"{_join(prefix, fused[0])} is a fused q|k|v projection: splitting it by columns would give a rank "
                "all of q and none of v. Split it into three linears (q, k, v), or pass plan={...} naming only the "
                "linears to split"
            )
        is_attn = any(n in ATTN_COLWISE for n in linears)
        col_names, row_names = (ATTN_COLWISE, ATTN_ROWWISE) if is_attn else (MLP_COLWISE, MLP_ROWWISE)
        cols = [n for n in linears if n in col_names]
        rows = [n for n in linears if n in row_names]
        if cols and len(rows) == 1:
            for n in linears:  # registration order
                if n in cols:
                    plan[_join(prefix, n)] = "colwise"
                elif n in rows:
                    plan[_join(prefix, n)] = "rowwise"
    return plan


def resolve_plan(module: nn.Module, plan: dict[str, str] | None = None, tp: int | None = None) -> dict[str, str]:
    """Concrete ``{linear name: style}`` for ``module``: the automatic plan, or ``plan`` with its
    patterns expanded; checked (styles, names, ``nn.Linear``, widths and heads divisible by ``tp``)."""
    if plan is None:
        resolved = auto_plan(module)
        if not resolved:
            raise ConfigError(
                f"the automatic tensor-parallel plan found no linear pair to split in {type(module).__name__}: it looks for "
                "attention q/k/v (query/key/value, q_proj/k_proj/v_proj, wq/wk/wv) next to out/o_proj/proj/out_proj/wo, and "
                "MLP fc/fc1/up_proj/gate_proj/w1/w3 next to proj/fc2/down_proj/w2. Pass a plan instead, e.g. "
                "plan={'layers.*.ff.lin1': 'colwise', 'layers.*.ff.lin2': 'rowwise'}, or on the command line "
                "--set 'trainer.strategy_options.plan={\"layers.*.ff.lin1\" = \"colwise\", \"layers.*.ff.lin2\" = \"rowwise\"}'"
            )
    else:
        if not isinstance(plan, dict) or not plan:
            raise ConfigError(f"plan must be a non-empty dict of module name (or pattern) -> 'colwise'|'rowwise'; got {plan!r}")
        names = [n for n, _ in module.named_modules() if n]
        resolved = {}
        for pattern, style in plan.items():
            if style not in STYLES:
                close = difflib.get_close_matches(str(style), STYLES, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"plan[{pattern!r}] = {style!r} is not a style.{hint} Styles: 'colwise', 'rowwise'")
            matched = [n for n in names if n == pattern or fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                close = difflib.get_close_matches(pattern, names, n=3)
                raise ConfigError(
                    f"plan names {pattern!r}, which matches no module of {type(module).__name__}"
                    + (f"; close names: {close}" if close else "") + "; see model.named_modules() for the names"
                )
            for n in matched:
                resolved[n] = style
    for name, style in resolved.items():
        sub = module.get_submodule(name)
        if not isinstance(sub, nn.Linear):
            raise ConfigError(f"plan[{name!r}] = {style!r}: tensor parallelism splits nn.Linear modules; {name} is a {type(sub).__name__}")
    if tp is not None:
        check_divisible(module, resolved, tp)
    return resolved


def _heads(attn: nn.Module, q: nn.Linear) -> int | None:
    """Attention heads a column-split linear produces, if the attention module says (head_dim or a head count)."""
    head_dim = getattr(attn, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return q.out_features // head_dim
    for attr in _HEAD_ATTRS:
        value = getattr(attn, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_divisible(module: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Every split width divides by ``tp``; attention splits whole heads (`ConfigError` otherwise)."""
    for name, style in plan.items():
        lin = module.get_submodule(name)
        assert isinstance(lin, nn.Linear)
        width = lin.out_features if style == "colwise" else lin.in_features
        if style == "colwise" and _leaf(name) in ATTN_COLWISE:
            heads = _heads(module.get_submodule(_parent(name)) if _parent(name) else module, lin)
            if heads is not None and heads % tp:
                options = [d for d in range(1, heads + 1) if heads % d == 0]
                raise ConfigError(
                    f"{name} has {heads} attention heads, which do not split across tp={tp} ranks (attention is split by "
                    f"whole heads); choose tp in {options}, or a model whose head count is a multiple of {tp}"
                )
        if width % tp:
            raise ConfigError(f"{name} ({style}) has {width} {'output' if style == 'colwise' else 'input'} features, not divisible by tp={tp}")


# -- applying the plan -----------------------------------------------------------------------


def _sublayers(plan: dict[str, str]) -> dict[str, list[str]]:
    """Parent module -> its column-split linears (the modules whose input Megatron's f acts on)."""
    out: dict[str, list[str]] = {}
    for name, style in plan.items():
        if style == "colwise":
            out.setdefault(_parent(name), []).append(name)
    return out


def _blocks(module: nn.Module, plan: dict[str, str]) -> list[str]:
    """Transformer blocks: the parents of the modules holding a row-split linear, in registration order."""
    sublayers = {_parent(n) for n, s in plan.items() if s == "rowwise"}
    parents = {_parent(s) for s in sublayers if s}
    order = [n for n, _ in module.named_modules()]
    return [n for n in order if n in parents]


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
        blocks = _blocks(module, resolved)
        if not blocks:
            raise ConfigError(
                "sequence_parallel needs transformer blocks: modules holding the split sublayers (attention, MLP) together "
                f"with their norms; the plan {resolved} has its row-split linears at the top of {type(module).__name__}"
            )
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
        n = flat.numel() * flat.element_size()
        for d, pl in enumerate(placements):
            if not pl.is_partial():
                continue
            pg = mesh.get_group(d)
            size = dist.get_world_size(pg)
            start = time.perf_counter()
            dist.all_reduce(flat, group=pg)
            if getattr(pl, "reduce_op", "sum") == "avg":
                flat.div_(size)
            if recorder is not None:
                sent, recv = wire_bytes("all_reduce", n, size)
                label = (mesh.mesh_dim_names or ())[d] if mesh.mesh_dim_names else "tp"
                recorder.add(CommEvent("all_reduce", label, size, n, sent, recv, time.perf_counter() - start))
            placements[d] = Replicate()
        offset = 0
        for p, t in zip(params, locals_):
            piece = flat[offset: offset + t.numel()].view_as(t)
            offset += t.numel()
            p.grad = DTensor.from_local(piece, mesh, placements, run_check=False)
    return sum(len(v) for v in groups.values())


# -- data parallel over the dp dimension ------------------------------------------------------


def replicate_grads(module: nn.Module, dp_group: Any, recorder: Recorder | None = None) -> None:
    """Average every gradient over the data-parallel group (DDP's step for modules holding DTensors).

    Each gradient's local tensor (a DTensor's shard, or the plain tensor) is averaged over
    ``dp_group`` (a `shardwise.comm.Group`, or a ProcessGroup); gradients are packed into one
    buffer per dtype, so a step is one allreduce per dtype (recorded as ``dp/all_reduce``).
    Replicas of one tp rank hold the same shard layout, so the averaged shard is the shard of
    the averaged gradient.
    """
    from torch.distributed.tensor import DTensor

    pg = dp_group.pg if isinstance(dp_group, Group) else dp_group
    name = dp_group.name if isinstance(dp_group, Group) else "dp"
    p = dist.get_world_size(pg)
    if p == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in module.parameters():
        if param.grad is None:
            continue
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        by_dtype.setdefault(local.dtype, []).append(local)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        n = flat.numel() * flat.element_size()
        start = time.perf_counter()
        dist.all_reduce(flat, group=pg)
        flat.div_(p)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
        if recorder is not None:
            sent, recv = wire_bytes("all_reduce", n, p)
            recorder.add(CommEvent("all_reduce", name, p, n, sent, recv, time.perf_counter() - start))


def shard_data_parallel(module: nn.Module, dp_mesh: Any, units: str | Sequence[str] = "auto") -> nn.Module:
    """FSDP2 ``fully_shard`` of ``module`` over the data-parallel DeviceMesh ``dp_mesh``, in place.

    Apply after `parallelize`: parameters that are tp DTensors become 2D (dp ``Shard(0)``, tp's
    own placement) when ``dp_mesh`` and the tp mesh are slices of one DeviceMesh (``mesh["dp"]``,
    ``mesh["tp"]``). ``units``: ``"auto"`` (one unit per block, as ``zero3``), ``"root"``, or names.
    """
    from shardwise.strategies.fsdp import apply_fsdp, resolve_units

    return apply_fsdp(module, dp_mesh, units=resolve_units(module, units))


# -- the global gradient norm -----------------------------------------------------------------


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
                pg = mesh.get_group(d)
                dist.all_reduce(sq, group=pg)
                if recorder is not None:
                    size = dist.get_world_size(pg)
                    sent, recv = wire_bytes("all_reduce", 8, size)
                    recorder.add(CommEvent("all_reduce", (mesh.mesh_dim_names or ("tp",) * mesh.ndim)[d] or "tp", size, 8, sent, recv, 0.0))
        total = sq if total is None else total + sq
    assert total is not None
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.dtype))  # type: ignore[union-attr]
    return norm.to(params[0].dtype)


# -- counting DTensor's collectives -----------------------------------------------------------

_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "allreduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}


def _collective_counter_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        """Counts the collectives DTensor (and FSDP2) issue, by kind, group and phase (forward/backward).

        A dispatch mode sees every operator below DTensor, so it sees the functional collectives
        DTensor's redistributions run (``_c10d_functional.*``) and c10d's own (``c10d.*``, FSDP2).
        Each is recorded on the ``Recorder`` with its payload and the bandwidth-optimal bytes.
        """

        def __init__(self, recorder: Recorder | None, names: dict[str, tuple[str, int]]) -> None:
            super().__init__()
            self.recorder, self.names = recorder, names
            self.counts: Counter[tuple[str, str, str]] = Counter()
            self.phase: str | None = None
            """Set by the strategy (forward inside step_fn, backward after); None: inside an autograd node or not."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            ns = getattr(func, "namespace", "")
            if ns in ("_c10d_functional", "c10d_functional", "c10d"):
                kind = _KINDS.get(func._schema.name.split("::")[-1])
                if kind is not None:
                    self._record(kind, func, args)
            return out

        def _record(self, kind: str, func: Any, args: Any) -> None:
            # c10d's in-place reduce-scatters take (outputs, inputs, ...): the payload is the input.
            first = args[1] if kind == "reduce_scatter" and func.namespace == "c10d" else args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            group = None
            for a in args[1:]:  # funcol: (..., group_name: str) last; c10d: a ProcessGroup script object
                if isinstance(a, str):
                    group = a
                elif isinstance(a, dist.ProcessGroup):
                    group = a.group_name
                elif type(a).__name__ == "ScriptObject":  # c10d ops see the group boxed
                    try:
                        group = dist.ProcessGroup.unbox(a).group_name
                    except Exception:  # noqa: BLE001 - a boxed ReduceOp, not a group
                        pass
            name, size = self.names.get(group or "", ("other", 0))
            if not size and group:  # a group the strategy did not name: ask c10d for its size
                try:
                    size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group))  # type: ignore[arg-type]
                except Exception:  # noqa: BLE001 - unknown to this torch: count it, bytes unknown
                    size = 1
            payload = sum(t.numel() * t.element_size() for t in tensors)
            if kind == "all_gather" and ns_is_input_shard(func):
                payload *= size  # the gathered buffer
            phase = self.phase or ("backward" if torch._C._current_autograd_node() is not None else "forward")
            self.counts[(name, kind, phase)] += 1
            if self.recorder is not None:
                sent, recv = wire_bytes(kind, payload, size)
                self.recorder.add(CommEvent(kind, name, size, payload, sent, recv, 0.0))

    return CollectiveCounter


def ns_is_input_shard(func: Any) -> bool:
    """True for all-gathers whose first argument is this rank's piece (funcol, FSDP2's coalesced/base ops)."""
    return func._schema.name.split("::")[-1] in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced")


def group_names(**groups: Any) -> dict[str, tuple[str, int]]:
    """``{process group name: (label, size)}`` from ``label=ProcessGroup`` pairs (what the counter calls each group)."""
    return {pg.group_name: (label, dist.get_world_size(pg)) for label, pg in groups.items() if pg is not None}


@contextlib.contextmanager
def count_collectives(recorder: Recorder | None = None, **groups: Any) -> Iterator[Counter[tuple[str, str, str]]]:
    """Count (and record) every collective issued inside the block, keyed ``(group label, kind, phase)``.

    >>> with count_collectives(tp=tp_mesh.get_group()) as counts:         # doctest: +SKIP
    ...     model(x).sum().backward()
    >>> counts[("tp", "all_reduce", "forward")]                             # doctest: +SKIP
    4
    """
    mode = _collective_counter_mode()(recorder, group_names(**groups))
    with mode:
        yield mode.counts


# -- the strategy -----------------------------------------------------------------------------


def _dim_mesh(mesh: Mesh, dim: str) -> Any:
    """The DeviceMesh of one dimension of the run's mesh (dp-major, tp fastest)."""
    public = getattr(mesh, "device_mesh", None)
    if callable(public):
        return public(dim)
    return mesh._device_mesh()[dim]


class TensorParallel:
    """Megatron tensor parallelism over ``tp`` ranks, data parallel (ddp or fsdp) over the rest.

    Options: ``tp`` (degree; default the world size), ``sequence_parallel``, ``plan`` (module
    name or pattern -> ``"colwise"``/``"rowwise"``; default automatic), ``dp_strategy``
    (``"ddp"``: one allreduce of the gradients per step over the dp group; ``"fsdp"``: FSDP2
    over the dp dimension of the 2D mesh), ``count_collectives`` (record DTensor's collectives
    each step through a dispatch mode; costs a little Python per operator).
    """

    name: ClassVar[str] = "tp"

    def __init__(
        self, *, tp: int | None = None, sequence_parallel: bool = False, plan: dict[str, str] | None = None,
        dp_strategy: str = "ddp", count_collectives: bool = True,
    ) -> None:
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ConfigError(f"tp must be a whole number >= 1; got {tp!r}")
        if dp_strategy not in ("ddp", "fsdp"):
            close = difflib.get_close_matches(str(dp_strategy), ["ddp", "fsdp"], n=1)
            raise ConfigError(f"dp_strategy must be 'ddp' or 'fsdp'; got {dp_strategy!r}" + (f". Did you mean {close[0]!r}?" if close else ""))
        if isinstance(plan, str):  # JSON text (a TOML inline table from --set arrives as a dict already)
            import json

            try:
                plan = json.loads(plan)
            except ValueError:
                raise ConfigError(f"plan must be a dict of module name (or pattern) -> 'colwise'|'rowwise', or its JSON text; got {plan!r}") from None
        if plan is not None:
            if not isinstance(plan, dict) or not plan:
                raise ConfigError(f"plan must be a non-empty dict of module name (or pattern) -> 'colwise'|'rowwise'; got {plan!r}")
            for key, style in plan.items():
                if style not in STYLES:
                    close = difflib.get_close_matches(str(style), STYLES, n=1)
                    raise ConfigError(f"plan[{key!r}] = {style!r} is not a style." + (f" Did you mean {close[0]!r}?" if close else "") + " Styles: 'colwise', 'rowwise'")
        self.tp, self.sequence_parallel, self.plan, self.dp_strategy = tp, bool(sequence_parallel), plan, dp_strategy
        self.count = count_collectives
        self.degree, self.dp = tp or 1, 1
        self.applied: dict[str, str] = {}
        self.recorder: Recorder | None = None
        self.dp_group: Group | None = None
        self.names: dict[str, tuple[str, int]] = {}
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.steps = 0
        self._world_tp: int | None = None
        self._dirty = False

    def mesh_degrees(self) -> dict[str, int]:
        tp = self.tp or self._world_tp
        return {"tp": tp} if tp is not None else {}

    def validate(self, world_size: int) -> None:
        tp = self.tp or world_size
        self._world_tp = world_size  # tp defaults to the world size (validate runs before the mesh is built)
        if world_size % tp:
            shapes = ", ".join(f"dp{world_size // d} x tp{d}" for d in range(1, world_size + 1) if world_size % d == 0)
            raise ConfigError(f"tp {tp} does not divide the world size {world_size}; valid shapes: {shapes} (set --tp to one of the tp degrees)")

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not dist.is_initialized():
            raise ConfigError("strategy 'tp' needs a process group; start the run through shardwise (Trainer, launch, or shardwise run)")
        if mesh.size("pp") != 1:
            raise ConfigError(f"strategy 'tp' runs on a dp x tp mesh; got pp={mesh.size('pp')}. Use strategy 'pipeline' with --tp for pp x tp")
        self.degree, self.dp = mesh.size("tp"), mesh.size("dp")
        self.recorder = recorder
        resolve_plan(model, self.plan, self.degree)  # a bad plan or head count fails here, before any group is built
        model = model.to(mesh.device)
        tp_mesh = _dim_mesh(mesh, "tp")
        parallelize(model, tp_mesh, self.plan, self.sequence_parallel)
        self.applied = dict(model._shardwise_tp["plan"])  # type: ignore[index]
        self.names = group_names(tp=tp_mesh.get_group())
        if self.dp > 1:
            dp_mesh = _dim_mesh(mesh, "dp")
            self.names.update(group_names(dp=dp_mesh.get_group()))
            self.dp_group = Group("dp", dp_mesh.get_group())
            if self.dp_strategy == "fsdp":
                shard_data_parallel(model, dp_mesh)
        self.model_params = list(model.parameters())
        optimizer = make_optimizer(self.model_params)
        # Gradients are finished (sequence-parallel partial sums reduced, dp replicas averaged)
        # before clipping and before the optimizer step, however backward was called: through
        # forward_backward, or engine.backward in a loop of the user's own.
        model.register_forward_pre_hook(self._mark_dirty)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.finish_grads(model))
        return model, optimizer

    def _mark_dirty(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._dirty = True

    def finish_grads(self, model: nn.Module) -> None:
        """Reduce sequence-parallel partial gradients and (ddp) average over dp, once per backward round.

        Called after forward_backward, by clip_grad_norm and before every optimizer step; a no-op
        when nothing ran forward with gradients since the last call. Under ddp, accumulation
        needs no ``no_sync``: the one allreduce runs on the summed gradients before the step.
        """
        if not self._dirty:
            return
        self._dirty = False
        if self.sequence_parallel:
            reduce_partial_grads(model, self.recorder)
        if self.dp > 1 and self.dp_strategy == "ddp" and self.dp_group is not None:
            replicate_grads(model, self.dp_group, self.recorder)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # parallelize_module and fully_shard change the module in place; names stay the user's

    def _fsdp(self) -> bool:
        return self.dp > 1 and self.dp_strategy == "fsdp"

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        if getattr(precision, "mode", None) == "16-mixed" and not self._fsdp():
            # torch's GradScaler unscales all gradients in one foreach call, which refuses a mix of
            # DTensor (split linears) and plain tensors (embedding, head): fail before the first step.
            raise ConfigError("strategy 'tp' does not run with precision '16-mixed' (torch's GradScaler cannot unscale a mix of "
                              "DTensor and plain gradients); use precision 'bf16-mixed', which needs no scaler, or '32'")
        mode = _collective_counter_mode()(self.recorder, self.names) if self.count else None
        if mode is not None:
            inner = step_fn

            def step_fn(model: nn.Module, batch: Any) -> torch.Tensor:  # forward; the rest is backward (FSDP's final callbacks included)
                mode.phase = "forward"
                try:
                    return inner(model, batch)
                finally:
                    mode.phase = "backward"
        with mode if mode is not None else contextlib.nullcontext():
            loss = accumulate_backward(model, microbatches, step_fn, precision, no_sync=lambda: self.no_sync(model))
        if mode is not None:
            self.counts.update(mode.counts)
        self.steps += 1
        self.finish_grads(model)
        return loss

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # ddp: nothing to skip (the dp allreduce runs once, in finish_grads); fsdp: accumulate
        # unsharded gradients and reduce-scatter their sum on the last micro-batch.
        if self._fsdp():
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            if self._fsdp():
                model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        self.finish_grads(model)
        return clip_grad_norm_(self.model_params, max_norm, self.recorder)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        return state

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        """Sharded state (DTensors, from a tp/fsdp checkpoint) or whole tensors (from single/ddp)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        from shardwise.checkpoint import optimizer_state_by_name, parameter_names
        from shardwise.strategies.fsdp import is_sharded_state

        full = not is_sharded_state(state["model"])
        options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=False)
        set_model_state_dict(model, state["model"], options=options)
        if optimizer is not None and "optimizer" in state:
            osd = state["optimizer"]
            if any(isinstance(k, int) for k in osd.get("state", {})) or any(isinstance(i, int) for g in osd["param_groups"] for i in g["params"]):
                osd = optimizer_state_by_name(osd, parameter_names(model, optimizer))
            set_optimizer_state_dict(model, optimizer, osd, options=options)

    def summary(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        per_step: dict[str, dict[str, float]] = {}
        for (group, kind, phase), n in sorted(self.counts.items()):
            per_step.setdefault(f"{group}/{kind}", {})[phase] = n / steps
        return {"tp": {
            "degree": self.degree, "dp": self.dp, "dp_strategy": self.dp_strategy if self.dp > 1 else None,
            "sequence_parallel": self.sequence_parallel, "plan": self.applied,
            "collectives_per_step": per_step if self.count else None, "counted_steps": self.steps if self.count else 0,
        }}
