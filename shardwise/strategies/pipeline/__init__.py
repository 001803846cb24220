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
the mesh's ``dp`` dimension (each stage module wrapped in DDP, or FSDP2 with
``dp_strategy="fsdp"``).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, ClassVar, ContextManager, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.comm.collectives import Group, all_reduce
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.plan.bubble import SCHEDULES, predicted_bubble, step_bubbles
from shardwise.precision import Precision
from shardwise.strategies.protocol import OptimizerFactory, StepFn

# -- the split -----------------------------------------------------------------------------------


def sequence_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in order, by original name: top-level children, ModuleLists expanded.

    >>> [n for n, _ in sequence_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))]
    ['0', '1']
    """
    own_params = [n for n, _ in model.named_parameters(recurse=False)]
    own_buffers = [n for n, _ in model.named_buffers(recurse=False)]
    if own_params or own_buffers:
        raise ConfigError(
            f"cannot split {type(model).__name__} into pipeline stages: it holds tensors of its own "
            f"({', '.join(own_params + own_buffers)}) outside its layers; move them into a child module"
        )
    layers: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            layers.extend((f"{name}.{i}", sub) for i, sub in child.named_children())
        elif isinstance(child, nn.ModuleDict):
            raise ConfigError(
                f"cannot split {type(model).__name__}: child {name!r} is a ModuleDict, whose order of use "
                "the pipeline cannot know; use a ModuleList or an nn.Sequential"
            )
        else:
            layers.append((name, child))
    if not layers:
        raise ConfigError(f"cannot split {type(model).__name__}: it has no child modules (a pipeline splits a sequence of layers)")
    return layers


def balance(weights: Sequence[int], parts: int) -> list[int]:
    """Start index of each of ``parts`` contiguous runs of ``weights`` (every run with a
    positive total) that minimise the largest run, then the sum of squared totals.

    >>> balance([4, 1, 1, 1, 1], 2)
    [0, 1]
    """
    n = len(weights)
    positive = sum(1 for w in weights if w > 0)
    if positive < parts:
        raise ValueError(f"{positive} layers with parameters cannot fill {parts} stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    # best[j][i]: (max, sum of squares) splitting the first i layers into j runs; cut[j][i]: last run's start.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, parts + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):
                prev = best[j - 1][s]
                run = prefix[i] - prefix[s]
                if prev == inf or run <= 0:
                    continue
                cand = (max(prev[0], run), prev[1] + run * run)
                if cand <= best[j][i]:  # ties: the later cut (a layer without parameters stays with the one before)
                    best[j][i], cut[j][i] = cand, s
    starts, i = [], n
    for j in range(parts, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def split_layers(layers: Sequence[tuple[str, nn.Module]], stages: int, split_points: Sequence[str] | None = None) -> list[list[tuple[str, nn.Module]]]:
    """Cut ``layers`` into ``stages`` contiguous runs: balanced by parameter count, or starting
    at the layers named in ``split_points`` (the first layer always starts stage 0)."""
    names = [n for n, _ in layers]
    counts = [sum(p.numel() for p in m.parameters()) for _, m in layers]
    if split_points:
        unknown = [s for s in split_points if s not in names]
        if unknown:
            raise ConfigError(f"split_points {unknown} are not layers of the model; its layers are {names}")
        starts = sorted({names.index(s) for s in split_points} | {0})
        if [names.index(s) for s in split_points if s != names[0]] != starts[1:]:
            raise ConfigError(f"split_points must name layers in model order, each once; got {list(split_points)} (layer order: {names})")
        if len(starts) != stages:
            raise ConfigError(f"split_points {list(split_points)} make {len(starts)} stages but the pipeline has {stages} (pp x virtual stages); name {stages - 1} layers that start stages 1..{stages - 1}")
    else:
        if sum(1 for c in counts if c > 0) < stages:
            raise ConfigError(
                f"the model has {len(layers)} layers ({sum(1 for c in counts if c > 0)} with parameters: {names}) "
                f"but the pipeline needs {stages} stages (pp x virtual stages), each with parameters; "
                "use fewer stages or a model with more layers"
            )
        starts = balance(counts, stages)
    bounds = starts + [len(layers)]
    runs = [list(layers[bounds[i]:bounds[i + 1]]) for i in range(stages)]
    for i, run in enumerate(runs):
        if not any(p.requires_grad for _, m in run for p in m.parameters()):
            raise ConfigError(f"pipeline stage {i} ({[n for n, _ in run]}) has no trainable parameters; move its split point")
    return runs


def _register(owner: nn.Module, name: str, layer: nn.Module) -> None:
    """Register ``layer`` on ``owner`` under its original dotted name (``blocks.2`` -> a ModuleDict ``blocks`` with key ``2``)."""
    parent, _, leaf = name.rpartition(".")
    if not parent:
        owner.add_module(name, layer)
        return
    if parent not in owner._modules:
        owner.add_module(parent, nn.ModuleDict())
    container = owner._modules[parent]
    assert isinstance(container, nn.ModuleDict)
    container[leaf] = layer


class StageModule(nn.Module):
    """A contiguous run of the model's layers under their original names; ``forward`` applies them in order."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.layer_names = [n for n, _ in layers]
        for name, layer in layers:
            _register(self, name, layer)
        self._layers = [layer for _, layer in layers]  # a plain list: the modules are registered above

    def forward(self, *x: Any) -> Any:
        out = self._layers[0](*x)
        for layer in self._layers[1:]:
            out = layer(out)
        return out


