"""Roles: what every module with parameters or buffers is, by its place in the model, once a plan
says which linears split; and the backstop that refuses a module no rule covers. No process group
needed, so `TensorParallel.plan` runs it in the parent before launch."""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.tensor_parallel.checks import _head_width, _heads
from shardwise.strategies.tensor_parallel.plan import EXPERTS, GATHERED, MLA, MLA_UPSTREAM, ROWWISE, _blocks, _join, _leaf, _parent, _splittable, _sublayers


def _inside(name: str, prefixes: set[str] | list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def roles(module: nn.Module, plan: dict[str, str], grad_sum: list[str], sequence_parallel: bool) -> dict[str, list[Any]]:
    """What happens to every module that owns parameters or buffers, by its place in the model.

    - split linears (the plan): DTensor shards;
    - inside a sublayer (the parent of column-split linears: attention, MLP), between Megatron's
      ``f`` and ``g``: only what the model declares ``replicated_with_grad_allreduce`` (a per-head
      norm sees only this rank's heads, so its gradient is summed over tp); anything else there is
      refused, since it would see 1/tp of the heads or hidden units with no rule for its gradient;
    - in a block outside the sublayers (norms, whatever their class: ``LayerNorm``, ``LlamaRMSNorm``,
      nanoGPT's own): replicated; under sequence parallelism they see a slice of the sequence, so
      their gradients are summed over tp (``sum``); a module there that holds linears the plan
      does not split (an attention left whole) runs on the gathered sequence instead (``whole``);
      a buffer there under sequence parallelism is refused (it may index positions);
    - outside the blocks (embeddings, final norm, head): replicated, computed whole on every rank.

    Returns ``{"blocks", "sublayers", "whole", "sum", "by_heads"}`` (``sum``: parameter names; ``by_heads``:
    attention sublayers whose own per-head parameters, one value per head, split with their heads). A module no rule
    covers is a `ConfigError` naming it (the backstop)."""
    blocks = _blocks(module, plan)
    subs = _sublayers(plan)
    sublayers = sorted(subs)
    gathered = {s for s, cols in subs.items() if all(plan[c] in GATHERED for c in cols)}  # whole activations inside
    latent = {_parent(n) for n, s in plan.items() if s == MLA}
    if sequence_parallel:
        _refuse_whole_inputs(plan)
    split = set(plan)
    anchors = list(split) + sublayers  # modules that hold split work; their ancestors are transparent
    whole: list[str] = []
    summed: list[str] = []
    by_heads: list[tuple[str, int]] = []
    for name, m in module.named_modules():
        if _inside(name, split) or _inside(name, whole):
            continue
        own_params = [n for n, p in m.named_parameters(recurse=False) if p is not None]
        own_buffers = [n for n, b in m.named_buffers(recurse=False) if b is not None]
        if name in grad_sum or any(_inside(name, [g]) for g in grad_sum):
            summed += [_join(name, n) for n in own_params]
            continue
        in_sub = [s for s in sublayers if s and name.startswith(s + ".")]  # a sublayer at the root: nothing to tell
        if in_sub and in_sub[0] in gathered:
            continue  # between a gathered column split and a split-input row split: whole, replicated, whole gradients
        if in_sub and in_sub[0] in latent and _leaf(name) in MLA_UPSTREAM:
            continue  # latent attention: upstream of the column splits, whose f sums their input gradients
        if in_sub and own_params and (all(m.get_parameter(n).numel() == 1 for n in own_params) or _per_head_norm(module, in_sub[0], m, own_params)):
            summed += [_join(name, n) for n in own_params]  # scalars (XIELU's alphas) act alike on every unit: each rank's gradient a partial sum
            continue
        if in_sub:
            if own_params:
                raise ConfigError(
                    f"{name} ({type(m).__name__}) holds parameters {own_params} inside {in_sub[0]}, between the column- and "
                    "row-split linears, where it sees 1/tp of the heads or hidden units; no rule says how its gradient "
                    "combines across tp ranks. Add it to the plan's linears, or declare it (transformers' "
                    "'replicated_with_grad_allreduce'), or train this model without tp"
                )
            continue
        if name in sublayers and name:
            heads = _heads(m, module.get_submodule(subs[name][0]))
            per_head = [n for n in own_params if isinstance(heads, int) and tuple(m.get_parameter(n).shape) == (heads,)]
            if per_head and isinstance(heads, int) and name not in gathered and any(plan[c] == "colwise" for c in subs[name]):
                by_heads.append((name, heads))  # one value per head (attention sinks, Doge's A): split by heads with them
                own_params = [n for n in own_params if n not in per_head]
            if own_params:
                raise ConfigError(
                    f"{name} ({type(m).__name__}) holds parameters {own_params} of its own next to its split linears; "
                    "no rule says how their gradients combine across tp ranks. Train this model without tp, or split them"
                )
            continue
        if not sequence_parallel or not _inside(name, blocks) or name in blocks and not own_params and not own_buffers:
            continue
        is_anchor_parent = any(a.startswith(name + ".") for a in anchors) or name in blocks
        if not is_anchor_parent and any(_splittable(c) for _, c in m.named_modules()):
            whole.append(name)
            continue
        if own_buffers:
            raise ConfigError(
                f"{name} ({type(m).__name__}) holds buffers {own_buffers} inside block {next(b for b in blocks if _inside(name, [b]))}, "
                "which sequence parallelism runs on a slice of the sequence; a buffer may index positions. Turn sequence_parallel off"
            )
        summed += [_join(name, n) for n in own_params]
    return {"blocks": blocks, "sublayers": sublayers, "whole": whole, "sum": summed, "by_heads": by_heads}


def _refuse_whole_inputs(plan: dict[str, str]) -> None:
    """Sequence parallelism with a style whose module takes a whole input (experts, latent attention, the gathered pair)."""
    special = [(n, s) for n, s in plan.items() if s in (EXPERTS, MLA) or s in GATHERED or (s in ROWWISE and s != "rowwise")]
    if special:
        name, style = special[0]
        raise ConfigError(
            f"sequence parallelism with tensor-parallel style {style!r} ({name}) is not built: that module's input is "
            "whole on every rank, not a slice of the sequence. Nearest working setting: sequence_parallel=False (tp alone is exact)"
        )


def _per_head_norm(module: nn.Module, sublayer: str, m: nn.Module, params: list[str]) -> bool:
    """A norm (an ``eps``) inside an attention whose weights are one head's width (Lfm2's ``q_layernorm``,
    Qwen3's ``q_norm`` when undeclared): the same weights on every head, so on this rank's heads it is
    exact and its gradient is a partial sum over heads, summed over tp like the replicated-with-allreduce style."""
    width = _head_width(module.get_submodule(sublayer))
    has_eps = any(isinstance(getattr(m, a, None), float) for a in ("eps", "variance_epsilon", "epsilon"))
    return width is not None and has_eps and all(tuple(m.get_parameter(n).shape) == (width,) for n in params)
