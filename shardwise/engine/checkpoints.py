"""How the `Engine` saves and loads a job's state: model, optimizer, plain values and every rank's
random streams, through `shardwise.checkpoint` (whole, in parts, or sharded with DCP)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from shardwise.engine.engine import Engine

__all__ = ["load", "save", "split_state"]


def split_state(engine: Engine, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(shared state for ``state.pt``, sharded state for DCP or None): `shardwise.checkpoint.split_state`
    with this run's strategy state, plus the engine's own counters."""

    def strategy_state() -> dict[str, Any]:
        if engine.parallel is None:
            raise ConfigError("save/load of a model or optimizer needs engine.setup to have been called")
        model = next((v for v in state.values() if isinstance(v, nn.Module)), None)
        return engine._run(model).state_dict(optimizer=True)

    shared, sharded = ckpt.split_state(state, strategy_state)
    shared["__precision__"] = engine.precision.state_dict()
    # The optimizer-step count drives after_step rounds (local SGD's every H): it must survive a resume.
    shared["__engine__"] = {"steps_taken": engine.steps_taken}
    return shared, sharded


def save(engine: Engine, path: str | os.PathLike[str], state: dict[str, Any], *, meta: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint directory atomically. Call on every rank.

    ``state`` maps names to the model and optimizer from ``setup``, to objects
    with ``state_dict()`` (schedulers, the data loader), or to plain values.
    Every rank's RNG streams are saved with it. Under a sharded strategy the model
    and optimizer are written in shards by every rank (``dcp/``, see `shardwise.checkpoint`).
    The strategy's ``save_extra_state(directory)`` adds its own files
    (each replica's state, the parameter servers' shards) before the manifest is written.
    """
    if not engine.writes_checkpoints:
        return Path(path)  # this rank loops alone; rank 0 writes the run's checkpoints
    # Every rank builds the state (a sharded strategy's is collective); rank 0 writes the shared part.
    own: dict[str, Any] = {"rng": ckpt.capture_rng()}
    objects = {k for k, v in state.items() if isinstance(v, (nn.Module, torch.optim.Optimizer))}
    part = engine.parallel.state_part(optimizer=any(isinstance(state[k], torch.optim.Optimizer) for k in objects)) if objects and engine.parallel else None
    if part is not None:
        # Written in parts: each rank's share of the model and optimizer in its own file, merged when read.
        split, sharded = split_state(engine, {k: v for k, v in state.items() if k not in objects})
        split[ckpt.PARTS] = {
            "model": next((k for k in objects if isinstance(state[k], nn.Module)), None),
            "optimizer": next((k for k in objects if isinstance(state[k], torch.optim.Optimizer)), None),
            **{k: part[k] for k in ("ranks", "names", "order")},
        }
        if part["part"] is not None:
            own["part"] = part["part"]
    else:
        split, sharded = split_state(engine, state)
    shared: dict[str, Any] | None = split
    meta = dict(meta or {})
    if not engine.is_rank_zero:
        shared = None
    else:
        models = [k for k, v in state.items() if isinstance(v, nn.Module)]
        model_state = (sharded or split).get(models[0]) if models else None
        meta["model_fingerprint"] = ckpt.fingerprint(model_state) if model_state is not None else None
        meta["strategy"] = engine.strategy.name
    extra: Callable[[Path], None] | None = engine.parallel.save_extra_state if engine.parallel is not None else None
    return ckpt.write(
        Path(path),
        rank=engine.rank,
        world_size=engine.world_size,
        shared=shared,
        own=own,
        barrier=engine.barrier,
        meta=meta,
        sharded=sharded,
        extra=extra,
    )


def load(engine: Engine, path: str | os.PathLike[str], state: dict[str, Any], *, restore_rng: bool = True) -> dict[str, Any]:
    """Restore ``state`` in place from a checkpoint; returns the saved values that are not objects."""
    path = Path(path)
    shared, own, manifest = ckpt.read(path, engine.rank)
    stored = set(shared) | set(manifest.get("sharded", {}).get("keys", []))
    missing = [k for k in state if k not in stored]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no {missing}; it holds {sorted(k for k in stored if not k.startswith('__'))}")
    plain: dict[str, Any] = {}
    model_key = next((k for k, v in state.items() if isinstance(v, nn.Module)), None)
    optim_key = next((k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)), None)
    if model_key is not None:
        model = state[model_key]
        optimizer = state[optim_key] if optim_key else None
        run = engine._run(model)
        template = run.state_dict(optimizer=optimizer is not None and "sharded" in manifest)
        if "sharded" in manifest:
            ckpt.check_model_state(template["model"], ckpt.sharded_shapes(path, model_key), path)
            sub = ckpt.read_sharded(path, template, run.module(), optimizer, model_key, optim_key)
        else:
            ckpt.check_model_state(template["model"], shared[model_key], path)
            sub = {"model": shared[model_key]}
            if optim_key is not None:
                sub["optimizer"] = shared[optim_key]
        run.load_state_dict(sub)
        run.load_extra_state(path)
    for key, value in state.items():
        if key in (model_key, optim_key):
            continue
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(shared[key])
        else:
            plain[key] = shared[key]
    engine.precision.load_state_dict(shared.get("__precision__", {}))
    engine.steps_taken = int(shared.get("__engine__", {}).get("steps_taken", engine.steps_taken))
    if restore_rng:
        if own is not None:
            ckpt.restore_rng(own["rng"])
        elif engine.is_rank_zero:
            print(f"shardwise: {path} has no RNG state for rank {engine.rank} (saved at another world size); RNG streams start fresh", flush=True)
    return plain
