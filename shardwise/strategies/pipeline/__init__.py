"""``pipeline``: split the model by layers into stages, one group of stages per rank, and run
micro-batches through them on a schedule (GPipe, 1F1B, interleaved 1F1B), on
``torch.distributed.pipelining``. Here: the `Pipeline` strategy (options, plan, the route that
cuts a model) and its run; the package by concern is listed in docs/strategies/pipeline.md,
with the design notes (the split, schedules, the loss, checkpoints, compositions, the bubble).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch.distributed as dist
from torch import nn

from shardwise.comm import Recorder
from shardwise.comm.mesh import Mesh
from shardwise.errors import ConfigError
from shardwise.strategies import materialize
from shardwise.strategies.compose import check_tp_fits, require_tensor_parallel
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Strategy, plan_layout
from shardwise.strategies.pipeline import traced
from shardwise.strategies.pipeline.evaluate import PipelineModule
from shardwise.strategies.pipeline.nested import _plan_blocks, check_layers, check_nested, is_nested, nested_layout, split_blocks
from shardwise.strategies.pipeline.observe import mean, write_timeline
from shardwise.strategies.pipeline.route import Route, _is_transformers, _needs_sample, _prove, _types, provable
from shardwise.strategies.pipeline.run import PipelineRun
from shardwise.strategies.pipeline.schedule import batch_rows, check_rows, check_schedule, concat_batches, split_batch
from shardwise.strategies.pipeline.split import StageModule, balance, sequence_layers, split_layers
from shardwise.strategies.pipeline.split import _register as _register  # importable from here, as before the split

__all__ = [
    "Pipeline",
    "PipelineModule",
    "PipelineRun",
    "StageModule",
    "balance",
    "batch_rows",
    "check_rows",
    "check_schedule",
    "concat_batches",
    "mean",
    "sequence_layers",
    "split_batch",
    "split_layers",
    "write_timeline",
]


# -- the strategy: options and plan ----------------------------------------------------------------


@dataclass(frozen=True)
class Pipeline(Strategy):
    """Pipeline parallelism over the mesh's ``pp`` dimension (tensor parallel inside, data parallel outside).

    Every stage's timing reaches every rank with the step's loss (one small all-gather per step),
    so the run's ``summary()`` is local; with ``timeline`` set, ``finish()`` gathers the last
    step's events to rank 0 (every rank calls it; the Trainer does).

    >>> Pipeline(pp=4, microbatches=8, schedule="interleaved").num_stages
    8
    """

    name: ClassVar[str] = "pipeline"
    compile_unit: ClassVar[str] = "stages"  # each stage runs its blocks compiled; the model is never called whole
    shards_meta: ClassVar[bool] = True  # split on the meta model, then each rank fills its own stages
    whole_model: ClassVar[bool] = False

    pp: int = 2
    """Pipeline stages, one per rank along the mesh's pp dimension."""
    microbatches: int | None = None
    """Micro-batches each rank's batch is cut into per step (default: pp)."""
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """Order of the micro-batches' forwards and backwards: gpipe, 1f1b, or interleaved (1F1B over virtual stages)."""
    virtual_stages: int | None = None
    """Model chunks per rank, interleaved only (default 2 there, 1 otherwise)."""
    split_points: tuple[str, ...] | None = None
    """Layer (or block) names that start stages 1, 2, ... (default: stages balanced by parameter count)."""
    tp: int = 1
    """Tensor-parallel degree inside each stage."""
    dp_strategy: Literal["ddp", "fsdp"] = "ddp"
    """How each stage's data-parallel replicas stay in sync: ddp (one gradient allreduce per step) or fsdp (FSDP2)."""
    timeline: str | None = None
    """A PNG path: the last step's forward and backward actions, one row per rank (events as JSON next to it)."""
    warmup_steps: int = 1
    """Steps left out of the measured bubble."""
    sequence_parallel: bool = False
    """With tp > 1: shard norms and dropout along the sequence."""
    tp_plan: dict[str, str] | None = None
    """With tp > 1: module-name pattern -> split style, instead of the model's own or the automatic plan."""
    layers: str | None = None
    """Dotted path of a nested model's block list (model.layers); found by itself when not given."""

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.virtual_stages is None:
            put("virtual_stages", 2 if self.schedule == "interleaved" else 1)
        if self.microbatches is None:
            put("microbatches", self.pp)
        check_schedule(self.schedule, self.pp, self.microbatches, self.virtual_stages)  # type: ignore[arg-type]
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"tp must be a whole number >= 1; got {self.tp!r}")
        if self.dp_strategy not in ("ddp", "fsdp"):
            raise ConfigError(f"dp_strategy must be 'ddp' or 'fsdp'; got {self.dp_strategy!r}")
        points = self.split_points
        if isinstance(points, str):
            points = [s for s in points.split(",") if s]
        if points is not None and not all(isinstance(p, str) for p in points):
            raise ConfigError(f"split_points must be layer names (e.g. ['blocks.2'] or 'blocks.2,blocks.4'); got {self.split_points!r}")
        put("split_points", tuple(points) if points else None)
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be true or false; got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1 (it shards activations across the tensor-parallel ranks)")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be a whole number >= 0; got {self.warmup_steps!r}")
        if self.tp_plan is not None and not isinstance(self.tp_plan, Mapping):
            raise ConfigError(f"tp_plan must map module-name patterns to split styles (e.g. {{'blocks.*.attn.q': 'colwise'}}); got {self.tp_plan!r}")
        put("timeline", self.timeline or None)
        put("layers", self.layers or None)

    @property
    def num_stages(self) -> int:
        """Stages over all ranks: ``pp x virtual_stages``."""
        return self.pp * int(self.virtual_stages or 1)

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        """``pp`` and ``tp`` on the mesh (``dp``: what the world leaves); refuses a batch per rank that
        does not cut into ``microbatches`` and a model `split` refuses. Pure."""
        if self.tp > 1:
            require_tensor_parallel()  # a clear error when the tensor-parallel package is not available
        layout = plan_layout(self.name, world_size, batch=batch, mesh=mesh, own={"pp": self.pp, "tp": self.tp})
        if batch is not None and layout.micro_batch is not None:
            micro = layout.micro_batch
            check_rows(micro * batch.accumulate, int(self.microbatches or 1), f"micro-batch {micro} x accumulate {batch.accumulate}")
        if model is not None:
            self.route(model, check=False)  # the proof of a split the tracer did not give waits for check_sample's batch
            if self.tp > 1:
                layout = replace(layout, units=self._tp_linears(model))
        return layout

    def _tp_linears(self, model: nn.Module) -> tuple[str, ...] | None:
        """The linears tensor parallelism splits across the stages (the plan resolved on the whole
        model, as each stage resolves its share): what the planner counts for tp's per-linear cost and
        allreduces, each repeated per micro-batch. None when the whole model does not resolve (the
        stages are checked one by one in `apply`)."""
        try:
            return check_tp_fits(model, self.tp_plan, self.tp, self.sequence_parallel, self.dp_strategy)
        except ConfigError:
            return None

    def split(self, model: nn.Module, sample: Any = None) -> list[list[str]]:
        """The layer (or block) names of each of the ``pp x virtual_stages`` stages, as ``apply`` will
        cut ``model``; a `ConfigError` for a model this pipeline cannot split: a forward the tracer
        cannot take and whose other split is not proven equal to it on ``sample`` (see `route`),
        fewer layers (blocks) than stages, ``split_points`` that do not name them in order, an
        encoder-decoder model, BatchNorm with more than one micro-batch, weights tied across stages
        under ``dp_strategy="fsdp"``. Pure."""
        return self.route(model, sample).names

    def check_sample(self, model: nn.Module, batch: Any, layout: Layout) -> None:
        """Prove the split on one sample of the training data (in the parent, before launch): the
        stages, run one after another on a float64 copy, equal the model's forward exactly. The
        sample travels with the strategy to the workers, whose `apply` proves it again."""
        self.route(model, batch)
        object.__setattr__(self, "_sample", batch)  # not an option: the sample `apply` checks again

    def route(self, model: nn.Module, sample: Any = None, *, check: bool = True) -> Route:
        """How ``model`` is split (`Route`), checked; ``sample`` (a batch as the loader gives it)
        proves a split the tracer did not give. ``check=False`` (``plan``, which has no sample) leaves
        that proof to `check_sample`.

        transformers' models (and models with a pipeline plan) are split by their block list, as
        they always were. A model the block-list split would take (``layers=``, tied weights, a
        list of repeated blocks) keeps it where the stages, run on ``sample`` in float64, give the
        model's output exactly. Otherwise the forward is traced (`traced`): a forward that is its
        layers in order is the plain sequence, any other is cut as traced. A forward the tracer
        cannot take is split by its top-level children only when ``sample`` proves it; without a
        sample (an `Engine` given none), or when the proof fails, it is refused, naming why."""
        if _is_transformers(model) or _plan_blocks(model) is not None:
            r = self._nested_route(model)
            if check and sample is not None and provable(model):
                # a backstop: a family whose forward does between its blocks what the stages do not (a per-layer
                # input from a prelude module, a block picked by position) is refused here, never trained wrong
                _prove(model, r, sample, "its block list", eval_mode=True)
            return r
        if self.layers:
            check_layers(model, self.layers)  # a wrong path is the user's mistake, said as such, never traced around
        gm: Any = None
        why = ""
        refused: ConfigError | None = None
        try:
            gm = traced.trace(model)
        except traced.TraceFailure as failure:
            why = f"torch.fx cannot trace its forward ({failure})"
        if self.layers or is_nested(model, None):
            where = f"layers={self.layers!r}" if self.layers else "its block list"
            try:
                r = self._nested_route(model)
                if not check:
                    return r
                if sample is not None:
                    _prove(model, r, sample, where + (f" ({why})" if why else ""))
                    return r
            except ConfigError as exc:
                if gm is None:
                    raise ConfigError(f"{exc} ({why})") from None
                refused = exc
            if gm is None:
                raise _needs_sample(model, why, where)
        if gm is not None:
            try:
                return self._traced_route(model, gm, sample, check)
            except ConfigError:
                if refused is not None:
                    raise refused from None  # neither split: the block list's reason is the one to read
                raise
        where = "its top-level children in order"
        try:
            r = self._sequence_route(model)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({why})") from None
        if not check:
            return r
        if sample is None:
            raise _needs_sample(model, why, where)
        _prove(model, r, sample, f"{where} ({why})")
        return r

    def _nested_route(self, model: nn.Module) -> Route:
        layout = nested_layout(model, self.layers)
        check_nested(model, layout, self.num_stages, int(self.microbatches or 1))
        runs = split_blocks(model, layout, self.num_stages, self.split_points)
        if layout.aliases and self.dp_strategy == "fsdp":
            raise ConfigError(
                f"{type(model).__name__} ties {', '.join(f'{a} to {c}' for a, c in layout.aliases.items())}; with the "
                "tied ends on different pipeline stages shardwise sums their gradients itself, which it does for "
                "dp_strategy='ddp' but not under FSDP's sharded gradients; use dp_strategy='ddp'"
            )
        return Route("nested", [[f"{layout.blocks}.{k}" for k in run] for run in runs], layout=layout, block_runs=runs)

    def _sequence_route(self, model: nn.Module) -> Route:
        runs = split_layers(sequence_layers(model), self.num_stages, self.split_points)
        return Route("sequence", [[n for n, _ in run] for run in runs])

    def _traced_route(self, model: nn.Module, gm: Any, sample: Any, check: bool) -> Route:
        if traced.is_chain(gm) and not any(True for _ in model.named_parameters(recurse=False)) and not any(True for _ in model.named_buffers(recurse=False)):
            return self._sequence_route(model)  # the forward is its layers in order: nothing between them
        if self.tp > 1:
            raise ConfigError(
                f"pipeline with tp={self.tp}: {type(model).__name__}'s forward has code between its layers, so its stages are "
                "cut from the traced forward, and tensor parallelism inside such stages is not supported; use tp=1, or "
                "a model whose forward applies its layers in order (or a transformers model)"
            )
        from shardwise.data.batches import model_args

        if sample is not None:
            args, kwargs = model_args(sample)
            if kwargs:
                raise ConfigError(
                    f"{type(model).__name__} is split by its traced forward, whose stages take positional inputs; the batch "
                    f"is a dict ({sorted(kwargs)}): use a tuple batch (inputs..., target)"
                )
            model64 = traced.float64_copy(model)
            gm64 = traced.trace(model64)
            args64 = traced.to_float64(tuple(args))
            plan = traced.plan_stages(gm64, self.num_stages, self.split_points, _types(gm64, args64, model64))
        else:
            plan = traced.plan_stages(gm, self.num_stages, self.split_points, traced.static_types(gm))
        mods: dict[int, nn.Module] = {s: traced.stage_module(gm, plan, s) for s in range(self.num_stages)}  # no copies: the model's own tensors
        ties = traced.cross_stage_ties(model, mods, self.pp)
        r = Route("traced", plan.runs, plan=plan, stage_mods=mods, ties=ties)
        if self.dp_strategy == "fsdp" and ties:
            raise ConfigError(
                f"{type(model).__name__} uses {', '.join(t.name for t in ties)} on stages of different "
                "pipeline ranks; shardwise sums such a weight's gradients itself, which it does for dp_strategy='ddp' but not "
                "under FSDP's sharded gradients; use dp_strategy='ddp'"
            )
        if sample is not None and check and not materialize.has_meta(model):  # on meta tensors there are no values to compare
            stages = [traced.stage_module(gm64, plan, s) for s in range(self.num_stages)]
            order = [n for run in plan.runs for n in run]
            stage_of = {n: s for s, run in enumerate(plan.runs) for n in run}
            traced.check_composition(model64, args64, {}, stages, lambda: traced.run_in_turn(stages, args64, {}, False), order, stage_of, "its traced forward")
        return r

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> PipelineRun:
        if not dist.is_initialized():
            raise ConfigError("strategy 'pipeline' needs a process group; start the run with nproc >= pp through shardwise (Trainer, launch, or shardwise run)")
        if mesh.size("pp") != self.pp or mesh.size("tp") != self.tp:
            raise ConfigError(f"the mesh has pp={mesh.size('pp')} x tp={mesh.size('tp')} but the pipeline was asked for pp={self.pp} x tp={self.tp}")
        return PipelineRun(self, model, make_optimizer, mesh, recorder)
