"""DDP communication hooks that average gradient buckets with our algorithms and codecs.

DDP hands each gradient bucket (a flat tensor) to a hook and waits on the future
it returns (PyTorch's DDP communication hooks; Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training"). Ours:

- `allreduce_hook`: the bucket averaged by a named algorithm (``ring``, ``tree``, ...), or
  through the two levels of ``hierarchical`` (`shardwise.comm.hierarchical`).
- `compression_hook`: the bucket averaged in compressed form (``int8``, ``topk:0.01``,
  ...), with an error-feedback residual kept per parameter, so it survives DDP
  rebuilding its buckets after the first step.
- `powersgd_hook`: torch's own ``powerSGD_hook`` (non-batched), with its traffic recorded.

Every hook records each bucket in the run's `Recorder`. The algorithms and codecs
block until the bucket is reduced, so these hooks do not overlap communication
with the rest of backward as the native hook does; on CPU with gloo that overlap
is small anyway.

>>> state, hook = make_comm_hook(group, recorder, allreduce="ring", compression=None)  # doctest: +SKIP
>>> ddp_model.register_comm_hook(state, hook)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.comm.algorithms import allreduce, check_algorithm
from shardwise.comm.codecs import Codec, CodecState, PowerSGD, get_codec
from shardwise.comm.collectives import Group
from shardwise.comm.compressed import compressed_allreduce
from shardwise.comm.hierarchical import NodeLevels, hierarchical_allreduce
from shardwise.comm.p2p import Workspace
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.comm.traffic import HIERARCHICAL
from shardwise.errors import ConfigError


def parse_options(allreduce: str = "native", compression: str | None = None) -> tuple[str, Codec | PowerSGD | None]:
    """Validate the ddp options ``allreduce`` and ``compression``; returns (algorithm, codec or None).

    ``allreduce`` is one of `shardwise.comm.algorithms.ALGORITHMS` or ``hierarchical``
    (`shardwise.comm.hierarchical`: within each node, across the node leaders, back).

    ``compression`` None, '' or 'none' means no compression. Codecs whose exchange is
    not an allreduce (int8, topk, sign, powersgd) combine only with ``allreduce='native'``;
    fp16, bf16 and randomk run over any algorithm.
    """
    algorithm = check_algorithm(allreduce, also=(HIERARCHICAL,))
    if compression is None or compression in ("", "none"):
        return algorithm, None
    if algorithm == HIERARCHICAL:
        raise ConfigError(
            f"allreduce='hierarchical' reduces uncompressed buckets; got compression {compression!r}. "
            "Drop the compression option, or choose a flat algorithm (native, ring, ...) to compress over"
        )
    codec = get_codec(compression)
    if codec.exchange != "allreduce" and algorithm != "native":
        raise ConfigError(
            f"compression {codec.spec!r} has its own exchange ({codec.exchange}), so it cannot run over "
            f"allreduce={algorithm!r}; the allreduce algorithm applies to uncompressed, fp16, bf16 and randomk buckets. "
            "Drop the allreduce option or choose compression 'fp16', 'bf16' or 'randomk:RATIO'"
        )
    return algorithm, codec


@dataclass
class CommHookState:
    """What our hooks keep between calls."""

    group: Group
    recorder: Recorder
    algorithm: str = "native"
    codec: Codec | None = None
    seed: int = 0
    workspace: Workspace = field(default_factory=Workspace)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    """Error-feedback residual of each parameter, by ``id(param)``."""
    generator: torch.Generator | None = None
    """The codec's random stream (randomk): seeded with ``seed`` on every rank alike, so that
    all ranks draw the same indices for the same bucket (buckets come in the same order)."""
    powersgd: Any = None
    levels: NodeLevels | None = None
    """The two-level mesh ``allreduce='hierarchical'`` reduces over (built once, with the hook)."""


def _done(buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def allreduce_hook(state, bucket):
    """Average the bucket with ``state.algorithm``; recorded as ``all_reduce:<algorithm>``.

    (state: CommHookState, bucket: dist.GradBucket) -> Future[Tensor]. Unannotated on
    purpose: DDP rejects a hook whose annotations are strings, which they are
    under ``from __future__ import annotations``.
    """
    buf = bucket.buffer()
    if state.levels is not None:  # hierarchical: each level recorded apart (node/reduce, leaders/all_reduce:native, node/broadcast)
        hierarchical_allreduce(buf, "avg", state.levels, recorder=state.recorder, workspace=state.workspace)
    else:
        allreduce(buf, "avg", algorithm=state.algorithm, group=state.group, recorder=state.recorder, workspace=state.workspace)
    return _done(buf)


def _bucket_layout(bucket: Any, buf: torch.Tensor) -> list[tuple[int, int, int]]:
    """(id(param), offset, numel) of each parameter's gradient inside the bucket buffer."""
    base, size = buf.data_ptr(), buf.element_size()
    return [(id(p), (g.data_ptr() - base) // size, g.numel()) for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)]


def compression_hook(state, bucket):
    """Average the bucket in compressed form with ``state.codec``; recorded as ``compressed:<codec>``.

    (state: CommHookState, bucket: dist.GradBucket) -> Future[Tensor], unannotated
    as `allreduce_hook`. The bucket's residual is assembled from, and split back
    into, per-parameter residuals.
    """
    buf = bucket.buffer()
    codec = state.codec
    if state.generator is None:
        # The same seed on every rank: random-k's exchange sums values at indices all ranks drew alike.
        state.generator = torch.Generator()
        state.generator.manual_seed(state.seed)
    cstate = CodecState(generator=state.generator)
    layout = _bucket_layout(bucket, buf) if codec.error_feedback else []
    if layout:
        residual = torch.zeros_like(buf)
        for key, offset, numel in layout:
            if key in state.residuals:
                residual[offset : offset + numel] = state.residuals[key]
        cstate.residual = residual
    compressed_allreduce(buf, codec, cstate, op="avg", group=state.group, recorder=state.recorder, algorithm=state.algorithm, workspace=state.workspace)
    if layout and cstate.residual is not None:
        for key, offset, numel in layout:
            state.residuals[key] = cstate.residual[offset : offset + numel]
    return _done(buf)


def powersgd_hook(state, bucket):
    """torch's ``powerSGD_hook`` with the bucket's traffic recorded as ``compressed:powersgd:<rank>``.

    Bytes: the elements torch's hook allreduces (P and Q of each compressed matrix,
    the uncompressed tensors whole; plain allreduce in the first steps), counted
    with the bandwidth-optimal allreduce figure, as for any library collective.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook as torch_powersgd_hook

    ps = state.powersgd
    buf = bucket.buffer()
    compressing = ps.iter >= ps.start_powerSGD_iter
    before = ps.total_numel_after_compression
    start = time.perf_counter()
    fut = torch_powersgd_hook(ps, bucket)
    p = state.group.size

    def record(f: torch.futures.Future[Any]) -> torch.Tensor:
        numel = ps.total_numel_after_compression - before if compressing else buf.numel()
        sent, recv = wire_bytes("all_reduce", numel * buf.element_size(), p)
        state.recorder.add(
            CommEvent(f"compressed:{state.codec.spec}", state.group.name, p, buf.numel() * buf.element_size(), sent, recv, time.perf_counter() - start)
        )
        value = f.value()
        out: torch.Tensor = value[0] if isinstance(value, list) else value
        return out

    return fut.then(record)


def make_comm_hook(
    group: Group, recorder: Recorder, *, allreduce: str = "native", compression: str | None = None, seed: int = 0, node_size: int = 1
) -> tuple[CommHookState, Callable[..., Any]]:
    """The (state, hook) pair for ``DistributedDataParallel.register_comm_hook``. With
    ``allreduce='hierarchical'``, ``node_size`` ranks per node: collective (builds the node groups)."""
    algorithm, codec = parse_options(allreduce, compression)
    state = CommHookState(group=group, recorder=recorder, algorithm=algorithm, seed=seed)
    if algorithm == HIERARCHICAL:
        state.levels = NodeLevels.build(group, node_size)
        if state.levels.nodes == 1 and group.size > 1 and group.rank == 0:  # said once, where the hook is made
            print(
                f"shardwise: allreduce='hierarchical' with node size {node_size} = the world size: one node, so it is a reduce "
                "and a broadcast; pass --node-size N (node_size=N) to model nodes of N processes",
                flush=True,
            )
    if codec is None:
        return state, allreduce_hook
    state.codec = codec  # type: ignore[assignment]
    if isinstance(codec, PowerSGD):
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        state.powersgd = PowerSGDState(
            process_group=group.pg,
            matrix_approximation_rank=codec.rank,
            start_powerSGD_iter=codec.start_iter,
            min_compression_rate=codec.min_compression_rate,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
            compression_stats_logging_frequency=2**62,
        )
        return state, powersgd_hook
    return state, compression_hook
