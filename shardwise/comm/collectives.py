"""Thin wrappers over c10d collectives: the one door to torch.distributed.

The six collectives (`broadcast`, `scatter`, `gather`, `reduce`, `all_gather`, `all_reduce`), `all_to_all`,
`barrier`, and point-to-point messages and groups for ranks that pair up themselves.

Each wrapper records what it sent into a `Recorder` (when given one) and turns a
failure or a timeout into a `CommError` that names the rank, the operation and
the group, instead of a bare gloo message.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardwise.comm import ledger
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.errors import CommError, ConfigError

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
    ledger.enter(op, group.name)  # where this rank is, for the launcher's report if a peer never comes
    try:
        out = call()
        ledger.leave()
        return out
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


def broadcast_async(tensor: torch.Tensor, src: int = 0, *, group: Group = WORLD, recorder: Recorder | None = None) -> Pending:
    """Start broadcasting ``tensor`` from group rank ``src`` in place; wait on the returned `Pending`.

    For many broadcasts in flight at once (a sharded optimizer's updated parameters, each from
    the rank that owns it): recorded when started, untimed (``seconds`` None, as `all_reduce_async`).
    """
    p = group.size
    if p == 1 or not dist.is_initialized():
        return Pending(None, "broadcast", group, src)
    n = _nbytes(tensor)
    sent, recv = wire_bytes("broadcast", n, p, is_root=group.rank == src)
    work = _guard("broadcast", group, lambda: dist.broadcast(tensor, src=group.global_rank(src), group=group.pg, async_op=True))
    (recorder or _NULL).add(CommEvent("broadcast", group.name, p, n, sent, recv, None))
    return Pending(work, "broadcast", group, src)


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


def _check_root(op: str, name: str, root: int, group: Group) -> None:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < group.size:
        raise ConfigError(f"{op}: {name}={root!r} is not a rank of group '{group.name}' (size {group.size}); pass a group rank 0 .. {group.size - 1}")


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", *, group: Group = WORLD, recorder: Recorder | None = None) -> torch.Tensor | None:
    """Reduce ``tensor`` from every rank of the group onto group rank ``dst``, in place there.

    Returns ``tensor`` (now the reduction) on ``dst`` and None on the other ranks, whose ``tensor``
    the backend may have used as scratch: its contents afterwards are unspecified (send a copy to
    keep it, as ``Engine.reduce`` does). Ops as `all_reduce`; ``mean`` divides on ``dst`` after the sum.
    """
    _check_root("reduce", "dst", dst, group)
    rop = _reduce_op(op, tensor)
    p = group.size
    if p == 1 or not dist.is_initialized():
        return tensor
    n = _nbytes(tensor)
    root = group.rank == dst
    sent, recv = wire_bytes("reduce", n, p, is_root=root)
    with (recorder or _NULL).timed("reduce", group.name, p, n, sent, recv):
        _guard("reduce", group, lambda: dist.reduce(tensor, dst=group.global_rank(dst), op=rop, group=group.pg))
    if not root:
        return None
    if op == "mean":
        tensor.div_(p)
    return tensor


def gather(tensor: torch.Tensor, dst: int = 0, *, group: Group = WORLD, recorder: Recorder | None = None) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` (equal shapes and dtypes on every rank), in group-rank order, on group
    rank ``dst``; None on the other ranks. Recorded with the whole buffer (p pieces) as its payload."""
    _check_root("gather", "dst", dst, group)
    p = group.size
    if p == 1 or not dist.is_initialized():
        return [tensor.clone()]
    tensor = tensor.contiguous()
    root = group.rank == dst
    out = [torch.empty_like(tensor) for _ in range(p)] if root else None
    n = _nbytes(tensor) * p
    sent, recv = wire_bytes("gather", n, p, is_root=root)
    with (recorder or _NULL).timed("gather", group.name, p, n, sent, recv):
        _guard("gather", group, lambda: dist.gather(tensor, gather_list=out, dst=group.global_rank(dst), group=group.pg))
    return out


def scatter(
    out: torch.Tensor, tensors: Sequence[torch.Tensor] | None = None, src: int = 0, *, group: Group = WORLD, recorder: Recorder | None = None
) -> torch.Tensor:
    """Fill ``out`` on every rank of the group with its piece of ``tensors``, the list of ``group.size``
    tensors (each of ``out``'s shape and dtype) given on group rank ``src`` (None elsewhere); returns ``out``.
    Recorded with the whole buffer (p pieces) as its payload. ``Engine.scatter`` needs no ``out``."""
    _check_root("scatter", "src", src, group)
    p = group.size
    root = group.rank == src
    if root and (tensors is None or len(tensors) != p):
        raise ConfigError(f"scatter: rank {src} must pass {p} tensors, one per rank of group '{group.name}'; got {0 if tensors is None else len(tensors)}")
    if p == 1 or not dist.is_initialized():
        return out.copy_(tensors[0]) if tensors is not None else out
    pieces = [t.contiguous() for t in tensors] if root and tensors is not None else None
    n = _nbytes(out) * p
    sent, recv = wire_bytes("scatter", n, p, is_root=root)
    with (recorder or _NULL).timed("scatter", group.name, p, n, sent, recv):
        _guard("scatter", group, lambda: dist.scatter(out, scatter_list=pieces, src=group.global_rank(src), group=group.pg))
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


