"""Mixture-of-experts layers found from the model's structure, and the backstop for the rest.

The rule: a module whose forward takes ``(hidden_states, top_k_index, top_k_weights)`` (the
experts interface transformers 5.x gives every MoE family: Mixtral, Qwen2/3-MoE, OLMoE,
GraniteMoE, DeepSeek-V3, ...), matched by position, not by name (any forward of exactly three
required positional arguments; `dispatch.py` checks their shapes on the first call: hidden rows
[T, H], integer indices [T, k], float weights [T, k]), and whose own parameters are stacked, each with the same leading
dimension E >= 2 (the experts: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I), biases (E, ...)),
and no child module holding parameters (a norm shared by the experts would need its own reduction).

The backstop: a module that looks like experts but no rule covers is refused before launch,
named: stacked parameters (two or more 3-D with one leading dimension) behind another forward,
a rule-shaped module with shared children, or a hand-written MoE: a ``ModuleList`` of two or more
modules of one type beside a linear router whose outputs are as many as the list.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from shardwise.errors import ConfigError

SIGNATURE = ("hidden_states", "top_k_index", "top_k_weights")
INTERFACE = (
    "forward(hidden_states, top_k_index, top_k_weights) -> [T, H]: three tensors, hidden rows [T, H], expert indices [T, k] "
    "(integer), routing weights [T, k] (float), matched by position (any names)"
)
"""The experts interface ep splits, as every message that refuses a forward says it."""


@dataclass(frozen=True)
class ExpertsLayer:
    """One stacked-experts module: its name, its number of experts, its stacked parameters' names."""

    name: str
    num_experts: int
    params: tuple[str, ...]


def forward_args(module: nn.Module) -> tuple[str, ...]:
    try:
        sig = inspect.signature(type(module).forward)  # follows functools.wraps to the model's own forward
    except (TypeError, ValueError):
        return ()
    return tuple(p for p in sig.parameters if p != "self")


