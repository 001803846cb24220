"""The contract every strategy meets: plan in the parent, apply in each process.

A strategy is a small frozen dataclass of typed options (``DDP(bucket_cap_mb=25)``). Each
field's docstring is its help text: the CLI flags and TOML keys are generated from the
fields (`shardwise.strategies.options`). Two methods, in this order:

- ``plan(world_size, model=None, batch=None, mesh=None) -> Layout`` runs once, before any
  process starts (the Trainer's and the launcher's parent, the planner for every
  candidate). It is pure: no process group, no side effect. It returns the mesh degrees,
  which ranks train and which serve, the data mesh, the ranks whose loss the run survives,
  and it raises `ConfigError` for every refusal it can know then (a world size the layout
  does not divide, an indivisible batch, too few micro-batches, a model it cannot split).
- ``apply(model, make_optimizer, mesh, recorder) -> Parallel`` runs once per process: it
  places and wraps the model, builds the optimizer on the parameters this rank keeps, and
  returns the per-run object the engine drives.

`Parallel` has no optional methods: a strategy with nothing to do for a hook says so in one
line (``def after_step(self, step: int) -> None: return None  # replicas are synchronized in backward``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm.collectives import WORLD, Group
from shardwise.comm.mesh import DIM_ORDER, Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies.precision import Precision

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""Builds the optimizer from parameters (``lambda params: torch.optim.Adam(params, lr=1e-3)``).
Strategies that shard call it after wrapping, on the parameters they keep."""

StepFn = Callable[[nn.Module, Any], torch.Tensor]
"""Runs forward on one micro-batch through the wrapped model and returns the loss."""


@dataclass(frozen=True)
class Batch:
    """The batch a run asks for, as the plan sees it: samples per optimizer step over every
    data-parallel rank, and how many loader micro-batches each rank accumulates per step."""

    global_batch: int
    accumulate: int = 1


@dataclass(frozen=True)
class Layout:
    """Everything a strategy decides before any process starts (``Strategy.plan``)."""

    strategy: str
    """The strategy's registered name."""
    world_size: int
    """Processes in the job."""
    degrees: Mapping[str, int]
    """Mesh degrees over the whole world (``dp``, ``pp``, ``tp``): what each process's `Mesh` is built from."""
    trainers: int
    """Ranks that run the training loop (the world, less the ranks that serve)."""
    data_parallel: int
    """How many ways each global batch is split: the size of the data mesh's ``dp`` dimension."""
    servers: tuple[int, ...] = ()
    """Ranks that serve instead of training (parameter servers)."""
    expendable: tuple[int, ...] = ()
    """Ranks whose death the run survives (asynchronous workers other than rank 0)."""
    micro_batch: int | None = None
    """Samples per loader micro-batch on one rank, when the plan was given the batch."""
    units: tuple[str, ...] | None = None
    """Submodules the strategy wraps or splits one by one, when the plan was given the model (FSDP's
    sharded units, the root not counted; the linears tensor parallelism splits, alone or inside a
    pipeline's stages): what its per-step work repeats over (`shardwise.strategies.cost.estimate.framework_units`)."""

    def describe(self) -> str:
        """One line: ``ddp on 4 processes: dp4 (micro-batch 8)``."""
        mesh = " x ".join(f"{d}{self.degrees[d]}" for d in DIM_ORDER if d in self.degrees)
        serve = f", {len(self.servers)} serving" if self.servers else ""
        micro = f" (micro-batch {self.micro_batch})" if self.micro_batch is not None else ""
        return f"{self.strategy} on {self.world_size} processes: {mesh}{serve}{micro}"


def merge_degrees(strategy: str, own: Mapping[str, int], requested: Mapping[str, int] | None) -> dict[str, int]:
    """The mesh degrees a strategy asks for (pipeline ``pp``, tensor ``tp``) merged with the ones a
    user set directly (``mesh={...}``); a conflict is a `ConfigError`. ``dp`` is left out unless
    given: it is whatever the world size leaves."""
    merged = {k: int(v) for k, v in (requested or {}).items()}
    unknown = sorted(set(merged) - set(DIM_ORDER))
    if unknown:
        raise ConfigError(f"unknown mesh dimension(s) {unknown}; the mesh has {', '.join(DIM_ORDER)} (e.g. mesh={{'tp': 2}})")
    for key, value in own.items():
        if key in merged and merged[key] != int(value):
            raise ConfigError(f"strategy {strategy!r} asks for {key}={value} but the mesh settings say {key}={merged[key]}")
        merged[key] = int(value)
    return merged


