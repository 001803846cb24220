"""``pipeline``: split the model by layers into stages, one group of stages per rank, and run
micro-batches through them on a schedule (GPipe, 1F1B, interleaved 1F1B).

Built on ``torch.distributed.pipelining`` (``PipelineStage`` and its schedules). What a model
must satisfy to be split automatically: it is a **sequence of layers**, either an
``nn.Sequential`` or a module whose ``forward`` applies its top-level children in
registration order, each child's output the next one's only input, with ``nn.ModuleList``
children expanded into their items (charlm's ``CharGPT``: ``embed, blocks.0 .. blocks.N-1,
head``). No parameters or buffers directly on the root module, no weights shared between
layers (tied embeddings), no skip connection across layers, and every layer boundary carries
one tensor. shardwise cannot see ``forward``, so this is the user's promise; parity with the
unsplit model is what the tests check for charlm.

Stages are contiguous runs of layers, balanced by parameter count (the split that minimises
the largest stage), or starting at the layers named in ``split_points``. A stage module keeps
the **original names** (a stage holding ``blocks.2`` has ``blocks.2.attn.q.weight``), so
checkpoints move between ``pipeline`` and every other strategy.

The loss: the Trainer's ``step_fn`` is ``loss_fn(model(*inputs), batch)``. The last stage calls
it once per micro-batch with a stand-in model that returns that micro-batch's pipeline output
(`_Replay`), so the user's own loss runs unchanged; the schedule is given ``target =
arange(m)``, which it chunks into one index per micro-batch. Gradients are those of the mean
loss (the schedule divides by ``m``); the step's mean loss reaches every rank.

Composition, in torchtitan's order: tensor parallel inside each stage (when
``shardwise.strategies.tensor_parallel`` exists), then the pipeline, then data parallel over
the mesh's ``dp`` dimension: with ``dp_strategy="ddp"`` the stage's gradients are averaged in
one flat allreduce after the schedule's backward (torch's DDP reducer fails to rebuild its
buckets under the schedule), or FSDP2 with ``dp_strategy="fsdp"``.

The strategy follows the plan/apply contract: `Pipeline` holds the options; its ``plan`` (pure,
in the parent) sets ``pp`` and ``tp`` on the mesh and refuses, before any process starts, a
batch per rank that does not cut into ``microbatches`` and a model it cannot split (`split`);
``apply`` builds this rank's stages and returns a `PipelineRun`. Every byte our code sends
goes through `shardwise.comm`, and the activations and gradients torch's schedule sends between
stages are recorded as ``pp/send`` and ``pp/recv`` (`observe.record_stage_traffic`).

The package, by concern: ``split`` (layers, balance, stage modules; shared with ``naive_mp``),
``schedule`` (what a schedule can run, micro-batches, the loss stand-in), ``evaluate`` (the
no-grad forward over point-to-point), ``compose`` (tensor and data parallel, the gradient norm),
``state`` (whole-model checkpoints), ``exchange`` (gathering each rank's part as tensors),
``observe`` (timing, traffic, bubble, timeline); here, the strategy and its run.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, ContextManager, Literal, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Recorder, all_gather
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.precision import Precision
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.pipeline.compose import _tensor_parallel, apply_data_parallel, average_grads, clip_grad_norm
from shardwise.strategies.pipeline.evaluate import _DTYPES, PipelineModule
from shardwise.strategies.pipeline.observe import _Clock, bubble_section, gather_events, mean, record_stage_traffic, write_timeline
from shardwise.strategies.pipeline.schedule import (
    _Replay, _schedule_class, batch_rows, check_rows, check_schedule, concat_batches, keep_buffers_through_inference, split_batch,
)
from shardwise.strategies.pipeline.nested import NestedStage, batch_kwargs, check_nested, is_nested, nested_layout, split_blocks
from shardwise.strategies.pipeline.split import StageModule, balance, sequence_layers, split_layers
from shardwise.strategies.pipeline.ties import Tie, _cross_stage_ties, _find_param, sync_tied
from shardwise.strategies.pipeline.split import _register as _register  # importable from here, as before the split
from shardwise.strategies.pipeline.state import gather_state, load_local_state

__all__ = [
    "Pipeline", "PipelineModule", "PipelineRun", "StageModule", "balance", "batch_rows", "check_rows", "check_schedule",
    "concat_batches", "mean", "sequence_layers", "split_batch", "split_layers", "write_timeline",
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
            self.split(model)
        return layout

    def split(self, model: nn.Module) -> list[list[str]]:
        """The layer (or block) names of each of the ``pp x virtual_stages`` stages, as ``apply`` will
        cut ``model``; a `ConfigError` for a model this pipeline cannot split: not a sequence of
        layers nor a nested model with a block list, fewer layers (blocks) than stages,
        ``split_points`` that do not name them in order, an encoder-decoder model, BatchNorm with
        more than one micro-batch, weights tied across stages under ``dp_strategy="fsdp"``. Pure."""
        if is_nested(model, self.layers):
            layout = nested_layout(model, self.layers)
            check_nested(model, layout, self.num_stages, int(self.microbatches or 1))
            runs = split_blocks(model, layout, self.num_stages, self.split_points)
            if layout.aliases and self.dp_strategy == "fsdp":
                raise ConfigError(
                    f"{type(model).__name__} ties {', '.join(f'{a} to {c}' for a, c in layout.aliases.items())}; with the "
                    "tied ends on different pipeline stages shardwise sums their gradients itself, which it does for "
                    "dp_strategy='ddp' but not under FSDP's sharded gradients; use dp_strategy='ddp'"
                )
            return [[f"{layout.blocks}.{k}" for k in run] for run in runs]
        return [[n for n, _ in run] for run in split_layers(sequence_layers(model), self.num_stages, self.split_points)]

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
        self._nested = is_nested(model, options.layers)
        self._aliases: dict[str, str] = {}
        self._tied: list[Tie] = []  # weights tied across pipeline ranks
        self.stage_layers = options.split(model)  # the checks of plan(), again: an Engine may not have been given the model
        """The layer (block) names of each stage, over all ranks."""
        if self._nested:
            layout = nested_layout(model, options.layers)
            block_runs = split_blocks(model, layout, self.num_stages, options.split_points)
            self._aliases = layout.aliases
            make_stage: Any = lambda s: NestedStage(model, layout, block_runs[s], s == 0, s == self.num_stages - 1)  # noqa: E731
            self._tied = _cross_stage_ties(model, layout, block_runs, self.pp)
        else:
            runs = split_layers(sequence_layers(model), self.num_stages, options.split_points)
            make_stage = lambda s: StageModule(runs[s])  # noqa: E731
        self._group = group = mesh.group("pp")
        me = mesh.coordinate("pp")
        stages: dict[int, nn.Module] = {}
        runners: dict[int, nn.Module] = {}
        self.stages: list[Any] = []
        for s in range(me, self.num_stages, self.pp):
            stage_mod = make_stage(s).to(mesh.device)
            if self.tp > 1:
                # Tensor parallel first, inside the stage (original names: the plan matches as on the whole model).
                _tensor_parallel().parallelize(stage_mod, mesh.device_mesh("tp"), plan=options.tp_plan, sequence_parallel=options.sequence_parallel)
                if isinstance(stage_mod, NestedStage):
                    stage_mod.stop_after_other_hooks()  # the stage ends on the gathered sequence
            stages[s] = stage_mod
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
        self.schedule = cls(target, n_microbatches=options.microbatches, loss_fn=self._loss, scale_grads=True)
        self._step_kwargs = {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        self.holds_first = 0 in stages
        self.holds_last = (self.num_stages - 1) in stages
        self.model = PipelineModule(stages, runners, self.num_stages, group, mesh.device, recorder)
        params = list({id(p): p for s in sorted(stages) for p in stages[s].parameters()}.values())  # a tie on one rank: once
        self._last_stage = stages.get(self.num_stages - 1)
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
        from shardwise.batches import model_args

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
        sync_tied(self._tied, self._tie_params, self._group, self.mesh.coordinate("pp"), grads=True, device=self.mesh.device, recorder=self.recorder)
        average_grads(self.model, self.mesh, dp_strategy=self.options.dp_strategy, tp=self.tp, sequence_parallel=self.options.sequence_parallel,
                      recorder=self.recorder)
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

    def no_sync(self) -> ContextManager[None]:
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
        return gather_state(self.model, self.optimizer if optimizer else None, self._group, self._all_names, self._aliases,
                            device=self.mesh.device, recorder=self.recorder)

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
            self._steps, schedule=o.schedule, pp=self.pp, microbatches=int(o.microbatches or 1),
            virtual_stages=int(o.virtual_stages or 1), num_stages=self.num_stages,
            stage_layers=self.stage_layers, warmup_steps=o.warmup_steps,
        )
        section.update({"tp": self.tp, "dp": self.dp, "dp_strategy": o.dp_strategy, "sequence_parallel": o.sequence_parallel})
        if self._timeline is not None:
            section["timeline"] = self._timeline
        return {"pipeline": section}