def _three_tensors(module: nn.Module) -> bool:
    """The forward's first three arguments are transformers' names, or three positional arguments of
    any names: the first required, the other two required or defaulting to None (GPT-OSS's
    ``(hidden_states, router_indices=None, routing_weights=None)``), any further ones with defaults."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    if tuple(p.name for p in params[:3]) == SIGNATURE:
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    three = params[:3]
    if len(three) < 3 or any(p.kind not in positional for p in three) or three[0].default is not inspect.Parameter.empty:
        return False
    rest_optional = all(p.default is not inspect.Parameter.empty or p.kind is inspect.Parameter.VAR_KEYWORD for p in params[3:])
    return rest_optional and all(p.default in (inspect.Parameter.empty, None) for p in three[1:])


def _library(module: nn.Module) -> bool:
    """The class comes from transformers (the user cannot rewrite it)."""
    return type(module).__module__.split(".")[0] == "transformers"


def _why_not(module: nn.Module, e: int) -> str:
    """Why a stacked-experts module is not covered, and what to do: for a library class, the nearest setting."""
    args = forward_args(module)
    cls = type(module).__name__
    if not _library(module):
        return f"{cls}: {e} stacked experts behind forward{args}; ep needs {INTERFACE}"
    how = (
        "each expert runs on every token (the router's weights applied to its input beforehand), not on the top-k tokens it is sent"
        if len(args) == 1
        else f"its forward{args} is not the top-k interface"
    )
    return f"{cls}, transformers' own class: {e} stacked experts behind forward{args}: {how}; ep=1 with strategy 'tp' or 'zero3' trains it"


def _stacked(module: nn.Module) -> int:
    """E when every own parameter has leading dimension E >= 2 and at least one is 3-D; else 0."""
    params = list(module.named_parameters(recurse=False))
    if not params or not any(p.dim() == 3 for _, p in params) or any(p.dim() < 2 for _, p in params):
        return 0
    lead = {p.shape[0] for _, p in params}
    return lead.pop() if len(lead) == 1 and min(p.shape[0] for _, p in params) >= 2 else 0


def _has_param_children(module: nn.Module) -> list[str]:
    return [n for n, c in module.named_children() if any(True for _ in c.parameters())]


def _hand_written(name: str, module: nn.Module) -> str | None:
    """A ModuleList of >= 2 same-type modules with parameters beside a Linear with as many outputs."""
    lists = [(n, c) for n, c in module.named_children() if isinstance(c, nn.ModuleList) and len(c) >= 2]
    routers = {c.out_features for c in module.children() if isinstance(c, nn.Linear)}
    for n, lst in lists:
        kinds = {type(m) for m in lst}
        if len(kinds) == 1 and len(lst) in routers and any(True for _ in lst.parameters()):
            return f"{name}.{n}" if name else n
    return None


def find_experts(model: nn.Module) -> tuple[list[ExpertsLayer], list[str]]:
    """The experts layers the rule covers, and the names (with why) of MoE-looking modules it does not."""
    covered: list[ExpertsLayer] = []
    uncovered: list[str] = []
    for name, module in model.named_modules():
        e = _stacked(module)
        if e and _three_tensors(module):
            shared = _has_param_children(module)
            if shared:
                uncovered.append(f"'{name}' ({type(module).__name__}: its experts share the parameters of {shared})")
                continue
            covered.append(ExpertsLayer(name, e, tuple(n for n, _ in module.named_parameters(recurse=False))))
        elif e and sum(1 for p in module.parameters(recurse=False) if p.dim() == 3) >= 2:
            uncovered.append(f"'{name}' ({_why_not(module, e)})")
        else:
            hand = _hand_written(name, module)
            if hand is not None:
                uncovered.append(f"'{hand}' (a ModuleList of {len(module.get_submodule(hand.split('.')[-1]))} experts beside a linear router)")
    return covered, uncovered


def check_model(model: nn.Module, ep: int, dp: int) -> list[ExpertsLayer]:
    """The experts layers ``ep`` splits, or a `ConfigError` (raised in the parent) saying why not."""
    if ep < 1:
        raise ConfigError(f"ep must be a whole number >= 1; got {ep!r}")
    if dp % ep:
        raise ConfigError(
            f"ep={ep} does not divide the data-parallel degree {dp}: expert parallelism splits each data-parallel "
            f"group into groups of {ep} ranks; choose an ep that divides {dp}, or a world size that is a multiple of {ep}"
        )
    covered, uncovered = find_experts(model)
    if uncovered and all("transformers' own class" in u for u in uncovered):
        names = ", ".join(u.split(" (", 1)[0] for u in uncovered)
        raise ConfigError(
            f"ep={ep}: expert parallelism does not cover the experts layer(s) {names} ({uncovered[0].split(' (', 1)[1]}. "
            "ep splits experts that receive only the tokens routed to them; these take a different interface. The nearest "
            "working settings: strategy 'tp' with ep=1 (the experts split by transformers' own plan), or 'zero3' with ep=1 "
            "(the experts sharded with the rest of the model)"
        )
    if uncovered:
        raise ConfigError(
            f"ep={ep}: {len(uncovered)} module(s) look like mixture-of-experts layers that expert parallelism does not cover: "
            + "; ".join(uncovered)
            + f". shardwise splits experts stacked as (num_experts, ...) parameters behind {INTERFACE}, as transformers' MoE "
            "families declare them; use ep=1 (the experts replicated or sharded by fsdp/zero3), or give your experts module "
            "that forward (a router outside it choosing the top k)"
        )
    if not covered:
        raise ConfigError(
            f"ep={ep} needs a mixture-of-experts model, and {type(model).__name__} has no experts layer (a module of stacked "
            "(num_experts, ...) parameters with forward(hidden_states, top_k_index, top_k_weights)); drop the ep option"
        )
    bad = [f"'{c.name}' ({c.num_experts} experts)" for c in covered if c.num_experts % ep]
    if bad:
        raise ConfigError(
            f"ep={ep} does not divide the number of experts of {', '.join(bad)}: each rank holds num_experts / ep experts; "
            f"choose an ep that divides {covered[0].num_experts}"
        )
    return covered
