"""``ps`` and ``central``: parameter servers (sync, async, stale synchronous), and central storage.

A launch of N processes runs ``N - servers`` workers (ranks ``0 .. W-1``) and ``servers``
parameter servers (ranks ``W .. N-1``), as in Li et al. 2014, "Scaling Distributed Machine
Learning with the Parameter Server" (OSDI). Parameters are partitioned over the servers
whole tensor by whole tensor, balanced by bytes; each server holds its shard and the
optimizer state of that shard (`server`). Each worker step:

    forward/backward on this worker's slice of the global batch (no collective)
    -> push: one message per server, the gradient of its shard (optionally compressed)
    -> pull: one answer per server, the shard's fresh parameters

The worker's "optimizer" is a `RemoteOptimizer` (`client`), whose ``step`` is that push and
pull, so the trainer's loop runs unchanged on workers; the worker's scheduler still sets the
learning rate, which travels in the push header. The wire format is `protocol`'s. Every
message, and the groups the workers form, go through `shardwise.comm`, so the recorder sees
every byte (``ps/push`` and ``ps/pull`` per step; see `client`).

The plan (``plan``, in the parent) knows everything before a process starts: the last
``servers`` ranks serve, the global batch is split over the workers only, asynchronous
workers other than rank 0 are expendable, and it refuses a world with no worker, a mesh with
model-parallel degrees, a model with fewer parameter tensors than servers. ``apply`` (every
process) serves on server ranks, inside ``apply``, until every worker is done, then returns a
run whose placement says ``trains=False``; on workers it returns at once with the workers'
mesh and group for the loop. ``finish`` (workers) ends the session with the servers, once;
worker 0 then receives their report and final parameters. ``summary`` reports.

Modes (``mode=``): ``sync`` equals ddp when no clip clips (see Known limits); ``async`` applies
each gradient on arrival; ``ssp`` with ``staleness=S`` bounds how far any worker runs ahead of
the slowest (Ho et al. 2013). The staleness of every applied gradient is recorded and reported
in summary.json under ``ps``, with the updates each server applied and the workers it lost.

``central`` is TensorFlow's CentralStorageStrategy: one server holds all parameters and the
optimizer, workers compute, updates are synchronous; here it is ``ps`` with one server in
sync mode (its summary section is ``ps``'s).

Checkpoints: ``save_extra_state`` (worker 0, called by the engine inside the checkpoint's
temporary directory) has every server write its shard, optimizer state and version there
(``server-NNN.pt``) before the manifest; ``load_extra_state`` (every worker) has every server
restore its file and answer with its parameters. Workers keep their clock in the
`RemoteOptimizer`'s state. A sync run resumed in new processes equals an uninterrupted one
bit for bit; an async or ssp resume continues from the servers' state at the save (which
gradients were in flight then is timing, so it cannot be bit-exact).

Lost workers: under ``async`` and ``ssp`` no worker waits for another, so each worker's
loop runs alone (the trainer's logged loss, evaluation and checkpoints: its own; rank 0's
are the run's), the placement's data mesh still splits each global batch over the workers,
and the plan's expendable ranks let `shardwise.launch` lose workers other than rank 0: the
servers drop a worker silent for ``worker_timeout_s`` (never worker 0, which reports the run)
and summary.json lists it under ``ps.lost_workers``. Under ``sync`` a lost worker stops the
run (the launcher names it).

Known limits: clipping is per worker (before the push), so with a clip that clips, sync applies
mean_w(clip(g_w)) where ddp applies clip(mean_w(g_w)); clipping the mean once would need each
server's squared norm of its averaged shard summed over the servers before any applies (one
scalar per server per step), which the servers' protocol does not carry yet; codecs'
error-feedback residuals (worker side) restart at zero after a resume.

Design notes: ranks that serve
==============================

- **Parameter servers** keep some ranks out of the loop. Workers are ranks `0 .. W-1` (so rank 0,
  which logs and writes `summary.json`, is a worker), servers `W .. N-1`. On a server rank
  `apply` serves until every worker is done or lost and only then returns; its the run's `placement`
  says `trains=False`, and the trainer returns at once (the one generic line in the loop: "if
  not engine.trains: return"). Under `sync`, the run's `placement` gives the workers a mesh of W
  data-parallel ranks and the workers' process group; the engine's own collectives (the logged
  loss, evaluation sums, checkpoint barriers) run over that group, so servers never join them.
  the plan's `trainers` lets `Trainer` check the global batch against W before anything starts.
- **Async and ssp workers loop alone.** No worker waits for another there, so nothing in the
  loop may make them meet: each worker's the run's `placement` is a one-rank group of its own and a
  one-rank mesh (its logged loss is its own loss, it evaluates the whole validation set alone,
  and its checkpoint calls write nothing: `Engine.writes_checkpoints` is false on a rank whose
  loop group lacks rank 0), while the placement's `data_mesh` (read into `Engine.data_mesh`, which the loader
  uses) still splits each global batch over the W workers. Rank 0's logs, evaluations and
  checkpoints are the run's. Code that writes its own loop should shard data by
  `engine.data_mesh`, not `engine.mesh`.
- A worker's optimizer is a `RemoteOptimizer`: `step()` pushes each shard's gradient to its
  server and pulls the fresh shard back, so the loop is unchanged; the learning rate (the
  worker's scheduler) travels in the push header, and the worker's clock (steps pushed) is
  kept in the optimizer's state dict. Messages are single `uint8` tensors, a 64-byte float64
  header (kind, worker, step, lr, version, length) then the payload (dense, or a codec's packed
  payload with error feedback); no pickled objects cross the wire.
- A server receives from any source (gloo supports `irecv` without a source). Gloo's receive
  cannot be polled or cancelled and a timed-out wait closes its connections, so a helper thread
  blocks on the receive and the serving loop waits on a queue with a timeout: a worker silent
  for `worker_timeout_s` (default 60) while the server owed it nothing is declared lost; sync
  steps with the rest and ssp's slowest clock moves on; `ps.lost_workers` reports it. An async
  or ssp worker that speaks again was only slow and rejoins; under sync that is an error naming
  the worker (raise `worker_timeout_s` above the longest pause between steps: evaluation,
  checkpoints). A receive left posted at exit makes gloo abort, so the reporting worker's last
  message (`BYE`) completes the server's last one.
- **Servers' checkpoints.** `Engine.save` runs the strategy's `save_extra_state` inside
  `checkpoint.write`, after each rank's own files and before the barrier that precedes the
  manifest. There worker 0 sends each server `SAVE` with the temporary directory's path (its
  UTF-8 bytes, a second message on `CTRL_TAG`); each server writes `server-NNN.pt` (its shard,
  which tensors it holds, its optimizer's state dict, its version and clocks; fsynced) and
  answers `SAVED`. So the servers' files are written before the manifest, hashed in it, and
  published by the same rename; servers need the checkpoint directory on their file system
  (one machine, or a shared one, as for every multi-process checkpoint). On resume, every
  worker's `load_extra_state` checks that the checkpoint holds server files, then sends `LOAD`
  with the path and its clock; each server reads the files on the first `LOAD`, sets that
  worker's clock, and answers with its parameters, which replace worker 0's copy from
  `state.pt`. Each file says which of the model's tensors (by position) it holds, so a
  checkpoint resumes under another number of servers too: each server takes its tensors and
  their optimizer state from whichever files hold them (renumbered into its own optimizer's
  order; this needs one parameter group) and the newest version. Sync resumed in new processes equals an uninterrupted run bit for bit
  (one and two servers, `tests/strategies/param_server/test_ps_resume.py`; two servers' checkpoint loaded by one
  server holds exactly their tensors and Adam state). Async and ssp cannot: the servers'
  state at the save holds whichever pushes had arrived (a save is not a barrier for the other
  workers, and with several servers each shard is saved at its own moment), so a resume goes
  on from there; the test checks it resumes from the saved version and trains on.
- **Losing a worker under `Trainer.fit`.** `shardwise.launch(..., expendable=ranks)` lets named
  ranks die or fail: the parent prints a line on stderr ("rank 1 died with exit code -9; the
  strategy can lose it") and waits for the others; that rank's result is `None`. The trainer
  passes the strategy's the plan's `expendable` ranks: async and ssp workers other than rank 0.
  Servers, rank 0 and every rank of other strategies still stop the job at once (rank 0 writes
  the summary, so its death fails the run, as does any death under sync: "rank 1 died with
  exit code -9 before reporting a result", no hang). The servers drop the dead worker after
  `worker_timeout_s`; worker 0 prints "lost worker(s) [1]", and `summary.json` lists it under
  `ps.lost_workers`. `tests/strategies/param_server/test_ps_kill.py` SIGKILLs worker 1 at step 5 under
  `Trainer.fit` (async): the run completes its 30 steps, the servers apply worker 0's steps
  after the death (versions 25 and 35 in the checkpoints of steps 20 and 30), evaluation counts
  every validation sample, and the summary names worker 1. Under `shardwise run` (torchrun)
  the death of any process still ends the job: torchrun's own policy.
- The worker's `summary()` ends its session (a DONE message to every server); worker 0 then
  receives each server's statistics (a float64 tensor) and final parameters, so the model the
  trainer returns is the servers' model. `summary.json` gets `ps`: servers, workers, mode,
  bound, shard bytes, updates and gradients per server, the staleness histogram (clocks ahead
  of the slowest live worker, Ho et al. 2013: 0 under sync, at most S under ssp) and the
  version-lag histogram (updates applied between a worker's pull and its push); these count
  this run's updates (after a resume too).
- Limits: clipping is per worker, before the push; the workers' codec residuals (error
  feedback) restart at zero after a resume; a ps run cannot resume another strategy's
  checkpoint (no server files: a `CheckpointError` says so); the other way, a ps checkpoint's
  `state.pt` holds worker 0's model (the servers' under sync) but not the servers' optimizer
  state. Local SGD and DiLoCo return rank 0's replica, which differs from the others when the
  last step is not a round.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.codecs import Codec, PowerSGD, get_codec
from shardwise.comm.collectives import Group, new_group
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import CheckpointError, ConfigError
from shardwise.strategies.common import LocalParallel
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Placement, Strategy, plan_layout
from shardwise.strategies.param_server.client import Client, RemoteOptimizer
from shardwise.strategies.param_server.protocol import SERVER_FILE, ServerStats, Tags, partition_by_bytes
from shardwise.strategies.param_server.server import Server

MODES: tuple[str, ...] = ("sync", "async", "ssp")
"""The consistency models (`PS.mode`'s values)."""

PS_GROUP = Group("ps")
_SESSIONS = itertools.count()
"""Sessions this process has built (see `protocol.Tags`)."""
"""The world, named for the recorder: every message between workers and servers is recorded under ``ps/``."""


@dataclass(frozen=True)
class ServerSettings:
    """What ``ps`` and ``central`` share: the servers' layout and protocol, checked once."""

    name: str
    servers: int
    mode: str
    staleness: int | None
    compression: str | None
    worker_timeout_s: float

    def __post_init__(self) -> None:
        name = self.name
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) or self.servers < 1:
            raise ConfigError(
                f"{name}: servers must be a whole number >= 1; got {self.servers!r}. Example: servers=1 (and at least one more process for a worker)"
            )
        if self.mode not in MODES:
            raise ConfigError(f"{name}: mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        s = self.staleness
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ConfigError(f"{name}: staleness must be a whole number of steps >= 0 (how far a worker may run ahead of the slowest); got {s!r}")
        if self.mode == "ssp" and s is None:
            raise ConfigError(f"{name}: mode='ssp' needs a staleness bound; pass staleness=S (e.g. staleness=2; 0 is bulk synchronous without averaging)")
        if self.mode != "ssp" and s is not None:
            raise ConfigError(f"{name}: staleness={s} applies only to mode='ssp'; got mode={self.mode!r}. Drop staleness or use mode='ssp'")
        t = self.worker_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(f"{name}: worker_timeout_s must be a number of seconds > 0; got {t!r}")
        if self.compression is not None and isinstance(get_codec(self.compression), PowerSGD):
            raise ConfigError(f"{name}: compression {self.compression!r} runs inside DDP's hook; choose fp16, bf16, int8, topk:RATIO, randomk:RATIO or sign")

    @property
    def alone(self) -> bool:
        """Whether each worker's loop runs alone: async and ssp workers never wait for each other."""
        return self.mode != "sync"

    def codec(self) -> Codec | None:
        codec = get_codec(self.compression) if self.compression else None
        assert not isinstance(codec, PowerSGD)  # refused in __post_init__
        return codec


def _compression(value: str | None) -> str | None:
    return None if value in (None, "", "none") else value


def check_model(name: str, model: nn.Module, servers: int) -> None:
    """Refuse a model the servers cannot share out: parameters that are not floating point, or
    fewer parameter tensors than servers (each server holds whole tensors)."""
    params = list(model.parameters())
    if not all(p.is_floating_point() for p in params):
        raise ConfigError(f"{name} sends floating-point parameters; this model has {sorted({str(p.dtype) for p in params})}")
    if len(params) < servers:
        raise ConfigError(
            f"{name}: servers={servers} but the model has only {len(params)} parameter tensors to share out; use at most {max(len(params), 1)} servers"
        )


def plan_servers(
    settings: ServerSettings, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None
) -> Layout:
    """The layout of a parameter-server job: the last ``servers`` ranks serve, the global batch is split over
    the workers only, asynchronous workers other than rank 0 may be lost. Pure."""
    name, servers = settings.name, settings.servers
    if isinstance(world_size, int) and not isinstance(world_size, bool) and servers >= world_size:
        raise ConfigError(f"{name}: servers={servers} leaves no worker in a world of {world_size} processes; use nproc >= {servers + 1} or fewer servers")
    requested = dict(mesh or {})
    split = {k: v for k, v in requested.items() if k != "dp" and v != 1}
    if split:
        raise ConfigError(
            f"{name}: every worker holds the whole model, so the only mesh dimension is dp (the workers); "
            f"got mesh={requested}. Drop the {', '.join(sorted(split))} setting(s)"
        )
    workers = world_size - servers if isinstance(world_size, int) else 0
    if "dp" in requested and requested["dp"] != workers:
        raise ConfigError(
            f"{name}: the data-parallel degree is the number of workers, {workers} "
            f"({world_size} processes less {servers} server(s)); got mesh={requested}. Drop the dp setting"
        )
    expendable = range(1, workers) if settings.alone else ()
    layout = plan_layout(name, world_size, batch=batch, servers=servers, expendable=expendable)
    if model is not None:
        check_model(name, model, servers)
    return layout


def apply_servers(settings: ServerSettings, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> ServerRun:
    """Share the model out over the servers and build this process's run.

    On a server rank this serves (inside this call) until every worker is done or lost, and
    returns a run that does not train. On a worker it returns at once: the model on the device,
    a `RemoteOptimizer`, and the workers' mesh and group for the loop (each worker's own, when
    workers loop alone).
    """
    name = settings.name
    if not dist.is_initialized():
        raise ConfigError(f"strategy {name!r} needs a process group; start the run with nproc >= servers + 1 through shardwise")
    plan_servers(settings, mesh.world_size, model)  # the plan's refusals, here too (an Engine alone plans without the model)
    params = list(model.parameters())
    if len({p.dtype for p in params}) != 1:
        # Known only now: the precision converts the model after the plan.
        raise ConfigError(f"{name} sends one floating-point dtype per model; this model has {sorted({str(p.dtype) for p in params})}. Convert it to one dtype")
    model = model.to(mesh.device)
    params = list(model.parameters())
    world, servers = mesh.world_size, settings.servers
    workers = world - servers
    server_ranks = list(range(workers, world))
    shards = partition_by_bytes([p.numel() * p.element_size() for p in params], servers)
    shard_bytes = [sum(params[i].numel() * params[i].element_size() for i in s) for s in shards]
    # Every rank takes part in making the workers' group (new_group is collective over the world),
    # and, when workers loop alone (async, ssp), one group per worker for its loop's own collectives.
    workers_group = new_group(range(workers), name="workers")
    solo = [new_group([w], name="alone") for w in range(workers)] if settings.alone else []
    tags = Tags.of_session(next(_SESSIONS))  # every rank counts the same sessions: its own tags for this one
    client = Client(params, shards, server_ranks, mesh.rank if mesh.rank < workers else 0, settings.codec(), recorder, PS_GROUP, tags)
    if mesh.rank >= workers:
        s = mesh.rank - workers
        owned = [nn.Parameter(params[i].detach().clone()) for i in shards[s]]
        server = Server(
            owned,
            make_optimizer,
            index=s,
            worker_ranks=list(range(workers)),
            mode=settings.mode,
            staleness=settings.staleness,
            coder=client.coders[s],
            message_bytes=client.message_bytes[s],
            reply_bytes=client.reply_bytes[s],
            worker_timeout_s=settings.worker_timeout_s,
            recorder=recorder,
            group=PS_GROUP,
            param_ids=shards[s],
            servers=servers,
            tags=tags,
        )
        stats = server.serve()
        server.report_to(0)
        return ServerRun(model, server.optimizer, Placement(trains=False), settings=settings, world_size=world, shard_bytes=shard_bytes, stats=[stats])
    lr = float(make_optimizer(model.parameters()).param_groups[0]["lr"])  # the user's rate, for the scheduler
    worker_mesh = Mesh(world_size=world, rank=mesh.rank, device=mesh.device, degrees={"dp": workers, "pp": 1, "tp": 1}, _groups={"dp": workers_group})
    placement = Placement(trains=True, mesh=worker_mesh, group=workers_group, data_mesh=worker_mesh)
    if settings.alone:
        own = solo[mesh.rank]
        alone_mesh = Mesh(world_size=world, rank=mesh.rank, device=mesh.device, degrees={"dp": 1, "pp": 1, "tp": 1}, _groups={"dp": own})
        placement = Placement(trains=True, mesh=alone_mesh, group=own, data_mesh=worker_mesh)
    return ServerRun(
        model, RemoteOptimizer(model.parameters(), lr, client), placement, settings=settings, world_size=world, shard_bytes=shard_bytes, client=client
    )


class ServerRun(LocalParallel):
    """One process of a parameter-server job: a worker (the whole model, a `RemoteOptimizer`) or a
    server that has already served (``placement.trains`` is False)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        placement: Placement,
        *,
        settings: ServerSettings,
        world_size: int,
        shard_bytes: list[int],
        client: Client | None = None,
        stats: list[ServerStats] | None = None,
    ) -> None:
        super().__init__(model, optimizer, placement)
        self.settings, self.world_size, self.shard_bytes = settings, world_size, shard_bytes
        self.client = client
        """This worker's side of the protocol (None on a server rank)."""
        self.stats: list[ServerStats] = list(stats or [])
        """What the servers applied: worker 0 receives it in ``finish``; a server rank holds its own."""

    def after_step(self, step: int) -> None:
        return None  # the push and the pull are the optimizer's step

    def save_extra_state(self, directory: Path) -> None:
        """Worker 0 has every server write its shard into the checkpoint's (temporary) directory."""
        if self.client is not None and self.client.worker == 0:
            self.client.save(Path(directory))

    def load_extra_state(self, path: Path) -> None:
        """Every worker has the servers restore their files from ``path`` and takes their parameters."""
        if self.client is None:
            return None  # a server rank restores on its workers' LOAD, while serving
        directory = Path(path)
        if not (directory / SERVER_FILE.format(index=0)).is_file():
            raise CheckpointError(
                f"checkpoint {directory} has no parameter-server state ({SERVER_FILE.format(index=0)}): it was saved by "
                "another strategy. Resume it with that strategy, or load its model into a fresh run"
            )
        clock = self.optimizer.steps if isinstance(self.optimizer, RemoteOptimizer) else 0
        self.client.load(directory, clock)

    def finish(self) -> None:
        """End this worker's session with the servers, once (worker 0 also collects their report and final
        parameters); the servers stop when every worker has. A server rank served inside ``apply``: nothing left."""
        if self.client is None or self.client.finished:
            return
        self.stats = self.client.finish(report=self.client.worker == 0)
        lost = sorted({w for st in self.stats for w in st.lost})
        if lost:
            print(
                f"shardwise ps: lost worker(s) {lost} during the run (silent for worker_timeout_s={self.settings.worker_timeout_s:g}s "
                "or gone); the servers applied the others' gradients and the run finished without them",
                flush=True,
            )

    def summary(self) -> dict[str, Any]:
        """The ``ps`` section: options and shard sizes, and on worker 0 after ``finish`` what the servers applied."""
        st = self.settings
        workers = self.world_size - st.servers
        section: dict[str, Any] = {
            "servers": st.servers,
            "workers": workers,
            "mode": st.mode,
            "staleness_bound": st.staleness,
            "compression": st.compression,
            "shard_bytes": self.shard_bytes,
        }
        if self.stats:
            merged = ServerStats(workers)
            for stats in self.stats:
                for i, c in enumerate(stats.staleness_hist):
                    merged.staleness_hist[i] += c
                for i, c in enumerate(stats.version_lag_hist):
                    merged.version_lag_hist[i] += c
            report = merged.report()
            section.update(
                {
                    "updates_per_server": [s.updates for s in self.stats],
                    "gradients_per_server": [s.gradients for s in self.stats],
                    "max_staleness": max(s.max_staleness for s in self.stats),
                    "max_version_lag": max(s.max_version_lag for s in self.stats),
                    "staleness_hist": report["staleness_hist"],
                    "version_lag_hist": report["version_lag_hist"],
                    "lost_workers": sorted({w for s in self.stats for w in s.lost}),
                }
            )
        return {"ps": section}


@dataclass(frozen=True)
class PS(Strategy):
    """Parameter servers: ``servers`` of the ranks hold the parameters and their optimizer state, the rest compute gradients."""

    name: ClassVar[str] = "ps"

    servers: int = 1
    """Processes that hold the parameters and their optimizer state (the last ranks); the others are workers."""
    mode: Literal["sync", "async", "ssp"] = "sync"
    """sync (every step waits for every worker: equals ddp without clipping), async (each gradient applied on arrival),
    or ssp (async within a staleness bound)."""
    staleness: int | None = None
    """ssp only: how many steps a worker may run ahead of the slowest live worker (0 is bulk synchronous without averaging)."""
    compression: str | None = None
    """Codec for pushed gradients, with error feedback: fp16, bf16, int8, topk:RATIO, randomk:RATIO or sign (shardwise.comm.codecs)."""
    worker_timeout_s: float = 60.0
    """Seconds a worker may stay silent, owed nothing, before the servers drop it (never worker 0; async and ssp go on without it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", _compression(self.compression))
        settings = self.settings()  # refuses a bad value
        object.__setattr__(self, "worker_timeout_s", float(settings.worker_timeout_s))

    def settings(self) -> ServerSettings:
        return ServerSettings(self.name, self.servers, self.mode, self.staleness, self.compression, self.worker_timeout_s)

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        return plan_servers(self.settings(), world_size, model, batch, mesh)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> ServerRun:
        return apply_servers(self.settings(), model, make_optimizer, mesh, recorder)


@dataclass(frozen=True)
class Central(Strategy):
    """Central storage (TensorFlow's CentralStorageStrategy): the last rank holds the parameters and the
    optimizer, every other rank computes, updates are synchronous (``ps`` with one server in sync mode)."""

    name: ClassVar[str] = "central"

    compression: str | None = None
    """Codec for pushed gradients, with error feedback: fp16, bf16, int8, topk:RATIO, randomk:RATIO or sign (shardwise.comm.codecs)."""
    worker_timeout_s: float = 60.0
    """Seconds a worker may stay silent, owed nothing, before the server drops it (a synchronous run then stops)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", _compression(self.compression))
        settings = self.settings()
        object.__setattr__(self, "worker_timeout_s", float(settings.worker_timeout_s))

    def settings(self) -> ServerSettings:
        return ServerSettings(self.name, 1, "sync", None, self.compression, self.worker_timeout_s)

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        return plan_servers(self.settings(), world_size, model, batch, mesh)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> ServerRun:
        return apply_servers(self.settings(), model, make_optimizer, mesh, recorder)


__all__ = ["MODES", "PS", "Central", "Client", "RemoteOptimizer", "Server", "ServerRun", "ServerSettings", "apply_servers", "plan_servers"]
