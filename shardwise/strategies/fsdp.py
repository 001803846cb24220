"""``zero2``, ``zero3`` / ``fsdp`` and ``hsdp``: sharded data parallel on FSDP2 (``fully_shard``).

FSDP2 (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
VLDB 2023; per-parameter DTensor sharding since torch 2.4) stores each parameter as a DTensor
sharded on dim 0 across the shard group. Before a unit's forward it all-gathers the unit's
parameters; after backward it reduce-scatters the gradients, so each rank keeps only its
shard of every gradient, and the optimizer, built on the sharded parameters, keeps only its
shard of the state. That is ZeRO stage 3 (Rajbhandari et al., SC 2020). The stages differ in
what stays whole:

======= ========================================== ==========================================
stage   at rest (between steps)                    at peak (inside a step)
======= ========================================== ==========================================
zero2   params whole (re-gathered after each step)  + the shard the optimizer steps (master)
        grads, optimizer state: 1/N                 + one unit's unsharded gradient in backward
zero3   params, grads, optimizer state: 1/N         + one or two units' gathered params and
                                                    one unit's unsharded gradient
hsdp    as zero3 within a shard group of S ranks,   as zero3; gradients are reduce-scattered
        replicated across R = world / S groups      in the group, then allreduced across groups
======= ========================================== ==========================================

zero2 is ``fully_shard(reshard_after_forward=False)`` with resharding after backward off too,
so the gathered parameters outlive the step; after ``optimizer.step()`` (a step post-hook) the
updated shards are gathered again, which is the all-gather ZeRO-2 does after its step. HSDP is
``fully_shard(mesh=2D DeviceMesh)`` with dims ``(replicate, shard)``; the old
``FullyShardedDataParallel`` is not used (its HYBRID_SHARD without an explicit mesh skips the
gradient sync across groups).

Checkpoints are sharded: `state_dict` returns DTensors keyed by parameter name (optimizer state
too, through ``torch.distributed.checkpoint.state_dict``), and the engine writes them with
``torch.distributed.checkpoint``; they load at any world size and under any strategy.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint import optimizer_state_by_name, parameter_names
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.precision import Precision
from shardwise.strategies.common import accumulate_backward
from shardwise.strategies.protocol import OptimizerFactory, StepFn
from shardwise.strategies.zero import ModelStateProbe, require_trainable

_MP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


# -- which modules become FSDP units ---------------------------------------------------------


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def auto_wrap_units(model: nn.Module, min_fraction: float = 0.05) -> list[str]:
    """Names of the submodules to shard as their own units (the root is always one).

    A model with a ``ModuleList`` of blocks (transformers, ResNet stages) gets one unit per
    block of the largest such list: gathering one block at a time bounds the peak to a block.
    Otherwise the root's large children (at least ``min_fraction`` of the parameters) are
    units, looking through containers that hold a single child with parameters
    (``Model.net = Sequential(...)``).
    """
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if lists:
        name, blocks = max(lists, key=lambda item: _numel(item[1]))
        if _numel(blocks) > 0:
            return [f"{name}.{i}" for i, b in enumerate(blocks) if _numel(b) > 0]
    prefix, node = "", model
    while True:
        with_params = [(n, c) for n, c in node.named_children() if _numel(c) > 0]
        if len(with_params) != 1:
            break
        prefix, node = f"{prefix}{with_params[0][0]}.", with_params[0][1]
    total = max(_numel(model), 1)
    return [f"{prefix}{n}" for n, c in node.named_children() if _numel(c) >= min_fraction * total]


def resolve_units(model: nn.Module, wrap: str | Sequence[str]) -> list[str]:
    """``wrap``: ``"auto"``, ``"root"`` (one unit), or submodule names / class names to shard as units."""
    if wrap == "auto":
        return auto_wrap_units(model)
    if wrap == "root":
        return []
    wanted = [wrap] if isinstance(wrap, str) else list(wrap)
    names = [n for n, m in model.named_modules() if n and (n in wanted or type(m).__name__ in wanted)]
    unknown = [w for w in wanted if not any(n == w or type(model.get_submodule(n)).__name__ == w for n in names)]
    if unknown:
        raise ConfigError(
            f"wrap={wanted!r}: {unknown} match no submodule name or class of {type(model).__name__}; "
            "use 'auto', 'root', or names from model.named_modules() (e.g. 'layers.0') or class names (e.g. 'Block')"
        )
    return names


# -- applying FSDP2 -------------------------------------------------------------------------


def shard_mesh(mesh: Mesh, replicate: int = 1) -> Any:
    """A DeviceMesh over the data-parallel ranks: 1D ``(shard,)``, or 2D ``(replicate, shard)`` for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = mesh.size("dp")
    if dp != mesh.world_size:
        raise ConfigError(f"sharded data parallel composes with pp/tp in a later release; got degrees {mesh.degrees}. Use dp only")
    if replicate == 1:
        return init_device_mesh(mesh.device.type, (dp,), mesh_dim_names=("shard",))
    return init_device_mesh(mesh.device.type, (replicate, dp // replicate), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(
    model: nn.Module,
    device_mesh: Any,
    *,
    units: Sequence[str],
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    offload: bool = False,
) -> nn.Module:
    """``fully_shard`` each unit, then the root (bottom-up, as FSDP2 requires); returns the root.

    ``mixed_precision="bf16"`` all-gathers parameters in bf16 for compute while gradients are
    reduced and master weights kept in fp32 (``MixedPrecisionPolicy``). ``offload`` keeps the
    shards (parameters, gradients, optimizer state) in CPU memory; pinned memory only where
    CUDA exists (without it, pinning raises "Cannot access accelerator device").
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if mixed_precision is not None:
        mp = MixedPrecisionPolicy(param_dtype=_MP_DTYPES[mixed_precision], reduce_dtype=torch.float32)
    off = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for name in sorted(units, key=lambda n: -n.count(".")):  # innermost first
        fully_shard(model.get_submodule(name), mesh=device_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=off)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=off)
    return model


def fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def regather(model: nn.Module) -> None:
    """Drop the gathered parameters and gather the current shards again (zero2, after each step)."""
    for m in fsdp_modules(model):
        m.reshard()
    for m in fsdp_modules(model):
        m.unshard()


# -- state dicts: sharded (DTensor), keyed by parameter name ------------------------------------


def dtensor_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Model (and optimizer) state of a module whose parameters are DTensors (FSDP2, tensor
    parallel), under the original names, as torch.distributed.checkpoint reads and writes it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def is_sharded_state(state: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(v, DTensor) for v in state.values())


class FSDP:
    """Sharded data parallel on FSDP2: ``zero3`` (alias ``fsdp``) by default; see `Zero2` and `HSDP`."""

    name: ClassVar[str] = "zero3"
    reshard_after_forward: ClassVar[bool] = True

    def __init__(self, *, wrap: str | list[str] = "auto", mixed_precision: str | None = None, offload: bool = False) -> None:
        if mixed_precision is not None and mixed_precision not in _MP_DTYPES:
            raise ConfigError(f"mixed_precision must be 'bf16', 'fp16' or None; got {mixed_precision!r}")
        self.wrap, self.mixed_precision, self.offload = wrap, mixed_precision, offload
        self.units: list[str] = []
        self.sharded_params: list[nn.Parameter] = []
        self.shape = (1, 1)  # (replicate, shard) once set up
        self.probe = ModelStateProbe(self.name, 1)

    def _replicate(self, world_size: int) -> int:
        return 1

    def validate(self, world_size: int) -> None:
        if world_size < 1:
            raise ConfigError(f"{self.name} needs at least one process; got a world size of {world_size}")

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not dist.is_initialized():
            raise ConfigError(f"strategy {self.name!r} needs a process group; start the run through shardwise (Trainer, launch, or shardwise run)")
        require_trainable(model, self.name)
        replicate = self._replicate(mesh.world_size)
        self.shape = (replicate, mesh.size("dp") // replicate)
        self.units = resolve_units(model, self.wrap)
        model = apply_fsdp(
            model.to(mesh.device), shard_mesh(mesh, replicate), units=self.units,
            reshard_after_forward=self.reshard_after_forward, mixed_precision=self.mixed_precision, offload=self.offload,
        )
        # The sharded DTensor parameters. Kept: under zero2, model.parameters() returns the
        # gathered compute tensors between steps, and their gradients have moved to these.
        self.sharded_params = list(model.parameters())
        optimizer = make_optimizer(self.sharded_params)
        self.probe = ModelStateProbe(self.name, mesh.size("dp") // replicate)
        self._after_setup(model, optimizer)
        return model, optimizer

    def _after_setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.probe.attach(model, optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard changes the module in place; names stay the user's

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        self.probe.arm()
        return accumulate_backward(model, microbatches, step_fn, precision, no_sync=lambda: self.no_sync(model))

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # Accumulate unsharded gradients locally; the last micro-batch reduce-scatters their sum.
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # Each rank holds a shard of every gradient: the norm of the local shards is not the
        # norm. The DTensor norm is a partial sum of squares; full_tensor() reduces it.
        from torch.distributed.tensor import DTensor

        params = [p for p in self.sharded_params if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        with self._sharded(model):
            return dtensor_state_dict(model, optimizer)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        """Load sharded state (DTensors, from a sharded checkpoint) or full state (plain tensors, from ddp/single)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        full = not is_sharded_state(state["model"])
        options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=False)
        with self._sharded(model):
            set_model_state_dict(model, state["model"], options=options)
            if optimizer is not None and "optimizer" in state:
                osd = state["optimizer"]
                if any(isinstance(k, int) for k in osd.get("state", {})) or any(isinstance(i, int) for g in osd["param_groups"] for i in g["params"]):
                    osd = optimizer_state_by_name(osd, parameter_names(model, optimizer))
                set_optimizer_state_dict(model, optimizer, osd, options=options)

    def _sharded(self, model: nn.Module) -> ContextManager[None]:
        return contextlib.nullcontext()

    def summary(self) -> dict[str, Any]:
        return {"fsdp": {"units": len(self.units) + 1, "replicate": self.shape[0], "shard": self.shape[1],
                         "mixed_precision": self.mixed_precision, "offload": self.offload},
                **self.probe.summary()}


