"""Transition only: runs a strategy written against the old setup()/getattr-hook protocol
through the plan/apply contract. Removed once every built-in strategy is converted."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager, Mapping, Sequence

import torch
from torch import nn

from shardwise.comm.recorder import Recorder
from shardwise.data import per_rank_batch
from shardwise.mesh import Mesh
from shardwise.precision import Precision
from shardwise.strategies import protocol
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy


class LegacyStrategy(Strategy):
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        inner = self.inner
        inner.validate(world_size)
        trainers = protocol.trainers(inner, world_size)
        degrees = protocol.mesh_degrees(inner, dict(mesh or {}))
        pp, tp = degrees.get("pp", 1), degrees.get("tp", 1)
        Mesh.build(world_size=trainers, **degrees)  # raises with the valid shapes
        dp = degrees.get("dp") or trainers // (pp * tp)
        micro = None
        if batch is not None:
            micro = per_rank_batch(batch.global_batch, dp, batch.accumulate)
            protocol.check_batch(inner, micro, batch.accumulate)
        if model is not None:
            protocol.check_model(inner, model)
        return Layout(
            strategy=self.name, world_size=world_size, degrees=degrees, trainers=trainers, data_parallel=dp,
            servers=tuple(range(trainers, world_size)), expendable=tuple(protocol.expendable_ranks(inner, world_size)), micro_batch=micro,
        )

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> Parallel:
        wrapped, optimizer = self.inner.setup(model, make_optimizer, mesh, recorder)
        return LegacyRun(self.inner, wrapped, optimizer)

    def options(self) -> dict[str, Any]:
        return {}


class LegacyRun(Parallel):
    def __init__(self, inner: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.inner, self.model, self.optimizer = inner, model, optimizer
        place = protocol.placement(inner)
        kwargs: dict[str, Any] = {"trains": place.trains, "mesh": place.mesh, "data_mesh": protocol.data_mesh(inner)}
        if place.group is not None:
            kwargs["group"] = place.group
        self.placement = Placement(**kwargs)
        self._summary: dict[str, Any] | None = None

    def module(self) -> nn.Module:
        return self.inner.unwrap(self.model)  # type: ignore[no-any-return]

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        return self.inner.forward_backward(self.model, microbatches, step_fn, precision)  # type: ignore[no-any-return]

    def no_sync(self) -> ContextManager[None]:
        return self.inner.no_sync(self.model)  # type: ignore[no-any-return]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.inner.clip_grad_norm(self.model, max_norm)  # type: ignore[no-any-return]

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        return self.inner.state_dict(self.model, self.optimizer if optimizer else None)  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(self.model, self.optimizer if "optimizer" in state else None, state)

    def after_step(self, step: int) -> None:
        protocol.after_step(self.inner, self.model, self.optimizer, step)

    def save_extra_state(self, directory: Path) -> None:
        protocol.save_extra_state(self.inner, self.model, self.optimizer, directory)

    def load_extra_state(self, path: Path) -> None:
        protocol.load_extra_state(self.inner, self.model, self.optimizer, path)

    def finish(self) -> None:
        if self._summary is None:
            self._summary = self.inner.summary()

    def summary(self) -> dict[str, Any]:
        self.finish()
        assert self._summary is not None
        return self._summary
