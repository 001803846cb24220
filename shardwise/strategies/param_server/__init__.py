"""``ps`` and ``central``: parameter servers (sync, async, stale synchronous), and central storage.

Here: the `PS` and `Central` strategies (plan: the last ``servers`` ranks serve) and the workers'
run; the servers are `server`, the workers' side `client`, the wire format `protocol`. Modes,
checkpoints, lost workers and known limits: docs/strategies/param_server.md.
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
    whole_model: ClassVar[bool] = False  # the servers hold the parameters

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