class Zero2(FSDP):
    """ZeRO stage 2: gradients and optimizer state sharded, parameters whole between steps."""

    name: ClassVar[str] = "zero2"
    reshard_after_forward: ClassVar[bool] = False

    def _after_setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for m in fsdp_modules(model):
            m.set_reshard_after_backward(False, recurse=False)
        self._in_state_dict = False
        # Registered before the probe's hook, so the probe sees the parameters gathered again.
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._regather_after_step(model))
        self.probe.attach(model, optimizer, master_copy=True)

    def _regather_after_step(self, model: nn.Module) -> None:
        # Not while a state dict is built or loaded: torch's get_optimizer_state_dict may run a
        # step (zero gradients) to create the state, and it maps parameters to names on the shards.
        if not self._in_state_dict:
            regather(model)

    @contextlib.contextmanager
    def _sharded(self, model: nn.Module) -> Iterator[None]:
        # State dicts are read and written on the shards; the whole parameters are gathered again after.
        for m in fsdp_modules(model):
            m.reshard()
        self._in_state_dict = True
        try:
            yield
        finally:
            self._in_state_dict = False
            regather(model)


class HSDP(FSDP):
    """Hybrid sharded data parallel: shard within groups of ``shard`` ranks, replicate across ``replicate`` groups.

    The default is two replicas (``replicate=2``) when the world size is even and at least 4,
    so a 4-process run is 2 x 2.
    """

    name: ClassVar[str] = "hsdp"

    def __init__(self, *, replicate: int | None = None, shard: int | None = None, wrap: str | list[str] = "auto",
                 mixed_precision: str | None = None, offload: bool = False) -> None:
        super().__init__(wrap=wrap, mixed_precision=mixed_precision, offload=offload)
        for key, value in (("replicate", replicate), ("shard", shard)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"hsdp {key} must be a whole number >= 1; got {value!r}")
        self.replicate, self.shard = replicate, shard

    def _shape(self, world_size: int) -> tuple[int, int]:
        r, s = self.replicate, self.shard
        if r is None and s is None:
            r = 2 if world_size >= 4 and world_size % 2 == 0 else 1
        if r is None:
            r = world_size // s if s and world_size % s == 0 else 0
        if s is None:
            s = world_size // r if r and world_size % r == 0 else 0
        return r, s

    def _replicate(self, world_size: int) -> int:
        return self._shape(world_size)[0]

    def validate(self, world_size: int) -> None:
        super().validate(world_size)
        r, s = self._shape(world_size)
        if r * s != world_size:
            options = ", ".join(f"{d}x{world_size // d}" for d in range(1, world_size + 1) if world_size % d == 0)
            raise ConfigError(
                f"hsdp shape replicate={self.replicate} x shard={self.shard} does not divide the world size {world_size}; "
                f"choose replicate x shard = {world_size} (one of {options}), e.g. --set trainer.strategy_options.replicate=1"
            )