def plan_layout(
    strategy: str,
    world_size: int,
    *,
    batch: Batch | None = None,
    mesh: Mapping[str, int] | None = None,
    own: Mapping[str, int] | None = None,
    servers: int = 0,
    expendable: Sequence[int] = (),
    micro_multiple: int = 1,
) -> Layout:
    """The common part of every plan: the mesh over the training ranks and the batch split.

    ``own`` holds the degrees the strategy asks for, ``servers`` the ranks kept out of the loop
    (the last ``servers`` ranks). The mesh shape and the batch are checked with the errors a
    user sees (the valid shapes; the batch sizes that divide).
    """
    from shardwise.data import per_rank_batch

    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"{strategy} needs a world size >= 1; got {world_size!r}")
    degrees = merge_degrees(strategy, own or {}, mesh)
    trainers = world_size - servers
    # raises with the valid shapes; no process group (merge_degrees keeps only dp, pp and tp)
    shape = Mesh.build(world_size=trainers, dp=degrees.get("dp"), pp=degrees.get("pp", 1), tp=degrees.get("tp", 1))
    dp = shape.size("dp")
    micro = None
    if batch is not None:
        micro = per_rank_batch(batch.global_batch, dp, batch.accumulate)
        if micro_multiple > 1 and (micro * batch.accumulate) % micro_multiple:
            rows = micro * batch.accumulate
            raise ConfigError(
                f"{strategy}: each rank's {rows} samples per step (micro-batch {micro} x accumulate {batch.accumulate}) "
                f"do not split into {micro_multiple} micro-batches; choose a global batch whose per-rank share is a multiple of {micro_multiple}"
            )
    return Layout(
        strategy=strategy,
        world_size=world_size,
        degrees=dict(shape.degrees) if servers == 0 else degrees,
        trainers=trainers,
        data_parallel=dp,
        servers=tuple(range(trainers, world_size)),
        expendable=tuple(expendable),
        micro_batch=micro,
    )