# -- schedules and validation --------------------------------------------------------------------


def check_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Refuse, before anything runs, what a schedule cannot run (torch raises some of these only
    on one rank, mid-step, while the others wait forever)."""
    if schedule not in SCHEDULES:
        import difflib

        close = difflib.get_close_matches(schedule, SCHEDULES, n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}{hint}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"pipeline {name} must be a whole number >= 1; got {value!r}")
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(f"schedule 1f1b needs at least as many micro-batches as stages; got microbatches={microbatches} < pp={pp}; use microbatches >= {pp} or schedule gpipe")
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise ConfigError(f"schedule interleaved needs virtual_stages >= 2 (model chunks per rank); got {virtual_stages}; use gpipe or 1f1b for one chunk per rank")
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            # torch's interleaved 1F1B runs micro-batches in rounds of about pp (flex schedule).
            raise ConfigError(f"schedule interleaved needs microbatches to be a multiple of max(1, microbatches // pp) = {rounds}; got microbatches={microbatches} with pp={pp}; use a multiple of {pp}")
    elif virtual_stages != 1:
        raise ConfigError(f"virtual_stages={virtual_stages} needs schedule interleaved; {schedule} runs one stage per rank")


def _schedule_class(schedule: str) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[schedule]


def split_batch(batch: Any, m: int) -> list[Any]:
    """``m`` equal micro-batches of a batch (a tensor, or a tuple/list of tensors), cut along
    dim 0 as the pipeline schedule cuts its inputs (``torch.tensor_split``)."""
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, m, dim=0))
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(b, m) if isinstance(b, torch.Tensor) else [b] * m for b in batch]
        return [type(batch)(p[i] for p in parts) if isinstance(batch, tuple) else [p[i] for p in parts] for i in range(m)]
    raise ConfigError(f"the pipeline strategy splits batches that are tensors or tuples of tensors; got {type(batch).__name__}")


def concat_batches(batches: Sequence[Any]) -> Any:
    """One batch from the step's loader micro-batches (concatenated along dim 0)."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches), dim=0)
    if isinstance(first, (tuple, list)):
        cols = [concat_batches([b[i] for b in batches]) if isinstance(first[i], torch.Tensor) else first[i] for i in range(len(first))]
        return tuple(cols) if isinstance(first, tuple) else cols
    raise ConfigError(f"the pipeline strategy splits batches that are tensors or tuples of tensors; got {type(first).__name__}")


