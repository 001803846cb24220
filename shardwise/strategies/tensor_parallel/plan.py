"""Tensor-parallel plans: which linears split how, what every other module with parameters is
(its role), and the checks that a split is exact. Nothing here needs a process group, so the
trainer can refuse a model before launch.

Where a plan comes from, in order: the user's ``plan``; the model's declared plan
(`declared_plan`: transformers' ``_tp_plan`` / ``config.base_model_tp_plan``); `auto_plan`, which
finds pairs by name in every module (``nn.Linear`` or transformers' ``Conv1D``):

========= ============================================================ =====================
role      child names                                                  style
========= ============================================================ =====================
attention ``q k v query key value q_proj k_proj v_proj wq wk wv``,     colwise (by heads)
          a stacked ``c_attn`` (permuted into per-rank whole heads)
          ``out o_proj proj out_proj wo c_proj``                       rowwise
MLP       ``fc fc1 c_fc up_proj gate_proj w1 w3``                      colwise
          ``proj fc2 down_proj w2 c_proj``                             rowwise
BERT      ``*.{query,key,value}``, ``intermediate.dense``               colwise
          the sibling ``output.dense``                                 rowwise
========= ============================================================ =====================

Fused projections of unknown layout (``qkv``, ``Wqkv``, ``query_key_value``, ``qkv_proj``,
``in_proj``) are refused. An attention that derives its head width from its input (nanoGPT) stays
whole. Attention is split by whole heads, key/value heads included. `roles` gives every other
module with parameters or buffers a rule by its place in the block and refuses one no rule covers.
"""

from __future__ import annotations

import difflib
import fnmatch
import re

from torch import nn

from shardwise.errors import ConfigError

STYLES = ("colwise", "rowwise", "packed_colwise", "colwise_gather_output", "rowwise_split_input")
"""Styles a user plan may name: Megatron's pair, a fused gate|up projection split gate and up alike
(``packed_colwise``), and a column split whose output is gathered whole again with the row split that
takes its own slice of a whole input (any fused layout, at the cost of an all-gather)."""
COLWISE = frozenset({"colwise", "packed_colwise"})
"""Column splits whose output stays split (a sublayer between them and the row split runs on 1/tp)."""
GATHERED = frozenset({"colwise_gather_output"})
ROWWISE = frozenset({"rowwise", "rowwise_split_input"})
EXPERTS = "moe_tp_experts"
MLA = "mla_kv_a_proj"
"""Multi-head latent attention's shared projection (DeepSeek-V2/V3): replicated; the rotary key it emits,
shared by every head, has its gradient summed over tp; its sublayer's other linears each take their own ``f``."""
MLA_UPSTREAM = frozenset({"q_a_proj", "q_a_layernorm", "kv_a_layernorm"})
FUSED_GATE_UP = frozenset({"gate_up_proj", "gate_up", "w12", "wi_gate_up", "fc1_gate_up"})

ATTN_COLWISE = frozenset({"q", "k", "v", "query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv"})
ATTN_ROWWISE = frozenset({"o", "out", "o_proj", "proj", "out_proj", "wo", "c_proj"})
MLP_COLWISE = frozenset({"fc", "fc1", "c_fc", "up_proj", "gate_proj", "w1", "w3", "fc_in", "dense_h_to_4h", "wi", "wi_0", "wi_1"})
MLP_ROWWISE = frozenset({"proj", "fc2", "down_proj", "w2", "c_proj", "fc_out", "dense_4h_to_h", "wo"})
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

# A fused q|k|v projection that stacks q, k and v as three equal blocks along its output features
# (GPT-2's and nanoGPT's ``c_attn``): split into per-rank whole heads by a permutation. Other fused
# layouts (Falcon's and BLOOM's per-head interleaving, ...) differ by model and are refused unless
# the model declares its own plan.
STACKED_QKV = frozenset({"c_attn"})
_HEAD_WIDTH_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")
_WIDTH_ATTRS = ("n_embd", "embed_dim", "split_size", "all_head_size", "hidden_size")
LOCAL_ATTRS = (
    "num_heads",
    "n_head",
    "n_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "split_size",
    "embed_dim",
    "all_head_size",
    "inner_dim",
)
"""Attributes of a head-split attention module set to this rank's value (divided by tp) after the split."""


