"""Plan patterns (`matches`: one dotted segment per ``*``) and the checks a resolved plan passes before launch: widths and heads divisible by tp
(`check_divisible`), a user's column split of a fused projection refused with the layout to use
(`_check_fused`), and each row split of a user's plan fed by a column split of its width
(`_check_pairs`). No process group needed."""

from __future__ import annotations

import functools
import re

from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.tensor_parallel.plan import (
    _HEAD_ATTRS,
    _HEAD_WIDTH_ATTRS,
    ATTN_COLWISE,
    COLWISE,
    EXPERTS,
    FUSED,
    FUSED_GATE_UP,
    GATHERED,
    MLA,
    ROWWISE,
    STACKED_QKV,
    _blocks_of,
    _leaf,
    _parent,
    fused_parts,
)


def _check_fused(name: str, plan: dict[str, str]) -> None:
    """A user's column split of a fused projection whose layout a plain column split breaks."""
    leaf = _leaf(name).lower()
    if leaf in FUSED_GATE_UP:
        raise ConfigError(
            f"tp_plan[{name!r}] = 'colwise' splits a fused gate|up projection by columns: its output is gate then up "
            "(chunked in two), so one rank would get all of gate and the other all of up, and training would be silently "
            f"wrong. Use the layout that splits gate and up alike: tp_plan[{name!r}] = 'packed_colwise' (with its down "
            "projection 'rowwise'), or 'colwise_gather_output' with the down projection 'rowwise_split_input'"
        )
    if leaf in FUSED and leaf not in STACKED_QKV:
        raise ConfigError(
            f"tp_plan[{name!r}] = 'colwise' splits a fused q|k|v projection by columns; whether a rank then holds whole "
            "heads depends on its layout (stacked q|k|v, or interleaved per head), which the plan does not say. Leave "
            "tp_plan unset (shardwise splits the layouts it knows by heads), or use the layout that is exact for any: "
            f"tp_plan[{name!r}] = 'colwise_gather_output' with the output projection 'rowwise_split_input'"
        )


