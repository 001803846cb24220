"""``pipeline``: split the model by layers into stages, one group of stages per rank, and run
micro-batches through them on a schedule (GPipe, 1F1B, interleaved 1F1B), on
``torch.distributed.pipelining``. Here: the `Pipeline` strategy (options, plan, the route that
cuts a model) and its run; the package by concern is listed in docs/strategies/pipeline.md,
with the design notes (the split, schedules, the loss, checkpoints, compositions, the bubble).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Recorder, all_gather
from shardwise.comm.mesh import Mesh
from shardwise.errors import ConfigError
from shardwise.strategies import materialize
from shardwise.strategies.compose import _tensor_parallel, apply_data_parallel, average_grads, clip_grad_norm
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.pipeline import traced
from shardwise.strategies.pipeline.evaluate import _DTYPES, PipelineModule
from shardwise.strategies.pipeline.nested import (
    NestedLayout,
    NestedStage,
    _plan_blocks,
    batch_kwargs,
    check_layers,
    check_nested,
    is_nested,
    nested_layout,
    split_blocks,
    tied_aliases,
)
from shardwise.strategies.pipeline.observe import _Clock, bubble_section, gather_events, mean, record_stage_traffic, write_timeline
from shardwise.strategies.pipeline.schedule import (
    _Replay,
    _schedule_class,
    batch_rows,
    check_rows,
    check_schedule,
    concat_batches,
    keep_buffers_through_inference,
    split_batch,
)
from shardwise.strategies.pipeline.split import StageModule, balance, sequence_layers, split_layers
from shardwise.strategies.pipeline.split import _register as _register  # importable from here, as before the split
from shardwise.strategies.pipeline.state import gather_state, load_local_state, local_part
from shardwise.strategies.pipeline.ties import Tie, _cross_stage_ties, _find_param, sync_tied
from shardwise.strategies.precision import Precision

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


# -- how a model is split ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """How a model is cut into stages: ``nested`` (its block list, `nested`), ``traced`` (its traced
    forward, `traced`) or ``sequence`` (its top-level children in order, `split`)."""

    kind: Literal["nested", "traced", "sequence"]
    names: list[list[str]]
    """The layers (blocks) each stage owns."""
    layout: NestedLayout | None = None
    block_runs: list[list[str]] | None = None
    plan: traced.TracedPlan | None = None
    stage_mods: dict[int, nn.Module] | None = None
    """A traced split's stage modules (over the model's own tensors), built once here and used by ``apply``."""
    ties: list[Tie] | None = None
    """A traced split's weights held by stages of two pipeline ranks."""


def _is_transformers(model: nn.Module) -> bool:
    """A transformers model (any class of its hierarchy defined in the transformers package)."""
    return any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__)


def _types(gm: Any, args: tuple[Any, ...], model64: nn.Module) -> dict[str, bool]:
    """Each node's kind (tensor or not) from one run on the sample; in eval mode where training mode
    cannot take one sample (BatchNorm on one row)."""
    try:
        return traced.node_types(gm, args)
    except Exception:
        model64.eval()
        try:
            return traced.node_types(gm, args)
        except Exception as exc:
            raise ConfigError(f"{type(model64).__name__}'s traced forward raises on a sample batch: {type(exc).__name__}: {exc}") from None
        finally:
            model64.train()


def _needs_sample(model: nn.Module, why: str, where: str) -> ConfigError:
    return ConfigError(
        f"cannot split {type(model).__name__} into pipeline stages: {why}, and splitting it by {where} "
        "is only done once a sample batch proves the stages equal the model's forward; train through the "
        "Trainer (which passes its first sample), build the strategy object, call its check_sample(model, batch, layout) "
        "and give it to Engine(strategy=...), or make the forward traceable (no Python control flow on tensor values or sizes)"
    )


