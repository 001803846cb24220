"""Tensor-parallel plans: which ``nn.Linear`` modules split how, and the checks that a split is
exact. Nothing here needs a process group, so the trainer can refuse a model before launch.

``auto_plan``: in every module, the ``nn.Linear`` children named like the first linear of a pair
are column-split and the one named like the second is row-split, when both are present:

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

A user plan (`resolve_plan`) maps module names or fnmatch patterns (``"layers.*.mlp.w1"``) to
``"colwise"`` or ``"rowwise"``; each must match at least one ``nn.Linear``.
"""

from __future__ import annotations

import difflib
import fnmatch

from torch import nn

from shardwise.errors import ConfigError

STYLES = ("colwise", "rowwise")

ATTN_COLWISE = frozenset({"q", "k", "v", "query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv"})
ATTN_ROWWISE = frozenset({"out", "o_proj", "proj", "out_proj", "wo", "c_proj"})
MLP_COLWISE = frozenset({"fc", "fc1", "c_fc", "up_proj", "gate_proj", "w1", "w3"})
MLP_ROWWISE = frozenset({"proj", "fc2", "down_proj", "w2", "c_proj"})
FUSED = frozenset({"qkv", "c_attn", "wqkv", "query_key_value", "qkv_proj", "in_proj"})
_HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "heads")


# -- naming helpers ----------------------------------------------------------------------------


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# -- plans: which linears split how ------------------------------------------------------------


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


# -- what a plan implies: sublayers (Megatron's f) and blocks (sequence parallelism) -----------


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


def _sequence_blocks(module: nn.Module, plan: dict[str, str]) -> list[str]:
    """The blocks sequence parallelism shards between (`_blocks`); a `ConfigError` when there are none."""
    blocks = _blocks(module, plan)
    if not blocks:
        raise ConfigError(
            "sequence_parallel needs transformer blocks: modules holding the split sublayers (attention, MLP) together "
            f"with their norms; the plan {plan} has its row-split linears at the top of {type(module).__name__}"
        )
    return blocks