class Strategy(ABC):
    """How a model is placed, wrapped and synchronized across processes.

    Subclasses are frozen dataclasses whose fields are the options (each with a docstring:
    the help of its CLI flag); ``__post_init__`` refuses a bad value with a `ConfigError`.
    The trainer and engine call only ``plan`` and ``apply``, so a new strategy plugs in by
    registering a name, without touching them.
    """

    name: ClassVar[str]
    # Whether a step may hold fewer samples than the global batch exactly (drop_last=False: an epoch's
    # smaller last batch, its micro-batch losses weighted by their share): true where the step's
    # micro-batches go through the step function in order and every data-parallel rank's gradient is
    # averaged (not pipelines' fixed micro-batches, parameter servers or replicas). A comment, not a
    # docstring: docstrings under a strategy's attributes are its options' CLI help.
    smaller_last_batch: ClassVar[bool] = False
    shards_meta: ClassVar[bool] = False  # apply takes a meta-built model and fills this rank's share (materialize.fill_share)
    needs_process_group: ClassVar[bool] = True  # runs in a process group even alone: the Trainer starts one worker for it at nproc=1
    whole_model: ClassVar[bool] = True  # every training rank holds the whole model (what rewrites weights in place, such as pruning, needs)
    compile_unit: ClassVar[str] = "model"  # what compile='on' compiles: "model" (after apply), "blocks" (before), "stages" (blocks only), "none"
    compile_refusal: ClassVar[str] = ""  # why, where compile_unit is "none"

    @abstractmethod
    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        """Decide the layout for ``world_size`` processes, or refuse with a `ConfigError`. Pure."""

    @abstractmethod
    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> Parallel:
        """Place and wrap the model on this process, build its optimizer, return the run's `Parallel`."""

    def check_precision(self, precision: str, layout: Layout) -> None:
        """Refuse, with a `ConfigError`, a precision this strategy cannot train in under ``layout``
        (called in the parent before launch, and by the Engine). Every precision runs by default."""
        return None

    def check_sample(self, model: nn.Module, batch: Any, layout: Layout) -> None:
        """Refuse, with a `ConfigError`, a model this strategy would fail on with ``batch`` (one sample
        of the training data, collated as the loader does), called by the Trainer in the parent
        before launch. A strategy may run the model on it there (tp rehearses its split on meta
        tensors); nothing by default."""
        return None

    def options(self) -> dict[str, Any]:
        """The options as plain values (for summary.json and the resolved config)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} if dataclasses.is_dataclass(self) else {}


@dataclass(frozen=True)
class Placement:
    """Where the training loop runs on this process once ``apply`` returned."""

    trains: bool = True
    """False on a rank that does not run the training loop (it served inside ``apply``)."""
    mesh: Mesh | None = None
    """The training ranks' mesh, for evaluation, logging and checkpoints (None: the engine's mesh)."""
    group: Group = field(default_factory=lambda: WORLD)
    """The group the loop's own collectives (logged loss, evaluation, checkpoints) run over."""
    steps_together: bool = True
    """Whether the loop's ranks take every optimizer step together (data, tensor and pipeline parallel,
    synchronous parameter servers), so a per-step verdict (the non-finite check) is agreed over
    ``group``; False where each rank steps alone between rounds (local SGD, DiLoCo, gossip)."""
    data_mesh: Mesh | None = None
    """The mesh each global batch is split over, when it differs from the loop's (asynchronous
    parameter-server workers loop alone yet each takes its slice of every batch). None: the loop's."""


class Parallel(ABC):
    """One run of a strategy on one process: the wrapped model, its optimizer, and every per-run
    method the engine calls. Built once per run by ``Strategy.apply``."""

    model: nn.Module
    """What the loop calls (the wrapper ``apply`` built)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over the parameters this rank keeps."""
    placement: Placement = Placement()

    @abstractmethod
    def module(self) -> nn.Module:
        """The user's module inside the wrapper."""

    @abstractmethod
    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        """Forward and backward over one step's micro-batches; returns the mean loss (detached)."""

    @abstractmethod
    def no_sync(self) -> AbstractContextManager[None]:
        """Skip gradient synchronization inside the block (accumulation)."""

    @abstractmethod
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip gradients by their global norm (across every shard) and return that norm."""

    @abstractmethod
    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` under the original module's names (optimizer only when asked)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict`` (the optimizer loads when ``state`` holds one)."""

    @abstractmethod
    def after_step(self, step: int) -> None:
        """After every optimizer step (``step`` counts them, 1 after the first), skipped fp16 step or not."""

    @abstractmethod
    def save_extra_state(self, directory: Path) -> None:
        """Write the state the model and optimizer do not hold into a checkpoint's temporary directory."""

    @abstractmethod
    def load_extra_state(self, path: Path) -> None:
        """Inverse of ``save_extra_state``, after the model and optimizer are loaded."""

    @abstractmethod
    def finish(self) -> None:
        """End of the run, on every rank once: collective reports are gathered, servers stop. Idempotent."""

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """This strategy's section of summary.json; a pure report (call after ``finish``)."""

    def state_part(self, optimizer: bool) -> dict[str, Any] | None:
        """For a checkpoint written in parts (`shardwise.checkpoint.parts`), on every rank (may be collective):
        ``{"part": this rank's {"model", "optimizer"} or None (a replica of another rank's), "ranks": the ranks
        whose parts make the whole, "names": the whole model's parameter names, "order": its state-dict keys}``.
        None (the default): ``state_dict`` gives the whole state, or DTensor shards."""
        return None

    def held_state_bytes(self) -> int:
        """Bytes of training state this rank keeps outside the model and its optimizer (DiLoCo's
        outer copy of the parameters and its outer momentum); 0 for most strategies. ``shardwise
        plan --validate`` adds it to the optimizer state it measures."""
        return 0
