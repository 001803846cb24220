"""``zero2``, ``zero3`` / ``fsdp`` and ``hsdp``: sharded data parallel on FSDP2 (``fully_shard``).

The strategies and their runs; the stages, what each keeps whole, the collectives they send and
the design notes: docs/strategies/sharded.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
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
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.errors import ConfigError
from shardwise.strategies import materialize
from shardwise.strategies.common import accumulate_backward
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.precision import Precision
from shardwise.strategies.sharded.zero1 import ModelStateProbe, require_dp_only, require_process_group, require_trainable

_MP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
MixedPrecision = Literal["bf16", "bfloat16", "fp16", "float16"]
"""The parameter dtypes FSDP2 may all-gather in for compute (gradients are reduced in fp32)."""


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
            return [f"{name}.{i}" for i, b in enumerate(blocks) if _numel(b) > 0] + _large_leaves(model, name, min_fraction)
    prefix, node = "", model
    while True:
        with_params = [(n, c) for n, c in node.named_children() if _numel(c) > 0]
        if len(with_params) != 1:
            break
        prefix, node = f"{prefix}{with_params[0][0]}.", with_params[0][1]
    total = max(_numel(model), 1)
    return [f"{prefix}{n}" for n, c in node.named_children() if _numel(c) >= min_fraction * total]


def _large_leaves(model: nn.Module, blocks: str, min_fraction: float) -> list[str]:
    """Modules outside the block list that hold their own large weights (an untied embedding, the head):
    units of their own, so each is gathered only while it runs, not for the whole step with the root
    (a 32000-word Llama's embedding and head are a third of its parameters). A weight shared with another
    module (a tied head) stays with the root: one unit must own it."""
    total = max(_numel(model), 1)
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    out: list[str] = []
    for n, m in model.named_modules():
        if not n or n == blocks or n.startswith(blocks + ".") or not any(True for _ in m.parameters(recurse=False)):
            continue
        own = list(m.parameters())
        if sum(p.numel() for p in own) >= min_fraction * total and all(owners.get(id(p), 0) == 1 for p in own) and not any(n.startswith(u + ".") for u in out):
            out.append(n)
    return out


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


# -- recording what FSDP2 sends ------------------------------------------------------------


class _Untimed:
    """Passes events to the run's `Recorder` without seconds: FSDP2's collectives run
    asynchronously inside it, so the time of a call is not observed (None, not 0)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def add(self, event: CommEvent) -> None:
        self.recorder.add(dataclasses.replace(event, seconds=None))


_FSDP_C10D_OPS = frozenset({"_allgather_base_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"})
"""The c10d operators FSDP2 issues for its all-gathers and reduce-scatters (HSDP's allreduce is
``allreduce_`` over the replicate group)."""


def _fsdp_counter(counter: type, replicate_group: str | None, fsdp_ops: bool = True) -> type:
    """The counting mode of `shardwise.strategies.tensor_parallel.counting`, narrowed to what
    FSDP2 and DTensor send, so that no byte is recorded twice or missed:

    - A collective sent through `shardwise.comm` inside a recorded block (SyncBatchNorm's
      statistics, a loss that averages across ranks) is recorded by comm itself: of the c10d
      operators only FSDP2's own are taken (its all-gathers and reduce-scatters, and under hsdp
      the allreduce over the replicate group), and none with ``fsdp_ops`` off (FSDP2's own are then
      recorded where FSDP2 issues them, `CollectiveTraffic.hook`). DTensor's functional
      collectives are all taken.
    - A dispatch mode sees an operator before a tensor subclass does, so the collectives DTensor
      issues while it runs an operator (the allreduce of a sharded gradient norm's partial sums)
      would run under the mode's handler, where the mode is off, and go unseen. Declining
      DTensor's operators (``NotImplemented``, as torch's CommDebugMode does) hands them to
      DTensor, whose collectives then reach the mode.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def group_of(args: Any) -> str | None:
        for a in args[1:]:
            if isinstance(a, dist.ProcessGroup):
                return a.group_name
            if type(a).__name__ == "ScriptObject":  # c10d operators see the group boxed
                try:
                    return dist.ProcessGroup.unbox(a).group_name
                except Exception:  # noqa: BLE001 - a boxed ReduceOp, not a group
                    continue
        return None

    class FSDPCounter(counter):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _record(self, kind: str, func: Any, args: Any) -> None:
            if func.namespace == "c10d":
                op = func._schema.name.split("::")[-1]
                fsdp_allreduce = op == "allreduce_" and replicate_group is not None and group_of(args) == replicate_group
                if not fsdp_ops or (op not in _FSDP_C10D_OPS and not fsdp_allreduce):
                    return  # sent through shardwise.comm, which records it, or recorded at FSDP2's source
            super()._record(kind, func, args)

    return FSDPCounter


class _Phase:
    """The phase FSDP2's collectives are recorded under (None: forward, or backward inside an autograd node)."""

    def __init__(self, phase: str | None = None) -> None:
        self.phase = phase


_MODE_PHASES = frozenset({"clip", "checkpoint"})
"""Phases whose collectives DTensor issues (a sharded norm's partial sums, state-dict gathers):
seen by the dispatch mode. FSDP2's own all-gathers, reduce-scatters and allreduces are recorded
where FSDP2 calls them (`CollectiveTraffic.hook`), with no per-operator cost."""


class CollectiveTraffic:
    """Records the collectives FSDP2 issues on the run's `Recorder`, by group label, and counts
    them by ``(group, kind, phase)``.

    FSDP2 calls c10d itself (all-gathers before forward and backward, reduce-scatters after
    backward, the allreduce across HSDP's replicas). ``hook(model)`` records them at the source:
    each unit's all-gather and reduce-scatter go through recording versions of FSDP2's default
    communication objects (``set_custom_all_gather`` / ``set_custom_reduce_scatter``, the
    tensors actually handed to c10d, padded shards included), and HSDP's allreduce is recorded
    by FSDP2's all-reduce hook with the reduced shard. That costs nothing per operator. Where
    this torch lacks those methods, or a unit holds more than one parameter group, the dispatch
    mode of `shardwise.strategies.tensor_parallel.counting` sees each c10d operator instead (a
    Python call per operator). DTensor's own collectives (clipping's norm, checkpoints) are
    always seen by that mode, in the phases that issue them.

    ``phase(name)`` names the collectives of a block; blocks nest (an inner one, e.g. a forward
    inside ``forward_backward``, adds nothing). With ``enabled`` off nothing is recorded and no
    operator pays the mode's Python call.
    """

    def __init__(self, recorder: Recorder | None, groups: Mapping[str, Any], enabled: bool = True) -> None:
        from shardwise.strategies.tensor_parallel.counting import _collective_counter_mode, group_names

        self.recorder = _Untimed(recorder) if recorder is not None else None
        self.names = group_names(**groups)
        self.enabled = enabled
        self.counts: Counter[tuple[str, str, str]] = Counter()
        replicate = groups.get("replicate")
        self._replicate = replicate.group_name if replicate is not None else None
        self._counter = _collective_counter_mode() if enabled else None
        self._mode_class = _fsdp_counter(self._counter, self._replicate) if self._counter is not None else None
        self.hooked = False
        """Whether FSDP2's own collectives are recorded at the source (`hook`), not by the mode."""
        self._state: _Phase | None = None
        self._active: Any = None
        self._hook_blocks: list[contextlib.ExitStack] = []

    def hook(self, model: nn.Module) -> None:
        """Record every FSDP2 unit's collectives where FSDP2 issues them (see the class)."""
        modules = fsdp_modules(model)
        if self._counter is None or not modules:
            return
        if not all(hasattr(m, "set_custom_all_gather") and hasattr(m, "set_custom_reduce_scatter") for m in modules):
            return  # an older torch: the mode sees FSDP2's c10d operators
        # torch before 2.12 holds one group per unit (`_fsdp_param_group`); later ones a list
        if any(len(getattr(m._get_fsdp_state(), "_fsdp_param_groups", ())) > 1 for m in modules):
            return  # per-parameter meshes: FSDP2 takes one custom communication per unit only
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        traffic = self

        class RecordedAllGather(DefaultAllGather):
            def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
                traffic._record("all_gather", group, output_tensor)  # the payload is the gathered buffer
                return super().__call__(output_tensor, input_tensor, group, async_op)

        class RecordedReduceScatter(DefaultReduceScatter):
            def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
                traffic._record("reduce_scatter", group, input_tensor)  # the payload is the whole gradient
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        for m in modules:
            m.set_custom_all_gather(RecordedAllGather())
            m.set_custom_reduce_scatter(RecordedReduceScatter())
            if self._replicate is not None:
                # Called after HSDP's allreduce across the replicas, with the reduced shard (its payload).
                m.set_all_reduce_hook(lambda shard: traffic._record("all_reduce", traffic._replicate, shard))
        self.hooked = True
        self._mode_class = _fsdp_counter(self._counter, self._replicate, fsdp_ops=False)

    def _record(self, kind: str, group: Any, tensor: torch.Tensor) -> None:
        name = group if isinstance(group, str) else group.group_name
        label, size = self.names.get(name, ("other", 1))
        state = self._state
        phase = (state.phase if state is not None else None) or ("backward" if torch._C._current_autograd_node() is not None else "forward")
        self.counts[(label, kind, phase)] += 1
        if self.recorder is not None:
            payload = tensor.numel() * tensor.element_size()
            sent, recv = wire_bytes(kind, payload, size)
            self.recorder.add(CommEvent(kind, label, size, payload, sent, recv, None))

    @contextlib.contextmanager
    def phase(self, name: str | None) -> Iterator[Any]:
        """Record the collectives issued in the block under phase ``name`` (None: forward, or backward
        inside an autograd node); yields an object whose ``phase`` a caller may move (None when off or
        nested)."""
        if self._mode_class is None or self._active is not None:
            yield None
            return
        if self.hooked and name not in _MODE_PHASES:
            state = self._state = _Phase(name)
            self._active = state
            try:
                yield state
            finally:
                self._active = self._state = None
            return
        mode = self._mode_class(self.recorder, self.names)
        mode.phase = name
        self._active = mode
        if self.hooked:
            self._state = mode  # FSDP2's own collectives in the block (none expected) take the mode's phase
        try:
            with mode:
                yield mode
        finally:
            self._active = self._state = None
            self.counts.update(mode.counts)

    def watch_forward(self, module: nn.Module) -> None:
        """Record the collectives of every forward of ``module`` run outside a block (evaluation):
        a pre-hook placed before FSDP2's own (the root's all-gather) opens a block, a hook after
        FSDP2's post-forward closes it, exception or not."""
        if self._mode_class is None:
            return

        def before(mod: nn.Module, args: Any) -> None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.phase("forward" if torch.is_grad_enabled() else "eval"))
            self._hook_blocks.append(stack)

        def after(mod: nn.Module, args: Any, output: Any) -> None:
            if self._hook_blocks:
                self._hook_blocks.pop().close()

        module.register_forward_pre_hook(before, prepend=True)
        module.register_forward_hook(after, always_call=True)

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        """Calls per optimizer step, ``{"group/kind": {phase: calls}}``."""
        out: dict[str, dict[str, float]] = {}
        for (group, kind, phase), n in sorted(self.counts.items()):
            out.setdefault(f"{group}/{kind}", {})[phase] = n / max(steps, 1)
        return out


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
    ) -> None:
        self.model, self.optimizer = model, optimizer
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

            return accumulate_backward(self.model, microbatches, run, precision, no_sync=self.no_sync)

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

        params = [p for p in self.sharded_params if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]  # the same tensors, typed as present
        with self.traffic.phase("clip"):
            total = torch.nn.utils.get_total_norm(grads, foreach=True)
            if isinstance(total, DTensor):
                total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        with self.traffic.phase("checkpoint"), self._sharded():
            return ckpt.dtensor_state_dict(self.model, self.optimizer if optimizer else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load sharded state (DTensors, from a sharded checkpoint) or full state (plain tensors, from ddp/single)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

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

    def __post_init__(self) -> None:
        if self.mixed_precision is not None and self.mixed_precision not in _MP_DTYPES:
            raise ConfigError(f"mixed_precision must be 'bf16', 'fp16' or None; got {self.mixed_precision!r}")
        wrap: Any = self.wrap
        if isinstance(wrap, (list, tuple)) and wrap and all(isinstance(w, str) and w for w in wrap):
            object.__setattr__(self, "wrap", tuple(wrap))  # frozen and hashable: a list from TOML becomes a tuple
        elif not (isinstance(wrap, str) and wrap):
            raise ConfigError(
                f"{self.name}: wrap must be 'auto', 'root', a submodule or class name, or a list of them (e.g. ['layers.0', 'Block']); got {wrap!r}"
            )
        for key in ("offload", "count_collectives"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{self.name}: {key} must be true or false; got {getattr(self, key)!r}")

    def shape(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) over ``world_size`` data-parallel ranks: all in one shard group."""
        return 1, world_size

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        layout = plan_layout(self.name, world_size, batch=batch, mesh=mesh)
        require_dp_only(self.name, layout.degrees)
        self.shape(layout.data_parallel)  # refuses a shape that does not divide the ranks
        if model is not None:
            require_trainable(model, self.name)
            units = resolve_units(model, self.wrap)  # an unknown unit name fails here, in the parent
            layout = dataclasses.replace(layout, units=tuple(units))
        return layout

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> FSDPRun:
        require_process_group(self.name)
        require_trainable(model, self.name)
        require_dp_only(self.name, mesh.degrees)
        replicate, shard = self.shape(mesh.size("dp"))
        units = resolve_units(model, self.wrap)
        device_mesh = shard_mesh(mesh, replicate)
        model = apply_fsdp(
            materialize.to_device(model, mesh.device),
            device_mesh,
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
        probe = ModelStateProbe(self.name, shard)
        run = FSDPRun if self.reshard_after_forward else Zero2Run
        return run(model, optimizer, sharded_params, strategy=self, units=units, shape=(replicate, shard), probe=probe, traffic=traffic)


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