def _splittable(m: nn.Module) -> bool:
    from shardwise.strategies.tensor_parallel.styles import is_splittable

    return is_splittable(m)


def runs_on_local_heads(attn: nn.Module) -> bool:
    """Whether an attention module can run on 1/tp of its heads: it reshapes by a fixed head width
    (``head_dim``-like attribute, HF's ``view(..., -1, head_dim)``), or stores no width at all.
    A module that keeps the model width and no head width (nanoGPT's ``n_embd``, reshaping with
    ``c // n_head`` where ``c`` is its input's width) derives the head width from the whole input."""
    if any(isinstance(getattr(attn, a, None), int) for a in _HEAD_WIDTH_ATTRS):
        return True
    return not any(isinstance(getattr(attn, a, None), int) for a in _WIDTH_ATTRS)


def per_head_layout(attn: nn.Module) -> bool:
    """A fused q|k|v whose output features hold each head's q, k and v together (BLOOM's and Falcon's
    ``view(batch, seq, heads, 3, head_dim)``, Falcon's new architecture's per-key/value-group blocks): a
    contiguous column split gives each rank whole heads. Told by the attention's own flags and signature:
    Falcon's ``multi_query`` (one shared k and v after all q heads) is not; BLOOM takes ``alibi``."""
    import inspect

    if not isinstance(getattr(attn, "num_heads", None), int) or not isinstance(getattr(attn, "head_dim", None), int):
        return False
    if hasattr(attn, "new_decoder_architecture"):
        return bool(attn.new_decoder_architecture) or not getattr(attn, "multi_query", True)
    try:
        return "alibi" in inspect.signature(attn.forward).parameters
    except (TypeError, ValueError):
        return False


def fused_parts(module: nn.Module, name: str) -> int:
    """3 for a stacked q|k|v projection split by heads (permuted), 0 otherwise."""
    if _leaf(name).lower() not in STACKED_QKV:
        return 0
    return 3


def auto_plan(module: nn.Module) -> dict[str, str]:
    """The Megatron plan for a module whose linears follow the usual names (see the module docstring).

    >>> from shardwise.tools.recipes.charlm import CharGPT
    >>> for name, style in auto_plan(CharGPT(11, 8, 16, 2, 1)).items():
    ...     print(name, style)
    blocks.0.attn.q colwise
    blocks.0.attn.k colwise
    blocks.0.attn.v colwise
    blocks.0.attn.proj rowwise
    blocks.0.mlp.fc colwise
    blocks.0.mlp.proj rowwise
    """
    plan: dict[str, str] = {}
    for prefix, parent in module.named_modules():
        linears = {n: c for n, c in parent.named_children() if _splittable(c)}
        # ``in_proj`` is a fused q|k|v only in an attention (a head count or width): a state-space or short
        # convolution mixer (Mamba, LFM) names its input projection so too, and is left whole
        heads = any(isinstance(getattr(parent, a, None), int) for a in _HEAD_ATTRS + _HEAD_WIDTH_ATTRS)
        fused = [n for n in linears if n.lower() in FUSED and (n.lower() != "in_proj" or heads)]
        stacked = [n for n in fused if n.lower() in STACKED_QKV]
        if fused and not stacked:
            rows = [n for n in linears if n in ATTN_ROWWISE | {"dense"} and n not in fused]
            if per_head_layout(parent) and len(rows) == 1:  # each head's q, k, v contiguous: a column split keeps whole heads
                plan[_join(prefix, fused[0])] = "colwise"
                plan[_join(prefix, rows[0])] = "rowwise"
                continue
            why = (
                "Falcon's multi-query layout (every head's q, then one k and one v shared by all heads)"
                if getattr(parent, "multi_query", False)
                else "a layout (stacked or interleaved per head) shardwise cannot tell"
            )
            raise ConfigError(
                f"{_join(prefix, fused[0])} is a fused q|k|v projection with {why}: a column split would not give each rank "
                "whole heads of q, k and v. Pass tp_plan={...} naming only the MLP's linears (the attention stays whole), "
                f"or the exact split of any layout: {{{_join(prefix, fused[0])!r}: 'colwise_gather_output', <its output "
                "projection>: 'rowwise_split_input'}"
            )
        if stacked:
            rows = [n for n in linears if n in ATTN_ROWWISE]
            if len(rows) == 1 and runs_on_local_heads(parent):
                plan[_join(prefix, stacked[0])] = "colwise"
                plan[_join(prefix, rows[0])] = "rowwise"
            continue  # an attention that derives its head width from its input stays whole (replicated)
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
    plan.update(_encoder_plan(module, plan))
    return plan