def batch_rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (tuple, list)) and batch:
        return batch_rows(batch[0])
    raise ConfigError(f"the pipeline strategy splits batches that are tensors or tuples of tensors; got {type(batch).__name__}")


def check_rows(rows: int, microbatches: int, where: str) -> None:
    if rows % microbatches or rows < microbatches:
        raise ConfigError(
            f"{where}: the per-rank batch of {rows} samples does not split into {microbatches} equal pipeline "
            f"micro-batches; choose a batch per rank (global batch / dp) that is a multiple of {microbatches}, "
            "or change microbatches"
        )


class _Replay:
    """Stands in for the model inside the user's ``step_fn`` on the last stage: returns the
    pipeline's output for the micro-batch, so ``loss_fn(model(*inputs), batch)`` runs as written."""

    def __init__(self, output: Any, inputs: tuple[Any, ...]) -> None:
        self.output, self.inputs = output, inputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        same = len(args) == len(self.inputs) and not kwargs and all(
            a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape) for a, b in zip(args, self.inputs)
        )
        if not same:
            raise ConfigError(
                "the pipeline strategy computes the loss on its last stage from the model's output: the step "
                "function must be loss_fn(model(*inputs), batch) with inputs the batch's leading elements "
                "(pass loss_fn=... to the Trainer; a training_step that calls the whole model cannot be split)"
            )
        return self.output


# -- the wrapped model -----------------------------------------------------------------------------


class PipelineModule(nn.Module):
    """This rank's share of the model, under the original names, callable like the user's model.

    ``module(x)`` (under ``torch.no_grad()``) runs every stage in order, activations sent from
    rank to rank over the pipeline group, and returns the last stage's output on every rank of
    the group (broadcast), so evaluation and sampling work unchanged. Every rank of the group
    must make the call (the first stage's rank reads ``x``). Training goes through the schedule
    (``Engine.forward_backward``), not through this forward.
    """

    def __init__(self, stages: dict[int, nn.Module], runners: dict[int, nn.Module], num_stages: int, group: Group, device: torch.device) -> None:
        super().__init__()
        for idx in sorted(stages):
            for name in stages[idx].layer_names:  # type: ignore[union-attr]
                _register(self, name, stages[idx].get_submodule(name))
        self._stage_mods = dict(stages)
        self._runners = dict(runners)  # what runs each stage (the stage module, or its DDP/FSDP wrapper)
        self.num_stages, self._group, self._device = num_stages, group, device
        self.pp = group.size

    def owner(self, stage: int) -> int:
        return stage % self.pp

    def forward(self, *inputs: Any) -> Any:
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            raise RuntimeError(
                "a pipeline-parallel model's forward does not carry gradients from stage to stage: train through "
                "engine.forward_backward (the pipeline schedule), and call the model under torch.no_grad() to evaluate"
            )
        me = self._group.rank
        x: tuple[Any, ...] = inputs
        out: Any = None
        for s in range(self.num_stages):
            owner = self.owner(s)
            if owner != me:
                continue
            if s > 0 and self.owner(s - 1) != me:
                x = (_recv_tensor(self._group, self.owner(s - 1), self._device),)
            out = self._runners[s](*x)
            if s < self.num_stages - 1 and self.owner(s + 1) != me:
                _send_tensor(out, self._group, self.owner(s + 1))
            x = (out,)
        return _broadcast_tensor(out, self._group, self.owner(self.num_stages - 1), self._device)


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8]
_HEADER = 10  # dtype code, ndim, up to 8 sizes


