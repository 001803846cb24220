"""The parameter server's wire format, partitioning, and staleness bookkeeping (no process group needed).

Only tensors cross the network (DESIGN: no pickled objects from peers). Every message is one
``uint8`` tensor: a fixed header of `HEADER_FIELDS` float64 values, then the payload bytes.
One message per push keeps a push atomic: a server that receives from any source never
pairs a header from one worker with a payload from another.

============  =====================================================================
header slot   meaning
============  =====================================================================
``KIND``      `PUSH` (a gradient follows), `DONE` (the worker finished), `PARAMS`, `SAVE`,
              `SAVED`, `LOAD`, `BYE` (the reporting worker got the servers' report)
``WORKER``    the worker's index (0 .. workers-1)
``STEP``      the worker's step: the gradient of its step ``t`` (clock ``t``)
``LR``        the worker's learning rate (its scheduler runs on the worker)
``VERSION``   push: the shard version the gradient was computed on; reply: the version sent
``LENGTH``    `SAVE`, `LOAD`: bytes of the checkpoint directory's path that follows on `CTRL_TAG`
============  =====================================================================

Checkpoints (`SAVE`, `LOAD`) name a directory: its path follows as a second message of
UTF-8 bytes on `CTRL_TAG` (a path is text, not a pickled object). On `SAVE` (worker 0, inside
the checkpoint's temporary directory, before the manifest) each server writes
``server-NNN.pt`` there itself and answers `SAVED` on `CTRL_TAG`; on `LOAD` (every worker,
with its clock in ``STEP``) it reads that file once and answers with its parameters.

Parameters are partitioned over the servers whole tensor by whole tensor, balanced by
bytes (largest first onto the least loaded server), as in Li et al. 2014, "Scaling
Distributed Machine Learning with the Parameter Server" (OSDI), where each server node
owns a key range.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.comm.codecs import Codec, CodecState, Encoded

HEADER_FIELDS = 8
HEADER_BYTES = HEADER_FIELDS * 8
KIND, WORKER, STEP, LR, VERSION, LENGTH = range(6)
PUSH, DONE, PARAMS, SAVE, SAVED, LOAD, BYE = 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0
PUSH_TAG, PULL_TAG, STATS_TAG, CTRL_TAG = 11, 12, 13, 14
"""The first session's tags (`Tags.of_session(0)`)."""


@dataclass(frozen=True)
class Tags:
    """The four message tags of one session between workers and servers.

    Every session of a process (each `Trainer.fit` or `Engine.setup` with a parameter-server
    strategy; every rank builds the same sessions in the same order) gets tags of its own, so
    nothing left of an earlier session (a worker declared lost whose message or receive gloo
    still holds for that tag) can meet a later session's messages.
    """

    push: int
    pull: int
    stats: int
    ctrl: int

    @classmethod
    def of_session(cls, session: int) -> Tags:
        base = PUSH_TAG + 4 * session
        return cls(base, base + 1, base + 2, base + 3)


SERVER_FILE = "server-{index:03d}.pt"
"""Each server's file in a checkpoint directory: its shard, its optimizer state, its version."""
HIST_BUCKETS = 64
"""Staleness histograms count 0 .. 62 exactly; the last bucket holds everything >= 63."""


