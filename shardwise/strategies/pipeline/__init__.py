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

The package, by concern: ``split`` (layers, balance, stage modules; shared with ``naive_mp``),
``schedule`` (what a schedule can run, micro-batches, the loss stand-in), ``evaluate`` (the
no-grad forward over point-to-point), ``compose`` (tensor and data parallel, the gradient norm),
``state`` (whole-model checkpoints), ``observe`` (timing, bubble, timeline); here, the strategy.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ClassVar, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.precision import Precision
from shardwise.strategies.pipeline.compose import _tensor_parallel, apply_data_parallel, average_grads, clip_grad_norm
from shardwise.strategies.pipeline.evaluate import _DTYPES, PipelineModule
from shardwise.strategies.pipeline.observe import _Clock, bubble_section, mean, write_timeline
from shardwise.strategies.pipeline.schedule import (
    _Replay, _schedule_class, batch_rows, check_rows, check_schedule, concat_batches, keep_buffers_through_inference, split_batch,
)
from shardwise.strategies.pipeline.nested import NestedStage, batch_kwargs, check_nested, is_nested, nested_layout, split_blocks
from shardwise.strategies.pipeline.split import StageModule, balance, sequence_layers, split_layers
from shardwise.strategies.pipeline.ties import Tie, _cross_stage_ties, _find_param, sync_tied
from shardwise.strategies.pipeline.split import _register as _register  # importable from here, as before the split
from shardwise.strategies.pipeline.state import gather_state, load_local_state
from shardwise.strategies.protocol import OptimizerFactory, StepFn

__all__ = [
    "Pipeline", "PipelineModule", "StageModule", "balance", "batch_rows", "check_rows", "check_schedule",
    "concat_batches", "mean", "sequence_layers", "split_batch", "split_layers", "write_timeline",
]


# -- the strategy ---------------------------------------------------------------------------------


