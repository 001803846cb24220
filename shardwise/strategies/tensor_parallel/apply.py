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

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.collectives import Group, broadcast
from shardwise.comm.recorder import Recorder
from shardwise.strategies.tensor_parallel import experts
from shardwise.strategies.tensor_parallel.checks import _is_attention_input
from shardwise.strategies.tensor_parallel.plan import (
    COLWISE,
    EXPERTS,
    GATHERED,
    LOCAL_ATTRS,
    MLA,
    _parent,
    _sequence_blocks,
    _sublayers,
    fused_parts,
    resolve,
)
from shardwise.strategies.tensor_parallel.roles import roles
from shardwise.strategies.tensor_parallel.styles import colwise, get_input, main_output, put_input, replace_output, rowwise


def tp_info(module: nn.Module) -> dict[str, Any] | None:
    """What `parallelize` recorded on ``module`` (plan, degree, source, sum, whole, fused, mesh); None where it did not run."""
    info = getattr(module, "_shardwise_tp", None)
    return info if isinstance(info, dict) else None


def parallelize(
    module: nn.Module,
    tp_mesh: Any,
    plan: dict[str, str] | None = None,
    sequence_parallel: bool = False,
    *,
    recorder: Recorder | None = None,
) -> nn.Module:
    """Split ``module``'s linear pairs across ``tp_mesh`` (a 1D DeviceMesh), in place; returns it.

    ``plan``: ``None`` for the model's declared plan (transformers' ``_tp_plan``) or else the
    automatic plan, or module name / fnmatch pattern -> ``"colwise"`` | ``"rowwise"``. Works on part
    of a model (a pipeline stage holding blocks 2-3): names are the module's own. Parameters of split
    linears (``nn.Linear`` or transformers' ``Conv1D``) become DTensors (colwise: output features
    ``Shard``; rowwise: input features ``Shard``, bias replicated); everything else stays a plain
    tensor, replicated (`roles.roles` says which gradients are summed over tp). Attention modules
    split by heads get their head-count and width attributes (``num_heads``, ``split_size``, ...)
    set to this rank's values.

    Sublayer inputs are found by binding the call to ``forward``'s signature, so HF layers called
    with ``hidden_states=...`` work. With ``sequence_parallel``, activations are sequence-sharded
    (dim 1) from the first block's input to the last block's output (registration order); the
    module's input and output stay whole, and so does everything computed outside the blocks
    (rotary tables, masks), which the blocks receive replicated and use on the gathered sequence.
    ``recorder`` records the one collective issued here (`synchronize_dropout`'s seed broadcast).

    >>> tp_mesh = init_device_mesh("cpu", (2,))                               # doctest: +SKIP
    >>> parallelize(model, tp_mesh, sequence_parallel=True)                  # doctest: +SKIP
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    # DTensor propagates shardings by running meta kernels on fake tensors; one that fails logs its
    # whole traceback from every rank ("[rank1] fake_tensor ...", about 60 lines) before the error the
    # launcher reports anyway, in one block. The rehearsal in the parent silences it the same way.
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL + 1)
    resolved, grad_sum, source = resolve(module, plan, tp)
    role = roles(module, resolved, grad_sum, sequence_parallel)
    blocks = _sequence_blocks(module, resolved) if sequence_parallel else []
    fused = {n: fused_parts(module, n) for n, s in resolved.items() if s == "colwise" and fused_parts(module, n)}
    fused.update({n: 2 for n, s in resolved.items() if s == "packed_colwise"})
    parallelize_module(module, tp_mesh, _style_objects(resolved, fused, sequence_parallel))
    fused_params = {k: v for n, s in resolved.items() if s == EXPERTS for k, v in experts.shard(module, n, tp_mesh).items()}
    seq: dict[str, int] = {}  # the sequence length of this forward (shards may be uneven: ViT's 17 tokens on 2 ranks)
    latent = {_parent(n) for n, s in resolved.items() if s == MLA}
    for name in [n for n, s in resolved.items() if s == MLA]:
        _latent_rope(module, name, tp_mesh)
    for name, heads in role["by_heads"]:
        experts.split_heads(module.get_submodule(name), heads, tp_mesh)  # before _localize divides its head count
    for sub, cols in _sublayers(resolved).items():
        target = module.get_submodule(sub) if sub else module
        if sub in latent:  # replicated linears take the input: each column split applies its own f
            _localize(target, tp)
            continue
        target.register_forward_pre_hook(_gather_input(tp_mesh, Shard(1) if sequence_parallel else Replicate(), seq), with_kwargs=True, prepend=True)
        if any(resolved[c] in COLWISE and _is_attention_input(c, target) for c in cols):
            _slice_alibi(target, tp_mesh)
            _localize(target, tp)
    if sequence_parallel:
        _sequence_boundaries(module, tp_mesh, blocks, seq)
        for name in role["whole"]:
            _run_whole(module.get_submodule(name), tp_mesh, seq)
    for name in role["sum"]:
        module.get_parameter(name)._shardwise_tp_sum = tp_mesh  # type: ignore[attr-defined]  # see grads._sum_role_grads
    synchronize_dropout(module, tp_mesh, blocks, role["whole"], recorder=recorder)
    module._shardwise_tp = {  # type: ignore[assignment]  # Module.__setattr__ is typed for tensors and modules; a dict is a plain attribute
        "plan": resolved,
        "sequence_parallel": sequence_parallel,
        "degree": tp,
        "source": source,
        "sum": role["sum"],
        "whole": role["whole"],
        "fused": fused,
        "fused_params": fused_params,
        "mesh": tp_mesh,
    }
    return module


def _style_objects(resolved: dict[str, str], fused: dict[str, int], sequence_parallel: bool) -> dict[str, Any]:
    """torch's ``ParallelStyle`` for each split linear of the plan (experts and latent projections have hooks of their own)."""
    from torch.distributed.tensor import Replicate, Shard

    out_layout = Shard(1) if sequence_parallel else Replicate()
    styles: dict[str, Any] = {}
    for name, style in resolved.items():
        if style in COLWISE:
            styles[name] = colwise(fused.get(name, 0))
        elif style in GATHERED:
            styles[name] = colwise(output_layouts=Replicate())
        elif style == "rowwise_split_input":
            styles[name] = rowwise(out_layout, input_layouts=Replicate())
        elif style not in (EXPERTS, MLA):
            styles[name] = rowwise(out_layout)
    return styles


