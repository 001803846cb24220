"""One rank of a pipeline (`PipelineRun`): its stages, their schedule, the step, checkpoints and reports."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from shardwise.comm import Recorder, all_gather
from shardwise.comm.mesh import Mesh
from shardwise.data.batches import model_args
from shardwise.errors import ConfigError
from shardwise.strategies import materialize
from shardwise.strategies.compose import (
    apply_data_parallel,
    average_grads,
    clip_grad_norm,
    fused_layout,
    parallelize_stage,
)
from shardwise.strategies.contract import OptimizerFactory, Parallel, Placement, StepFn
from shardwise.strategies.pipeline.evaluate import _DTYPES, PipelineModule
from shardwise.strategies.pipeline.nested import (
    NestedStage,
    batch_kwargs,
    tied_aliases,
)
from shardwise.strategies.pipeline.observe import _Clock, bubble_section, gather_events, record_stage_traffic, write_timeline
from shardwise.strategies.pipeline.own_step import Call, has_own_step, probe_call
from shardwise.strategies.pipeline.route import Route, _prove
from shardwise.strategies.pipeline.schedule import (
    _Replay,
    _schedule_class,
    batch_rows,
    check_rows,
    concat_batches,
    keep_buffers_through_inference,
    split_batch,
)
from shardwise.strategies.pipeline.split import StageModule, sequence_layers, split_layers
from shardwise.strategies.pipeline.state import gather_state, load_local_state, local_part
from shardwise.strategies.pipeline.ties import Tie, _cross_stage_ties, _find_param, sync_tied
from shardwise.strategies.precision import Precision

if TYPE_CHECKING:
    from shardwise.strategies.pipeline import Pipeline


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
        route, self._unproven = _route(options, model)
        self._user_model, self._call = model, cast("Call | None", None)
        """The user's model and how its training_step calls it (`own_step.Call`, read on the first step)."""
        self._nested = route.kind == "nested"
        self.stage_layers = route.names
        """The layer (block) names of each stage, over all ranks."""
        make_stage = self._stage_maker(route, model)
        self._state_order = list(model.state_dict().keys())
        self._group = group = mesh.group("pp")
        me = mesh.coordinate("pp")
        stages = self._build_stages(model, make_stage, me)
        runners: dict[int, nn.Module] = {}
        self.stages: list[Any] = []
        for s in sorted(stages):
            runners[s] = apply_data_parallel(stages[s], mesh, options.dp_strategy, self.tp)
            stage = PipelineStage(runners[s], s, self.num_stages, mesh.device, group=group.pg)
            self._clock.instrument(stage)
            record_stage_traffic(stage, group, recorder)
            keep_buffers_through_inference(stage, stages[s])
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
        if has_own_step(model):
            self.model.__dict__["training_step"] = _direct_step  # so the Trainer's step function goes through training_step
        params = list({id(p): p for s in sorted(stages) for p in stages[s].parameters()}.values())  # a tie on one rank: once
        self._last_stage = stages.get(self.num_stages - 1)
        self._params = params
        self.optimizer = make_optimizer(params)
        self._chunks: list[Any] = []
        self._losses: dict[int, torch.Tensor] = {}
        self._step_fn: StepFn | None = None
        self._precision: Precision | None = None

    def _stage_maker(self, route: Route, model: nn.Module) -> Callable[[int], nn.Module]:
        """Stage ``s``'s module over the model's own tensors, as ``route`` cuts it; notes tied names and cross-rank ties."""
        if route.kind == "nested":
            assert route.layout is not None and route.block_runs is not None
            layout, block_runs = route.layout, route.block_runs
            self._aliases = layout.aliases
            self._tied = _cross_stage_ties(model, layout, block_runs, self.pp)
            return lambda s: NestedStage(model, layout, block_runs[s], s == 0, s == self.num_stages - 1)
        if route.kind == "traced":
            assert route.stage_mods is not None and route.ties is not None
            self._aliases = tied_aliases(model)
            self._tied = route.ties
            return route.stage_mods.__getitem__
        runs = split_layers(sequence_layers(model), self.num_stages, self.options.split_points)
        return lambda s: StageModule(runs[s])

    def _build_stages(self, model: nn.Module, make_stage: Callable[[int], nn.Module], me: int) -> dict[int, nn.Module]:
        """This rank's stages on its device, tensor parallel inside each, then filled (a meta-built model)."""
        mesh, options = self.mesh, self.options
        stages: dict[int, nn.Module] = {}
        for s in range(me, self.num_stages, self.pp):
            stage_mod = materialize.to_device(make_stage(s), mesh.device)
            if self.tp > 1:
                # Tensor parallel first, inside the stage (original names: the plan matches as on the whole model).
                parallelize_stage(stage_mod, mesh, options.tp_plan, options.sequence_parallel)
                if isinstance(stage_mod, NestedStage):
                    stage_mod.stop_after_other_hooks()  # the stage ends on the gathered sequence
            stages[s] = stage_mod
        # A meta-built model: this rank's stages get storage and their values (the initializers run over the whole model).
        fused = fused_layout(*stages.values()) if self.tp > 1 else None
        materialize.fill_share(model, [stages[s] for s in sorted(stages)], mesh.device, fused)
        return stages

    def module(self) -> nn.Module:
        return self.model  # this rank's share of the model, under the original names

    # -- one step -----------------------------------------------------------------------------
    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the user's step function on micro-batch ``target``."""
        i = int(target.reshape(-1)[0])
        batch = self._chunks[i]
        full = getattr(self._last_stage, "output", None) if self._nested else None
        assert self._step_fn is not None
        own = (self._user_model, self._call) if self._call is not None else None
        loss = self._step_fn(_Replay(output, batch, full, own), batch)  # type: ignore[arg-type]
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
        self._chunks = split_batch(batch, m)
        self._step_fn, self._precision = step_fn, precision
        self._losses = {}
        self._clock.events = []
        call_args, call_kwargs = model_args(batch)
        if has_own_step(self._user_model) and self._call is None:
            self._first_own_step(self._chunks[0], call_args, call_kwargs)
        if self._nested:
            # every stage gets the micro-batch as keywords (masks, positions; targets a training_step passes
            # to self(x, y)); only the first reads the inputs
            args: tuple[Any, ...] = ()
            kwargs = self._call.stage_kwargs(batch) if self._call is not None else batch_kwargs(call_args, call_kwargs)
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

    def _first_own_step(self, chunk: Any, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> None:
        """How the model's training_step calls it, read on the first micro-batch (the same on every rank);
        a split that waited for a sample is proven on it here (see `_route`)."""
        call = probe_call(self._user_model, chunk)
        (a, k), (a0, k0) = call.bind(chunk), model_args(chunk)
        plain = self._nested or (len(a) == len(a0) and all(x is y for x, y in zip(a, a0, strict=True)) and k.keys() == k0.keys())
        if not plain:
            raise ConfigError(
                f"{type(self._user_model).__name__}.training_step calls the model with more than its inputs (targets), which "
                "reach only a last stage that runs the model's own forward: the split by its block list does, this one (by "
                "its traced forward or its children) does not; pass layers='path.to.blocks', or loss_fn=... with self(x)"
            )
        if self._unproven is not None:
            _prove(self._user_model, self._unproven, chunk, "its block list (proven on the first training batch)", call)
            self._unproven = None
        self._call = call

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


def _route(options: Pipeline, model: nn.Module) -> tuple[Route, Route | None]:
    """The route ``apply`` takes, and the same route again when its proof waits for the first step.

    The Trainer gives no sample before launch to a model with a ``training_step`` (the batch need not
    fit its forward); a split that must be proven on a sample is then proven on the first training
    batch, before the schedule's first send, when nothing has changed the model's own modules yet
    (no tensor parallel, no FSDP inside the stages)."""
    sample = options.__dict__.get("_sample")
    try:
        return options.route(model, sample), None
    except ConfigError:
        if sample is not None or not has_own_step(model) or options.tp > 1 or options.dp_strategy != "ddp" or materialize.has_meta(model):
            raise
    route = options.route(model, check=False)
    return route, (route if route.kind != "traced" else None)


def _direct_step(batch: Any) -> Any:
    raise ConfigError(
        "the model's training_step runs on the pipeline's last stage inside its schedule (Trainer.fit); evaluating "
        "through training_step is not supported under the pipeline: pass loss_fn=... or define validation_step"
    )