def _encoder_plan(module: nn.Module, found: dict[str, str]) -> dict[str, str]:
    """BERT's layout (BERT, RoBERTa, ViT, ELECTRA, ...): ``attention.{self,attention}.{query,key,value}``
    with the row-split ``attention.output.dense`` in a sibling module, and the MLP as
    ``intermediate.dense`` (colwise) then ``output.dense`` (rowwise) in the layer."""
    plan: dict[str, str] = {}
    for prefix, parent in module.named_modules():
        kids = dict(parent.named_children())
        out = kids.get("output")
        dense = getattr(out, "dense", None) if out is not None else None
        if dense is None or not _splittable(dense):
            continue
        for name, child in kids.items():
            if name == "output":
                continue
            lins = {n: c for n, c in child.named_children() if _splittable(c)}
            qkv = [n for n in lins if n in ("query", "key", "value")]
            if len(qkv) == 3 and _join(_join(prefix, name), qkv[0]) not in found:
                for n in qkv:
                    plan[_join(_join(prefix, name), n)] = "colwise"
                plan[_join(prefix, "output.dense")] = "rowwise"
            elif name == "intermediate" and list(lins) == ["dense"]:
                plan[_join(prefix, "intermediate.dense")] = "colwise"
                plan[_join(prefix, "output.dense")] = "rowwise"
    return plan


# transformers' tensor-parallel styles that concern modules shardwise keeps whole (embeddings, the
# output head: every tp rank computes them on the same batch) or handles by role (norms).
_HF_SKIPPED = frozenset(
    {
        "embedding_rowwise",
        "embedding_colwise",
        "colwise_gather_output_head",
        "gather",
        "sequence_parallel",
        "replicate",
        "isolated",
        "local",
        "local_params",  # an attention's own per-head parameters (sinks): split with its heads by role (roles.by_heads)
    }
)
_HF_GRAD_SUM = "replicated_with_grad_allreduce"
_HF_MODULE_STYLES = frozenset({"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", EXPERTS, MLA})
_HF_PARAM_STYLES = frozenset({"packed_colwise", "packed_rowwise", "colwise", "rowwise"})
_HF_REFUSED = {
    "all_reduce": "a module whose output is a partial sum (shared experts computed on a slice)",
    "moe_identity_expert": "identity experts whose output the expert sum would count tp times",
    "colwise_rep": "a column split whose output is gathered back, declared with the row split it feeds",
    "rowwise_rep": "a row split of a replicated input",
}


def declared_raw(module: nn.Module) -> dict[str, str]:
    """transformers' plan as the model declares it (``model._tp_plan``, else ``config.base_model_tp_plan``
    under the base model's prefix): ``{pattern: style}``, untranslated; empty when none."""
    raw = getattr(module, "_tp_plan", None)
    if isinstance(raw, dict) and raw:
        return dict(raw)
    cfg = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
    if not isinstance(cfg, dict) or not cfg:
        return {}
    prefix = getattr(module, "base_model_prefix", "") or ""
    prefix = prefix if prefix and hasattr(module, prefix) else ""
    return {_join(prefix, k): v for k, v in cfg.items()}