def _latent_rope(module: nn.Module, name: str, tp_mesh: Any) -> None:
    """transformers' ``mla_kv_a_proj``: the replicated latent projection's last ``qk_rope_head_dim`` outputs
    (the rotary key every head shares) bypass the column-split ``kv_b_proj``; each rank's heads give it
    a partial gradient, summed over tp (identity forward). The latent part's gradient is whole already."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    owner = module.get_submodule(_parent(name)) if _parent(name) else module
    rope = getattr(owner, "qk_rope_head_dim", None) or getattr(getattr(owner, "config", None), "qk_rope_head_dim", None)
    if not isinstance(rope, int):
        raise ValueError(f"{name} is declared 'mla_kv_a_proj' but its attention has no qk_rope_head_dim to split its output by")

    def after(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        latent, key = out.split([out.shape[-1] - rope, rope], dim=-1)
        key = DTensor.from_local(key, tp_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))
        return torch.cat([latent, key], dim=-1)

    module.get_submodule(name).register_forward_hook(after)


def _slice_alibi(attn: nn.Module, tp_mesh: Any) -> None:
    """An attention that takes ALiBi's per-head biases (BLOOM: ``alibi`` of shape ``(batch x heads, 1, keys)``,
    built by the model for all heads) gets this rank's heads of them."""
    import inspect

    heads = getattr(attn, "num_heads", None)
    try:
        takes = "alibi" in inspect.signature(attn.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes or not isinstance(heads, int):
        return
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    local = heads // tp

    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        alibi = kwargs.get("alibi")
        if not isinstance(alibi, torch.Tensor) or alibi.shape[0] % heads:
            return None
        mine = alibi.reshape(-1, heads, *alibi.shape[1:])[:, rank * local : (rank + 1) * local]
        return args, {**kwargs, "alibi": mine.reshape(-1, *alibi.shape[1:])}

    attn.register_forward_pre_hook(hook, with_kwargs=True)


def _localize(attn: nn.Module, tp: int) -> None:
    """Set an attention module's head counts and widths to this rank's (its forward reshapes with them)."""
    for attr in LOCAL_ATTRS:
        value = getattr(attn, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % tp == 0:
            setattr(attn, attr, value // tp)


def _sharded(x: torch.Tensor, tp_mesh: Any, seq: dict[str, int]) -> Any:
    """This rank's sequence shard as a DTensor of the whole sequence (``torch.chunk`` shards, maybe uneven)."""
    from torch.distributed.tensor import DTensor, Shard

    shape = (x.shape[0], seq["len"], *x.shape[2:])
    stride = tuple(int(v) for v in torch.empty(0).new_empty(shape, device="meta").stride())
    return DTensor.from_local(x.contiguous(), tp_mesh, (Shard(1),), run_check=False, shape=torch.Size(shape), stride=stride)


def _dense(dx: Any) -> Any:
    """``dx`` (a DTensor) with a contiguous local tensor.

    Up to torch 2.12 gathering an uneven ``Shard(1)`` (7 positions on 2 ranks) pads, all-gathers
    and narrows the result back: the local tensor is then a non-contiguous view, and a linear's
    ``view`` of it fails ("view size is not compatible with input tensor's size and stride").
    Seen on torch 2.11; from 2.13 the gathered tensor is contiguous and this is a no-op. The clone
    keeps the DTensor's placements, so the gradient's reduce-scatter is unchanged."""
    if dx.to_local().is_contiguous():
        return dx
    return dx.clone(memory_format=torch.contiguous_format)


def _gather_input(tp_mesh: Any, layout: Any, seq: dict[str, int]) -> Any:
    """Megatron's ``f`` on a sublayer's main input, positional or keyword: a replicated DTensor
    (allreduce of the input gradient backward; under sequence parallelism an all-gather forward and a
    reduce-scatter backward). The column-split linears inside share it, so their input gradients
    are summed once."""
    from torch.distributed.tensor import DTensor, Replicate

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, where = get_input(mod, args, kwargs)
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return None
        if not layout.is_replicate() and x.dim() < 3:
            raise ValueError(
                f"sequence parallelism shards dim 1 of (batch, sequence, features) activations inside the blocks, but "
                f"{type(mod).__name__} received shape {tuple(x.shape)} (the block flattened batch and sequence, as OPT's "
                "decoder layer does); turn sequence_parallel off for this model"
            )
        if layout.is_replicate():
            dx = DTensor.from_local(x, tp_mesh, (layout,), run_check=False)
        else:
            dx = _dense(_sharded(x, tp_mesh, seq).redistribute(tp_mesh, (Replicate(),)))
        return put_input(args, kwargs, where, dx)

    return hook


def _run_whole(mod: nn.Module, tp_mesh: Any, seq: dict[str, int]) -> None:
    """Under sequence parallelism, a module of a block that the plan leaves whole (an attention that
    cannot run on 1/tp of its heads) runs on the gathered sequence, and each rank keeps its slice of
    the output: its parameters then get whole gradients (every rank sees the whole output gradient)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def before(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, where = get_input(m, args, kwargs)
        if not isinstance(x, torch.Tensor):
            return None
        full = _sharded(x, tp_mesh, seq).redistribute(tp_mesh, (Replicate(),)).to_local().contiguous()
        return put_input(args, kwargs, where, full)

    def after(m: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        y = main_output(out)
        piece = DTensor.from_local(y, tp_mesh, (Replicate(),), run_check=False).redistribute(tp_mesh, (Shard(1),)).to_local().contiguous()
        return replace_output(out, piece)

    mod.register_forward_pre_hook(before, with_kwargs=True)
    mod.register_forward_hook(after, with_kwargs=True)


def _sequence_boundaries(module: nn.Module, tp_mesh: Any, blocks: list[str], seq: dict[str, int]) -> None:
    """Enter the sequence-sharded region at the first block (a local slice: no communication
    forward, an all-gather of the gradient backward) and leave it after the last (an all-gather
    forward, a slice of the gradient backward). The input may be positional or a keyword, the
    output a tensor or a tuple whose first element is the hidden states."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = tp_mesh.size()

    def enter(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, where = get_input(mod, args, kwargs)
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[1] < tp:
            raise ValueError(
                f"sequence parallelism splits dim 1 (the sequence) of the blocks' input (batch, sequence, features) across "
                f"tp={tp} ranks; got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}: use sequences of at "
                f"least {tp} positions, or turn sequence_parallel off"
            )
        seq["len"] = int(x.shape[1])
        if isinstance(x, DTensor):
            dx = x.redistribute(tp_mesh, (Shard(1),))
        else:
            dx = DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False).redistribute(tp_mesh, (Shard(1),))
        return put_input(args, kwargs, where, dx.to_local().contiguous())  # see _dense

    def leave(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        y = main_output(out)
        dx = y if isinstance(y, DTensor) else _sharded(y, tp_mesh, seq)
        return replace_output(out, dx.redistribute(tp_mesh, (Replicate(),)).to_local().contiguous())

    module.get_submodule(blocks[0]).register_forward_pre_hook(enter, with_kwargs=True)
    module.get_submodule(blocks[-1]).register_forward_hook(leave, with_kwargs=True)


def synchronize_dropout(
    module: nn.Module,
    tp_mesh: Any,
    sharded_blocks: Sequence[str] = (),
    whole: Sequence[str] = (),
    *,
    recorder: Recorder | None = None,
) -> int:
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
    the rank's stream. Returns how many modules were synchronized. The seed's broadcast (8 bytes,
    through `shardwise.comm`) is recorded on ``recorder`` when given.
    """
    drops = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if not drops:
        return 0
    pg = tp_mesh.get_group()
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=tp_mesh.device_type)
    broadcast(seed, 0, group=Group("tp", pg), recorder=recorder)  # from tp rank 0
    base, rank = int(seed.item()), dist.get_rank(pg)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    for index, (name, drop) in enumerate(drops):
        sharded = any(name.startswith(b + ".") for b in sharded_blocks) and not any(name.startswith(w + ".") for w in whole)
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
