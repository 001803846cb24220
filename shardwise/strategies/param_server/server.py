"""One parameter server: owns a shard of the parameters and its optimizer state, applies pushed gradients.

Three consistency models, after Li et al. 2014 ("Scaling Distributed Machine Learning with
the Parameter Server", OSDI) and Ho et al. 2013 ("More Effective Distributed ML via a Stale
Synchronous Parallel Parameter Server", NeurIPS):

- ``sync`` (bulk synchronous): wait for every live worker's gradient of step t, average them
  in worker order, step once, answer everyone. The same update as ddp.
- ``async``: apply each gradient the moment it arrives and answer that worker at once
  (Downpour SGD, Dean et al. 2012). Workers never wait for each other.
- ``ssp`` (stale synchronous parallel): apply at once like async, but hold back the answer to
  a worker that would otherwise start a step more than S clocks ahead of the slowest live
  worker. Every applied gradient is then at most S clocks stale.

Messages arrive from any worker (``irecv`` with no source, which gloo supports). Gloo's
receive cannot be polled and a timed-out wait closes the connection, so the serving loop posts
one receive at a time (recorded, through `shardwise.comm`), a helper thread blocks on it and
hands the message over a queue, and the loop waits on the queue with a timeout. Each message is
handled before the next receive is posted, so messages are applied in the order they arrived.
A worker silent for ``worker_timeout_s`` while the server owed it nothing is declared lost, and
no longer counts: sync steps with the rest, ssp's slowest clock moves on. The reporting worker
(worker 0) is never declared lost by silence: it is the one that pauses alone (evaluation,
checkpoints), its death ends the run anyway (it is not expendable), and losing it would end the
session under it. DONE messages end each worker's session.

Every byte a server exchanges goes through `shardwise.comm` and is recorded in the server
process's recorder (``ps/irecv`` for pushes, ``ps/recv`` for a checkpoint's path, ``ps/send`` for
answers and reports).

Checkpoints: a `SAVE` from worker 0 names the checkpoint's temporary directory; the server
writes its shard, its optimizer state and its version there (``server-NNN.pt``, fsynced)
and answers, so the file is in place before worker 0 writes the manifest. A `LOAD` from
each resuming worker names a checkpoint; the server reads it on the first one (its tensors
from whichever server files hold them, so the number of servers may change), sets that
worker's clock, and answers with the restored parameters.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint import load_file, write_file
from shardwise.comm.collectives import Group, Pending, irecv, recv, send
from shardwise.comm.recorder import Recorder
from shardwise.errors import CheckpointError, CommError
from shardwise.strategies.param_server.protocol import (
    BYE,
    DONE,
    KIND,
    LENGTH,
    LOAD,
    LR,
    PARAMS,
    PUSH,
    SAVE,
    SAVED,
    SERVER_FILE,
    STEP,
    VERSION,
    WORKER,
    GradientCoder,
    ServerStats,
    Tags,
    header,
    pack,
    path_of,
    unpack_header,
)


class Inbox:
    """Whole messages from any worker, one receive at a time: the serving loop posts each receive
    (``ask``), a helper thread waits for it and hands the message over ``messages``."""

    def __init__(self, size: int, group: Group, recorder: Recorder, tag: int) -> None:
        self.size, self.group, self.recorder, self.tag = size, group, recorder, tag
        self.messages: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.posted = False
        """Whether a receive is posted: one must not be left at exit (gloo aborts then)."""
        self._posted: queue.Queue[tuple[Pending, torch.Tensor]] = queue.Queue()
        threading.Thread(target=self._run, name="ps-inbox", daemon=True).start()

    def ask(self) -> None:
        """Post the next receive (on the serving thread, so the recorder is only ever used there)."""
        buf = torch.empty(self.size, dtype=torch.uint8)
        try:
            pending = irecv(buf, None, group=self.group, recorder=self.recorder, tag=self.tag)
        except CommError as exc:
            self.messages.put((-1, exc))
            return
        self.posted = True
        self._posted.put((pending, buf))

    def _run(self) -> None:
        while True:
            pending, buf = self._posted.get()
            try:
                pending.wait()
                self.posted = False
                self.messages.put((pending.source(), buf))
            except Exception as exc:  # noqa: BLE001 - handed to the serving loop, which decides
                self.posted = False
                self.messages.put((-1, exc))


class Server:
    """Serve one shard until every worker is done or lost; returns what was applied."""

    def __init__(
        self,
        params: list[nn.Parameter],
        make_optimizer: Callable[[Any], torch.optim.Optimizer],
        *,
        index: int,
        worker_ranks: list[int],
        mode: str,
        staleness: int | None,
        coder: GradientCoder,
        message_bytes: int,
        reply_bytes: int,
        worker_timeout_s: float,
        recorder: Recorder,
        group: Group,
        param_ids: list[int] | None = None,
        servers: int = 1,
        tags: Tags,
    ) -> None:
        self.tags = tags
        """This session's message tags (see `Tags`)."""
        self.recorder, self.group = recorder, group
        """Every message goes through `shardwise.comm` over ``group`` (the world, named) and is recorded here."""
        self.params = params
        self.param_ids = list(param_ids) if param_ids is not None else list(range(len(params)))
        """Which of the model's parameter tensors (by position) this shard holds; checked on resume."""
        self.servers = servers
        self.loaded_from: str | None = None
        self.optimizer = make_optimizer(params)
        self.index = index
        self.worker_ranks = worker_ranks
        self.mode, self.staleness = mode, staleness
        self.coder = coder
        self.message_bytes, self.reply_bytes = message_bytes, reply_bytes
        self.worker_timeout_s = worker_timeout_s
        n = len(worker_ranks)
        self.stats = ServerStats(n)
        self.version = 0
        self.completed = [0] * n
        self.live = set(range(n))
        self.last_seen = [time.monotonic()] * n
        self.pending: dict[int, tuple[int, torch.Tensor, float, int]] = {}  # sync: this step's pushes
        self.held: set[int] = set()  # ssp: workers whose answer is held back
        self.inbox: Inbox | None = None

    # -- the loop --------------------------------------------------------------------------------
    def serve(self) -> ServerStats:
        self.inbox = inbox = Inbox(self.message_bytes, self.group, self.recorder, self.tags.push)
        inbox.ask()
        while self.live:
            try:
                src, msg = inbox.messages.get(timeout=min(1.0, self.worker_timeout_s / 4))
            except queue.Empty:
                self._check_silent()
                continue
            if isinstance(msg, Exception):
                raise CommError(f"parameter server {self.index} (rank {dist.get_rank()}): receiving a push failed: {msg}") from msg
            w = self.worker_ranks.index(src) if src in self.worker_ranks else -1
            if w in self.stats.lost and w not in self.live:
                self._rejoin(w)
            if w in self.live:
                self.last_seen[w] = time.monotonic()
                self._handle(w, msg)
            else:
                head = unpack_header(msg).tolist()
                what = f"rank {src} (worker {w}, live {sorted(self.live)}): {head}"
                print(f"shardwise ps: server {self.index} dropped a message from {what}", file=sys.stderr, flush=True)
            if self.live:
                inbox.ask()
        return self.stats

    def _check_silent(self) -> None:
        # Owed workers wait for us, not we for them; worker 0 reports the run and is never dropped (see above).
        owed = set(self.pending) | self.held | {0}
        now = time.monotonic()
        for w in sorted(self.live - owed):
            if now - self.last_seen[w] > self.worker_timeout_s:
                print(
                    f"shardwise ps: server {self.index} declares worker {w} lost: silent for {now - self.last_seen[w]:.1f}s "
                    f"(worker_timeout_s={self.worker_timeout_s:g})",
                    file=sys.stderr,
                    flush=True,
                )
                self.stats.lost.append(w)
                self._leave(w)

    def _rejoin(self, w: int) -> None:
        """A worker declared lost speaks again: it was slow, not dead (silent past ``worker_timeout_s``)."""
        if self.mode == "sync":
            # Its step is behind the steps applied without it: it cannot rejoin a synchronous run.
            raise CommError(
                f"parameter server {self.index} (rank {dist.get_rank()}): worker {w} (rank {self.worker_ranks[w]}) was "
                f"silent for more than worker_timeout_s={self.worker_timeout_s:g}s, declared lost, then sent again; "
                "raise worker_timeout_s above the longest pause between its steps (evaluation, checkpoints)"
            )
        self.stats.lost.remove(w)
        self.live.add(w)
        self.last_seen[w] = time.monotonic()

    def _leave(self, w: int) -> None:
        self.live.discard(w)
        if self.mode == "sync" and self.pending and set(self.pending) >= self.live:
            self._apply_sync()
        if self.mode == "ssp":
            self._release()

    def _handle(self, w: int, msg: torch.Tensor) -> None:
        head = unpack_header(msg)
        kind = float(head[KIND])
        if kind == DONE:
            self._leave(w)
            return
        if kind == SAVE:
            self._save(w, self._receive_path(w, int(head[LENGTH])))
            return
        if kind == LOAD:
            self._load(w, int(head[STEP]), self._receive_path(w, int(head[LENGTH])))
            return
        assert kind == PUSH and int(head[WORKER]) == w, f"bad message kind {kind} from worker {w}"
        step, lr, read = int(head[STEP]), float(head[LR]), int(head[VERSION])
        grad = self.coder.decode(msg)
        if self.mode == "sync":
            self.pending[w] = (step, grad, lr, read)
            if set(self.pending) >= self.live:
                self._apply_sync()
            return
        self._record(w, step, read)
        self._apply(grad, lr)
        self.completed[w] += 1
        if self.mode == "async":
            self._reply(w)
        else:
            self.held.add(w)
            self._release()

    # -- updates -----------------------------------------------------------------------------------
    def _record(self, w: int, step: int, read: int) -> None:
        slowest = min(self.completed[v] for v in self.live | {w})
        self.stats.record(step - slowest, self.version - read)

    def _apply(self, grad: torch.Tensor, lr: float) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = grad[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # the worker's scheduler sets the rate
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.stats.updates += 1

    def _apply_sync(self) -> None:
        workers = sorted(self.pending)
        for w in workers:
            step, _, _, read = self.pending[w]
            self._record(w, step, read)
        total = self.pending[workers[0]][1].clone()
        for w in workers[1:]:
            total.add_(self.pending[w][1])
        self._apply(total.div_(len(workers)), self.pending[workers[0]][2])
        for w in workers:
            self.completed[w] += 1
        self.pending.clear()
        for w in workers:
            if w in self.live:
                self._reply(w)

    def _release(self) -> None:
        """ssp: answer every held worker that is now within S clocks of the slowest live worker."""
        if not self.live:
            return
        slowest = min(self.completed[v] for v in self.live)
        assert self.staleness is not None
        for w in sorted(self.held):
            if w not in self.live or self.completed[w] - slowest <= self.staleness:
                self.held.discard(w)
                if w in self.live:
                    self._reply(w)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _receive_path(self, w: int, length: int) -> Path:
        # No receive of the inbox is posted while a message is handled, so this one cannot cross it.
        raw = torch.empty(length, dtype=torch.uint8)
        recv(raw, self.worker_ranks[w], group=self.group, recorder=self.recorder, tag=self.tags.ctrl)
        return Path(path_of(raw))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this server: its shard, its optimizer state, its version."""
        return {
            "index": self.index,
            "servers": self.servers,
            "param_ids": self.param_ids,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "clocks": list(self.completed),
        }

    def _save(self, w: int, directory: Path) -> None:
        write_file(directory / SERVER_FILE.format(index=self.index), self.state())
        ack = header(SAVED, w, 0, 0.0, self.version)
        send(ack.view(torch.uint8).clone(), self.worker_ranks[w], group=self.group, recorder=self.recorder, tag=self.tags.ctrl)

    def _load(self, w: int, clock: int, directory: Path) -> None:
        """Restore this shard from ``directory`` (on the first worker's LOAD), set ``w``'s clock, answer it."""
        if self.loaded_from is None:
            self._restore(directory)
            self.loaded_from = str(directory)
        elif self.loaded_from != str(directory):
            raise CheckpointError(f"parameter server {self.index}: worker {w} resumes from {directory}, another worker from {self.loaded_from}")
        self.completed[w] = clock
        self._reply(w)

    def _restore(self, directory: Path) -> None:
        """This shard's tensors, optimizer state and version from the checkpoint's server files, whatever
        number of servers wrote them: tensors are found by their position in the model."""
        first = load_file(directory / SERVER_FILE.format(index=0))
        saved = [first] + [load_file(directory / SERVER_FILE.format(index=i)) for i in range(1, int(first["servers"]))]
        where = {gid: (st, k) for st in saved for k, gid in enumerate(st["param_ids"])}
        shapes = [tuple(where[g][0]["params"][where[g][1]].shape) if g in where else None for g in self.param_ids]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise CheckpointError(f"{directory}: the servers' files do not hold this model's parameter tensors {self.param_ids} with their shapes")
        with torch.no_grad():
            for p, g in zip(self.params, self.param_ids, strict=True):
                st, k = where[g]
                p.copy_(st["params"][k])
        same = int(first["servers"]) == self.servers and saved[self.index]["param_ids"] == self.param_ids
        if same:
            self.optimizer.load_state_dict(saved[self.index]["optimizer"])
        else:
            # Another partition: renumber each tensor's optimizer state into this shard's order.
            if any(len(st["optimizer"]["param_groups"]) != 1 for st in saved) or len(self.optimizer.param_groups) != 1:
                raise CheckpointError(
                    f"{directory}: resuming with servers={self.servers} (saved with {first['servers']}) needs an optimizer with one parameter group; "
                    f"resume with servers={first['servers']}"
                )
            group = {**saved[0]["optimizer"]["param_groups"][0], "params": list(range(len(self.param_ids)))}
            state = {
                j: where[g][0]["optimizer"]["state"][where[g][1]] for j, g in enumerate(self.param_ids) if where[g][1] in where[g][0]["optimizer"]["state"]
            }
            self.optimizer.load_state_dict({"state": state, "param_groups": [group]})
        self.version = max(int(st["version"]) for st in saved) if not same else int(saved[self.index]["version"])

    # -- answers -------------------------------------------------------------------------------------
    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _reply(self, w: int) -> None:
        msg = pack(header(PARAMS, w, self.completed[w], 0.0, self.version), self.flat_params(), self.reply_bytes)
        try:
            send(msg, self.worker_ranks[w], group=self.group, recorder=self.recorder, tag=self.tags.pull)
        except CommError as exc:
            # The worker is gone (its connection closed): the run goes on without it, and says so.
            print(f"shardwise ps: server {self.index} lost worker {w}: answering it failed: {exc}", file=sys.stderr, flush=True)
            self.stats.lost.append(w)
            self.live.discard(w)

    def report_to(self, worker: int) -> None:
        """After the last worker: the stats and the final parameters go to ``worker`` (the one that writes the summary)."""
        if worker in self.stats.lost:
            return
        dst = self.worker_ranks[worker]
        send(self.stats.to_tensor(), dst, group=self.group, recorder=self.recorder, tag=self.tags.stats)
        final = pack(header(PARAMS, worker, 0, 0.0, self.version), self.flat_params(), self.reply_bytes)
        send(final, dst, group=self.group, recorder=self.recorder, tag=self.tags.pull)
        self._close_inbox()

    def _close_inbox(self) -> None:
        """Wait for the reporting worker's BYE, so that no receive is left posted when this process exits.

        A loop that ended on a worker's silence leaves a receive posted, which gloo cannot cancel and
        aborts on at exit; so one is always posted here, and the BYE completes it. The BYE always
        comes (the reporting worker sends it as soon as it has the report), so this waits for it
        however slow that worker is; a receive that fails (the process group's timeout, or the
        worker gone) ends the wait.
        """
        inbox = self.inbox
        if inbox is None:
            return
        while True:
            if not inbox.posted:
                inbox.ask()
            _, msg = inbox.messages.get()
            if isinstance(msg, Exception):
                return
            kind = float(unpack_header(msg)[KIND])
            if kind == BYE:
                return
            if kind == PUSH:  # a worker declared lost that was only slow: tell it the session is over
                w = int(unpack_header(msg)[WORKER])
                bye = pack(header(DONE, w, 0, 0.0, self.version), None, self.reply_bytes)
                send(bye, self.worker_ranks[w], group=self.group, recorder=self.recorder, tag=self.tags.pull)
