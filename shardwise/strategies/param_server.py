"""``ps`` and ``central``: parameter servers (sync, async, stale synchronous), and central storage.

A launch of N processes runs ``N - servers`` workers (ranks ``0 .. W-1``) and ``servers``
parameter servers (ranks ``W .. N-1``), as in Li et al. 2014, "Scaling Distributed Machine
Learning with the Parameter Server" (OSDI). Parameters are partitioned over the servers
whole tensor by whole tensor, balanced by bytes; each server holds its shard and the
optimizer state of that shard (`shardwise.strategies.ps_server`). Each worker step:

    forward/backward on this worker's slice of the global batch (no collective)
    -> push: one message per server, the gradient of its shard (optionally compressed)
    -> pull: one answer per server, the shard's fresh parameters

The worker's "optimizer" is a `RemoteOptimizer`, whose ``step`` is that push and pull, so
the trainer's loop runs unchanged on workers; the worker's scheduler still sets the learning
rate, which travels in the push header. Server ranks do not run the loop: their ``setup``
returns only after serving, and ``placement()`` tells the engine so (``trains=False``); the
workers' placement gives the loop their own group and mesh (data sharded over workers
only). See docs/architecture.md, "Ranks that serve".

Modes (``mode=``): ``sync`` equals ddp when no clip clips (see Known limits); ``async`` applies each gradient on arrival;
``ssp`` with ``staleness=S`` bounds how far any worker runs ahead of the slowest (Ho et al.
2013). The staleness of every applied gradient is recorded and reported in summary.json
under ``ps``, with the updates each server applied and the workers it lost.

``central`` is TensorFlow's CentralStorageStrategy: one server holds all parameters and the
optimizer, workers compute, updates are synchronous; here it is ``ps`` with one server in
sync mode.

Checkpoints: ``save_extra_state`` (worker 0, called by the engine inside the checkpoint's
temporary directory) has every server write its shard, optimizer state and version there
(``server-NNN.pt``) before the manifest; ``load_extra_state`` (every worker) has every server
restore its file and answer with its parameters. Workers keep their clock in the
`RemoteOptimizer`'s state. A sync run resumed in new processes equals an uninterrupted one
bit for bit; an async or ssp resume continues from the servers' state at the save (which
gradients were in flight then is timing, so it cannot be bit-exact).

Lost workers: under ``async`` and ``ssp`` no worker waits for another, so each worker's
loop runs alone (the trainer's logged loss, evaluation and checkpoints: its own; rank 0's
are the run's), ``data_mesh()`` still splits each global batch over the workers, and
``expendable_ranks`` lets `shardwise.launch` lose workers other than rank 0: the servers
drop a worker silent for ``worker_timeout_s`` and summary.json lists it under
``ps.lost_workers``. Under ``sync`` a lost worker stops the run (the launcher names it).

Known limits: clipping is per worker (before the push), so with a clip that clips, sync applies
mean_w(clip(g_w)) where ddp applies clip(mean_w(g_w)); clipping the mean once would need each
server's squared norm of its averaged shard summed over the servers before any applies (one
scalar per server per step), which the servers' protocol does not carry yet; codecs' error-feedback residuals
(worker side) restart at zero after a resume.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.codecs import Codec, PowerSGD, get_codec
from shardwise.comm.collectives import Group
from shardwise.comm.recorder import CommEvent, Recorder
from shardwise.errors import CheckpointError, CommError, ConfigError
from shardwise.mesh import Mesh
from shardwise.strategies.common import LocalModel
from shardwise.strategies.protocol import OptimizerFactory, Placement
from shardwise.strategies.ps_protocol import (
    BYE, CTRL_TAG, DONE, HEADER_BYTES, KIND, LOAD, PULL_TAG, PUSH, PUSH_TAG, SAVE, SAVED, SERVER_FILE, STATS_TAG, VERSION,
    GradientCoder, ServerStats, header, pack, partition_by_bytes, path_bytes, payload_of, unpack_header,
)
from shardwise.strategies.ps_server import Server

MODES = ("sync", "async", "ssp")


class Client:
    """A worker's side of the protocol: push gradients to each shard's server, pull its parameters."""

    def __init__(self, params: list[nn.Parameter], shards: list[list[int]], server_ranks: list[int], worker: int,
                 codec: Codec | None, recorder: Recorder) -> None:
        self.params, self.shards, self.server_ranks, self.worker = params, shards, server_ranks, worker
        dtype = params[0].dtype
        self.numels = [sum(params[i].numel() for i in shard) for shard in shards]
        self.coders = [GradientCoder(n, dtype, codec) for n in self.numels]
        self.message_bytes = [HEADER_BYTES + c.payload_bytes for c in self.coders]
        self.reply_bytes = [HEADER_BYTES + n * params[0].element_size() for n in self.numels]
        self.versions = [0] * len(shards)
        self.recorder = recorder
        self.finished = False

    def _grad(self, shard: list[int]) -> torch.Tensor:
        grads = [self.params[i].grad for i in shard]
        return torch.cat([(g if g is not None else torch.zeros_like(self.params[i])).reshape(-1) for g, i in zip(grads, shard)])

    def _unflatten(self, s: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for i in self.shards[s]:
                p = self.params[i]
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    def push_pull(self, step: int, lr: float) -> None:
        start = time.perf_counter()
        sends = []
        for s, shard in enumerate(self.shards):
            payload = self.coders[s].encode(self._grad(shard).cpu())
            msg = pack(header(PUSH, self.worker, step, lr, self.versions[s]), payload, self.message_bytes[s])
            sends.append(dist.isend(msg, dst=self.server_ranks[s], tag=PUSH_TAG))
        pushed = time.perf_counter()
        replies = [torch.empty(n, dtype=torch.uint8) for n in self.reply_bytes]
        recvs = [dist.irecv(r, src=src, tag=PULL_TAG) for r, src in zip(replies, self.server_ranks)]
        for work in sends + recvs:
            if work is not None:
                work.wait()
        for s, reply in enumerate(replies):
            if float(unpack_header(reply)[KIND]) == DONE:
                raise CommError(
                    f"ps worker {self.worker} (rank {dist.get_rank()}): the parameter servers ended the session without "
                    "this worker: it was silent for more than worker_timeout_s and declared lost"
                )
            self.versions[s] = int(unpack_header(reply)[VERSION])
            self._unflatten(s, payload_of(reply, self.params[0].dtype, self.numels[s]))
        end = time.perf_counter()
        dense = sum(self.numels) * self.params[0].element_size()
        k = len(self.shards)
        self.recorder.add(CommEvent("push", "ps", k + 1, dense, sum(self.message_bytes), 0, pushed - start, 1))
        self.recorder.add(CommEvent("pull", "ps", k + 1, dense, 0, sum(self.reply_bytes), end - pushed, 1))

    def save(self, directory: Path) -> None:
        """Have every server write its file into ``directory``; returns once all of them have."""
        raw = path_bytes(directory)
        for s, dst in enumerate(self.server_ranks):
            dist.send(pack(header(SAVE, self.worker, 0, 0.0, 0, raw.numel()), None, self.message_bytes[s]), dst=dst, tag=PUSH_TAG)
            dist.send(raw, dst=dst, tag=CTRL_TAG)
        for src in self.server_ranks:
            ack = torch.empty(HEADER_BYTES, dtype=torch.uint8)
            dist.recv(ack, src=src, tag=CTRL_TAG)
            assert float(unpack_header(ack)[KIND]) == SAVED, f"server rank {src} answered a save with {unpack_header(ack).tolist()}"

    def load(self, directory: Path, clock: int) -> None:
        """Have every server restore its file from ``directory``, and take the parameters they answer with."""
        raw = path_bytes(directory)
        for s, dst in enumerate(self.server_ranks):
            dist.send(pack(header(LOAD, self.worker, clock, 0.0, 0, raw.numel()), None, self.message_bytes[s]), dst=dst, tag=PUSH_TAG)
            dist.send(raw, dst=dst, tag=CTRL_TAG)
        for s, src in enumerate(self.server_ranks):
            reply = torch.empty(self.reply_bytes[s], dtype=torch.uint8)
            dist.recv(reply, src=src, tag=PULL_TAG)
            self.versions[s] = int(unpack_header(reply)[VERSION])
            self._unflatten(s, payload_of(reply, self.params[0].dtype, self.numels[s]))

    def finish(self, report: bool) -> list[ServerStats]:
        """Tell every server this worker is done; the reporting worker then gets their stats and final parameters."""
        if self.finished:
            return []
        self.finished = True
        for s in range(len(self.shards)):
            dist.send(pack(header(DONE, self.worker, 0, 0.0, 0), None, self.message_bytes[s]), dst=self.server_ranks[s], tag=PUSH_TAG)
        if not report:
            return []
        out = []
        workers = dist.get_world_size() - len(self.shards)
        for s, src in enumerate(self.server_ranks):
            t = torch.empty(ServerStats.size(workers), dtype=torch.float64)
            dist.recv(t, src=src, tag=STATS_TAG)
            out.append(ServerStats.from_tensor(t, workers))
            reply = torch.empty(self.reply_bytes[s], dtype=torch.uint8)
            dist.recv(reply, src=src, tag=PULL_TAG)
            self._unflatten(s, payload_of(reply, self.params[0].dtype, self.numels[s]))
            # The last message: it completes the server's last posted receive (see Server._close_inbox).
            dist.send(pack(header(BYE, self.worker, 0, 0.0, 0), None, self.message_bytes[s]), dst=src, tag=PUSH_TAG)
        return out


class RemoteOptimizer(torch.optim.Optimizer):
    """A worker's optimizer: ``step`` pushes the gradients and pulls fresh parameters; the state lives on the servers."""

    def __init__(self, params: Any, lr: float, client: Client) -> None:
        super().__init__(params, {"lr": lr})
        self.client = client
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("the parameter server's workers do not support an optimizer closure (LBFGS); use a first-order optimizer")
        self.client.push_pull(self.steps, float(self.param_groups[0]["lr"]))
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        # The worker's clock (steps pushed) goes with the learning rate: the servers' staleness
        # bookkeeping counts from it after a resume.
        return {**super().state_dict(), "clock": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.steps = int(state.pop("clock", self.steps))
        super().load_state_dict(state)


class PS(LocalModel):
    """Parameter servers: ``servers`` of the ranks hold the parameters, the rest compute gradients."""

    name: ClassVar[str] = "ps"

    def __init__(self, *, servers: int = 1, mode: str = "sync", staleness: int | None = None,
                 compression: str | None = None, worker_timeout_s: float = 60.0) -> None:
        if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
            raise ConfigError(f"ps: servers must be a whole number >= 1; got {servers!r}. Example: servers=1 (and at least one more process for a worker)")
        if mode not in MODES:
            raise ConfigError(f"ps: mode must be one of {', '.join(MODES)}; got {mode!r}")
        if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0):
            raise ConfigError(f"ps: staleness must be a whole number of steps >= 0 (how far a worker may run ahead of the slowest); got {staleness!r}")
        if mode == "ssp" and staleness is None:
            raise ConfigError("ps: mode='ssp' needs a staleness bound; pass staleness=S (e.g. staleness=2; 0 is bulk synchronous without averaging)")
        if mode != "ssp" and staleness is not None:
            raise ConfigError(f"ps: staleness={staleness} applies only to mode='ssp'; got mode={mode!r}. Drop staleness or use mode='ssp'")
        if worker_timeout_s <= 0:
            raise ConfigError(f"ps: worker_timeout_s must be > 0 seconds; got {worker_timeout_s!r}")
        self.servers, self.mode, self.staleness = servers, mode, staleness
        self.compression = None if compression in (None, "", "none") else compression
        codec = get_codec(self.compression) if self.compression else None
        if isinstance(codec, PowerSGD):
            raise ConfigError(f"ps: compression {compression!r} runs inside DDP's hook; choose fp16, bf16, int8, topk:RATIO, randomk:RATIO or sign")
        self.codec: Codec | None = codec
        self.worker_timeout_s = float(worker_timeout_s)
        self.world_size = 0
        self._placement = Placement()
        self.client: Client | None = None
        self._data_mesh: Mesh | None = None
        self.shard_bytes: list[int] = []
        self.stats: list[ServerStats] = []
        self.serve_s = 0.0

    # -- who does what ------------------------------------------------------------------------------
    def validate(self, world_size: int) -> None:
        if self.servers >= world_size:
            raise ConfigError(
                f"ps: servers={self.servers} leaves no worker in a world of {world_size} processes; "
                f"use nproc >= {self.servers + 1} or fewer servers"
            )

    def trainers(self, world_size: int) -> int:
        """Ranks that run the training loop: the workers."""
        return world_size - self.servers

    def placement(self) -> Placement:
        return self._placement

    @property
    def alone(self) -> bool:
        """Whether each worker's loop runs alone: async and ssp workers never wait for each other."""
        return self.mode != "sync"

    def data_mesh(self) -> Mesh | None:
        """The workers' mesh that global batches are split over (None: the loop's own mesh)."""
        return self._data_mesh

    def expendable_ranks(self, world_size: int) -> list[int]:
        """Ranks the run can lose: async and ssp workers other than rank 0 (which writes the summary)."""
        return list(range(1, world_size - self.servers)) if self.alone else []

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not dist.is_initialized():
            raise ConfigError("strategy 'ps' needs a process group; start the run with nproc >= servers + 1 through shardwise")
        self.validate(mesh.world_size)
        params = [p for p in model.parameters()]
        if len({p.dtype for p in params}) != 1 or not params[0].is_floating_point():
            raise ConfigError(f"ps sends one floating-point dtype per model; this model has {sorted({str(p.dtype) for p in params})}. Convert it to one dtype")
        if len(params) < self.servers:
            raise ConfigError(f"ps: servers={self.servers} but the model has only {len(params)} parameter tensors to share out; use at most {len(params)} servers")
        model = model.to(mesh.device)
        params = list(model.parameters())
        self.world_size = world = mesh.world_size
        workers = world - self.servers
        server_ranks = list(range(workers, world))
        shards = partition_by_bytes([p.numel() * p.element_size() for p in params], self.servers)
        self.shard_bytes = [sum(params[i].numel() * params[i].element_size() for i in s) for s in shards]
        # Every rank takes part in making the workers' group (new_group is collective over the world),
        # and, when workers loop alone (async, ssp), one group per worker for its loop's own collectives.
        workers_group = Group("workers", dist.new_group(ranks=list(range(workers))))
        solo = [dist.new_group(ranks=[w]) for w in range(workers)] if self.alone else []
        client = Client(params, shards, server_ranks, mesh.rank if mesh.rank < workers else 0, self.codec, recorder)
        if mesh.rank >= workers:
            s = mesh.rank - workers
            owned = [nn.Parameter(params[i].detach().clone()) for i in shards[s]]
            server = Server(owned, make_optimizer, index=s, worker_ranks=list(range(workers)), mode=self.mode,
                            staleness=self.staleness, coder=client.coders[s], message_bytes=client.message_bytes[s],
                            reply_bytes=client.reply_bytes[s], worker_timeout_s=self.worker_timeout_s,
                            param_ids=shards[s], servers=self.servers)
            start = time.perf_counter()
            self.stats = [server.serve()]
            server.report_to(0)
            self.serve_s = time.perf_counter() - start
            self._placement = Placement(trains=False)
            return model, server.optimizer
        self.client = client
        lr = float(make_optimizer(model.parameters()).param_groups[0]["lr"])  # the user's rate, for the scheduler
        worker_mesh = Mesh(world_size=world, rank=mesh.rank, device=mesh.device, degrees={"dp": workers, "pp": 1, "tp": 1},
                           _groups={"dp": workers_group})
        self._data_mesh = worker_mesh
        self._placement = Placement(trains=True, mesh=worker_mesh, group=workers_group)
        if self.alone:
            own = Group("alone", solo[mesh.rank])
            alone_mesh = Mesh(world_size=world, rank=mesh.rank, device=mesh.device, degrees={"dp": 1, "pp": 1, "tp": 1}, _groups={"dp": own})
            self._placement = Placement(trains=True, mesh=alone_mesh, group=own)
        return model, RemoteOptimizer(model.parameters(), lr, client)

    # -- the worker's side of the loop ------------------------------------------------------------------
    def save_extra_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> None:
        """Worker 0 has every server write its shard into the checkpoint's (temporary) directory."""
        if self.client is not None and self.client.worker == 0:
            self.client.save(Path(directory))

    def load_extra_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> None:
        """Every worker has the servers restore their files from ``directory`` and takes their parameters."""
        if self.client is None:
            return
        directory = Path(directory)
        if not (directory / SERVER_FILE.format(index=0)).is_file():
            raise CheckpointError(
                f"checkpoint {directory} has no parameter-server state ({SERVER_FILE.format(index=0)}): it was saved by "
                "another strategy. Resume it with that strategy, or load its model into a fresh run"
            )
        clock = optimizer.steps if isinstance(optimizer, RemoteOptimizer) else 0
        self.client.load(directory, clock)

    def finish(self) -> None:
        """End this worker's session with the servers (worker 0 also collects their stats and final parameters)."""
        if self.client is not None and not self.client.finished:
            self.stats = self.client.finish(report=self.client.worker == 0)
            lost = sorted({w for st in self.stats for w in st.lost})
            if lost:
                print(f"shardwise ps: lost worker(s) {lost} during the run (silent for worker_timeout_s={self.worker_timeout_s:g}s "
                      "or gone); the servers applied the others' gradients and the run finished without them", flush=True)

    def summary(self) -> dict[str, Any]:
        """The ``ps`` section; on workers it first ends the session (the trainer calls it once, at the end)."""
        self.finish()
        section: dict[str, Any] = {
            "servers": self.servers, "workers": self.world_size - self.servers, "mode": self.mode,
            "staleness_bound": self.staleness, "compression": self.compression, "shard_bytes": self.shard_bytes,
        }
        if self.stats:
            merged = ServerStats(self.world_size - self.servers)
            for st in self.stats:
                for i, c in enumerate(st.staleness_hist):
                    merged.staleness_hist[i] += c
                for i, c in enumerate(st.version_lag_hist):
                    merged.version_lag_hist[i] += c
            report = merged.report()
            section.update({
                "updates_per_server": [st.updates for st in self.stats],
                "gradients_per_server": [st.gradients for st in self.stats],
                "max_staleness": max(st.max_staleness for st in self.stats),
                "max_version_lag": max(st.max_version_lag for st in self.stats),
                "staleness_hist": report["staleness_hist"],
                "version_lag_hist": report["version_lag_hist"],
                "lost_workers": sorted({w for st in self.stats for w in st.lost}),
            })
        return {"ps": section}


def central(*, compression: str | None = None, worker_timeout_s: float = 60.0) -> PS:
    """``central``: TensorFlow's CentralStorageStrategy, ps with one server in sync mode.

    Parameters and optimizer state live in one process (the last rank), every other rank
    computes; each step is synchronous, so it equals ddp.
    """
    ps = PS(servers=1, mode="sync", compression=compression, worker_timeout_s=worker_timeout_s)
    ps.name = "central"  # type: ignore[misc]
    return ps
