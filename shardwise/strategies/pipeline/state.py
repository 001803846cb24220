"""Checkpoints of a pipeline: every stage's model and optimizer state gathered into the whole
model's (``gather_state``), and this rank's part kept from a whole state (``load_local_state``).

The whole state is exactly what ``single`` writes: model keys in the model's own order (stage
order), optimizer state by parameter number in the whole model's parameter order. So a pipeline
checkpoint resumes under any strategy, and any plain checkpoint resumes under ``pipeline``.
Each rank's part crosses the pipeline group as tensors (`exchange.all_gather_tree`), never as a
pickled object, and the recorder counts it (``pp/all_gather``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.comm import Group, Recorder
from shardwise.strategies.compose import relayout_whole
from shardwise.strategies.pipeline.evaluate import PipelineModule
from shardwise.strategies.pipeline.exchange import all_gather_tree


def gather_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: Group,
    all_names: list[str],
    aliases: dict[str, str] | None = None,
    *,
    device: torch.device,
    recorder: Recorder | None = None,
    order: list[str] | None = None,
) -> dict[str, Any]:
    """The whole model (and optimizer, numbered as the whole model's optimizer numbers its
    parameters), gathered from every pipeline rank to every rank of the group.

    ``aliases``: tied names -> first name. A weight tied across stages is in the model state
    under every name (as ``single``'s state dict has it) and in the optimizer state once, under
    its first name (the first owner's copy; every copy took the same steps). ``device``: where the
    exchange's tensors go on the wire (the group's backend's device). ``order``: the model's own
    ``state_dict`` keys, in its order (a traced split's stages hold a root tensor such as a position
    table apart from the layers, so stage order alone is not the model's)."""
    parts = all_gather_tree(local_part(model, optimizer, aliases), group=group, recorder=recorder, device=device)
    return ckpt.merge_parts(parts, all_names, order)


def local_part(model: nn.Module, optimizer: torch.optim.Optimizer | None, aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """This rank's part of the whole state (`shardwise.checkpoint.parts`): its stages' model state in the
    model's own layout (a fused q|k|v split by heads put back), in stage order, and its optimizer state by
    parameter name, a weight tied across stages under its first name."""
    aliases = aliases or {}
    stage_mods = model._stage_mods if isinstance(model, PipelineModule) else {0: model}
    local_model = {s: {k: _full(v).detach().cpu() for k, v in m.state_dict().items()} for s, m in stage_mods.items()}
    local_opt = None
    if optimizer is not None:
        named = ckpt.optimizer_state_by_name(optimizer.state_dict(), ckpt.parameter_names(model, optimizer))
        local_opt = {"state": {k: {n: _full(t) for n, t in s.items()} for k, s in named["state"].items()}, "param_groups": named["param_groups"]}
        local_opt = _to_cpu(local_opt)
    for sd in local_model.values():  # a fused q|k|v split by heads: saved in the model's own layout
        relayout_whole(stage_mods.values(), sd, None, invert=True)
    relayout_whole(stage_mods.values(), {}, local_opt, invert=True)
    if local_opt is not None:
        local_opt = _canonical(local_opt, aliases)
    flat: dict[str, Any] = {}
    for s in sorted(local_model):
        flat.update(local_model[s])
    return {"model": flat, "optimizer": local_opt}


def load_local_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any], all_names: list[str], aliases: dict[str, str] | None = None
) -> None:
    """Keep this rank's part of a whole-model state (from any strategy's ``state_dict``); a copy of a
    tied weight takes the optimizer state saved under the weight's first name."""
    aliases = aliases or {}
    own = model.state_dict()
    missing = [k for k in own if k not in state["model"]]
    if missing:
        from shardwise.errors import CheckpointError

        raise CheckpointError(f"the state has no {missing[:5]} for this pipeline stage")
    stage_mods = model._stage_mods if isinstance(model, PipelineModule) else {0: model}
    mine = {k: state["model"][k] for k in own}
    if ckpt.has_dtensor(own):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        relayout_whole(stage_mods.values(), mine, None, invert=False)
        set_model_state_dict(model, mine, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(mine)
    if optimizer is None or "optimizer" not in state:
        return
    full = state["optimizer"]
    named = ckpt.optimizer_state_by_name(full, all_names)
    local_names = ckpt.parameter_names(model, optimizer)
    first = {n: aliases.get(n, n) for n in local_names}  # this rank's name -> the saved name
    sub: dict[str, Any] = {
        "state": {n: dict(named["state"][first[n]]) for n in local_names if first[n] in named["state"]},
        "param_groups": [dict(g, params=[n for n in local_names if first[n] in set(g["params"])]) for g in named["param_groups"]],
    }
    sub["param_groups"] = [g for g in sub["param_groups"] if g["params"]]
    if ckpt.has_dtensor(own):
        # Sharded parameters (tp, fsdp): torch slices each whole tensor to this rank's shard (state keyed by name).
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        relayout_whole(stage_mods.values(), {}, sub, invert=False)
        set_optimizer_state_dict(model, optimizer, cast(Any, sub), options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(ckpt.optimizer_state_by_number(sub, local_names))


def _canonical(named: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """Optimizer state by name with tied names replaced by the weight's first name."""
    if not aliases:
        return named
    return {
        "state": {aliases.get(n, n): s for n, s in named["state"].items()},
        "param_groups": [dict(g, params=[aliases.get(n, n) for n in g["params"]]) for g in named["param_groups"]],
    }


def _full(t: Any) -> Any:
    return ckpt.full_tensor(t)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
