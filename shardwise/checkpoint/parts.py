"""Checkpoints written in parts: each rank its own share of the model and optimizer, merged when read.

A pipeline rank holds its stages only. Gathering the whole state on a rank to write ``state.pt``
made that rank hold the whole model (and the exchange's buffers) at every checkpoint: a 200 M
Llama's pipeline ranks peaked 1.6 GB above their training peak. So each rank writes its part into
its own file (``rank-RRRRR.pt``, under ``"part"``: ``{"model": {name: tensor}, "optimizer":
{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]} | None}``), and ``state.pt``
records under `PARTS` which keys they stand for, the ranks, the whole model's parameter names and
its state-dict order. `merge` makes the whole state ``single`` would have written (model keys in
the model's order, optimizer numbered as the whole model's optimizer numbers its parameters), so
the checkpoint resumes and exports under any strategy: `files.read` merges on load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.checkpoint.names import optimizer_state_by_number

PARTS = "__parts__"


def merge(parts: list[dict[str, Any]], names: list[str], order: list[str] | None = None) -> dict[str, Any]:
    """The whole ``{"model", "optimizer"}`` state from every rank's part (rank order).

    A tensor in two parts (a weight tied across pipeline ranks) keeps the first rank's copy, in the
    model and in the optimizer: every copy took the same steps."""
    model: dict[str, Any] = {}
    for part in parts:
        for k, v in part["model"].items():
            model.setdefault(k, v)
    if order is not None:
        known = set(order)
        model = {k: model[k] for k in order if k in model} | {k: v for k, v in model.items() if k not in known}
    out: dict[str, Any] = {"model": model}
    optimizers = [p["optimizer"] for p in parts if p.get("optimizer") is not None]
    if optimizers:
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        for opt in optimizers:
            for k, v in opt["state"].items():
                state.setdefault(k, v)
            for gi, g in enumerate(opt["param_groups"]):
                if gi < len(groups):
                    have = set(groups[gi]["params"])
                    groups[gi]["params"] = groups[gi]["params"] + [n for n in g["params"] if n not in have]
                else:
                    groups.append(dict(g, params=list(g["params"])))
        rank_of = {n: i for i, n in enumerate(names)}
        for g in groups:
            g["params"] = sorted(g["params"], key=lambda n: rank_of[n])
        numbered = [n for g in groups for n in g["params"]]
        out["optimizer"] = optimizer_state_by_number({"state": state, "param_groups": groups}, numbered)
    return out


def join(path: Path, shared: dict[str, Any], load: Any) -> dict[str, Any]:
    """``shared`` (a checkpoint's ``state.pt``) with the parts its `PARTS` entry names merged in, whole;
    ``shared`` itself when it has none. ``load(file)`` reads one rank's file."""
    info = shared.get(PARTS)
    if info is None:
        return shared
    parts = [load(Path(path) / f"rank-{r:05d}.pt")["part"] for r in info["ranks"]]
    whole = merge(parts, list(info["names"]), info.get("order"))
    out = {k: v for k, v in shared.items() if k != PARTS}
    out[info["model"]] = whole["model"]
    if info.get("optimizer"):
        out[info["optimizer"]] = whole.get("optimizer", {"state": {}, "param_groups": []})
    return out