def partition_by_bytes(sizes: Sequence[int], servers: int) -> list[list[int]]:
    """Assign tensor indices to ``servers`` bins, largest first onto the lightest (ties: lowest index).

    Deterministic, so every rank computes the same partition. Each bin is sorted by index.

    >>> partition_by_bytes([400, 40, 400, 10], 2)
    [[0, 1], [2, 3]]
    """
    load = [0] * servers
    bins: list[list[int]] = [[] for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        s = min(range(servers), key=lambda b: (load[b], b))
        bins[s].append(i)
        load[s] += sizes[i]
    return [sorted(b) for b in bins]


def header(kind: float, worker: int, step: int, lr: float, version: int, length: int = 0) -> torch.Tensor:
    h = torch.zeros(HEADER_FIELDS, dtype=torch.float64)
    h[KIND], h[WORKER], h[STEP], h[LR], h[VERSION], h[LENGTH] = kind, worker, step, lr, version, length
    return h


def path_bytes(path: str | os.PathLike[str]) -> torch.Tensor:
    """A directory's path as a ``uint8`` tensor of its UTF-8 bytes (what follows a `SAVE` or `LOAD`)."""
    raw = os.fsencode(os.fspath(path))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def path_of(raw: torch.Tensor) -> str:
    return os.fsdecode(bytes(raw.tolist()))


def pack(head: torch.Tensor, payload: torch.Tensor | None, size: int) -> torch.Tensor:
    """One message of ``size`` bytes: the header, then the payload's bytes (zeros when there is none)."""
    msg = torch.zeros(size, dtype=torch.uint8)
    msg[:HEADER_BYTES] = head.view(torch.uint8)
    if payload is not None:
        raw = payload.contiguous().view(-1).view(torch.uint8)
        msg[HEADER_BYTES : HEADER_BYTES + raw.numel()] = raw
    return msg


def unpack_header(msg: torch.Tensor) -> torch.Tensor:
    return msg[:HEADER_BYTES].clone().view(torch.float64)


def payload_of(msg: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The dense payload (``numel`` values of ``dtype``) that follows the header, copied out."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return msg[HEADER_BYTES : HEADER_BYTES + nbytes].clone().view(dtype)


@dataclass
class GradientCoder:
    """How one shard's gradient travels: dense, or a codec's packed payload with error feedback (worker side)."""

    numel: int
    dtype: torch.dtype
    codec: Codec | None = None
    state: CodecState = field(default_factory=CodecState)
    _template: Encoded | None = None

    def __post_init__(self) -> None:
        if self.codec is not None:
            # Every payload of a codec has the layout of this one (fixed k, fixed scale count).
            self._template = self.codec.encode(torch.zeros(self.numel, dtype=self.dtype), CodecState())

    @property
    def payload_bytes(self) -> int:
        if self._template is None:
            return self.numel * torch.empty(0, dtype=self.dtype).element_size()
        return self._template.nbytes

    def encode(self, grad: torch.Tensor) -> torch.Tensor:
        if self.codec is None:
            return grad
        encs, _ = self.codec.compress(grad, self.state)
        return encs[0].pack()

    def decode(self, msg: torch.Tensor) -> torch.Tensor:
        if self.codec is None:
            return payload_of(msg, self.dtype, self.numel)
        assert self._template is not None
        raw = msg[HEADER_BYTES : HEADER_BYTES + self.payload_bytes].clone()
        return self.codec.decode(self._template.unpack_like(raw))


@dataclass
class ServerStats:
    """What a server applied: updates, staleness of each applied gradient, and workers it lost.

    Two staleness measures per gradient (both recorded, both histogrammed):

    - ``staleness``: clocks the pushing worker is ahead of the slowest live worker when its
      gradient is applied (Ho et al. 2013, "More Effective Distributed ML via a Stale
      Synchronous Parallel Parameter Server"): 0 under sync, at most S under ssp.
    - ``version_lag``: updates this server applied between the worker's pull and this push
      (the delay tau of asynchronous SGD analyses, e.g. Lian et al. 2015).
    """

    workers: int
    updates: int = 0
    gradients: int = 0
    max_staleness: int = 0
    max_version_lag: int = 0
    lost: list[int] = field(default_factory=list)
    staleness_hist: list[int] = field(default_factory=lambda: [0] * HIST_BUCKETS)
    version_lag_hist: list[int] = field(default_factory=lambda: [0] * HIST_BUCKETS)

    def record(self, staleness: int, version_lag: int) -> None:
        self.gradients += 1
        self.max_staleness = max(self.max_staleness, staleness)
        self.max_version_lag = max(self.max_version_lag, version_lag)
        self.staleness_hist[min(max(staleness, 0), HIST_BUCKETS - 1)] += 1
        self.version_lag_hist[min(max(version_lag, 0), HIST_BUCKETS - 1)] += 1

    def to_tensor(self) -> torch.Tensor:
        lost = [1.0 if w in self.lost else 0.0 for w in range(self.workers)]
        head = [float(self.updates), float(self.gradients), float(self.max_staleness), float(self.max_version_lag)]
        return torch.tensor(head + lost + self.staleness_hist + self.version_lag_hist, dtype=torch.float64)

    @staticmethod
    def size(workers: int) -> int:
        return 4 + workers + 2 * HIST_BUCKETS

    @classmethod
    def from_tensor(cls, t: torch.Tensor, workers: int) -> ServerStats:
        v = [int(x) for x in t.tolist()]
        lost = [w for w in range(workers) if v[4 + w]]
        o = 4 + workers
        return cls(workers, v[0], v[1], v[2], v[3], lost, v[o : o + HIST_BUCKETS], v[o + HIST_BUCKETS : o + 2 * HIST_BUCKETS])

    def report(self) -> dict[str, Any]:
        """JSON-friendly: histograms as {value: count}, zeros left out (the last key means '>= 63')."""

        def hist(h: list[int]) -> dict[str, int]:
            return {str(i): c for i, c in enumerate(h) if c}

        return {
            "updates": self.updates,
            "gradients": self.gradients,
            "max_staleness": self.max_staleness,
            "max_version_lag": self.max_version_lag,
            "lost_workers": self.lost,
            "staleness_hist": hist(self.staleness_hist),
            "version_lag_hist": hist(self.version_lag_hist),
        }
