"""Allreduce in compressed form: each codec's exchange, over our point-to-point building blocks.

>>> compressed_allreduce(grad, get_codec("topk:0.01"), state, op="avg", recorder=rec)  # doctest: +SKIP

- ``allreduce`` (fp16, bf16): prescale by 1/p for an average (as torch's
  ``fp16_compress_hook`` does, so the 16-bit sum cannot overflow where the mean
  would not), encode, allreduce the 16-bit payload with any algorithm, decode.
- ``allreduce`` (randomk): every rank draws the same ``k`` indices from its
  state's generator (seeded alike on every rank, advanced once per call), so the
  ``k`` selected values are allreduced with any algorithm, averaged, and put back
  at those indices (Stich, Cordonnier & Jaggi 2018; Vogels et al. 2019). No
  indices cross the wire, and each coordinate sent is the mean over all ranks.
- ``allgather`` (topk, sign): each rank's payload has the same layout; a ring
  all-gather gives everyone all ``p`` of them, which every rank decodes and adds
  in rank order (so all ranks hold the same bits). Top-k's indices differ by rank,
  so its payloads cannot be summed as they are.
- ``scatter-gather`` (int8, Bagua's ByteGrad; Gan et al. 2021, "BAGUA: Scaling up
  Distributed Learning with System Relaxations"): the tensor is cut into ``p``
  pieces, each quantized with its own range; piece ``j`` of every rank goes to rank
  ``j`` (pairwise all-to-all), which decodes and sums them, quantizes the sum again
  and all-gathers it. Error feedback covers the first quantization.

Each call records one event ``compressed:<codec>`` whose ``payload_bytes`` is the
dense tensor and whose ``sent_bytes`` is what this rank actually sent, so the
saving reads straight off the recorder. `compressed_traffic` gives the same
numbers as a formula.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardwise.comm.algorithms import check_algorithm, reduce_with
from shardwise.comm.codecs import Cast, Codec, CodecState, Int8, Sign, Sparse
from shardwise.comm.collectives import WORLD, Group
from shardwise.comm.p2p import Peers, Workspace, pairwise_alltoall, ring_allgather
from shardwise.comm.recorder import CommEvent, Recorder
from shardwise.comm.traffic import Traffic, allreduce_traffic, pairwise_alltoall_traffic, ring_allgather_traffic, split_sizes
from shardwise.errors import ConfigError


def _meta_bytes(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4


def compressed_traffic(codec: Codec, n: int, dtype: torch.dtype, p: int, rank: int, algorithm: str = "native") -> Traffic:
    """Bytes and rounds for ``rank`` in `compressed_allreduce` of ``n`` elements of ``dtype``.

    - fp16/bf16: the allreduce ``algorithm``'s traffic at 2 bytes an element.
    - randomk: the allreduce ``algorithm``'s traffic for ``k`` elements of ``b`` bytes
      (``native`` at ``p = 2``: ``k b``, a ``n / k`` = 1/RATIO reduction of fp32's ``n b``).
    - topk: ``(p-1) k (4 + b)`` each way in ``p-1`` rounds (int32 indices, ``b``-byte values).
    - sign: ``(p-1) (ceil(n/8) + m)`` each way, ``m`` the scale's bytes (4, or 8 for float64).
    - int8: piece ``j`` packs to ``e_j = c_j + 2m`` bytes; the all-to-all sends
      ``sum_{j != k} e_j`` and receives ``(p-1) e_k``, the ring all-gather sends all but
      ``e_{k+1}`` and receives all but ``e_k``; ``2(p-1)`` rounds.
    """
    if p == 1 or n == 0:
        return Traffic(0, 0, 0)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    m = _meta_bytes(dtype)
    if isinstance(codec, Cast):
        return allreduce_traffic(algorithm, n, 2, p, rank)
    if isinstance(codec, Sparse) and codec.exchange == "allreduce":
        return allreduce_traffic(algorithm, codec.k(n), itemsize, p, rank)
    if isinstance(codec, Sparse):
        k = codec.k(n)
        payload = k * ((4 if n < 2**31 else 8) + itemsize)
        return ring_allgather_traffic([payload] * p, rank)
    if isinstance(codec, Sign):
        return ring_allgather_traffic([-(-n // 8) + m] * p, rank)
    if isinstance(codec, Int8):
        e = [c + 2 * m for c in split_sizes(n, p)]
        return pairwise_alltoall_traffic(e, [e[rank]] * p, rank) + ring_allgather_traffic(e, rank)
    raise ConfigError(f"no traffic formula for codec {codec.spec!r}")


def _cast(flat: torch.Tensor, codec: Cast, state: CodecState, op: str, algorithm: str, peers: Peers, ws: Workspace) -> None:
    x = flat / peers.size if op == "avg" else flat
    (enc,), _ = codec.compress(x, state)
    wire = enc.parts["x"]
    reduce_with(wire, "sum", algorithm, peers, ws)
    flat.copy_(codec.decode(enc))


def _shared_sparse(flat: torch.Tensor, codec: Sparse, state: CodecState, op: str, algorithm: str, peers: Peers, ws: Workspace) -> None:
    """Random-k: allreduce the values at the indices every rank drew alike, and put them back."""
    (enc,), _ = codec.compress(flat, state)
    values = enc.parts["val"]  # a fresh tensor (advanced indexing copies)
    reduce_with(values, op, algorithm, peers, ws)
    flat.zero_()
    flat[codec.indices(enc)] = values


def _allgather(flat: torch.Tensor, codec: Codec, state: CodecState, op: str, peers: Peers, ws: Workspace) -> None:
    p, k = peers.size, peers.rank
    (enc,), _ = codec.compress(flat, state)
    raw = enc.pack()
    slab = ws.get("gathered", p * raw.numel(), torch.uint8, flat.device).view(p, raw.numel())
    slab[k].copy_(raw)
    ring_allgather(list(slab), peers)
    flat.zero_()
    for j in range(p):
        codec.decode_add(enc.unpack_like(slab[j]), flat)
    if op == "avg":
        flat.div_(p)


def _scatter_gather(flat: torch.Tensor, codec: Codec, state: CodecState, op: str, peers: Peers, ws: Workspace) -> None:
    p, k = peers.size, peers.rank
    encs, _ = codec.compress(flat, state, pieces=p)
    raws = [e.pack() for e in encs]
    sizes = [r.numel() for r in raws]
    inbox = ws.get("inbox", p * sizes[k], torch.uint8, flat.device).view(p, sizes[k])
    pairwise_alltoall(raws, list(inbox), peers)
    mine = flat.tensor_split(p)[k]
    acc = torch.zeros_like(mine)
    for i in range(p):  # rank order: every owner sums the same way
        acc.add_(codec.decode(encs[k].unpack_like(inbox[i])))
    if op == "avg":
        acc.div_(p)
    reduced = codec.encode(acc, state).pack()
    out = ws.get("outbox", sum(sizes), torch.uint8, flat.device)
    blocks = list(torch.split(out, sizes))
    blocks[k].copy_(reduced)
    ring_allgather(blocks, peers)
    for piece, enc, block in zip(flat.tensor_split(p), encs, blocks, strict=True):
        piece.copy_(codec.decode(enc.unpack_like(block)))


def compressed_allreduce(
    tensor: torch.Tensor,
    codec: Codec,
    state: CodecState,
    *,
    op: str = "avg",
    group: Group = WORLD,
    recorder: Recorder | None = None,
    algorithm: str = "native",
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Sum or average a floating-point ``tensor`` across ``group`` in compressed form, in place.

    ``state`` is this tensor's error-feedback state (keep one per tensor, across
    steps; for randomk, seeded alike on every rank). ``algorithm`` is the allreduce
    used by the codecs whose exchange is an allreduce (fp16, bf16, randomk); the
    others have their own exchange. Records one event ``compressed:<codec>``.
    """
    if op not in ("sum", "avg", "mean"):
        raise ConfigError(f"compressed allreduce sums or averages; got op {op!r}. Use op='sum' or op='avg'")
    op = "avg" if op == "mean" else op
    codec.check(tensor)
    check_algorithm(algorithm)
    if codec.exchange != "allreduce" and algorithm != "native":
        raise ConfigError(
            f"codec {codec.spec!r} has its own exchange ({codec.exchange}); allreduce={algorithm!r} applies only to "
            "uncompressed, fp16, bf16 or randomk payloads. Leave allreduce at 'native' with this codec"
        )
    p = group.size
    if p == 1 or not dist.is_initialized():
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    peers = Peers(group, f"compressed:{codec.spec}")
    ws = workspace or Workspace()
    start = time.perf_counter()
    if flat.numel():
        if isinstance(codec, Cast):
            _cast(flat, codec, state, op, algorithm, peers, ws)
        elif isinstance(codec, Sparse) and codec.exchange == "allreduce":
            _shared_sparse(flat, codec, state, op, algorithm, peers, ws)
        elif codec.exchange == "allgather":
            _allgather(flat, codec, state, op, peers, ws)
        else:
            _scatter_gather(flat, codec, state, op, peers, ws)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    if recorder is not None:
        n = flat.numel() * flat.element_size()
        recorder.add(CommEvent(peers.op, group.name, p, n, peers.sent, peers.received, time.perf_counter() - start, peers.steps))
    return tensor