class Pipeline:
    """Pipeline parallelism over the mesh's ``pp`` dimension (tensor parallel inside, data parallel outside).

    Options: ``pp`` stages (ranks), ``microbatches`` per step (default ``pp``), ``schedule``
    (``gpipe``, ``1f1b``, ``interleaved``), ``virtual_stages`` (model chunks per rank,
    interleaved only, default 2), ``split_points`` (layer names that start stages 1..), ``tp``
    (tensor-parallel degree inside each stage), ``dp_strategy`` (``ddp`` or ``fsdp`` over the
    data-parallel dimension), ``timeline`` (a PNG path: the forward/backward actions of one step,
    events as JSON next to it), ``warmup_steps`` (steps left out of the measured bubble).

    Every stage's timing reaches every rank with the step's loss (one small all-gather per
    step), so ``summary()`` is local, except with ``timeline`` set: then it gathers the last
    step's events to rank 0, and every rank must call it (the Trainer does).

    >>> Pipeline(pp=4, microbatches=8, schedule="interleaved").num_stages
    8
    """

    name: ClassVar[str] = "pipeline"

    def __init__(
        self, *, pp: int = 2, microbatches: int | None = None, schedule: str = "1f1b", virtual_stages: int | None = None,
        split_points: Sequence[str] | None = None, tp: int = 1, dp_strategy: str = "ddp", timeline: str | None = None,
        warmup_steps: int = 1, sequence_parallel: bool = False, tp_plan: dict[str, str] | None = None,
        layers: str | None = None,
    ) -> None:
        if virtual_stages is None:
            virtual_stages = 2 if schedule == "interleaved" else 1
        microbatches = pp if microbatches is None else microbatches
        check_schedule(schedule, pp, microbatches, virtual_stages)
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tp must be a whole number >= 1; got {tp!r}")
        if dp_strategy not in ("ddp", "fsdp"):
            raise ConfigError(f"dp_strategy must be 'ddp' or 'fsdp'; got {dp_strategy!r}")
        if isinstance(split_points, str):
            split_points = [s for s in split_points.split(",") if s]
        self.pp, self.microbatches, self.schedule_name = pp, microbatches, schedule
        self.virtual_stages, self.split_points, self.tp = virtual_stages, list(split_points or []), tp
        self.dp_strategy, self.timeline, self.warmup_steps = dp_strategy, timeline, warmup_steps
        self.sequence_parallel, self.tp_plan = bool(sequence_parallel), tp_plan
        self.layers = layers or None
        """Dotted path of a nested model's block list (``model.layers``); found by itself when not given."""
        self._nested = False
        self._tied: list[Tie] = []  # weights tied across pipeline ranks
        self._skip_norm: set[int] = set()
        self._aliases: dict[str, str] = {}
        if self.sequence_parallel and tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1 (it shards activations across the tensor-parallel ranks)")
        self.num_stages = pp * virtual_stages
        self._clock = _Clock()
        self._steps: list[list[tuple[float, float, float]]] = []  # per step: each pp rank's (busy, start, end)
        self._last_events: list[tuple[int, int, str, float, float]] = []
        self._mesh: Mesh | None = None
        self._recorder: Recorder | None = None
        self._all_names: list[str] = []

    # -- before launch ------------------------------------------------------------------------
    def validate(self, world_size: int) -> None:
        if self.tp > 1:
            _tensor_parallel()  # a clear error when the tensor-parallel block is not available
        Mesh.build(world_size=world_size, pp=self.pp, tp=self.tp)  # raises with the valid shapes

    def mesh_degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "tp": self.tp}

    def check_batch(self, micro_batch: int, accumulate: int) -> None:
        check_rows(micro_batch * accumulate, self.microbatches, f"micro-batch {micro_batch} x accumulate {accumulate}")

    def check_model(self, model: nn.Module) -> None:
        """Refuse, in the parent before any process starts, a model this pipeline cannot split: not
        a sequence of layers, fewer layers with parameters than ``pp x virtual_stages`` stages, or
        ``split_points`` that do not name its layers in order (``setup``'s checks, no process group)."""
        if is_nested(model, self.layers):
            layout = nested_layout(model, self.layers)
            check_nested(model, layout, self.num_stages, self.microbatches)
            split_blocks(model, layout, self.num_stages, self.split_points)
            if layout.aliases and self.dp_strategy == "fsdp":
                raise ConfigError(
                    f"{type(model).__name__} ties {', '.join(f'{a} to {c}' for a, c in layout.aliases.items())}; with the "
                    "tied ends on different pipeline stages shardwise sums their gradients itself, which it does for "
                    "dp_strategy='ddp' but not under FSDP's sharded gradients; use dp_strategy='ddp'"
                )
            return
        split_layers(sequence_layers(model), self.num_stages, self.split_points)

    # -- setup --------------------------------------------------------------------------------
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.pipelining import PipelineStage

        if not dist.is_initialized():
            raise ConfigError("strategy 'pipeline' needs a process group; start the run with nproc >= pp through shardwise (Trainer, launch, or shardwise run)")
        if mesh.size("pp") != self.pp:
            raise ConfigError(f"the mesh has pp={mesh.size('pp')} but the pipeline was asked for pp={self.pp}")
        self._mesh, self._recorder = mesh, recorder
        self._all_names = [n for n, _ in model.named_parameters()]
        self._nested = is_nested(model, self.layers)
        if self._nested:
            self.check_model(model)
            layout = nested_layout(model, self.layers)
            block_runs = split_blocks(model, layout, self.num_stages, self.split_points)
            self.stage_layers = [[f"{layout.blocks}.{k}" for k in run] for run in block_runs]
            self._aliases = layout.aliases
            make_stage: Any = lambda s: NestedStage(model, layout, block_runs[s], s == 0, s == self.num_stages - 1)  # noqa: E731
            self._tied = _cross_stage_ties(model, layout, block_runs, self.pp)
        else:
            runs = split_layers(sequence_layers(model), self.num_stages, self.split_points)
            self.stage_layers = [[n for n, _ in run] for run in runs]
            make_stage = lambda s: StageModule(runs[s])  # noqa: E731
        group = mesh.group("pp")
        me = mesh.coordinate("pp")
        stages: dict[int, nn.Module] = {}
        runners: dict[int, nn.Module] = {}
        self.stages: list[Any] = []
        for s in range(me, self.num_stages, self.pp):
            stage_mod = make_stage(s).to(mesh.device)
            if self.tp > 1:
                # Tensor parallel first, inside the stage (original names: the plan matches as on the whole model).
                _tensor_parallel().parallelize(stage_mod, mesh.device_mesh("tp"), plan=self.tp_plan, sequence_parallel=self.sequence_parallel)
                if isinstance(stage_mod, NestedStage):
                    stage_mod.stop_after_other_hooks()  # the stage ends on the gathered sequence
            stages[s] = stage_mod
            runners[s] = apply_data_parallel(stage_mod, mesh, self.dp_strategy, self.tp)
            stage = PipelineStage(runners[s], s, self.num_stages, mesh.device, group=group.pg)
            self._clock.instrument(stage)
            keep_buffers_through_inference(stage, stage_mod)
            self.stages.append(stage)
        self._group = group
        self._tie_params = {t.name: _find_param(stages, t.name, self._aliases) for t in self._tied}
        self._skip_norm = {id(p) for t in self._tied if (p := self._tie_params[t.name]) is not None and me != t.first}
        sync_tied(self._tied, self._tie_params, group, me, grads=False, device=mesh.device)  # one logical weight: start equal
        self._clock.align(group)
        cls = _schedule_class(self.schedule_name)
        target = self.stages if self.schedule_name == "interleaved" else self.stages[0]
        self.schedule = cls(target, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=True)
        import inspect

        self._step_kwargs = {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        self.holds_first = 0 in stages
        self.holds_last = (self.num_stages - 1) in stages
        wrapped = PipelineModule(stages, runners, self.num_stages, group, mesh.device)
        self._module = wrapped
        self._local_names = [n for n, _ in wrapped.named_parameters()]
        params = list({id(p): p for s in sorted(stages) for p in stages[s].parameters()}.values())  # a tie on one rank: once
        self._last_stage = stages.get(self.num_stages - 1)
        return wrapped, make_optimizer(params)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    # -- one step -----------------------------------------------------------------------------
    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the user's step function on micro-batch ``target``."""
        i = int(target.reshape(-1)[0])
        batch = self._chunks[i]
        full = getattr(self._last_stage, "output", None) if self._nested else None
        loss = self._step_fn(_Replay(output, batch, full), batch)  # type: ignore[arg-type]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigError(f"the pipeline's step function must return a scalar loss tensor; got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        self._losses[i] = loss.detach()  # by index: torch's shape inference may run micro-batch 0 once more
        scaler = self._precision.scaler if self._precision is not None else None
        return scaler.scale(loss) if scaler is not None else loss

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        if len(microbatches) == 0:
            raise ValueError("a step needs at least one micro-batch")
        batch = concat_batches(microbatches)
        check_rows(batch_rows(batch), self.microbatches, "pipeline forward_backward")  # every rank, before any send
        from shardwise.batches import model_args

        self._chunks = split_batch(batch, self.microbatches)
        self._step_fn, self._precision = step_fn, precision
        self._losses: dict[int, torch.Tensor] = {}
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
        target = torch.arange(self.microbatches) if self.holds_last else None
        start = time.perf_counter()
        with precision.autocast():
            self.schedule.step(*args, target=target, **kwargs, **self._step_kwargs)
        end = time.perf_counter()
        self._chunks = []
        assert self._mesh is not None
        sync_tied(self._tied, self._tie_params, self._group, self._mesh.coordinate("pp"), grads=True, device=self._mesh.device, recorder=self._recorder)
        average_grads(self._module, self._mesh, dp_strategy=self.dp_strategy, tp=self.tp, sequence_parallel=self.sequence_parallel, recorder=self._recorder)
        busy = sum(e - s for _, _, _, s, e in self._clock.events)
        loss = torch.stack([self._losses[i] for i in sorted(self._losses)]).double().mean() if self.holds_last else torch.zeros((), dtype=torch.float64)
        # One small all_gather per step: the loss (from the last stage) and every stage's timing.
        dtype_code = _DTYPES.index(next(iter(self._losses.values())).dtype) if self._losses else -1
        mine = torch.tensor([float(loss), busy, start - self._clock.offset, end - self._clock.offset, dtype_code], dtype=torch.float64)
        rows = [torch.zeros(5, dtype=torch.float64) for _ in range(self.pp)]
        t0 = time.perf_counter()
        dist.all_gather(rows, mine, group=self._group.pg)
        if self._recorder is not None and self.pp > 1:
            sent, recv = wire_bytes("all_gather", 40, self.pp)
            self._recorder.add(CommEvent("all_gather", "pp", self.pp, 40, sent, recv, time.perf_counter() - t0))
        self._steps.append([(float(r[1]), float(r[2]), float(r[3])) for r in rows])
        self._last_events = [(st, mb, kind, s - self._clock.offset, e - self._clock.offset) for st, mb, kind, s, e in self._clock.events]
        last_rank = (self.num_stages - 1) % self.pp
        dtype = _DTYPES[int(rows[last_rank][4])]  # the last stage's loss dtype, on every rank
        return rows[last_rank][0].to(device=self._mesh.device if self._mesh else "cpu", dtype=dtype)

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        # The schedule accumulates over micro-batches and synchronizes once, on the last backward.
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global norm, each gradient's square counted once (see `compose.clip_grad_norm`)."""
        device = self._mesh.device if self._mesh else torch.device("cpu")
        return clip_grad_norm(model, max_norm, device, self._group if self.pp > 1 else None, skip=self._skip_norm)

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """The whole model (and optimizer, numbered as the whole model's optimizer numbers its
        parameters), gathered from every pipeline rank to every rank of the group."""
        return gather_state(model, optimizer, self._group, self.pp, self._all_names, self._aliases)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        """Keep this rank's part of a whole-model state (from any strategy's ``state_dict``)."""
        load_local_state(model, optimizer, state, self._all_names, self._aliases)

    # -- observability ------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The ``pipeline`` section (collective over the pipeline group when ``timeline`` is set)."""
        section = bubble_section(
            self._steps, schedule=self.schedule_name, pp=self.pp, microbatches=self.microbatches,
            virtual_stages=self.virtual_stages, num_stages=self.num_stages,
            stage_layers=getattr(self, "stage_layers", None), warmup_steps=self.warmup_steps,
        )
        if self.timeline and dist.is_initialized() and getattr(self, "_group", None) is not None:
            events: list[Any] = [None] * self.pp
            dist.all_gather_object(events, self._last_events, group=self._group.pg)
            if self._mesh is not None and self._mesh.rank == 0:
                section["timeline"] = write_timeline(self.timeline, [e for ev in events for e in ev], self.pp, self.schedule_name)
        return {"pipeline": section}
