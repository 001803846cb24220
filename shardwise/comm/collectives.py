"""Thin wrappers over c10d collectives: the one door to torch.distributed.

Each wrapper records what it sent into a `Recorder` (when given one) and turns a
failure or a timeout into a `CommError` that names the rank, the operation and
the group, instead of a bare gloo message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.errors import CommError

T = TypeVar("T")

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


@dataclass(frozen=True)
class Group:
    """A named process group; ``pg=None`` is the default (world) group."""

    name: str = "world"
    pg: Any = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.pg) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.pg) if dist.is_initialized() else 0

    def contains(self, global_rank: int) -> bool:
        """Whether the process of global rank ``global_rank`` is in this group."""
        if self.pg is None or not dist.is_initialized():
            return True
        return global_rank in dist.get_process_group_ranks(self.pg)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.pg, group_rank) if self.pg is not None else group_rank


WORLD = Group()


def _guard(op: str, group: Group, call: Callable[[], T]) -> T:
    try:
        return call()
    except RuntimeError as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CommError(
            f"rank {rank}: {op} on group '{group.name}' (size {group.size}) failed: {exc}. "
            "A timeout here usually means another rank stopped or is running a different operation"
        ) from exc


def _reduce_op(op: str, tensor: torch.Tensor) -> Any:
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {sorted(_OPS)}")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op='mean' needs a floating-point tensor; got {tensor.dtype}")
    return _OPS[op]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, op: str = "sum", *, group: Group = WORLD, recorder: Recorder | None = None) -> torch.Tensor:
    """Reduce ``tensor`` in place across the group and return it."""
    p = group.size
    if p == 1 or not dist.is_initialized():
        return tensor
    rop = _reduce_op(op, tensor)
    n = _nbytes(tensor)
    sent, recv = wire_bytes("all_reduce", n, p)
    rec = recorder or _NULL
    with rec.timed("all_reduce", group.name, p, n, sent, recv):
        _guard("all_reduce", group, lambda: dist.all_reduce(tensor, op=rop, group=group.pg))
    if op == "mean":
        tensor.div_(p)
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, *, group: Group = WORLD, recorder: Recorder | None = None) -> torch.Tensor:
    """Broadcast ``tensor`` from group rank ``src`` in place."""
    p = group.size
    if p == 1 or not dist.is_initialized():
        return tensor
    n = _nbytes(tensor)
    sent, recv = wire_bytes("broadcast", n, p, is_root=group.rank == src)
    rec = recorder or _NULL
    with rec.timed("broadcast", group.name, p, n, sent, recv):
        _guard("broadcast", group, lambda: dist.broadcast(tensor, src=group.global_rank(src), group=group.pg))
    return tensor


def all_gather(tensor: torch.Tensor, *, group: Group = WORLD, recorder: Recorder | None = None) -> list[torch.Tensor]:
    """Gather equal-shaped tensors from every rank of the group."""
    p = group.size
    if p == 1 or not dist.is_initialized():
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(p)]
    n = _nbytes(tensor) * p
    sent, recv = wire_bytes("all_gather", n, p)
    rec = recorder or _NULL
    with rec.timed("all_gather", group.name, p, n, sent, recv):
        _guard("all_gather", group, lambda: dist.all_gather(out, tensor, group=group.pg))
    return out


def barrier(*, group: Group = WORLD, recorder: Recorder | None = None) -> None:
    """Wait for every rank of the group (a zero-byte collective, so it also times out)."""
    if group.size == 1 or not dist.is_initialized():
        return
    rec = recorder or _NULL
    with rec.timed("barrier", group.name, group.size, 0, 0, 0):
        # A tiny allreduce instead of dist.barrier: it honours the group's timeout on gloo and NCCL alike.
        flag = torch.zeros(1, device=_device_of(group))
        _guard("barrier", group, lambda: dist.all_reduce(flag, group=group.pg))


def _device_of(group: Group) -> torch.device:
    backend = dist.get_backend(group.pg)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _NullRecorder(Recorder):
    def add(self, event: Any) -> None:  # noqa: D401 - nothing to keep
        return None


_NULL = _NullRecorder()


def all_reduce_async(
    tensor: torch.Tensor, op: str = "sum", *, group: Group = WORLD, recorder: Recorder | None = None, timed: bool = False
) -> torch.futures.Future[torch.Tensor]:
    """Start the backend's own allreduce of ``tensor`` in place; a future of the reduced tensor.

    For work that overlaps the reduction, as a DDP communication hook does with each
    gradient bucket. The recorder gets the tensor's bytes (the bandwidth-optimal
    figure of `wire_bytes`, as for `all_reduce`) once per call, when the operation
    is launched, untimed (``seconds`` None: the backend runs it while the caller goes
    on, so its wall time is not this call's cost). With ``timed=True`` the event is
    added when the reduction completes instead, with the seconds from launch to
    completion; the backend completes futures on its own thread, so the recorder is
    then written from that thread. ``op='mean'`` divides after the sum, as `all_reduce`.
    """
    p = group.size
    if p == 1 or not dist.is_initialized():
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done
    rop = _reduce_op(op, tensor)
    n = _nbytes(tensor)
    sent, recv = wire_bytes("all_reduce", n, p)
    rec = recorder or _NULL
    start = time.perf_counter()
    work = _guard("all_reduce", group, lambda: dist.all_reduce(tensor, op=rop, group=group.pg, async_op=True))
    if not timed:
        rec.add(CommEvent("all_reduce", group.name, p, n, sent, recv, None))

    def finished(fut: torch.futures.Future[Any]) -> torch.Tensor:
        if timed:
            rec.add(CommEvent("all_reduce", group.name, p, n, sent, recv, time.perf_counter() - start))
        if op == "mean":
            tensor.div_(p)
        return tensor

    return work.get_future().then(finished)