def _head_width(attn: nn.Module) -> int | None:
    for attr in _HEAD_WIDTH_ATTRS:
        value = getattr(attn, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _heads(attn: nn.Module, q: nn.Module, parts: int = 1) -> int | None:
    """Attention heads a column-split linear produces, if the attention module says (head_dim or a head count)."""
    from shardwise.strategies.tensor_parallel.styles import features

    width = _head_width(attn)
    if width is not None:
        return features(q)[1] // parts // width
    for attr in _HEAD_ATTRS:
        value = getattr(attn, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _is_attention_input(name: str, attn: nn.Module) -> bool:
    return _leaf(name) in ATTN_COLWISE or _leaf(name).lower() in FUSED or _head_width(attn) is not None


def check_divisible(module: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Every split width divides by ``tp``; attention splits whole heads, query and key/value heads
    alike (grouped-query attention's ``num_key_value_heads``) (`ConfigError` otherwise)."""
    from shardwise.strategies.tensor_parallel.styles import features

    for name, style in plan.items():
        lin = module.get_submodule(name)
        if style == EXPERTS:
            from shardwise.strategies.tensor_parallel.experts import layout

            layout(module, name, tp)
            continue
        if style == MLA:
            continue
        fan_in, fan_out = features(lin)
        width = fan_out // (2 if style == "packed_colwise" else 1) if style in COLWISE | GATHERED else fan_in
        attn = module.get_submodule(_parent(name)) if _parent(name) else module
        if style == "colwise" and _is_attention_input(name, attn):
            parts = fused_parts(module, name) or 1
            heads = _heads(attn, lin, parts)
            counts = {"heads": heads} if heads is not None else {}
            counts.update(
                {a: v for a in _HEAD_ATTRS + ("num_key_value_heads", "num_kv_heads", "n_kv_heads") if isinstance(v := getattr(attn, a, None), int) and v > 0}
            )
            for what, n in counts.items():
                if n % tp:
                    options = [d for d in range(1, n + 1) if n % d == 0]
                    label = f"{n} attention heads" if what == "heads" else f"{what} = {n}"
                    raise ConfigError(
                        f"{name} has {label}, which do not split across tp={tp} ranks (attention is split by "
                        f"whole heads, key/value heads included); choose tp in {options}, or a model whose head counts are multiples of {tp}"
                    )
        if width % tp:
            raise ConfigError(
                f"{name} ({style}) has {width} {'input' if style in ROWWISE else 'output'} features"
                + (" per half (gate, up)" if style == "packed_colwise" else "")
                + f", not divisible by tp={tp}; choose tp among the divisors of {width}"
            )


def _check_pairs(module: nn.Module, plan: dict[str, str]) -> None:
    """Each row split of a user's plan consumes a column split's output: some column-split linear of
    its block (or of the model, outside blocks) produces its input width (a fused q|k|v a third of
    its output, a packed gate|up half). Otherwise the split cannot run (DTensor's "a and b must have
    same reduction dim" inside the workers): refused here, naming the module."""
    from shardwise.strategies.tensor_parallel.styles import features

    blocks = _blocks_of(plan)
    for row, style in plan.items():
        if style != "rowwise":
            continue
        block = next((b for b in blocks if row.startswith(b + ".")), "")
        widths = {}
        for col, st in plan.items():
            if st in COLWISE and col.startswith(block):
                leaf = _leaf(col).lower()
                parts = 3 if leaf in FUSED else 2 if st == "packed_colwise" or leaf in FUSED_GATE_UP else 1
                widths[col] = features(module.get_submodule(col))[1] // parts
        need = features(module.get_submodule(row))[0]
        if need not in widths.values():
            raise ConfigError(
                f"tp_plan[{row!r}] = 'rowwise' takes {need} input features, but no column-split linear "
                + (f"of {block} " if block else "")
                + f"produces that width ({widths or 'none is split'}): a row split consumes a column split's output. "
                "Name the linear whose output it reads 'colwise' (q, k, v for an attention's output projection), or "
                "leave this one out of the plan"
            )


def matches(pattern: str, name: str) -> bool:
    """``name`` is ``pattern``, or matches it as an fnmatch pattern whose ``*`` and ``?`` stay inside one
    dotted segment (``encoder.layer.*.output.dense`` is not ``encoder.layer.0.attention.output.dense``)."""
    return name == pattern or _pattern_re(pattern).fullmatch(name) is not None


@functools.lru_cache(maxsize=1024)
def _pattern_re(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        end = pattern.find("]", i + 2) if c == "[" else -1
        if c == "*":
            out.append("[^.]*")
        elif c == "?":
            out.append("[^.]")
        elif end != -1:
            body = pattern[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def _whole_statistics(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """An MLP that takes a statistic over its hidden units before the activation (Gemma 3n's activation
    sparsity: the mean and deviation of ``gate_proj``'s outputs set the cut, ``activation_sparsity > 0``)
    would take it over 1/tp of them, silently wrong: its pair is gathered instead (column splits with
    their output gathered whole, the row split taking its slice: exact, one all-gather more)."""
    out = dict(plan)
    for name, style in plan.items():
        parent = _parent(name)
        sparsity = getattr(module.get_submodule(parent) if parent else module, "activation_sparsity", 0)
        if isinstance(sparsity, (int, float)) and sparsity > 0:
            out[name] = {"colwise": "colwise_gather_output", "rowwise": "rowwise_split_input"}.get(style, style)
    return out


def gather_unknown_fused(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A declared plan's column split of a fused q|k|v whose layout shardwise cannot tell made the gathered
    pair (the projection's output gathered whole, its output projection's input split), exact for any layout.

    transformers declares ``colwise`` for CodeGen's ``qkv_proj``, whose forward reshapes the output into a
    fixed count of q|v|k blocks: a plain column split trains it 7.9e-3 off ``single`` (the zoo sweep).
    A layout known to keep whole heads per rank (`per_head_layout`, a stacked ``c_attn``) keeps its split."""
    from shardwise.strategies.tensor_parallel.plan import FUSED, per_head_layout

    out = dict(plan)
    for name, style in plan.items():
        leaf = _leaf(name).lower()
        if style != "colwise" or leaf not in FUSED or leaf in STACKED_QKV:
            continue
        parent = _parent(name)
        if per_head_layout(module.get_submodule(parent) if parent else module):
            continue
        rows = [n for n, st in plan.items() if _parent(n) == parent and st == "rowwise"]
        if len(rows) == 1:
            out[name], out[rows[0]] = "colwise_gather_output", "rowwise_split_input"
    return out
