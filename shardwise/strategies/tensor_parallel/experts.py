"""Mixture-of-experts experts under tensor parallelism: transformers' ``moe_tp_experts``.

An experts module (Mixtral's, Qwen-MoE's, OLMoE's, GraniteMoE's, ...) holds every expert's weights
as 3-D tensors, ``gate_up_proj`` ``(experts, 2 x intermediate, hidden)`` and ``down_proj``
``(experts, hidden, intermediate)`` (Llama 4 stores both transposed), and runs the routed tokens
through them. Under tp every expert's intermediate dimension is split, Megatron's MLP split applied to
each expert at once: ``gate_up_proj`` by its packed output features (``packed_colwise``: each rank
holds its slice of gate and its slice of up, so ``chunk(2)`` still separates them; the weight is
permuted once, as a stacked q|k|v is, and saved in the original layout), ``down_proj`` by its input
features (``rowwise``). The model declares the styles on the weights; the dimension each names is
transformers' (``colwise``/``packed_colwise``: ``ndim - 2``, ``rowwise``/``packed_rowwise``: the last).

Around the module: Megatron's ``f`` on every floating-point input (the tokens and the routing
weights: identity forward, their gradients, partial sums over the ranks, allreduced backward) and
``g`` on its output (each rank's sum over experts is a partial sum: allreduced forward). The
forward runs on this rank's shards as plain tensors (the experts index their weights per expert);
gradients reach the DTensor parameters through ``to_local``. The router stays replicated (whole
gradient: the routing weights' gradient is summed before it). Sequence parallelism is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.tensor_parallel.plan import _join, declared_raw, matches

_COLUMN = ("colwise", "packed_colwise")
_KNOWN = ("colwise", "packed_colwise", "rowwise", "packed_rowwise")


def layout(model: nn.Module, name: str, tp: int | None = None) -> dict[str, tuple[int, int]]:
    """``{parameter of the experts module name: (dimension split, parts)}`` (parts 2 for a packed
    gate|up) from the styles the model declares on its weights; a `ConfigError` naming the parameter
    when one has no style, or its split width does not divide by ``tp``."""
    experts = model.get_submodule(name)
    raw = declared_raw(model)
    out: dict[str, tuple[int, int]] = {}
    for pname, p in experts.named_parameters(recurse=False):
        full = _join(name, pname)
        styles = [st for pat, st in raw.items() if matches(pat, full)]
        if not styles or styles[-1] not in _KNOWN or p.dim() < 2:
            raise ConfigError(
                f"{full} ({tuple(p.shape)}) is a weight of the experts module {name} ('moe_tp_experts') with "
                f"{'style ' + repr(styles[-1]) if styles else 'no declared style'}: shardwise splits 3-D expert weights "
                "declared colwise, rowwise, packed_colwise or packed_rowwise. Nearest working setting: pass tp_plan={...} "
                "naming the attention's linears only (the experts stay whole), or use a data-parallel or sharded strategy"
            )
        style = styles[-1]
        dim = p.dim() - 2 if style in _COLUMN else p.dim() - 1
        parts = 2 if style.startswith("packed") else 1
        if tp is not None and p.shape[dim] % (parts * tp):
            raise ConfigError(
                f"{full} ({style}) splits dimension {dim} of size {p.shape[dim]}"
                + (" (gate and up halves)" if parts == 2 else "")
                + f", which does not divide by tp={tp}; choose tp among the divisors of {p.shape[dim] // parts}"
            )
        out[pname] = (dim, parts)
    if not out:
        raise ConfigError(f"{name} is declared 'moe_tp_experts' but holds no parameters of its own; pass tp_plan={{...}}")
    return out


def shard(model: nn.Module, name: str, mesh: Any) -> dict[str, tuple[int, int]]:
    """Split the experts module ``name`` over ``mesh`` (in place) and wrap its forward in ``f`` and
    ``g``; returns ``{full parameter name: (dim, parts)}`` of the permuted (packed) weights."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardwise.strategies.tensor_parallel.styles import fused_permutation

    tp = mesh.size()
    experts = model.get_submodule(name)
    lay = layout(model, name, tp)
    packed: dict[str, tuple[int, int]] = {}
    for pname, (dim, parts) in lay.items():
        param = experts.get_parameter(pname)
        data = param.detach()
        if parts > 1:
            data = data.index_select(dim, fused_permutation(data.shape[dim] // parts, parts, tp).to(data.device))
            packed[_join(name, pname)] = (dim, parts)
        dist = distribute_tensor(data, mesh, [Shard(dim)])
        experts.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))
    _wrap(experts, mesh)
    return packed


def split_heads(attn: nn.Module, heads: int, mesh: Any) -> None:
    """An attention's own parameters of one value per head (attention sinks, Doge's ``A``: shape
    ``(heads,)``) split with its heads (``Shard(0)``, contiguous as the column split of q is); its forward
    sees this rank's values as plain tensors, their gradients whole for those heads (no reduction)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    for pname, p in list(attn.named_parameters(recurse=False)):
        if tuple(p.shape) == (heads,):
            attn.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]), requires_grad=p.requires_grad))
    saved: list[dict[str, Any]] = []

    def before(m: nn.Module, args: Any) -> None:
        originals = {n: q for n, q in m.named_parameters(recurse=False) if isinstance(q, DTensor)}
        saved.append(originals)
        for n, q in originals.items():
            m._parameters[n] = q.to_local()  # type: ignore[assignment]  # this rank's heads for this forward

    def after(m: nn.Module, args: Any, out: Any) -> None:
        m._parameters.update(saved.pop())

    attn.register_forward_pre_hook(before, prepend=True)
    attn.register_forward_hook(after)


def _wrap(experts: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    saved: list[dict[str, Any]] = []

    def f(x: Any) -> Any:
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))
        return x

    def before(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        originals = {n: p for n, p in m.named_parameters(recurse=False) if isinstance(p, DTensor)}
        saved.append(originals)
        for n, p in originals.items():
            m._parameters[n] = p.to_local()  # type: ignore[assignment]  # a view of the shard for this forward; grads reach p
        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

    def after(m: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        for n, p in saved.pop().items():
            m._parameters[n] = p
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(m).__name__} returned {type(out).__name__}; tp experts expect one tensor")
        return DTensor.from_local(out, mesh, (Partial(),), run_check=False).redistribute(mesh, (Replicate(),)).to_local()

    experts.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    experts.register_forward_hook(after, with_kwargs=True)