def declared_plan(module: nn.Module) -> tuple[dict[str, str], list[str]] | None:
    """The model's own tensor-parallel plan (`declared_raw`) translated, as (``{pattern: style}``,
    patterns whose replicated parameters need their gradients summed over tp); ``None`` when the
    model declares none. Module styles are kept (``colwise``, ``rowwise``, ``colwise_gather_output``,
    ``rowwise_split_input``, ``moe_tp_experts``); styles on parameters (``packed_colwise``,
    ``packed_rowwise``, ``colwise``, ``rowwise`` on an experts module's 3-D weights) are read by
    `shardwise.strategies.tensor_parallel.experts`; embedding and head styles are skipped (kept whole,
    exact); a style that cannot be exact here is a `ConfigError` naming it, its module and what runs."""
    raw = declared_raw(module)
    if not raw:
        return None
    params = {n for n, _ in module.named_parameters()}
    names = [n for n, _ in module.named_modules() if n]
    plan: dict[str, str] = {}
    grad_sum: list[str] = []
    for pattern, style in raw.items():
        on_module = any(matches(pattern, n) for n in names)
        on_param = not on_module and any(matches(pattern, n) for n in params)
        if not on_module and not on_param:
            continue  # names nothing here (another prefix of the same plan, a part of the model)
        if style == _HF_GRAD_SUM:
            grad_sum.append(pattern)
        elif on_param and style in _HF_PARAM_STYLES:
            continue  # an experts module's weights: read with the module (experts.layout)
        elif style in _HF_MODULE_STYLES:
            plan[pattern] = style
        elif style in _HF_REFUSED or style not in _HF_SKIPPED:
            what = _HF_REFUSED.get(style, "a style shardwise does not know")
            raise ConfigError(
                f"{type(module).__name__} declares tensor-parallel style {style!r} for {pattern!r} ({what}), which shardwise "
                "does not translate exactly. Nearest working setting: pass tp_plan={...} naming only the linears to split "
                f"(e.g. the MLP's: {_mlp_hint(module)}), or train it with a data-parallel or sharded strategy (ddp, fsdp)"
            )
    # a gathered column split is half of a pair only next to a split-input row split; alone (the output
    # head, a router) it is a linear computed whole on every rank, which keeping it whole is, exactly
    pairs = {_parent(p) for p, st in plan.items() if st == "rowwise_split_input"}
    plan = {p: st for p, st in plan.items() if st not in GATHERED or _parent(p) in pairs}
    return (plan, grad_sum) if plan else None