def monitored_barrier(*, group: Group = WORLD, timeout_s: float, recorder: Recorder | None = None) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout_s`` (gloo's monitored
    barrier, waiting for all of them); a plain `barrier` on other backends."""
    if group.size == 1 or not dist.is_initialized():
        return
    if dist.get_backend(group.pg) != "gloo":
        barrier(group=group, recorder=recorder)
        return
    rec = recorder or _NULL
    with rec.timed("monitored_barrier", group.name, group.size, 0, 0, 0):
        timeout = datetime.timedelta(seconds=timeout_s)
        _guard("monitored_barrier", group, lambda: dist.monitored_barrier(group=group.pg, timeout=timeout, wait_all_ranks=True))


def _device_of(group: Group) -> torch.device:
    backend = dist.get_backend(group.pg)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _NullRecorder(Recorder):
    def add(self, event: Any) -> None:  # noqa: D401 - nothing to keep
        return None


_NULL = _NullRecorder()


# -- point to point and groups -------------------------------------------------------------------
# For strategies whose ranks pair up themselves (parameter servers and their workers). Ranks are
# group ranks, as in `broadcast` (on the world group they are the global ranks). A message is
# recorded as op ``send`` / ``recv`` (blocking, timed) or ``isend`` / ``irecv`` (posted; its time is
# not seen), group size 2, with its bytes. An operation made of several messages that records
# itself as one event (as our allreduce algorithms do) passes ``recorder=None``, so nothing counts twice.


class Pending:
    """A posted ``isend``, ``irecv`` or ``broadcast_async``: ``wait()`` blocks until it is done (a failure or
    timeout is a `CommError` naming this rank, the operation and the group); ``source()`` is the sender's group rank."""

    def __init__(self, work: Any, op: str, group: Group, peer: int | None) -> None:
        self.work, self.op, self.group, self.peer = work, op, group, peer

    def wait(self) -> None:
        if self.work is None:  # nothing was sent (a group of one)
            return
        what = f"{self.op} {'from any rank' if self.peer is None else f'with rank {self.peer}'}"
        _guard(what, self.group, lambda: self.work.wait())

    def source(self) -> int:
        """The group rank the message came from (after ``wait``; for a receive from any rank)."""
        if self.peer is not None:
            return self.peer
        return int(self.work._source_rank())  # the process group's own numbering: the group rank


def _p2p_record(recorder: Recorder | None, op: str, group: Group, tensor: torch.Tensor, seconds: float | None) -> None:
    if recorder is None:
        return
    n = _nbytes(tensor)
    sent, received = wire_bytes("send" if op in ("send", "isend") else "recv", n, 2)
    recorder.add(CommEvent(op, group.name, 2, n, sent, received, seconds))


def send(tensor: torch.Tensor, dst: int, *, group: Group = WORLD, recorder: Recorder | None = None, tag: int = 0) -> None:
    """Send ``tensor`` to group rank ``dst`` and return once it is out (the receiver has posted its receive)."""
    start = time.perf_counter()
    _guard(f"send to rank {dst}", group, lambda: dist.send(tensor, dst=group.global_rank(dst), group=group.pg, tag=tag))
    _p2p_record(recorder, "send", group, tensor, time.perf_counter() - start)


