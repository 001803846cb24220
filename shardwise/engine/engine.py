"""The `Engine` class: one process's handle on a distributed job (the package docstring says more)."""

from __future__ import annotations

import contextlib
import gc
import os
import random
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.comm import WORLD, Group, Recorder, all_reduce
from shardwise.comm.mesh import Mesh
from shardwise.data import ShardedLoader, pinning, unpack_data
from shardwise.data.stream import StreamLoader, loader_for
from shardwise.engine import checkpoints
from shardwise.engine.collectives import Collectives
from shardwise.engine.plan import plan_strategy
from shardwise.errors import ConfigError
from shardwise.launcher.env import DEFAULT_TIMEOUT_S, DistEnv, choose_device, connect, detect_env
from shardwise.launcher.memory import return_large_frees
from shardwise.strategies import Layout, OptimizerFactory, Parallel, StepFn, Strategy, checkpointing, compiling, materialize
from shardwise.strategies.batchnorm import UNSYNCED_REPLICAS, convert_sync_batchnorm, unsynced_batchnorm_warning
from shardwise.strategies.precision import Precision


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every device) with one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Engine(Collectives):
    """One process's handle on a distributed job: strategy, precision, device, collectives, checkpoints."""

    def __init__(
        self,
        *,
        strategy: str | Strategy = "single",
        accelerator: str = "auto",
        precision: str | int = "32",
        strategy_options: dict[str, Any] | None = None,
        mesh: dict[str, int] | None = None,
        seed: int | None = None,
        deterministic: bool = False,
        timeout_s: float | None = None,
        env: DistEnv | None = None,
        sync_batchnorm: bool = False,
        layout: Layout | None = None,
        out: str | os.PathLike[str] | None = None,
        loggers: Sequence[Any] | str | None = None,
        callbacks: Sequence[Any] = (),
        activation_checkpointing: str = "off",
        compile: str | bool = "off",
    ) -> None:
        self.out = Path(out) if out is not None else None
        """Where the loggers write (``loggers=`` by name need it)."""
        self.callbacks = list(callbacks)
        """Objects whose methods `call` runs by name (as Lightning Fabric's ``fabric.call``)."""
        self._loggers = _EngineLoggers(loggers, self.out)
        self._finished: dict[str, Any] | None = None
        self.env = env if env is not None else detect_env()
        if isinstance(strategy, Strategy) and layout is not None:  # planned and checked by the Trainer's parent (`plan_strategy`)
            self.strategy, self.layout = strategy, layout
        else:
            self.strategy, self.layout = plan_strategy(
                strategy, strategy_options, self.env.world_size, precision=precision, sync_batchnorm=sync_batchnorm, mesh=mesh
            )
        """``layout``: the strategy's plan for this job (the Trainer's parent passes the one it made; alone, the engine plans)."""
        self.sync_batchnorm = sync_batchnorm
        """BatchNorm layers become SyncBatchNorm over the data-parallel group in ``setup``."""
        self.activation_checkpointing = checkpointing.parse(activation_checkpointing)
        """Which blocks ``setup`` makes recompute their forward in backward (`shardwise.strategies.checkpointing`)."""
        self.compile = compiling.parse(compile)
        """What ``setup`` compiles with ``torch.compile`` (`shardwise.strategies.compiling`): nothing, the model or its blocks."""
        self.compiled: compiling.Tracker | None = None
        """What this process compiled (`compiling.Tracker`: seconds, graphs, recompilations), once ``setup`` compiled."""
        self.device = choose_device(accelerator, self.env)
        return_large_frees()  # freed tensors go back to the system, so each rank's peak is what its tensors hold
        self._owns_group = connect(self.env, self.device, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        if timeout_s is not None and not self._owns_group and dist.is_initialized():
            _set_timeout(timeout_s)  # a group made before (launch's, the user's): the timeout asked for here holds
        self.world_mesh = Mesh.build(world_size=self.env.world_size, rank=self.env.rank, device=self.device, **self.layout.degrees)
        """The mesh over every process, as the plan laid it out (`mesh` is the loop's)."""
        self.precision = Precision(precision, self.device)
        self.recorder = Recorder()
        if deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        if seed is not None:
            seed_everything(seed)
        self.parallel: Parallel | None = None
        """The strategy applied to this process's model (``setup`` builds it, once per model)."""
        self._runs: list[Parallel] = []
        self.writes_checkpoints = True
        """False on a training rank whose loop group lacks rank 0 (it loops alone, as an async
        parameter-server worker does): ``save`` writes nothing there, so it never races rank 0."""
        self.steps_taken = 0
        self._loggers.open(self.is_rank_zero)
        if self.is_rank_zero and self.env.distributed and dist.is_initialized():
            print(f"shardwise: {self.env.world_size} processes, backend {dist.get_backend()} on {self.device.type}, strategy {self.strategy.name}", flush=True)

    # -- where this process stands -------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        """The loop's mesh: the world's, unless the strategy's placement keeps ranks out of the loop."""
        place = self.parallel.placement if self.parallel is not None else None
        return place.mesh if place is not None and place.mesh is not None else self.world_mesh

    @property
    def group(self) -> Group:
        """The ranks that run the loop (the world, unless the strategy's placement keeps some to serve)."""
        return self.parallel.placement.group if self.parallel is not None else WORLD

    @property
    def steps_together(self) -> bool:
        """Whether the loop's ranks take every step together (`Placement.steps_together`): per-step verdicts are agreed over ``group``."""
        return self.parallel.placement.steps_together if self.parallel is not None else True

    @property
    def trains(self) -> bool:
        """False on a rank that only serves (a parameter server): it served in ``setup``; skip the loop."""
        return self.parallel.placement.trains if self.parallel is not None else True

    @property
    def data_mesh(self) -> Mesh:
        """The mesh the training data is sharded over: the loop's, unless the placement says otherwise
        (asynchronous parameter-server workers take their slice of each global batch, but log,
        evaluate and checkpoint alone)."""
        place = self.parallel.placement if self.parallel is not None else None
        return place.data_mesh if place is not None and place.data_mesh is not None else self.mesh

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def is_rank_zero(self) -> bool:
        return self.env.rank == 0

    # -- model, optimizer, steps ---------------------------------------------------
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Place and wrap ``model`` for the strategy and build its optimizer afterwards.

        ``make_optimizer`` receives the parameters to optimize (after wrapping, so
        sharded strategies hand it only their shard).
        """
        if not isinstance(model, nn.Module):
            raise ConfigError(f"setup needs a torch.nn.Module; got {type(model).__name__}")
        if not callable(make_optimizer) or isinstance(make_optimizer, torch.optim.Optimizer):
            raise ConfigError(
                "setup needs an optimizer *factory*, a function of the parameters "
                "(e.g. lambda params: torch.optim.Adam(params, lr=1e-3)), because sharding strategies "
                "must build the optimizer after wrapping the model"
            )
        if not any(True for _ in model.parameters()):
            raise ConfigError(f"the model {type(model).__name__} has no parameters; there is nothing to train")
        if materialize.has_meta(model):
            # Built on the meta device: each rank gives storage to its share only. The plan (which initializer writes
            # what, found on meta tensors) is made on the whole model, before the strategy wraps or splits it.
            init = materialize.plan_init(model)
            init.check()
            if self.strategy.shards_meta:
                materialize.attach(model, init)  # the strategy's apply fills this rank's share (`materialize.fill_share`)
            else:
                materialize.fill(model, init, device=self.device)  # replicas hold the whole model
        model = self.precision.convert_module(model)
        self._batchnorm(model)
        checkpointing.apply(model, self.activation_checkpointing)
        if self.compile.enabled:  # the Trainer's parent checked it; an Engine of the user's own loop checks it here
            compiling.check(self.compile, model, self.strategy, self.device.type)
        where = self.compile.resolved(self.strategy.compile_unit) if self.compile.enabled else "off"
        tracker = compiling.Tracker(self.compile, self.strategy.compile_unit) if where != "off" else None
        self.compiled = tracker
        if tracker is not None and where == "blocks":  # before the strategy: FSDP2 shards compiled units, tp splits them, stages keep them
            tracker.compiled = compiling.compile_blocks(model, self.compile)
        self.parallel = self.strategy.apply(model, make_optimizer, self.world_mesh, self.recorder)
        if tracker is not None and where == "model":  # after: the module the strategy runs (DDP's wrapper, so its buckets split the graph)
            tracker.compiled = compiling.compile_module(self.parallel.model, self.compile)
        self._runs.append(self.parallel)
        self.writes_checkpoints = self.group.contains(0)
        return self.parallel.model, self.parallel.optimizer

    def _run(self, model: nn.Module | None = None) -> Parallel:
        """The run ``setup`` built for ``model`` (the wrapper it returned), else the latest."""
        for run in reversed(self._runs):
            if model is None or run.model is model:
                return run
        if self.parallel is None:
            raise ConfigError("call engine.setup(model, make_optimizer) first")
        return self.parallel

    @property
    def _model(self) -> nn.Module | None:
        return self.parallel.model if self.parallel is not None else None

    @property
    def _optimizer(self) -> torch.optim.Optimizer | None:
        return self.parallel.optimizer if self.parallel is not None else None

    def _batchnorm(self, model: nn.Module) -> None:
        """SyncBatchNorm over the dp group when asked; otherwise a warning, once, when BatchNorm trains data-parallel."""
        dp = self.mesh.size("dp")
        if self.sync_batchnorm and dp > 1:
            convert_sync_batchnorm(model, self.mesh.group("dp"), self.recorder)
        elif self.strategy.name not in UNSYNCED_REPLICAS:
            warning = unsynced_batchnorm_warning(model, dp)
            if warning and self.is_rank_zero:
                print(warning, flush=True)

    def run_of(self, model: nn.Module) -> Parallel | None:
        """The strategy's run behind the wrapper ``setup`` returned (None for any other module)."""
        return next((run for run in self._runs if model is run.model), None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the wrapper ``setup`` returned (any other module as it is)."""
        for run in self._runs:
            if model is run.model:
                return run.module()
        return model

    def to_device(self, batch: Any) -> Any:
        """Move a batch to this rank's device (and to float64 under precision '64')."""
        return self.precision.convert_input(batch)

    def autocast(self) -> AbstractContextManager[Any]:
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled for fp16 when the precision needs it."""
        self.precision.backward(loss)

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn) -> torch.Tensor:
        """Forward and backward over one step's micro-batches (sync on the last only)."""
        return self._run(model).forward_backward(microbatches, step_fn, self.precision)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """Skip gradient synchronization inside the block (all but the last micro-batch)."""
        return self._run(model).no_sync()

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm (unscaling fp16 gradients first); returns the norm."""
        if max_norm <= 0:
            raise ConfigError(f"max_norm must be > 0; got {max_norm}")
        self.precision.unscale(optimizer)
        return self._run(model).clip_grad_norm(max_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer (through the grad scaler under fp16); False if fp16 overflow skipped it.

        Then the strategy's ``after_step`` runs (local SGD's averaging round), on every rank,
        skipped step or not, so all ranks reach the same rounds.
        """
        agree = None
        if self.precision.scaler is not None and self.group.size > 1:
            agree = lambda flag: all_reduce(flag, "max", group=self.group, recorder=self.recorder)  # noqa: E731  # one overflow verdict
        stepped = self.precision.step(optimizer, agree)
        self.steps_taken += 1
        run = next((r for r in reversed(self._runs) if r.optimizer is optimizer), self.parallel)
        if run is not None:
            run.after_step(self.steps_taken)
        return stepped

    def finish(self) -> dict[str, Any]:
        """End the strategy's run on this rank (collective reports, servers stop; call on every rank
        once training is over) and return its section of summary.json."""
        run = self._run()
        run.finish()
        self._finished = run.summary()
        if self.compiled is not None:
            report = self._finished["compile"] = self.compiled.report()
            if self.is_rank_zero and self.trains and self.steps_taken and not report["graphs"]:
                ran = ", ".join(report["compiled"])
                print(
                    f"shardwise: compile={self.compile} made no graph on rank 0: {ran} ran uncompiled (Dynamo traced no frame of it), "
                    "or ran graphs an earlier run in this process compiled",
                    flush=True,
                )
        return self._finished

    # -- loggers and callbacks (rank 0 logs; every rank calls) ----------------------
    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one metric to the loggers (rank 0 only; others return at once): ``value`` a number
        or a one-element tensor, ``step`` by default the optimizer steps taken so far. The value is
        rank 0's as it is: reduce it first (``engine.all_reduce(loss.detach().clone())``) to log
        the mean over ranks."""
        self.log_dict({name: value}, step)

    def log_dict(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """`log` for several metrics at one step."""
        if not self._loggers.active:
            return
        record = {k: (v.detach().item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        self._loggers.active.log_metrics({**record, "step": self.steps_taken if step is None else int(step)})

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record hyperparameters once (nested dicts are flattened to ``a.b`` keys); rank 0 only."""
        if self._loggers.active:
            from shardwise.engine.loggers import flatten

            self._loggers.active.log_hyperparams(flatten(params))

    def call(self, hook: str, *args: Any, **kwargs: Any) -> None:
        """Run ``hook(*args, **kwargs)`` on every callback that defines it, in order (on this rank;
        call it on every rank when the hook runs a collective)."""
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if callable(fn):
                fn(*args, **kwargs)

    # -- collectives: all_reduce, broadcast, reduce, gather, scatter, gather_for_metrics, barrier
    # (`shardwise.engine.collectives.Collectives`, a base class) -------------------------------

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (download, preprocess, cache); the others after it."""
        if not self.is_rank_zero:
            self.barrier()
        yield
        if self.is_rank_zero:
            self.barrier()

    def loader(
        self,
        data: Any,
        *,
        global_batch: int,
        accumulate: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = True,
        limit: int | float | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        resume: str = "auto",
    ) -> ShardedLoader | StreamLoader:
        """This rank's loader of ``data`` over the engine's data mesh (call after ``setup``): a `ShardedLoader` for a
        map-style Dataset, a `StreamLoader` for a stream (an IterableDataset; ``resume`` 'auto' or 'replay', no
        ``shuffle``), a DataLoader's own collate_fn and workers taken. Iterate it for each step's ``accumulate``
        micro-batches; put it in what `save` and `load` get (``{"loader": loader, ...}``): its position resumes."""
        dataset, collate, workers, _ = unpack_data(data)
        return loader_for(
            dataset,
            resume=resume,
            shuffle=shuffle,
            global_batch=global_batch,
            world_size=self.data_mesh.size("dp"),
            rank=self.data_mesh.coordinate("dp"),
            accumulate=accumulate,
            seed=seed,
            collate_fn=collate,
            num_workers=max(workers, num_workers),
            limit=limit,
            drop_last=drop_last,
            pin_memory=pinning(pin_memory, self.device)[0],
            prefetch_factor=prefetch_factor,
        )

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_rank_zero:
            print(*args, **kwargs, flush=True)

    # -- checkpoints (`shardwise.engine.checkpoints`) -------------------------------------------
    def save(self, path: str | os.PathLike[str], state: dict[str, Any], *, meta: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint directory atomically. Call on every rank.

        ``state`` maps names to the model and optimizer from ``setup``, to objects
        with ``state_dict()`` (schedulers, the data loader), or to plain values.
        Every rank's RNG streams are saved with it. Under a sharded strategy the model
        and optimizer are written in shards by every rank (``dcp/``, see `shardwise.checkpoint`).
        The strategy's ``save_extra_state(directory)`` adds its own files
        (each replica's state, the parameter servers' shards) before the manifest is written.
        """
        return checkpoints.save(self, path, state, meta=meta)

    def consolidated_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole parameters and buffers by name, on CPU; collective under sharded strategies (call on every rank)."""
        full = self._run(model).state_dict(optimizer=False)["model"]
        return {k: ckpt.full_tensor(v).detach().cpu() for k, v in full.items()}

    def load(self, path: str | os.PathLike[str], state: dict[str, Any], *, restore_rng: bool = True) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint; returns the saved values that are not objects."""
        return checkpoints.load(self, path, state, restore_rng=restore_rng)

    def close(self) -> None:
        """Leave the process group if this engine created it, and free it while Python is alive.

        ``destroy_process_group`` only forgets the group: its C++ object, and gloo's worker
        threads with it, live on while anything refers to it (a DDP wrapper's reducer, a
        strategy's run). Freed later, in the interpreter's finalization, a worker thread
        that still holds the last collective's tensors needs the GIL to let them go, and
        the process aborts ("terminate called without an active exception", exit -6) after
        a run that succeeded. So the engine drops its runs first and collects them. A loop
        of your own that still holds the wrapped model keeps the group alive: drop it
        (``del model``) before ``close``.
        """
        if self._loggers.active:
            self._loggers.active.finalize({"steps": self.steps_taken, **(self._finished or {})})
            self._loggers.active = None
        if self._owns_group and dist.is_initialized():
            self.parallel = None
            self._runs.clear()
            dist.destroy_process_group()
            gc.collect()
            self._owns_group = False


def _set_timeout(seconds: float) -> None:
    """Set the default group's collective timeout (a group the engine joined rather than made)."""
    import datetime

    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=seconds))
    except (ImportError, AttributeError, ValueError, RuntimeError) as exc:  # a torch without it, or a backend that refuses
        if dist.get_rank() == 0:
            print(f"shardwise: could not set the collective timeout of the existing process group to {seconds:g} s ({exc}); it keeps its own", flush=True)