def _mlp_hint(module: nn.Module) -> dict[str, str]:
    try:
        plan = auto_plan(module)
    except ConfigError:
        return {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    mlp = {re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", n): s for n, s in plan.items() if _leaf(n) in MLP_COLWISE | MLP_ROWWISE and _leaf(n) not in ATTN_ROWWISE}
    return mlp or {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}


def _expand(module: nn.Module, plan: dict[str, str], what: str = "tp_plan", lenient: bool = False) -> dict[str, str]:
    """Patterns -> module names (`matches`: one dotted segment per ``*``). ``lenient`` (a declared plan
    on part of a model, a pipeline stage): a pattern that matches nothing is skipped."""
    names = [n for n, _ in module.named_modules() if n]
    resolved: dict[str, str] = {}
    known = STYLES + ((EXPERTS, MLA) if lenient else ())
    for pattern, style in plan.items():
        if style not in known:
            close = difflib.get_close_matches(str(style), STYLES, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"tp_plan[{pattern!r}] = {style!r} is not a style.{hint} Styles: {', '.join(map(repr, STYLES))}")
        matched = [n for n in names if matches(pattern, n)]
        if not matched and lenient:
            continue
        if not matched:
            close = difflib.get_close_matches(pattern, names, n=3)
            wide = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            raise ConfigError(
                f"{what} names {pattern!r}, which matches no module of {type(module).__name__}"
                + (f" (each '*' matches one dotted segment; across dots it would match {wide[:3]}: write each segment)" if wide else "")
                + (f"; close names: {close}" if close else "")
                + "; see model.named_modules() for the names"
            )
        for n in matched:
            resolved[n] = style
    return resolved


def resolve_plan(module: nn.Module, plan: dict[str, str] | None = None, tp: int | None = None) -> dict[str, str]:
    """Concrete ``{linear name: style}`` for ``module``: ``plan`` with its patterns expanded, else the
    model's declared plan (`declared_plan`), else the automatic plan; checked (styles, names, linears,
    widths and heads divisible by ``tp``)."""
    return resolve(module, plan, tp)[0]


def resolve(module: nn.Module, plan: dict[str, str] | None = None, tp: int | None = None) -> tuple[dict[str, str], list[str], str]:
    """(`resolve_plan`'s plan, names of replicated modules whose gradients are summed over tp as the
    model declares, where the plan came from: ``"user"``, ``"declared"`` or ``"auto"``)."""
    grad_sum: list[str] = []
    if plan is not None:
        if not isinstance(plan, dict) or not plan:
            raise ConfigError(f"tp_plan must be a non-empty dict of module name (or pattern) -> 'colwise'|'rowwise'; got {plan!r}")
        resolved, source = _expand(module, plan), "user"
    elif (declared := declared_plan(module)) is not None:
        resolved, source = _expand(module, declared[0], f"the tensor-parallel plan {type(module).__name__} declares", lenient=True), "declared"
        if not resolved:
            raise ConfigError(
                f"the tensor-parallel plan {type(module).__name__} declares ({sorted(declared[0])}) matches none of its modules; pass tp_plan={{...}}"
            )
        names = [n for n, _ in module.named_modules() if n]
        grad_sum = [n for n in names if any(matches(pat, n) for pat in declared[1])]
        resolved = gather_unknown_fused(module, resolved)
    else:
        resolved, source = auto_plan(module), "auto"
        convs = [n for n, m in module.named_modules() if isinstance(m, nn.modules.conv._ConvNd)]
        if not resolved and convs:
            raise ConfigError(
                f"{type(module).__name__} is a convolutional network ({len(convs)} convolutions, e.g. {convs[0]}) with no "
                "attention or MLP linear pair: tensor parallelism splits linear layers, not convolutions. Train it with a "
                "data-parallel strategy (ddp, zero1/2/3, fsdp) or a pipeline instead"
            )
        if not resolved:
            rules = (
                f"the automatic tensor-parallel plan found no linear pair to split in {type(module).__name__}: it looks for "
                "attention q/k/v (query/key/value, q_proj/k_proj/v_proj, wq/wk/wv, a stacked c_attn) next to "
                "out/o_proj/proj/out_proj/wo/c_proj, MLP fc/fc1/up_proj/gate_proj/w1/w3/c_fc next to proj/fc2/down_proj/w2/c_proj, "
                "and BERT's intermediate.dense/output.dense."
            )
            pair = _example_pair(module)
            if pair is None:
                raise ConfigError(
                    f"{rules} Pass a plan instead: attention's q, k, v and an MLP's first linear colwise, the linear that "
                    "consumes their output rowwise, by their names in model.named_modules() (e.g. strategy_options="
                    "{'tp_plan': {'layers.*.mlp.fc': 'colwise', 'layers.*.mlp.proj': 'rowwise'}}, or --set "
                    '\'trainer.strategy_options.tp_plan={"layers.*.mlp.fc" = "colwise", "layers.*.mlp.proj" = "rowwise"}\'). '
                    f"No pair of {type(module).__name__}'s own consecutive linears splits by itself; a model that fits on one "
                    "device trains as well with a data-parallel strategy (ddp, zero1, zero2, zero3)"
                )
            first, second = pair
            raise ConfigError(
                f"{rules} Pass a plan instead (a linear whose output feeds the next one: the first colwise, the second "
                f"rowwise), e.g. strategy_options={{'tp_plan': {{{first!r}: 'colwise', {second!r}: 'rowwise'}}}}, or on the "
                f'command line --set \'trainer.strategy_options.tp_plan={{"{first}" = "colwise", "{second}" = "rowwise"}}\''
            )
    for name, style in resolved.items():
        sub = module.get_submodule(name)
        if style in (EXPERTS, MLA):
            continue  # experts: checked by experts.layout; MLA: a replicated linear
        if not _splittable(sub):
            raise ConfigError(f"tp_plan[{name!r}] = {style!r}: tensor parallelism splits nn.Linear modules (and Conv1D); {name} is a {type(sub).__name__}")
        if source == "user" and style == "colwise":
            _check_fused(name, resolved)
    if source == "user":
        _check_pairs(module, resolved)
    resolved = _whole_statistics(module, resolved)
    if tp is not None:
        check_divisible(module, resolved, tp)
    return resolved, grad_sum, source


def _example_pair(module: nn.Module) -> tuple[str, str] | None:
    """Two of ``module``'s own linears, in module order, the first's output width the second's input
    width, that a plan can split (colwise, then rowwise) under the roles' rules; None when no such
    pair passes them."""
    from shardwise.strategies.tensor_parallel.roles import roles  # roles imports this module

    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    pairs = [(a, b) for (a, first), (b, second) in zip(linears, linears[1:], strict=False) if first.out_features == second.in_features]
    pairs.sort(key=lambda p: p[0].rpartition(".")[0] != p[1].rpartition(".")[0])  # a pair inside one module (an MLP) first
    for a, b in pairs:
        try:
            roles(module, {a: "colwise", b: "rowwise"}, [], False)
        except ConfigError:
            continue
        pattern_a, pattern_b = (re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", n) for n in (a, b))
        # the same pair in every block of a list (layers.*.fc) when the pattern names as many modules as blocks
        if pattern_a != a and len(fnmatch.filter([n for n, _ in linears], pattern_a)) == len(fnmatch.filter([n for n, _ in linears], pattern_b)):
            return pattern_a, pattern_b
        return a, b
    return None


# -- what a plan implies: sublayers (Megatron's f) and blocks (sequence parallelism) -----------


def _sublayers(plan: dict[str, str]) -> dict[str, list[str]]:
    """Sublayer -> its column-split linears (the modules whose input Megatron's f acts on): their
    parent (attention, MLP), or the linear itself when its parent is a block (OPT's ``fc1`` sits
    in the decoder layer next to the norms)."""
    blocks = set(_blocks_of(plan))
    out: dict[str, list[str]] = {}
    for name, style in plan.items():
        if style in COLWISE or style in GATHERED:
            parent = _parent(name)
            out.setdefault(name if parent in blocks else parent, []).append(name)
    return out


def _blocks_of(plan: dict[str, str]) -> list[str]:
    """Elements of a block list (a dotted name ending in an index) that hold split linears."""
    found = []
    for name in plan:
        parts = name.split(".")
        idx = [i for i, p in enumerate(parts[:-1]) if p.isdigit()]
        if idx:
            found.append(".".join(parts[: idx[-1] + 1]))
    return found


def _blocks(module: nn.Module, plan: dict[str, str]) -> list[str]:
    """Transformer blocks, in registration order: the elements of a block list (``layers.3``,
    ``transformer.h.0``, ``encoder.layer.1``) that hold split linears; for a split linear outside
    any list, the parent of the module holding it (charlm-style ``blocks`` need no list)."""
    found: set[str] = set()
    for name, style in plan.items():
        parts = name.split(".")
        idx = [i for i, p in enumerate(parts[:-1]) if p.isdigit()]
        if idx:
            found.add(".".join(parts[: idx[-1] + 1]))
        elif style in ROWWISE and _parent(name) and _parent(_parent(name)):
            found.add(_parent(_parent(name)))
    order = [n for n, _ in module.named_modules()]
    return [n for n in order if n in found]


def _sequence_blocks(module: nn.Module, plan: dict[str, str]) -> list[str]:
    """The blocks sequence parallelism shards between (`_blocks`); a `ConfigError` when there are none."""
    blocks = _blocks(module, plan)
    if not blocks:
        raise ConfigError(
            "sequence_parallel needs transformer blocks: modules holding the split sublayers (attention, MLP) together "
            f"with their norms; the plan {plan} has its row-split linears at the top of {type(module).__name__}"
        )
    return blocks


from shardwise.strategies.tensor_parallel.checks import (  # noqa: E402  # the checks read this module's tables
    _check_fused,
    _check_pairs,
    _whole_statistics,
    check_divisible,
    gather_unknown_fused,
    matches,
)
