"""The `Engine`'s collectives over the loop's group: the six the material teaches, and metrics gathering.

`Collectives` is a base class of `Engine` (kept apart so engine.py stays a readable size): every
method runs on the loop's ranks (``engine.group``), is recorded in ``engine.recorder`` (count, bytes,
seconds; the bytes formulas are in docs/comm.md, "The six collectives"), and must be called on
every rank of that group, in the same order. Ranks given (``src``, ``dst``) are ranks of that
group: the global ranks unless a parameter-server strategy keeps some ranks out of the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardwise.comm import Group, Recorder, all_gather, all_reduce, barrier, broadcast, gather, reduce, scatter
from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.comm.mesh import Mesh

_WIRE_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_DIMS = 8
SCATTER_HEADER_BYTES = 8 * (2 + _MAX_DIMS)
"""The header `Collectives.scatter` broadcasts first (the pieces' dtype and shape, or src's refusal);
`Collectives.gather` and `Collectives.reduce` all-gather one of these from every rank (each rank's dtype
and shape) before the data, so unequal inputs raise a `ConfigError` on every rank instead of a crash."""


class Collectives:
    """The collective methods of `Engine` (see the module docstring)."""

    recorder: Recorder
    device: torch.device

    if TYPE_CHECKING:

        @property
        def group(self) -> Group: ...

        @property
        def mesh(self) -> Mesh: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce across all ranks in place ('sum', 'mean', 'min', 'max', 'product'); every rank gets the result."""
        return all_reduce(tensor, op, group=self.group, recorder=self.recorder)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` copied into ``tensor`` on every rank (in place); returns it."""
        return broadcast(tensor, src, group=self.group, recorder=self.recorder)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum") -> torch.Tensor | None:
        """Reduce every rank's ``tensor`` onto rank ``dst`` ('sum', 'mean', 'min', 'max', 'product').

        On ``dst``: the reduction, written into ``tensor`` (in place, as `all_reduce`) and returned.
        On every other rank: None, and ``tensor`` is left as it was (its copy is what is sent).
        Shapes and dtypes must agree on every rank: each rank's dtype and shape go round first (an
        all-gather of a `SCATTER_HEADER_BYTES` header per rank, recorded as ``all_gather``), and a
        mismatch raises a `ConfigError` naming every rank's on every rank, before any data moves.
        Recorded as ``reduce``: each other rank sends the tensor's bytes, ``dst`` receives them once
        (the bandwidth-optimal figures).
        """
        self._same_everywhere("reduce", tensor, "dst", dst)
        if self.group.rank == dst:
            return reduce(tensor, dst, op, group=self.group, recorder=self.recorder)
        reduce(tensor.clone(), dst, op, group=self.group, recorder=self.recorder)
        return None

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` on rank ``dst``, as a list in rank order (its own included, as a
        copy); None on every other rank. Shapes and dtypes must agree on every rank, checked first as
        in `reduce` (a header all-gathered, recorded as ``all_gather``; a `ConfigError` on every rank
        naming each rank's shape and dtype). Recorded as ``gather``: payload the p tensors' bytes,
        ``dst`` receives p - 1 of them, each other rank sends one."""
        self._same_everywhere("gather", tensor, "dst", dst)
        return gather(tensor, dst, group=self.group, recorder=self.recorder)

    def scatter(self, tensors: Sequence[torch.Tensor] | None, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensors`` (one per rank, equal shapes and dtypes) handed out: every rank,
        ``src`` included, returns its own piece (``tensors[rank]``, a new tensor on this engine's device).

        The other ranks pass None, or anything: their ``tensors`` are ignored (so every rank may build
        the same list and pass it). a header of `SCATTER_HEADER_BYTES` (the pieces' dtype and shape)
        is broadcast from ``src`` first, recorded as a ``broadcast``. Input ``src`` refuses (the wrong
        number of tensors, unequal shapes or dtypes, more than 8 dimensions) raises a `ConfigError`
        on every rank instead of leaving them waiting. Recorded as ``scatter``: payload the p
        pieces' bytes, ``src`` sends p - 1 of them, each other rank receives one.
        """
        group = self.group
        p = group.size
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < p:
            raise ConfigError(f"scatter: src={src!r} is not a rank of the loop's group (size {p}); pass a rank 0 .. {p - 1}")
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        problem = ""
        if group.rank == src:
            problem = _scatter_problem(tensors, p)
            if not problem and tensors is not None:
                first = tensors[0]
                header[:2] = torch.tensor([_WIRE_DTYPES.index(first.dtype), first.dim()])
                header[2 : 2 + first.dim()] = torch.tensor(first.shape, dtype=torch.int64)
            else:
                header[0] = -1
        if p > 1:
            broadcast(header, src, group=group, recorder=self.recorder)
        if int(header[0]) < 0:
            raise ConfigError(problem or f"scatter: rank {src} refused its input (its error says why); nothing was sent")
        dtype, ndim = _WIRE_DTYPES[int(header[0])], int(header[1])
        out = torch.empty([int(d) for d in header[2 : 2 + ndim]], dtype=dtype, device=self.device)
        pieces = [t.to(self.device) for t in tensors] if group.rank == src and tensors is not None else None
        return scatter(out, pieces, src, group=group, recorder=self.recorder)

    def _same_everywhere(self, op: str, tensor: torch.Tensor, name: str, root: int) -> None:
        """Raise the same `ConfigError` on every rank unless every rank's ``tensor`` has one shape and dtype."""
        group = self.group
        p = group.size
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < p:
            raise ConfigError(f"{op}: {name}={root!r} is not a rank of group '{group.name}' (size {p}); pass a group rank 0 .. {p - 1}")
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{op}: pass a tensor on every rank; rank {group.rank} passed {type(tensor).__name__}")
        if p == 1:
            return
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        header[0] = _WIRE_DTYPES.index(tensor.dtype) if tensor.dtype in _WIRE_DTYPES else -1
        header[1] = tensor.dim()
        if tensor.dim() <= _MAX_DIMS:
            header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        seen = [h.tolist() for h in all_gather(header, group=group, recorder=self.recorder)]
        if all(h == seen[0] for h in seen) and seen[0][0] >= 0 and seen[0][1] <= _MAX_DIMS:
            return

        def described(h: list[int]) -> str:
            dims = "more than 8 dims" if h[1] > _MAX_DIMS else str(tuple(h[2 : 2 + h[1]]))
            return f"{dims} {_WIRE_DTYPES[h[0]] if h[0] >= 0 else 'an unsupported dtype'}"

        ranks = ", ".join(f"rank {j} {described(h)}" for j, h in enumerate(seen))
        odd = any(h[0] < 0 or h[1] > _MAX_DIMS for h in seen)
        limits = f" (up to {_MAX_DIMS} dims; dtypes {', '.join(str(d) for d in _WIRE_DTYPES)})" if odd else ""
        raise ConfigError(
            f"{op}: every rank must pass one shape and dtype{limits}; got {ranks}. "
            "Nothing was sent: pad or reshape to a common shape and cast to one dtype on every rank"
        )

    def gather_for_metrics(self, outputs: Any, *, total: int, offset: int = 0) -> Any:
        """Every data-parallel rank's evaluation outputs, in dataset order, without the padding.

        For a loader over torch's ``DistributedSampler(dataset, num_replicas=engine.mesh.size("dp"),
        rank=engine.mesh.coordinate("dp"), shuffle=False)``: that sampler gives rank ``r`` the
        samples ``r, r + W, r + 2W, ...`` of the dataset padded to a multiple of ``W`` by repeating
        its first samples, so the last ``W * ceil(total / W) - total`` positions are duplicates
        that would count twice in a metric. ``outputs`` (a tensor, or a tuple or list of tensors,
        first dimension the samples) are this rank's outputs for its samples ``offset`` to
        ``offset + len``: all of them at once (``offset=0``), or one batch at a time with
        ``offset`` = batch index x batch size. ``total`` is ``len(dataset)``, which the padded
        loader cannot tell. Returns the same structure on every rank, rows in dataset order (the
        sampler's order with ``shuffle=True``), each sample once: what one process computes.
        """
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(self.gather_for_metrics(t, total=total, offset=offset) for t in outputs)
        world = self.mesh.size("dp")
        per_rank = -(-total // world)
        if total < 1 or offset < 0 or outputs.dim() == 0 or offset + outputs.shape[0] > per_rank:
            raise ConfigError(
                f"gather_for_metrics: {tuple(outputs.shape)} outputs from offset {offset} do not fit a padded shard of "
                f"{per_rank} samples ({total} samples over {world} ranks); pass total=len(dataset), offset = batch index x batch size"
            )
        wire = outputs.contiguous() if outputs.dtype != torch.bool else outputs.to(torch.uint8)
        gathered = all_gather(wire.to(self.device), group=self.mesh.group("dp"), recorder=self.recorder)
        # Local row j of rank r is position (offset + j) * W + r of the padded sequence: interleave, then cut at total.
        rows = torch.stack(gathered, 1).flatten(0, 1)[: max(0, total - offset * world)]
        return rows.to(outputs.device, torch.bool) if outputs.dtype == torch.bool else rows.to(outputs.device)

    def barrier(self) -> None:
        """Wait until every rank of the loop's group gets here."""
        barrier(group=self.group, recorder=self.recorder)


def _scatter_problem(tensors: Sequence[torch.Tensor] | None, p: int) -> str:
    """Why ``src``'s scatter input cannot be sent ('' when it can)."""
    if tensors is None or isinstance(tensors, torch.Tensor) or len(tensors) != p:
        got = "None" if tensors is None else f"a tensor of shape {tuple(tensors.shape)}" if isinstance(tensors, torch.Tensor) else f"{len(tensors)}"
        return f"scatter: the source rank must pass a list of {p} tensors, one per rank; got {got}"
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return f"scatter: every piece must be a tensor; got {[type(t).__name__ for t in tensors]}"
    first = tensors[0]
    odd = [i for i, t in enumerate(tensors) if t.shape != first.shape or t.dtype != first.dtype]
    if odd:
        t = tensors[odd[0]]
        return f"scatter: every piece needs the first one's shape {tuple(first.shape)} and dtype {first.dtype}; piece {odd[0]} has {tuple(t.shape)}, {t.dtype}"
    if first.dim() > _MAX_DIMS or first.dtype not in _WIRE_DTYPES:
        known = ", ".join(str(d) for d in _WIRE_DTYPES)
        return f"scatter: pieces of up to {_MAX_DIMS} dimensions and dtypes {known}; got {first.dim()} dimensions, {first.dtype}"
    return ""
