"""Point-to-point messages inside a group, counted: the building block of our own collectives.

Only tensors cross the wire here (``dist.isend``/``dist.irecv``), never pickled
objects. A `Peers` object is made for one operation: it translates group ranks,
counts bytes sent and received and the rounds taken, and turns a gloo/NCCL failure
or timeout into a `CommError` that names the rank, the peer and the operation.
The operation records one `CommEvent` at the end (see `shardwise.comm.algorithms`),
so nested building blocks never double-count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Group
from shardwise.comm.traffic import Traffic
from shardwise.errors import CommError


class Peers:
    """This rank's point-to-point view of ``group`` for one operation, with a byte counter."""

    def __init__(self, group: Group, op: str) -> None:
        self.group = group
        self.op = op
        self.size = group.size
        self.rank = group.rank
        self.sent = 0
        self.received = 0
        self.steps = 0

    @property
    def traffic(self) -> Traffic:
        return Traffic(self.sent, self.received, self.steps)

    def _fail(self, what: str, peer: int, exc: Exception) -> CommError:
        return CommError(
            f"rank {self.rank} of group '{self.group.name}' (size {self.size}): {what} peer {peer} "
            f"during {self.op} failed: {exc}. A timeout here usually means the peer stopped or is running "
            "a different operation (every rank must call the same collective with the same algorithm and size)"
        )

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Any:
        """Start sending ``tensor`` to group rank ``peer``; returns the work (None for an empty tensor)."""
        if tensor.numel() == 0:
            return None
        self.sent += tensor.numel() * tensor.element_size()
        try:
            return dist.isend(tensor, group=self.group.pg, tag=tag, group_dst=peer)
        except RuntimeError as exc:
            raise self._fail("sending to", peer, exc) from exc

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Any:
        """Start receiving into ``tensor`` from group rank ``peer``; returns the work (None when empty)."""
        if tensor.numel() == 0:
            return None
        self.received += tensor.numel() * tensor.element_size()
        try:
            return dist.irecv(tensor, group=self.group.pg, tag=tag, group_src=peer)
        except RuntimeError as exc:
            raise self._fail("receiving from", peer, exc) from exc

    def wait(self, work: Any, peer: int) -> None:
        """Wait for one message; a failure names this rank and the peer."""
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._fail("exchanging with", peer, exc) from exc

    def exchange(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int, tag: int = 0) -> None:
        """One round: send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (either may be None)."""
        s = self.isend(send, dst, tag) if send is not None else None
        r = self.irecv(recv, src, tag) if recv is not None else None
        self.wait(r, src)
        self.wait(s, dst)
        self.steps += 1


class Workspace:
    """Scratch buffers kept between calls, one per (slot, dtype, device).

    A fresh 32 MB buffer costs a page fault per 4 KB page on first touch, every
    call; reusing one is part of what keeps our ring close to gloo's own.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined), reused across calls."""
        key = (slot, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]


def ring_allgather(blocks: list[torch.Tensor], peers: Peers, tag: int = 0) -> None:
    """Fill every rank's block of ``blocks`` (rank ``k`` holds ``blocks[k]`` on entry) in ``p - 1`` rounds.

    Round ``s``: send block ``k - s`` to ``k + 1``, receive block ``k - s - 1`` from ``k - 1``
    (the all-gather half of the ring allreduce). Blocks may differ in size; every
    rank must pass blocks of the same sizes.
    """
    p, k = peers.size, peers.rank
    nxt, prv = (k + 1) % p, (k - 1) % p
    for s in range(p - 1):
        peers.exchange(blocks[(k - s) % p], nxt, blocks[(k - s - 1) % p], prv, tag)


def pairwise_alltoall(send: list[torch.Tensor], recv: list[torch.Tensor], peers: Peers, tag: int = 0) -> None:
    """Send ``send[j]`` to rank ``j`` and receive ``recv[j]`` from it, for every ``j``, in ``p - 1`` rounds.

    Round ``s`` pairs rank ``k`` with ``k + s`` (to) and ``k - s`` (from). The own
    block is copied locally.
    """
    p, k = peers.size, peers.rank
    recv[k].copy_(send[k])
    for s in range(1, p):
        peers.exchange(send[(k + s) % p], (k + s) % p, recv[(k - s) % p], (k - s) % p, tag)