class _EngineLoggers:
    """The engine's loggers: named (``"csv"``, ...) or objects, built on rank 0 only once the
    rank is known; ``active`` is their fan-out there, None elsewhere or without loggers."""

    def __init__(self, loggers: Sequence[Any] | str | None, out: Path | None) -> None:
        from shardwise.engine.loggers import Logger, check_names

        items = [x for x in (loggers.split(",") if isinstance(loggers, str) else list(loggers or ())) if x != ""]
        for item in items:
            if not isinstance(item, (str, Logger)):
                raise ConfigError(f"loggers takes names ('csv', 'tensorboard', 'mlflow', 'wandb') or Logger objects; got {type(item).__name__}")
        self.names = [x for x in items if isinstance(x, str)]
        self.objects = [x for x in items if isinstance(x, Logger)]
        check_names(self.names)
        if self.names and out is None:
            raise ConfigError(f"loggers ({', '.join(self.names)}) write into a run directory: pass Engine(out=DIR, loggers=...)")
        self.out = out
        self.active: Any = None

    def open(self, rank_zero: bool) -> None:
        if rank_zero and (self.names or self.objects):
            from shardwise.checkpoint.rundir import new_run_id
            from shardwise.engine.loggers import Loggers, RunInfo

            self.active = Loggers.build(self.names, self.objects, RunInfo(self.out, new_run_id()))


def call_through(model: nn.Module, module: nn.Module, method: str, *args: Any) -> Any:
    """Call ``module.<method>(*args)`` through the wrapper's forward, so its hooks (DDP's sync) run.

    Wrappers like DDP only synchronize what passes through their ``forward``; a
    ``training_step`` method called directly would bypass it. For one call,
    ``module.forward`` is a redirect that first restores the real forward (the
    method itself usually calls ``self(x)``; an instance's own replacement, as
    context parallelism's, is kept) and then runs the method.
    """
    if model is module:
        return getattr(module, method)(*args)

    own = module.__dict__.get("forward")  # a forward replaced on the instance (context parallelism's) stays in force

    def put_back() -> None:
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = own

    def redirect(*a: Any, **k: Any) -> Any:
        put_back()
        return getattr(module, method)(*a, **k)

    module.forward = redirect
    try:
        return model(*args)
    finally:
        put_back()