def recv(tensor: torch.Tensor, src: int | None = None, *, group: Group = WORLD, recorder: Recorder | None = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from group rank ``src`` (None: from any rank); returns the sender's group rank."""
    start = time.perf_counter()
    peer = None if src is None else group.global_rank(src)
    what = "recv from any rank" if src is None else f"recv from rank {src}"
    sender = _guard(what, group, lambda: dist.recv(tensor, src=peer, group=group.pg, tag=tag))
    _p2p_record(recorder, "recv", group, tensor, time.perf_counter() - start)
    return int(sender) if group.pg is None else dist.get_group_rank(group.pg, int(sender))


def isend(tensor: torch.Tensor, dst: int, *, group: Group = WORLD, recorder: Recorder | None = None, tag: int = 0) -> Pending:
    """Start sending ``tensor`` to group rank ``dst``; wait on the returned `Pending`. Recorded when posted."""
    work = _guard(f"isend to rank {dst}", group, lambda: dist.isend(tensor, dst=group.global_rank(dst), group=group.pg, tag=tag))
    _p2p_record(recorder, "isend", group, tensor, None)
    return Pending(work, "isend", group, dst)


def irecv(tensor: torch.Tensor, src: int | None = None, *, group: Group = WORLD, recorder: Recorder | None = None, tag: int = 0) -> Pending:
    """Start receiving into ``tensor`` from group rank ``src`` (None: from any rank, as gloo allows);
    wait on the returned `Pending`. Recorded when posted, for the whole buffer."""
    peer = None if src is None else group.global_rank(src)
    what = "irecv from any rank" if src is None else f"irecv from rank {src}"
    work = _guard(what, group, lambda: dist.irecv(tensor, src=peer, group=group.pg, tag=tag))
    _p2p_record(recorder, "irecv", group, tensor, None)
    return Pending(work, "irecv", group, src)


def new_group(ranks: Any, *, name: str) -> Group:
    """A named group of the given global ranks. Collective over the world: every process calls it,
    in the same order, with the same ranks, whether or not it is a member. No bytes are recorded."""
    members = sorted(int(r) for r in ranks)
    return Group(name, _guard(f"new_group {members}", Group(name), lambda: dist.new_group(ranks=members)))


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

    future: torch.futures.Future[torch.Tensor] = work.get_future().then(finished)
    return future


# -- all-to-all ------------------------------------------------------------------------------------
# Each rank sends a piece of its rows to every rank (expert parallelism's token dispatch and combine,
# Ulysses' heads <-> sequence exchange). Bytes: this rank's payload is its whole input; it sends every
# row except the piece addressed to itself, and receives every output row except the piece from
# itself: sent = (rows_in - in_splits[me]) x row_bytes, received = (rows_out - out_splits[me]) x
# row_bytes. With equal splits both are (p - 1) / p of the payload, `wire_bytes("all_to_all", ...)`.


def _splits(splits: Sequence[int] | None, rows: int, p: int, what: str) -> list[int]:
    if splits is None:
        if rows % p:
            raise ConfigError(f"all_to_all: {rows} rows do not split into {p} equal pieces; pass {what} (one count per rank)")
        return [rows // p] * p
    out = [int(s) for s in splits]
    if len(out) != p or any(s < 0 for s in out):
        raise ConfigError(f"all_to_all: {what}={out} must be {p} non-negative counts, one per rank of the group")
    return out


def all_to_all(
    tensor: torch.Tensor,
    input_splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    *,
    group: Group = WORLD,
    recorder: Recorder | None = None,
) -> torch.Tensor:
    """Send rows (dim 0) of ``tensor`` to every rank of the group: ``input_splits[j]`` rows, in order,
    to group rank j; return the rows received, ``output_splits[j]`` from rank j, in group-rank order.

    Splits None: equal pieces (the rows must divide by the group size). Not differentiable; see
    `all_to_all_autograd`. Recorded as one ``all_to_all`` event with the bytes of the block comment above.
    """
    p = group.size
    if p == 1 or not dist.is_initialized():
        return tensor.clone()
    tensor = tensor.contiguous()
    ins = _splits(input_splits, tensor.shape[0], p, "input_splits")
    if sum(ins) != tensor.shape[0]:
        raise ConfigError(f"all_to_all: input_splits={ins} sum to {sum(ins)}, but the tensor has {tensor.shape[0]} rows")
    outs = _splits(output_splits, tensor.shape[0], p, "output_splits")
    out = tensor.new_empty((sum(outs), *tensor.shape[1:]))
    row = tensor[0:0].new_empty((1, *tensor.shape[1:])).numel() * tensor.element_size()
    me = group.rank
    n = _nbytes(tensor)
    sent, recv = (sum(ins) - ins[me]) * row, (sum(outs) - outs[me]) * row
    with (recorder or _NULL).timed("all_to_all", group.name, p, n, sent, recv):
        _guard("all_to_all", group, lambda: dist.all_to_all_single(out, tensor, outs, ins, group=group.pg))
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all whose backward is the all-to-all back (splits swapped): the gradient of each row
    returns to the rank that sent it, as in GShard's dispatch/combine (Lepikhin et al., 2020)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, ins: list[int], outs: list[int], group: Group, recorder: Recorder | None) -> torch.Tensor:
        ctx.ins, ctx.outs, ctx.group, ctx.recorder = ins, outs, group, recorder
        return all_to_all(tensor, ins, outs, group=group, recorder=recorder)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = all_to_all(grad.contiguous(), ctx.outs, ctx.ins, group=ctx.group, recorder=ctx.recorder)
        return back, None, None, None, None


def all_to_all_autograd(
    tensor: torch.Tensor,
    input_splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    *,
    group: Group = WORLD,
    recorder: Recorder | None = None,
) -> torch.Tensor:
    """`all_to_all` inside autograd: backward sends each row's gradient back to its sender (a second
    recorded ``all_to_all`` with the splits swapped, so forward + backward move twice the bytes)."""
    p = group.size
    rows = tensor.shape[0]
    ins = _splits(input_splits, rows, p, "input_splits")
    outs = _splits(output_splits, rows, p, "output_splits")
    out: torch.Tensor = _AllToAll.apply(tensor, ins, outs, group, recorder)  # type: ignore[no-untyped-call]
    return out
