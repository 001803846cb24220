"""A worker's side of the parameter servers: push gradients to each shard's server, pull its parameters.

The worker's optimizer is a `RemoteOptimizer`, whose ``step`` is one push and one pull, so
the training loop runs unchanged on workers. Every message goes through `shardwise.comm`:

- a push (one message per server, header and gradient or its codec's payload) is recorded as
  one ``ps/push`` event when the messages are out: ``payload_bytes`` the dense gradient,
  ``sent_bytes`` what went on the wire;
- a pull (one answer per server, header and the shard's parameters) as one ``ps/pull`` event
  when every answer is in;
- checkpoints' and the end of the session's messages (`SAVE`, `LOAD`, `DONE`, the servers'
  report, `BYE`) as the ``ps/send`` and ``ps/recv`` of each message.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.codecs import Codec
from shardwise.comm.collectives import Group, Pending, irecv, isend, recv, send
from shardwise.comm.recorder import CommEvent, Recorder
from shardwise.errors import CommError, ConfigError
from shardwise.strategies.param_server.protocol import (
    BYE,
    DONE,
    HEADER_BYTES,
    KIND,
    LOAD,
    PUSH,
    SAVE,
    SAVED,
    VERSION,
    GradientCoder,
    ServerStats,
    Tags,
    header,
    pack,
    path_bytes,
    payload_of,
    unpack_header,
)


class Client:
    """A worker's side of the protocol with every server (the coders and message sizes are the servers' too)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        shards: list[list[int]],
        server_ranks: list[int],
        worker: int,
        codec: Codec | None,
        recorder: Recorder,
        group: Group,
        tags: Tags,
    ) -> None:
        self.tags = tags
        """This session's message tags (see `Tags`)."""
        self.params, self.shards, self.server_ranks, self.worker = params, shards, server_ranks, worker
        self.recorder, self.group = recorder, group
        dtype = params[0].dtype
        self.numels = [sum(params[i].numel() for i in shard) for shard in shards]
        self.coders = [GradientCoder(n, dtype, codec) for n in self.numels]
        self.message_bytes = [HEADER_BYTES + c.payload_bytes for c in self.coders]
        """Bytes of one push to each server: the header, then the (encoded) gradient of its shard."""
        self.reply_bytes = [HEADER_BYTES + n * params[0].element_size() for n in self.numels]
        """Bytes of one answer from each server: the header, then its shard's parameters."""
        self.workers = min(server_ranks)  # workers are ranks 0 .. W-1, the servers the ranks after them
        self.versions = [0] * len(shards)
        self.finished = False
        self._replies: list[tuple[Pending, torch.Tensor]] = []
        self._pushed_at = 0.0

    def _grad(self, shard: list[int]) -> torch.Tensor:
        grads = [self.params[i].grad for i in shard]
        return torch.cat([(g if g is not None else torch.zeros_like(self.params[i])).reshape(-1) for g, i in zip(grads, shard, strict=True)])

    def _unflatten(self, s: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for i in self.shards[s]:
                p = self.params[i]
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def push_pull(self, step: int, lr: float) -> None:
        """One optimizer step of this worker: push every shard's gradient, then take the servers' answers."""
        self.push(step, lr)
        self.pull()

    def push(self, step: int, lr: float) -> None:
        """Send each server the gradient of its shard (the answers' receives are posted first); returns once they are out."""
        start = time.perf_counter()
        sends = []
        for s, shard in enumerate(self.shards):
            payload = self.coders[s].encode(self._grad(shard).cpu())
            msg = pack(header(PUSH, self.worker, step, lr, self.versions[s]), payload, self.message_bytes[s])
            sends.append(isend(msg, self.server_ranks[s], group=self.group, tag=self.tags.push))
        replies = [torch.empty(n, dtype=torch.uint8) for n in self.reply_bytes]
        self._replies = [(irecv(r, src, group=self.group, tag=self.tags.pull), r) for r, src in zip(replies, self.server_ranks, strict=True)]
        for work in sends:
            work.wait()
        self._pushed_at = time.perf_counter()
        dense = sum(self.numels) * self.params[0].element_size()
        self.recorder.add(CommEvent("push", self.group.name, len(self.shards) + 1, dense, sum(self.message_bytes), 0, self._pushed_at - start, 1))

    def pull(self) -> None:
        """Wait for every server's answer to the last push and take its parameters."""
        for work, _ in self._replies:
            work.wait()
        for s, (_, reply) in enumerate(self._replies):
            if float(unpack_header(reply)[KIND]) == DONE:
                raise CommError(
                    f"ps worker {self.worker} (rank {dist.get_rank()}): the parameter servers ended the session without "
                    "this worker: it was silent for more than worker_timeout_s and declared lost"
                )
            self.versions[s] = int(unpack_header(reply)[VERSION])
            self._unflatten(s, payload_of(reply, self.params[0].dtype, self.numels[s]))
        self._replies = []
        dense = sum(self.numels) * self.params[0].element_size()
        self.recorder.add(CommEvent("pull", self.group.name, len(self.shards) + 1, dense, 0, sum(self.reply_bytes), time.perf_counter() - self._pushed_at, 1))

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        send(tensor, dst, group=self.group, recorder=self.recorder, tag=tag)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        recv(tensor, src, group=self.group, recorder=self.recorder, tag=tag)

    def save(self, directory: Path) -> None:
        """Have every server write its file into ``directory``; returns once all of them have."""
        raw = path_bytes(directory)
        for s, dst in enumerate(self.server_ranks):
            self._send(pack(header(SAVE, self.worker, 0, 0.0, 0, raw.numel()), None, self.message_bytes[s]), dst, self.tags.push)
            self._send(raw, dst, self.tags.ctrl)
        for src in self.server_ranks:
            ack = torch.empty(HEADER_BYTES, dtype=torch.uint8)
            self._recv(ack, src, self.tags.ctrl)
            if float(unpack_header(ack)[KIND]) != SAVED:
                raise CommError(f"parameter server rank {src} answered a save with {unpack_header(ack).tolist()}; expected SAVED")

    def load(self, directory: Path, clock: int) -> None:
        """Have every server restore its file from ``directory``, and take the parameters they answer with."""
        raw = path_bytes(directory)
        for s, dst in enumerate(self.server_ranks):
            self._send(pack(header(LOAD, self.worker, clock, 0.0, 0, raw.numel()), None, self.message_bytes[s]), dst, self.tags.push)
            self._send(raw, dst, self.tags.ctrl)
        for s, src in enumerate(self.server_ranks):
            reply = torch.empty(self.reply_bytes[s], dtype=torch.uint8)
            self._recv(reply, src, self.tags.pull)
            self.versions[s] = int(unpack_header(reply)[VERSION])
            self._unflatten(s, payload_of(reply, self.params[0].dtype, self.numels[s]))

    def finish(self, report: bool) -> list[ServerStats]:
        """Tell every server this worker is done (once); the reporting worker then gets their stats and final parameters."""
        if self.finished:
            return []
        self.finished = True
        for s in range(len(self.shards)):
            self._send(pack(header(DONE, self.worker, 0, 0.0, 0), None, self.message_bytes[s]), self.server_ranks[s], self.tags.push)
        if not report:
            return []
        out = []
        for s, src in enumerate(self.server_ranks):
            t = torch.empty(ServerStats.size(self.workers), dtype=torch.float64)
            self._recv(t, src, self.tags.stats)
            out.append(ServerStats.from_tensor(t, self.workers))
            reply = torch.empty(self.reply_bytes[s], dtype=torch.uint8)
            self._recv(reply, src, self.tags.pull)
            self._unflatten(s, payload_of(reply, self.params[0].dtype, self.numels[s]))
            # The last message: it completes the server's last posted receive (see Server._close_inbox).
            self._send(pack(header(BYE, self.worker, 0, 0.0, 0), None, self.message_bytes[s]), src, self.tags.push)
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