def _header(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
        raise ConfigError(f"a pipeline stage boundary must carry one tensor of at most {_HEADER - 2} dims; got {type(t).__name__}")
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _empty_from(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    ndim = int(h[1])
    return torch.empty([int(s) for s in h[2:2 + ndim]], dtype=_DTYPES[int(h[0])], device=device)


def _send_tensor(t: torch.Tensor, group: Group, dst: int) -> None:
    dst_global = group.global_rank(dst)
    dist.send(_header(t).to(t.device), dst=dst_global, group=group.pg)
    dist.send(t.contiguous(), dst=dst_global, group=group.pg)


def _recv_tensor(group: Group, src: int, device: torch.device) -> torch.Tensor:
    src_global = group.global_rank(src)
    h = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(h, src=src_global, group=group.pg)
    out = _empty_from(h.cpu(), device)
    dist.recv(out, src=src_global, group=group.pg)
    return out


def _broadcast_tensor(t: torch.Tensor | None, group: Group, src: int, device: torch.device) -> torch.Tensor:
    if group.size == 1:
        assert t is not None
        return t
    src_global = group.global_rank(src)
    h = _header(t).to(device) if group.rank == src and t is not None else torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.broadcast(h, src=src_global, group=group.pg)
    buf = t.contiguous() if group.rank == src and t is not None else _empty_from(h.cpu(), device)
    dist.broadcast(buf, src=src_global, group=group.pg)
    return buf


# -- timing ---------------------------------------------------------------------------------------


class _Clock:
    """Busy time of each forward and backward action, per step, on a clock shared by the group."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, str, float, float]] = []  # (stage, micro-batch, F|B, start, end)
        self.offset = 0.0

    def instrument(self, stage: Any) -> None:
        """Time the stage's ``forward_one_chunk`` and ``backward_one_chunk`` (the schedule's compute
        actions; waiting for activations and gradients happens outside them)."""
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        idx = stage.stage_index

        def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fwd(chunk, *args, **kwargs)
            finally:
                self.events.append((idx, chunk, "F", t0, time.perf_counter()))

        def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return bwd(chunk, *args, **kwargs)
            finally:
                self.events.append((idx, chunk, "B", t0, time.perf_counter()))

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk

    def align(self, group: Group) -> None:
        """Offset of this rank's ``perf_counter`` from the group's first rank (everyone leaves a barrier together)."""
        if group.size == 1:
            return
        dist.barrier(group=group.pg)
        now = torch.tensor([time.perf_counter()], dtype=torch.float64)
        got = [torch.zeros(1, dtype=torch.float64) for _ in range(group.size)]
        dist.all_gather(got, now, group=group.pg)
        self.offset = float(now) - float(got[0])


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

    # -- setup --------------------------------------------------------------------------------
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.pipelining import PipelineStage

        if not dist.is_initialized():
            raise ConfigError("strategy 'pipeline' needs a process group; start the run with nproc >= pp through shardwise (Trainer, launch, or shardwise run)")
        if mesh.size("pp") != self.pp:
            raise ConfigError(f"the mesh has pp={mesh.size('pp')} but the pipeline was asked for pp={self.pp}")
        self._mesh, self._recorder = mesh, recorder
        self._all_names = [n for n, _ in model.named_parameters()]
        runs = split_layers(sequence_layers(model), self.num_stages, self.split_points)
        self.stage_layers = [[n for n, _ in run] for run in runs]
        group = mesh.group("pp")
        me = mesh.coordinate("pp")
        stages: dict[int, nn.Module] = {}
        runners: dict[int, nn.Module] = {}
        self.stages: list[Any] = []
        for s in range(me, self.num_stages, self.pp):
            stage_mod = StageModule(runs[s]).to(mesh.device)
            if self.tp > 1:
                # Tensor parallel first, inside the stage (original names: the plan matches as on the whole model).
                _tensor_parallel().parallelize(stage_mod, mesh.device_mesh("tp"), plan=self.tp_plan, sequence_parallel=self.sequence_parallel)
            stages[s] = stage_mod
            runners[s] = self._apply_data_parallel(stage_mod, mesh)
            stage = PipelineStage(runners[s], s, self.num_stages, mesh.device, group=group.pg)
            self._clock.instrument(stage)
            self.stages.append(stage)
        self._group = group
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
        params = [p for s in sorted(stages) for p in stages[s].parameters()]
        return wrapped, make_optimizer(params)

    def _apply_data_parallel(self, stage_mod: nn.Module, mesh: Mesh) -> nn.Module:
        """Data parallel last, over the mesh's dp dimension: FSDP2 (``dp_strategy="fsdp"``), or,
        with ``ddp``, the stage module as it is and its gradients averaged after the schedule
        (`_average_grads`).

        Not torch's DistributedDataParallel: its reducer, fed one backward per micro-batch by the
        schedule, fails to rebuild its buckets after the first step (torch 2.13, gloo: "rebuilt
        parameter indices size is not same as original model parameters size")."""
        if mesh.size("dp") == 1 or self.dp_strategy == "ddp":
            return stage_mod
        if self.tp > 1:
            # One FSDP unit per stage (its "auto" units would pick the ModuleDict holding the stage's blocks).
            return cast(nn.Module, _tensor_parallel().shard_data_parallel(stage_mod, mesh.device_mesh("dp"), units="root"))
        from torch.distributed.fsdp import fully_shard

        return cast(nn.Module, fully_shard(stage_mod, mesh=mesh.device_mesh("dp")))

    def _average_grads(self) -> None:
        """Sequence-parallel partial gradients summed over tp, then every local gradient averaged
        across the data-parallel group: one flat allreduce per step."""
        assert self._mesh is not None
        if self.sequence_parallel:
            _tensor_parallel().reduce_partial_grads(self._module, self._recorder)
        if self._mesh.size("dp") == 1 or self.dp_strategy != "ddp":
            return
        if self.tp > 1:  # gradients are DTensors: average their local shards
            _tensor_parallel().replicate_grads(self._module, self._mesh.group("dp"), self._recorder)
            return
        grads = [p.grad for p in self._module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, "mean", group=self._mesh.group("dp"), recorder=self._recorder)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    # -- one step -----------------------------------------------------------------------------
    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the user's step function on micro-batch ``target``."""
        i = int(target.reshape(-1)[0])
        batch = self._chunks[i]
        from shardwise.trainer.loop import model_inputs  # layer 5 helper, imported at run time (no cycle)

        loss = self._step_fn(_Replay(output, model_inputs(batch)), batch)  # type: ignore[arg-type]
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
        from shardwise.trainer.loop import model_inputs

        self._chunks = split_batch(batch, self.microbatches)
        self._step_fn, self._precision = step_fn, precision
        self._losses: dict[int, torch.Tensor] = {}
        self._clock.events = []
        args = model_inputs(batch) if self.holds_first else ()
        target = torch.arange(self.microbatches) if self.holds_last else None
        start = time.perf_counter()
        with precision.autocast():
            self.schedule.step(*args, target=target, **self._step_kwargs)
        end = time.perf_counter()
        self._chunks = []
        self._average_grads()
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
        """Clip by the global norm: a gradient's squared norm counts once, summed over the tp ranks
        that hold shards of it and over the pp ranks (each parameter lives on one stage), never
        over replicas (dp, or tp for replicated tensors). Same coefficient as torch's
        ``clip_grad_norm_``: ``max_norm / (norm + 1e-6)``, at most 1."""
        params = [p for p in model.parameters() if p.grad is not None]
        device = self._mesh.device if self._mesh else torch.device("cpu")
        replicated = torch.zeros((), dtype=torch.float64, device=device)
        sharded: dict[tuple[int, tuple[int, ...]], tuple[Any, torch.Tensor]] = {}  # (mesh, sharded dims) -> (mesh, sum of squares)
        locals_: list[torch.Tensor] = []
        for p in params:
            g: Any = p.grad
            local: torch.Tensor = g.to_local() if hasattr(g, "to_local") else g
            locals_.append(local)
            sq = local.double().pow(2).sum()
            # Sharded along a mesh dim: any placement but Replicate and Partial (torch 2.13's
            # _StridedShard, which FSDP2 over TP produces, answers is_shard() False).
            dims = tuple(i for i, pl in enumerate(getattr(g, "placements", ())) if not (pl.is_replicate() or pl.is_partial()))
            if dims:
                key = (id(g.device_mesh), dims)
                mesh_, acc = sharded.get(key, (g.device_mesh, torch.zeros((), dtype=torch.float64, device=device)))
                sharded[key] = (mesh_, acc + sq)
            else:
                replicated = replicated + sq
        for (_, dims), (mesh_, acc) in sharded.items():
            for d in dims:  # tp shards, fsdp's dp shards: each piece counted once
                dist.all_reduce(acc, group=mesh_.get_group(d))
            replicated = replicated + acc
        total_sq = replicated.reshape(1)
        if self.pp > 1:
            dist.all_reduce(total_sq, group=self._group.pg)
        norm = total_sq.sqrt()[0]
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if locals_:
            torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
        dtype = locals_[0].dtype if locals_ else torch.float32
        return norm.to(dtype)

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """The whole model (and optimizer, numbered as the whole model's optimizer numbers its
        parameters), gathered from every pipeline rank to every rank of the group."""
        stage_mods = model._stage_mods if isinstance(model, PipelineModule) else {0: model}
        local_model = {s: {k: _full(v).detach().cpu() for k, v in m.state_dict().items()} for s, m in stage_mods.items()}
        local_opt = None
        if optimizer is not None:
            named = ckpt.optimizer_state_by_name(optimizer.state_dict(), ckpt.parameter_names(model, optimizer))
            local_opt = {"state": {k: {n: _full(t) for n, t in s.items()} for k, s in named["state"].items()}, "param_groups": named["param_groups"]}
            local_opt = _to_cpu(local_opt)
        parts: list[Any] = [None] * self.pp
        dist.all_gather_object(parts, (local_model, local_opt), group=self._group.pg)
        by_stage = {s: sd for stage_states, _ in parts for s, sd in stage_states.items()}
        full_model: dict[str, Any] = {}
        for s in sorted(by_stage):  # stage order is the model's order: its state_dict order
            full_model.update(by_stage[s])
        out: dict[str, Any] = {"model": full_model}
        if optimizer is not None:
            state: dict[str, Any] = {}
            groups: list[dict[str, Any]] = []
            for _, opt in parts:
                state.update(opt["state"])
                for gi, g in enumerate(opt["param_groups"]):
                    if gi < len(groups):
                        groups[gi]["params"] = groups[gi]["params"] + list(g["params"])
                    else:
                        groups.append(dict(g, params=list(g["params"])))
            order = {n: i for i, n in enumerate(self._all_names)}
            for g in groups:
                g["params"] = sorted(g["params"], key=lambda n: order[n])
            names = [n for g in groups for n in g["params"]]
            out["optimizer"] = ckpt.optimizer_state_by_number({"state": state, "param_groups": groups}, names)
        return out

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        """Keep this rank's part of a whole-model state (from any strategy's ``state_dict``)."""
        own = model.state_dict()
        missing = [k for k in own if k not in state["model"]]
        if missing:
            from shardwise.errors import CheckpointError

            raise CheckpointError(f"the state has no {missing[:5]} for this pipeline stage")
        if any(hasattr(v, "full_tensor") for v in own.values()):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, {k: state["model"][k] for k in own}, options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict({k: state["model"][k] for k in own})
        if optimizer is None or "optimizer" not in state:
            return
        full = state["optimizer"]
        named = ckpt.optimizer_state_by_name(full, self._all_names)
        local_names = ckpt.parameter_names(model, optimizer)
        keep = set(local_names)
        sub = {
            "state": {n: s for n, s in named["state"].items() if n in keep},
            "param_groups": [dict(g, params=[n for n in g["params"] if n in keep]) for g in named["param_groups"]],
        }
        sub["param_groups"] = [g for g in sub["param_groups"] if g["params"]]
        if any(hasattr(v, "full_tensor") for v in own.values()):
            # Sharded parameters (tp, fsdp): torch slices each whole tensor to this rank's shard (state keyed by name).
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, cast(Any, sub), options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(ckpt.optimizer_state_by_number(sub, local_names))

    # -- observability ------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The ``pipeline`` section (collective over the pipeline group when ``timeline`` is set)."""
        measured_steps = self._steps[self.warmup_steps:] or self._steps
        per_stage: list[list[float]] = [[] for _ in range(self.pp)]
        busy: list[list[float]] = [[] for _ in range(self.pp)]
        walls, step_means = [], []
        for rows in measured_steps:
            wall, bubbles = step_bubbles([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
            walls.append(wall)
            step_means.append(sum(bubbles) / len(bubbles))
            for i, b in enumerate(bubbles):
                per_stage[i].append(b)
                busy[i].append(rows[i][0])
        section: dict[str, Any] = {
            "schedule": self.schedule_name, "pp": self.pp, "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages, "stages": self.num_stages,
            "stage_layers": getattr(self, "stage_layers", None),
            "bubble_measured": mean([mean(s) for s in per_stage]) if measured_steps else None,
            # The median step resists a step the OS stalled (shared machines); the mean is the headline.
            "bubble_measured_median_step": statistics.median(step_means) if step_means else None,
            "bubble_predicted": predicted_bubble(self.schedule_name, self.pp, self.microbatches, self.virtual_stages),
            "bubble_formula": "(p-1)/(v*m+p-1)" if self.schedule_name == "interleaved" else "(p-1)/(m+p-1)",
            "bubble_source": "Narayanan et al. 2021 (Megatron-LM, SC'21), section 2.2",
            "steps_measured": len(measured_steps),
            "step_wall_s": mean(walls),
            "per_stage": [{"rank": i, "stages": list(range(i, self.num_stages, self.pp)), "bubble": mean(per_stage[i]), "busy_s": mean(busy[i])} for i in range(self.pp)],
        }
        if self.timeline and dist.is_initialized() and getattr(self, "_group", None) is not None:
            events: list[Any] = [None] * self.pp
            dist.all_gather_object(events, self._last_events, group=self._group.pg)
            if self._mesh is not None and self._mesh.rank == 0:
                section["timeline"] = write_timeline(self.timeline, [e for ev in events for e in ev], self.pp, self.schedule_name)
        return {"pipeline": section}


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _tensor_parallel() -> Any:
    try:
        from shardwise.strategies import tensor_parallel
    except ImportError as exc:
        raise ConfigError("pipeline with tp > 1 needs shardwise.strategies.tensor_parallel, which this installation does not have; use tp=1") from exc
    return tensor_parallel


def write_timeline(path: str, events: list[tuple[int, int, str, float, float]], pp: int, schedule: str) -> str:
    """A PNG of which stage ran which micro-batch's forward (F) and backward (B) when, one row per
    rank, and the events as JSON next to it (``<path>.json``); returns the PNG's path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = min((e[3] for e in events), default=0.0)
    rows: list[dict[str, Any]] = [{"stage": st, "rank": st % pp, "microbatch": mb, "kind": k, "start_s": s - t0, "end_s": e - t0} for st, mb, k, s, e in sorted(events, key=lambda e: e[3])]
    out.with_suffix(out.suffix + ".json").write_text(json.dumps({"schedule": schedule, "pp": pp, "events": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("the pipeline timeline PNG needs matplotlib (pip install 'shardwise[plot]'); the events were written as JSON") from exc
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * pp))
    stages = max((r["stage"] for r in rows), default=0) + 1
    cmap = plt.get_cmap("tab10")
    for r in rows:
        shade = 0.35 if r["kind"] == "F" else 0.85
        color = cmap(r["stage"] // pp % 10)
        ax.barh(r["rank"], (r["end_s"] - r["start_s"]) * 1e3, left=r["start_s"] * 1e3, height=0.8, color=color, alpha=shade + 0.15, edgecolor="black", linewidth=0.3)
        ax.text((r["start_s"] + r["end_s"]) / 2 * 1e3, r["rank"], f"{r['kind']}{r['microbatch']}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {i}" for i in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first action")
    ax.set_title(f"{schedule}: {stages} stages on {pp} ranks (F light, B dark; colour = model chunk)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)