def _prove(model: nn.Module, r: Route, sample: Any, where: str) -> None:
    """The stages of ``r``, on a float64 copy of ``model`` run one after another on ``sample``, give
    the model's own output exactly (`traced.check_composition`), or a `ConfigError` naming where not."""
    from shardwise.data.batches import model_args

    if materialize.has_meta(model):
        raise ConfigError(
            f"{type(model).__name__} was built on the meta device, and the pipeline splits it by {where}: a split the "
            "tracer did not give is used only after its stages, run in float64 on the first training sample, give the "
            "model's output exactly, which needs the model's weights. Build this model eagerly for the pipeline, or make "
            "its forward traceable by torch.fx (no assert or branch on a tensor's size or value), or use another strategy"
        )

    model64 = traced.float64_copy(model)
    args, kwargs = model_args(sample)
    args64, kwargs64 = traced.to_float64(tuple(args)), traced.to_float64(dict(kwargs))
    stage_of: dict[str, int] = {}
    if r.kind == "nested":
        assert r.layout is not None and r.block_runs is not None
        layout, n = r.layout, len(r.block_runs)
        stages: list[nn.Module] = [NestedStage(model64, layout, r.block_runs[s], s == 0, s == n - 1) for s in range(n)]
        stage_of = {name: s for s, run in enumerate(r.names) for name in run} | {p: 0 for p in layout.prelude} | {p: n - 1 for p in layout.postlude}
        order = list(layout.prelude) + [name for run in r.names for name in run] + list(layout.postlude)

        def run() -> Any:
            traced.run_in_turn(stages, (), batch_kwargs(args64, kwargs64), True)
            return stages[-1].output

    else:
        if kwargs:
            raise ConfigError(
                f"{type(model).__name__} is split by its top-level children, which take positional inputs; the batch is a dict ({sorted(kwargs)})"
            )
        runs = split_layers(sequence_layers(model64), len(r.names), [run[0] for run in r.names[1:]])
        stages = [StageModule(run) for run in runs]
        stage_of = {name: s for s, run in enumerate(r.names) for name in run}
        order = [name for run in r.names for name in run]

        def run() -> Any:
            return traced.run_in_turn(stages, args64, {}, False)

    traced.check_composition(model64, args64, kwargs64, stages, run, order, stage_of, where)


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
            _tensor_parallel()  # a clear error when the tensor-parallel package is not available
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
            return tuple(_tensor_parallel().check_model_fits(model, self.tp_plan, self.tp, self.sequence_parallel, self.dp_strategy))
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
            return self._nested_route(model)
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


# -- one run: the stages on this rank, the schedule, the step ----------------------------------------


