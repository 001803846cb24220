"""``zero2``, ``zero3`` / ``fsdp`` and ``hsdp``: sharded data parallel on FSDP2 (``fully_shard``).

The strategies (`FSDP`, `Zero2`, `HSDP`: options, plan) and their runs (`FSDPRun`, `Zero2Run`);
the units in `units`, the recording of what FSDP2 sends in `traffic`. The stages, what each keeps
whole, the collectives they send and the design notes: docs/strategies/sharded.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.checkpoint import optimizer_state_by_name, parameter_names
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies import compose, materialize
from shardwise.strategies.common import accumulate_backward
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.precision import Precision
from shardwise.strategies.sharded.traffic import CollectiveTraffic
from shardwise.strategies.sharded.units import _MP_DTYPES, MixedPrecision, apply_fsdp, auto_wrap_units, fsdp_modules, regather, resolve_units, shard_mesh
from shardwise.strategies.sharded.zero1 import ModelStateProbe, require_dp_only, require_process_group, require_trainable

__all__ = [
    "FSDP",
    "HSDP",
    "CollectiveTraffic",
    "FSDPRun",
    "MixedPrecision",
    "ShardedDataParallel",
    "Zero2",
    "Zero2Run",
    "apply_fsdp",
    "auto_wrap_units",
    "fsdp_modules",
    "regather",
    "resolve_units",
    "shard_mesh",
]

# -- the run --------------------------------------------------------------------------------


class FSDPRun(Parallel):
    """One rank of zero3 / hsdp: the module with every unit ``fully_shard``-ed in place."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sharded_params: list[nn.Parameter],
        *,
        strategy: ShardedDataParallel,
        units: list[str],
        shape: tuple[int, int],
        probe: ModelStateProbe,
        traffic: CollectiveTraffic,
        ep: Any = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self._ep = ep  # expert parallelism (compose.expert_parallel): its slices are left out of FSDP2
        self.placement = Placement()
        self.sharded_params = sharded_params
        """The sharded DTensor parameters the optimizer steps (under zero2, ``model.parameters()``
        returns the gathered compute tensors between steps, and their gradients have moved here)."""
        self.units, self.shape, self.probe, self.traffic = units, shape, probe, traffic
        self._strategy = strategy
        self.steps = 0
        traffic.watch_forward(model)
        self._prepare()

    def _prepare(self) -> None:
        self.probe.attach(self.model, self.optimizer)

    def module(self) -> nn.Module:
        return self.model  # fully_shard changes the module in place; names stay the user's

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        self.probe.arm()
        self.steps += 1
        with self.traffic.phase("backward") as mode:
            run = step_fn
            if mode is not None:

                def run(model: nn.Module, batch: Any) -> torch.Tensor:  # forward; the rest is backward (FSDP2's final callback too)
                    mode.phase = "forward"
                    try:
                        return step_fn(model, batch)
                    finally:
                        mode.phase = "backward"

            loss = accumulate_backward(self.model, microbatches, run, precision, no_sync=self.no_sync)
        if self._ep is not None:
            self._ep.reduce_grads()
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # Accumulate unsharded gradients locally; the last micro-batch reduce-scatters their sum.
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # Each rank holds a shard of every gradient: the norm of the local shards is not the
        # norm. DTensor computes the norm from the shards' partial norms, reduced across the
        # shard group (one allreduce it issues itself, recorded under the phase "clip").
        from torch.distributed.tensor import DTensor

        ep = self._ep
        params = [p for p in self.sharded_params if p.grad is not None and (ep is None or not ep.is_expert(p))]
        grads = [p.grad for p in params if p.grad is not None]  # the same tensors, typed as present
        with self.traffic.phase("clip"):
            total = torch.nn.utils.get_total_norm(grads, foreach=True)
            if isinstance(total, DTensor):
                total = total.full_tensor()
        if ep is not None:  # expert slices: plain tensors, one per ep rank, counted over the ep group
            total = ep.global_norm(total)
            torch.nn.utils.clip_grads_with_norm_([p for p in ep.params.values() if p.grad is not None], max_norm, total, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        with self.traffic.phase("checkpoint"), self._sharded():
            state = ckpt.dtensor_state_dict(self.model, self.optimizer if optimizer else None)
        return state if self._ep is None else self._ep.whole_state(state, self.optimizer if optimizer else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load sharded state (DTensors, from a sharded checkpoint) or full state (plain tensors, from ddp/single)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        if self._ep is not None:  # expert tensors are whole in a state: this rank's slices
            state = self._ep.local_state(state, self.optimizer)
        full = not ckpt.has_dtensor(state["model"])
        options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=False)
        with self.traffic.phase("checkpoint"), self._sharded():
            set_model_state_dict(self.model, state["model"], options=options)
            if "optimizer" in state:
                osd = state["optimizer"]
                if any(isinstance(k, int) for k in osd.get("state", {})) or any(isinstance(i, int) for g in osd["param_groups"] for i in g["params"]):
                    osd = optimizer_state_by_name(osd, parameter_names(self.model, self.optimizer))
                set_optimizer_state_dict(self.model, self.optimizer, osd, options=options)

    def _sharded(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # zero3 / hsdp: the parameters are sharded between steps already

    def after_step(self, step: int) -> None:
        return None  # the optimizer stepped the shards; the next forward gathers them

    def save_extra_state(self, directory: Path) -> None:
        return None  # the sharded model and optimizer state hold everything

    def load_extra_state(self, path: Path) -> None:
        return None

    def finish(self) -> None:
        return None  # the probe measured at the first step and the traffic was recorded as it went

    def summary(self) -> dict[str, Any]:
        s = self._strategy
        section: dict[str, Any] = {
            "units": len(self.units) + 1,
            "replicate": self.shape[0],
            "shard": self.shape[1],
            "mixed_precision": s.mixed_precision,
            "offload": s.offload,
        }
        if self.traffic.enabled:
            section["collectives_per_step"] = self.traffic.per_step(self.steps)
        if self._ep is not None:
            section["expert_parallel"] = self._ep.summary()
        return {"fsdp": section, **self.probe.summary()}


class Zero2Run(FSDPRun):
    """One rank of zero2: every unit stays gathered between steps; the shards the optimizer
    updated are gathered again after each step."""

    def _prepare(self) -> None:
        for m in fsdp_modules(self.model):
            m.set_reshard_after_backward(False, recurse=False)
        self._in_state_dict = False
        # Registered before the probe's hook, so the probe sees the parameters gathered again. A
        # step post-hook, not after_step: a loop that calls optimizer.step() itself stays correct.
        self.optimizer.register_step_post_hook(lambda opt, args, kwargs: self._regather_after_step())
        self.probe.attach(self.model, self.optimizer, master_copy=True)

    def _regather_after_step(self) -> None:
        # Not while a state dict is built or loaded: torch's get_optimizer_state_dict may run a
        # step (zero gradients) to create the state, and it maps parameters to names on the shards.
        if not self._in_state_dict:
            with self.traffic.phase("step"):
                regather(self.model)

    @contextlib.contextmanager
    def _sharded(self) -> Iterator[None]:
        # State dicts are read and written on the shards; the whole parameters are gathered again after.
        for m in fsdp_modules(self.model):
            m.reshard()
        self._in_state_dict = True
        try:
            yield
        finally:
            self._in_state_dict = False
            regather(self.model)

    def after_step(self, step: int) -> None:
        return None  # the re-gather ran in the optimizer's step post-hook


# -- the strategies ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ShardedDataParallel(Strategy):
    """What zero2, zero3 and hsdp share: the options of FSDP2 and the plan over data-parallel ranks."""

    name: ClassVar[str] = "zero3"
    compile_unit: ClassVar[str] = "blocks"  # FSDP2 wants each unit compiled before fully_shard
    smaller_last_batch: ClassVar[bool] = True
    shards_meta: ClassVar[bool] = True  # fully_shard on the meta model, then each rank fills its shards
    whole_model: ClassVar[bool] = False
    reshard_after_forward: ClassVar[bool] = True
    """Free each unit's gathered parameters after its forward (zero3, hsdp) or keep them (zero2)."""

    wrap: str | tuple[str, ...] = "auto"
    """Units to shard one at a time: auto (one per block of the largest ModuleList, else the large children), root, or submodule / class names."""
    mixed_precision: MixedPrecision | None = None
    """All-gather parameters in this dtype for compute (bf16 or fp16); gradients are reduced and master weights kept in fp32."""
    offload: bool = False
    """Keep the parameter, gradient and optimizer shards in CPU memory (FSDP2's CPUOffloadPolicy)."""
    count_collectives: bool = True
    """Record FSDP2's all-gathers, reduce-scatters and allreduces on the run's Recorder (one Python call per collective)."""
    ep: int = 1
    """Expert parallelism: split each MoE layer's experts over groups of ep data-parallel ranks (all-to-all; experts kept out of FSDP2)."""
    cp: int = 1
    """Context parallelism: split each sequence over this many ranks (attention by ring or Ulysses); they share samples."""
    cp_style: Literal["ring", "ulysses"] = "ring"
    """How context-parallel attention sees the whole sequence: ring (key/value blocks passed round) or ulysses (all-to-all over heads)."""

    def __post_init__(self) -> None:
        compose.check_context_parallel_options(self.name, self.cp, self.cp_style)
        if self.mixed_precision is not None and self.mixed_precision not in _MP_DTYPES:
            raise ConfigError(f"mixed_precision must be 'bf16', 'fp16' or None; got {self.mixed_precision!r}")
        wrap: Any = self.wrap
        if isinstance(wrap, (list, tuple)) and wrap and all(isinstance(w, str) and w for w in wrap):
            object.__setattr__(self, "wrap", tuple(wrap))  # frozen and hashable: a list from TOML becomes a tuple
        elif not (isinstance(wrap, str) and wrap):
            raise ConfigError(
                f"{self.name}: wrap must be 'auto', 'root', a submodule or class name, or a list of them (e.g. ['layers.0', 'Block']); got {wrap!r}"
            )
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"{self.name}: ep must be a whole number >= 1 (ranks that split the experts); got {self.ep!r}")
        for key in ("offload", "count_collectives"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{self.name}: {key} must be true or false; got {getattr(self, key)!r}")

    def shape(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) over ``world_size`` data-parallel ranks: all in one shard group."""
        return 1, world_size

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        layout = compose.context_parallel_layout(lambda w: plan_layout(self.name, w, batch=batch, mesh=mesh), world_size, self.cp, self.name)
        require_dp_only(self.name, layout.degrees)
        self.shape(layout.data_parallel * self.cp)  # refuses a shape that does not divide the ranks (cp ranks shard too)
        if self.ep > 1:
            if self.cp > 1:
                raise ConfigError(f"{self.name}: ep={self.ep} with cp={self.cp}: expert and context parallelism do not compose yet; use one of them")
            compose.check_expert_parallel(model, self.ep, layout.data_parallel)
        if model is not None:
            require_trainable(model, self.name)
            units = resolve_units(model, self.wrap)  # an unknown unit name fails here, in the parent
            layout = dataclasses.replace(layout, units=tuple(units))
        return layout

    def check_sample(self, model: nn.Module, batch: Any, layout: Layout) -> None:
        compose.check_context_parallel(model, batch, self.cp, self.cp_style, self.name)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> FSDPRun:
        require_process_group(self.name)
        require_trainable(model, self.name)
        mesh = compose.apply_context_parallel(model, mesh, recorder, self.cp_style)  # cp first; then sharded over dp x cp
        require_dp_only(self.name, mesh.degrees)
        replicate, shard = self.shape(mesh.size("dp"))
        units = resolve_units(model, self.wrap)
        device_mesh = shard_mesh(mesh, replicate)
        model = materialize.to_device(model, mesh.device)
        ep = compose.expert_parallel(model, self.ep, mesh, recorder) if self.ep > 1 else None
        model = apply_fsdp(
            model,
            device_mesh,
            ignored=None if ep is None else set(ep.params.values()),
            units=units,
            reshard_after_forward=self.reshard_after_forward,
            mixed_precision=self.mixed_precision,
            offload=self.offload,
        )
        materialize.fill_share(model, [model], mesh.device)  # a meta-built model: this rank's shards only
        sharded_params = list(model.parameters())
        optimizer = make_optimizer(sharded_params)
        if replicate == 1:
            groups = {"dp": device_mesh.get_group()}
        else:
            groups = {"replicate": device_mesh["replicate"].get_group(), "shard": device_mesh["shard"].get_group()}
        traffic = CollectiveTraffic(recorder, groups, enabled=self.count_collectives)
        traffic.hook(model)
        probe = ModelStateProbe(self.name, shard, () if ep is None else list(ep.params.values()))
        run = FSDPRun if self.reshard_after_forward else Zero2Run
        return run(model, optimizer, sharded_params, strategy=self, units=units, shape=(replicate, shard), probe=probe, traffic=traffic, ep=ep)


@dataclass(frozen=True, kw_only=True)
class FSDP(ShardedDataParallel):
    """ZeRO stage 3 on FSDP2 (``zero3``, alias ``fsdp``): parameters, gradients and optimizer state sharded."""

    name: ClassVar[str] = "zero3"
    reshard_after_forward: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class Zero2(ShardedDataParallel):
    """ZeRO stage 2: gradients and optimizer state sharded, parameters whole between steps."""

    name: ClassVar[str] = "zero2"
    reshard_after_forward: ClassVar[bool] = False
    whole_model: ClassVar[bool] = True  # parameters whole between steps


@dataclass(frozen=True, kw_only=True)
class HSDP(ShardedDataParallel):
    """Hybrid sharded data parallel: shard within groups of ``shard`` ranks, replicate across ``replicate`` groups.

    The default is two replicas (``replicate=2``) when the world size is even and at least 4,
    so a 4-process run is 2 x 2.
    """

    name: ClassVar[str] = "hsdp"
    reshard_after_forward: ClassVar[bool] = True

    replicate: int | None = None
    """Replica groups gradients are allreduced across (default: 2 when the world size is even and >= 4, else 1)."""
    shard: int | None = None
    """Ranks in each shard group (default: the world size / replicate)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, value in (("replicate", self.replicate), ("shard", self.shard)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"hsdp {key} must be a whole number >= 1; got {value!r}")

    def shape(self, world_size: int) -> tuple[int, int]:
        r, s = self.replicate, self.shard
        if r is None and s is None:
            r = 2 if world_size >= 4 and world_size % 2 == 0 else 1
        if r is None:
            r = world_size // s if s and world_size % s == 0 else 0
        if s is None:
            s = world_size // r if r and world_size % r == 0 else 0
        if r * s != world_size:
            options = ", ".join(f"{d}x{world_size // d}" for d in range(1, world_size + 1) if world_size % d == 0)
            raise ConfigError(
                f"hsdp shape replicate={self.replicate} x shard={self.shard} does not divide the world size {world_size}; "
                f"choose replicate x shard = {world_size} (one of {options}), e.g. --set trainer.strategy_options.replicate=1"
            )
        return r, s