class PipelineRun(Parallel):
    """This rank's stages (``stage_index % pp == pp coordinate``), their schedule, and the reports.

    ``model`` is a `PipelineModule`: this rank's share of the model under the original names,
    whose no-grad forward runs every stage over point-to-point (evaluation); training goes through
    the schedule in ``forward_backward``."""

    def __init__(self, options: Pipeline, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.options, self.mesh, self.recorder = options, mesh, recorder
        self.placement = Placement()
        self.pp, self.tp, self.dp = mesh.size("pp"), mesh.size("tp"), mesh.size("dp")
        self.num_stages = options.num_stages
        self._clock = _Clock()
        self._steps: list[list[tuple[float, float, float]]] = []  # per step: each pp rank's (busy, start, end)
        self._last_events: list[tuple[int, int, str, float, float]] = []
        self._timeline: str | None = None
        self._finished = False
        self._all_names = [n for n, _ in model.named_parameters()]
        self._aliases: dict[str, str] = {}
        self._tied: list[Tie] = []  # weights tied across pipeline ranks
        # the checks of plan(), again (an Engine may not have been given the model), and the proof
        # of a split the tracer did not give, on the sample the Trainer's check_sample left
        route = options.route(model, options.__dict__.get("_sample"))
        self._nested = route.kind == "nested"
        self.stage_layers = route.names
        """The layer (block) names of each stage, over all ranks."""
        if route.kind == "nested":
            assert route.layout is not None and route.block_runs is not None
            layout, block_runs = route.layout, route.block_runs
            self._aliases = layout.aliases
            make_stage: Any = lambda s: NestedStage(model, layout, block_runs[s], s == 0, s == self.num_stages - 1)  # noqa: E731
            self._tied = _cross_stage_ties(model, layout, block_runs, self.pp)
        elif route.kind == "traced":
            assert route.stage_mods is not None and route.ties is not None
            self._aliases = tied_aliases(model)
            self._tied = route.ties
            make_stage = route.stage_mods.__getitem__
        else:
            runs = split_layers(sequence_layers(model), self.num_stages, options.split_points)
            make_stage = lambda s: StageModule(runs[s])  # noqa: E731
        self._state_order = list(model.state_dict().keys())
        self._group = group = mesh.group("pp")
        me = mesh.coordinate("pp")
        stages: dict[int, nn.Module] = {}
        runners: dict[int, nn.Module] = {}
        self.stages: list[Any] = []
        for s in range(me, self.num_stages, self.pp):
            stage_mod = materialize.to_device(make_stage(s), mesh.device)
            if self.tp > 1:
                # Tensor parallel first, inside the stage (original names: the plan matches as on the whole model).
                _tensor_parallel().parallelize(stage_mod, mesh.device_mesh("tp"), plan=options.tp_plan, sequence_parallel=options.sequence_parallel)
                if isinstance(stage_mod, NestedStage):
                    stage_mod.stop_after_other_hooks()  # the stage ends on the gathered sequence
            stages[s] = stage_mod
        # A meta-built model: this rank's stages get storage and their values (the initializers run over the whole model).
        fused = _tensor_parallel().relayout.fused_layout(*stages.values()) if self.tp > 1 else None
        materialize.fill_share(model, [stages[s] for s in sorted(stages)], mesh.device, fused)
        for s in sorted(stages):
            stage_mod = stages[s]
            runners[s] = apply_data_parallel(stage_mod, mesh, options.dp_strategy, self.tp)
            stage = PipelineStage(runners[s], s, self.num_stages, mesh.device, group=group.pg)
            self._clock.instrument(stage)
            record_stage_traffic(stage, group, recorder)
            keep_buffers_through_inference(stage, stage_mod)
            self.stages.append(stage)
        self._tie_params = {t.name: _find_param(stages, t.name, self._aliases) for t in self._tied}
        self._skip_norm = {id(p) for t in self._tied if (p := self._tie_params[t.name]) is not None and me != t.first}
        sync_tied(self._tied, self._tie_params, group, me, grads=False, device=mesh.device, recorder=recorder)  # one logical weight: start equal
        self._clock.align(group, recorder, mesh.device)
        cls = _schedule_class(options.schedule)
        target = self.stages if options.schedule == "interleaved" else self.stages[0]
        # Gradients of the mean loss: divided by m once per parameter after the schedule (`forward_backward`), not by
        # torch per stage (scale_grads), which divides a module held by two of this rank's stages twice (a traced
        # model's module used twice, under interleaving), once partway through the other stage's backwards.
        self.schedule = cls(target, n_microbatches=options.microbatches, loss_fn=self._loss, scale_grads=False)
        self._step_kwargs = {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        self.holds_first = 0 in stages
        self.holds_last = (self.num_stages - 1) in stages
        self.model = PipelineModule(stages, runners, self.num_stages, group, mesh.device, recorder)
        params = list({id(p): p for s in sorted(stages) for p in stages[s].parameters()}.values())  # a tie on one rank: once
        self._last_stage = stages.get(self.num_stages - 1)
        self._params = params
        self.optimizer = make_optimizer(params)
        self._chunks: list[Any] = []
        self._losses: dict[int, torch.Tensor] = {}
        self._step_fn: StepFn | None = None
        self._precision: Precision | None = None

    def module(self) -> nn.Module:
        return self.model  # this rank's share of the model, under the original names

    # -- one step -----------------------------------------------------------------------------
    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the user's step function on micro-batch ``target``."""
        i = int(target.reshape(-1)[0])
        batch = self._chunks[i]
        full = getattr(self._last_stage, "output", None) if self._nested else None
        assert self._step_fn is not None
        loss = self._step_fn(_Replay(output, batch, full), batch)  # type: ignore[arg-type]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigError(f"the pipeline's step function must return a scalar loss tensor; got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        self._losses[i] = loss.detach()  # by index: torch's shape inference may run micro-batch 0 once more
        scaler = self._precision.scaler if self._precision is not None else None
        return scaler.scale(loss) if scaler is not None else loss

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        if len(microbatches) == 0:
            raise ValueError("a step needs at least one micro-batch")
        m = int(self.options.microbatches or 1)
        batch = concat_batches(microbatches)
        check_rows(batch_rows(batch), m, "pipeline forward_backward")  # every rank, before any send
        from shardwise.data.batches import model_args

        self._chunks = split_batch(batch, m)
        self._step_fn, self._precision = step_fn, precision
        self._losses = {}
        self._clock.events = []
        call_args, call_kwargs = model_args(batch)
        if self._nested:
            # every stage gets the micro-batch as keywords (masks, positions); only the first reads the inputs
            args: tuple[Any, ...] = ()
            kwargs = batch_kwargs(call_args, call_kwargs)
        else:
            if call_kwargs:
                raise ConfigError(
                    "a dict batch needs a model the pipeline splits by its block list (a transformers model, or "
                    "layers='path.to.blocks'); this model is split by its top-level children, which take one tensor"
                )
            args, kwargs = (call_args if self.holds_first else ()), {}
        target = torch.arange(m) if self.holds_last else None
        start = time.perf_counter()
        with precision.autocast():
            self.schedule.step(*args, target=target, **kwargs, **self._step_kwargs)
        end = time.perf_counter()
        self._chunks = []
        if m > 1:
            for p in self._params:
                if p.grad is not None:
                    p.grad.div_(m)
        sync_tied(self._tied, self._tie_params, self._group, self.mesh.coordinate("pp"), grads=True, device=self.mesh.device, recorder=self.recorder)
        average_grads(
            self.model, self.mesh, dp_strategy=self.options.dp_strategy, tp=self.tp, sequence_parallel=self.options.sequence_parallel, recorder=self.recorder
        )
        busy = sum(e - s for _, _, _, s, e in self._clock.events)
        loss = torch.stack([self._losses[i] for i in sorted(self._losses)]).double().mean() if self.holds_last else torch.zeros((), dtype=torch.float64)
        # One small all_gather per step: the loss (from the last stage) and every stage's timing.
        dtype_code = _DTYPES.index(next(iter(self._losses.values())).dtype) if self._losses else -1
        mine = torch.tensor([float(loss), busy, start - self._clock.offset, end - self._clock.offset, dtype_code], dtype=torch.float64, device=self.mesh.device)
        rows = [r.cpu() for r in all_gather(mine, group=self._group, recorder=self.recorder)]
        self._steps.append([(float(r[1]), float(r[2]), float(r[3])) for r in rows])
        self._last_events = [(st, mb, kind, s - self._clock.offset, e - self._clock.offset) for st, mb, kind, s, e in self._clock.events]
        last_rank = (self.num_stages - 1) % self.pp
        dtype = _DTYPES[int(rows[last_rank][4])]  # the last stage's loss dtype, on every rank
        return rows[last_rank][0].to(device=self.mesh.device, dtype=dtype)

    def no_sync(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # the schedule accumulates over micro-batches; gradients sync once, after it

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm, each gradient's square counted once (see `compose.clip_grad_norm`)."""
        return clip_grad_norm(self.model, max_norm, self.mesh.device, self._group if self.pp > 1 else None, skip=self._skip_norm, recorder=self.recorder)

    def after_step(self, step: int) -> None:
        return None  # gradients were synchronized in forward_backward, before the step

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        """The whole model (and optimizer, numbered as the whole model's optimizer numbers its
        parameters), gathered from every pipeline rank to every rank of the group."""
        return gather_state(
            self.model,
            self.optimizer if optimizer else None,
            self._group,
            self._all_names,
            self._aliases,
            device=self.mesh.device,
            recorder=self.recorder,
            order=self._state_order,
        )

    def state_part(self, optimizer: bool) -> dict[str, Any] | None:
        """Checkpoints in parts: each pipeline rank writes its own stages' state (dp 0, tp 0 of each pipeline
        rank; the whole tensors of a tp split gathered first, collectively), so no rank holds the whole model
        to save it (`shardwise.checkpoint.parts`; read back whole, under any strategy)."""
        part = local_part(self.model, self.optimizer if optimizer else None, self._aliases)
        writes = self.mesh.coordinate("dp") == 0 and self.mesh.coordinate("tp") == 0
        return {"part": part if writes else None, "ranks": [p * self.tp for p in range(self.pp)], "names": self._all_names, "order": self._state_order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep this rank's part of a whole-model state (from any strategy's ``state_dict``)."""
        load_local_state(self.model, self.optimizer, state, self._all_names, self._aliases)

    def save_extra_state(self, directory: Path) -> None:
        return None  # the gathered state_dict holds every stage's model and optimizer

    def load_extra_state(self, path: Path) -> None:
        return None

    # -- observability ------------------------------------------------------------------------
    def finish(self) -> None:
        """With ``timeline`` set, the last step's events of every pipeline rank gathered (tensors, over
        the pp group) and drawn by global rank 0. Every rank calls it once; again, it does nothing."""
        if self._finished:
            return
        self._finished = True
        if self.options.timeline:
            events = gather_events(self._last_events, self._group, self.recorder, self.mesh.device)
            if self.mesh.rank == 0:
                self._timeline = write_timeline(self.options.timeline, events, self.pp, self.options.schedule)

    def summary(self) -> dict[str, Any]:
        """The ``pipeline`` section: the schedule, the mesh (pp, tp, dp), the split, the bubble measured and predicted."""
        o = self.options
        section = bubble_section(
            self._steps,
            schedule=o.schedule,
            pp=self.pp,
            microbatches=int(o.microbatches or 1),
            virtual_stages=int(o.virtual_stages or 1),
            num_stages=self.num_stages,
            stage_layers=self.stage_layers,
            warmup_steps=o.warmup_steps,
        )
        section.update({"tp": self.tp, "dp": self.dp, "dp_strategy": o.dp_strategy, "sequence_parallel": o.sequence_parallel})
        if self._timeline is not None:
            section["timeline"] = self._timeline
        return {"pipeline": section}
