"""Layer 1: every byte shardwise sends goes through here and is recorded.

The collective wrappers and the recorder load with the package; our own allreduce
algorithms, codecs and compressed exchanges load on first use
(``shardwise.comm.allreduce``, ``shardwise.comm.get_codec``, ...).

Design notes: Communication
===========================

`shardwise.comm` is layer 1 and the one door to `torch.distributed`: every byte shardwise sends
goes through it and is recorded. `collectives.py` wraps the c10d collectives (`all_reduce`,
`broadcast`, `all_gather`, `barrier`) and, for ranks that pair up themselves (parameter servers
and their workers), point-to-point `send`, `recv`, `isend`, `irecv` and `new_group`; `p2p.py`
holds `Peers` (counted `isend`/`irecv` within a group), `traffic.py` the byte formulas,
`algorithms.py` our allreduce algorithms, `codecs.py` the compression codecs, `compressed.py` their
exchanges, `hooks.py` the DDP communication hooks; `shardwise bench comm` lives in
`shardwise/tools/bench/comm.py`.

**The Recorder.** One per engine, passed explicitly to whatever communicates (no global). Each
operation adds one `CommEvent`: `op`, `group`, group size, `payload_bytes` (the tensor handed to
the operation), `sent_bytes` and `received_bytes` (this rank's), `seconds` and `steps`. A *step*
is a round in which a rank sends at most one message and receives at most one (the single-port,
full-duplex model of Thakur, Rabenseifner & Gropp 2005). Totals are keyed `group/op` and become
`comm` in `summary.json` (with `sent_bytes_per_step`). How bytes are counted:

- **Our algorithms and exchanges: exact.** `Peers` adds the size of every message it actually
  posts and receives, and counts rounds (an empty piece's round still counts). A composite
  operation (a compressed exchange that runs an all-to-all and an all-gather) records one event,
  so nested building blocks never count twice. Tests check the recorded bytes and steps against
  `traffic.py` byte for byte, at p = 2, 3, 4 and sizes that do not divide by p.
- **Library collectives (gloo's, NCCL's: `native`, DDP's own allreduce, the wrappers): the
  bandwidth-optimal figures** that nccl-tests uses for bus bandwidth, because the library's
  schedule is hidden: allreduce `2(p-1)/p n` each way, all-gather and reduce-scatter `(p-1)/p` of
  the full buffer, broadcast `n` out of the root; `steps` is 0. `recorder.wire_bytes` states them.

**Allreduce algorithms** (`allreduce(t, op, algorithm=...)`; ops sum/avg/min/max; float and
integer dtypes; any world size). Schedules after Thakur et al. 2005; every rank ends with the
same bits. For `n` elements of `b` bytes (`N = n b`) and `p` ranks, rank `k` sends:

| algorithm | bytes sent by rank k | rounds |
| --- | --- | --- |
| `ring` (reduce-scatter + all-gather, pipelined in segments of `RING_SEGMENT_BYTES`) | `(2n - c[k] - c[k+1]) b`; `2(p-1)/p N` when p divides n | `2(p-1)` |
| `recursive-doubling` (butterfly) | `N lg p` (p a power of two) | `lg p` |
| `rabenseifner` (recursive halving, then doubling) | `(n - c[k] + S(k)) b`; `2(p-1)/p N` when p divides n | `2 lg p` |
| `tree` (binomial reduce to 0, then broadcast) | `N (children(k) + [k != 0])` | `2 (children(k) + [k != 0])` |
| `master-worker` | root `(p-1) N`, worker `N` | root `2(p-1)`, worker 2 |
| `all-to-all` | `(p-1) N` | `p - 1` |
| `native` | `2(p-1) N // p` (the bandwidth-optimal figure) | 0 (hidden) |

Sizes that do not divide by p: a tensor is cut as `torch.tensor_split` cuts it, the first
`n mod q` pieces one element longer (`c[j]` above, `traffic.split_sizes`); ring cuts into p
pieces, so rank k sends every piece but its own in the reduce-scatter and every piece but
`k+1`'s in the all-gather. `S(k)` sums, over the halving rounds, the aligned block of `2^j`
pieces that holds piece k. World sizes that are not powers of two (recursive doubling,
Rabenseifner) fold as MPICH does: with `p' = 2^floor(lg p)` and `r = p - p'`, each even rank
below `2r` hands its vector to the odd rank above (`N` each way, two extra rounds) and sits out
while the `p'` others run the power-of-two algorithm. `allreduce_traffic` gives every row.

**Codecs and exchanges** (`get_codec(spec)`, `compressed_allreduce(t, codec, state)`). A codec
turns a flat floating-point tensor into an `Encoded` payload and back; how `p` payloads are
combined is the codec's `exchange`, chosen by what can be summed on the wire. `k = max(1,
floor(RATIO n))`, `m` the scale's bytes (4, or 8 for float64); bytes are per rank, each way:

| codec | payload | exchange | why | bytes sent (p = 2, fp32, native: vs `4n`) |
| --- | --- | --- | --- | --- |
| `fp16`, `bf16` | n 16-bit values | allreduce, any algorithm | 16-bit values sum as they are; prescaled by 1/p so an fp16 sum cannot overflow where the mean would not | the algorithm's at 2 bytes (2x fewer) |
| `randomk:RATIO` | k values (plus an 8-byte seed, needed only by a standalone message) | allreduce of the k values, any algorithm | every rank draws the same k indices from a generator seeded alike and advanced once per call, so summing values sums the sparse tensors; no indices on the wire | the algorithm's for k elements (1/RATIO fewer) |
| `topk:RATIO` | k (int32 index, value) pairs | ring all-gather, decoded and added in rank order | each rank's largest entries are elsewhere: payloads cannot be summed | `(p-1) k (4 + b)` in `p-1` rounds |
| `sign` | `ceil(n/8)` bytes of bits and one scale (mean magnitude) | ring all-gather | a sum of signs is not a sign | `(p-1)(ceil(n/8) + m)` |
| `int8` | one byte an element, scale and zero point per piece | scatter-gather (Bagua's ByteGrad): pairwise all-to-all of p pieces, each owner decodes, sums, re-quantizes, then ring all-gather | codes with different scales cannot be summed, and gathering all p full payloads would cost p times more | piece j packs to `e_j = c_j + 2m`: `sum_{j != k} e_j` plus all but `e_{k+1}`, in `2(p-1)` rounds (4x fewer) |
| `powersgd:RANK` | P and Q of each matrix | two allreduces with an orthogonalization between (torch's non-batched `powerSGD_hook`; the batched one fails on torch 2.13) | does not fit encode -> exchange -> decode | the bandwidth-optimal figure on the elements it allreduces |

`compressed_traffic` gives each row. Random-k used to draw indices per rank and all-gather
(index, value) pairs, so every value sent was averaged with `p - 1` zeros; with shared
randomness every coordinate sent is the mean over all ranks (Stich, Cordonnier & Jaggi 2018;
Vogels et al. 2019 use the same all-reduce-compatible random-k). The codec state's seed must be
the same on every rank (the DDP hook seeds one generator per hook alike; buckets come in the same
order on every rank). On digits (300 AdamW steps, p = 2; `tests/strategies/data_parallel/test_ddp_comm.py`):

| codec | validation accuracy | bytes sent vs uncompressed |
| --- | --- | --- |
| none | 96.66% | 1x |
| fp16 / bf16 | 96.66% / 96.94% | 2x fewer |
| int8 | 97.21% | 4.0x |
| topk:0.01 | 96.94% | 50x |
| randomk:0.2 | 96.66% | 5.0x |
| sign | 97.21% | 32x |
| powersgd:4 | 96.94% | 9.4x |

Random-k needs a large ratio under Adam: at 0.01, 0.05, 0.1, 0.15 it reached 90.81%, 94.99%,
94.99%, 95.54%. A coordinate sent once every `1/RATIO` steps arrives as one accumulated spike,
and Adam, dividing by the root of the mean square, moves it roughly `sqrt(RATIO)` as far as a
dense gradient would. Over four seeds randomk:0.2 was 0.6 points below uncompressed on average
(worst 1.4); topk:0.01 varies as much (worst 1.7 at one seed).

**Error feedback** (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019): what a codec
drops is kept in a per-tensor residual and added to the next gradient, `corrected = g +
residual`, `sent = decode(encode(corrected))`, `residual = corrected - sent`. It is exact for
every codec (tests check `sent + residual == g + old residual` bit for bit; sign up to one
rounding), computed in place in the residual's memory. On by default for int8, topk, randomk and
sign, off for the 16-bit casts; int8's second quantization (of the summed piece) is not covered.

**DDP hooks.** The ddp options `allreduce` and `compression` (`--allreduce ring`,
`--compression int8`) pick the hook: neither keeps the backend's own allreduce, started per
bucket through `all_reduce_async` by a small recording hook (each real bucket one event, its
bytes counted from the bucket itself; timed with `record_buckets=True`); an algorithm
gives `allreduce_hook`; a codec `compression_hook` (residuals kept per parameter, by
`id(param)`, so they survive DDP rebuilding its buckets after the first step); powersgd
`powersgd_hook`. A codec whose exchange is not an allreduce (int8, topk, sign, powersgd) runs
only with `allreduce="native"`. Bad names and combinations fail in the strategy's constructor,
before any process starts: one line with what was wrong, the known names and the closest match
(exit code 2 from the command). **Our hooks block until the bucket is reduced** and return a
completed future, so the next bucket's gradients wait for them: communication does not overlap
the rest of backward, unlike native DDP, whose asynchronous allreduce runs while autograd
computes the next buckets. On CPU with gloo that overlap is small; on GPUs it matters, so a
step-time comparison of our hooks with native DDP includes the lost overlap.

**`shardwise bench comm`** (`--nproc P --algorithms ... --codecs ... --sizes 1KB,...,64MB
--json FILE`): for each algorithm, codec and size, time (the slowest rank's mean, the median
of interleaved repetitions), algorithm bandwidth `size / time` and bus bandwidth `algbw x
2(p-1)/p` as nccl-tests defines them, the ratio to native, the bytes each rank sent and the
rounds (what the Recorder counted), and for codecs the bytes against the fp32 ring. It fits
Hockney's alpha-beta model to our point-to-point algorithms, `time = alpha x steps + beta x
bytes_sent_per_rank` (weighted least squares on relative error; native is left out, its rounds
are hidden), plus `latency + seconds_per_byte x size` per algorithm, and saves it as JSON
(`--fit`, default `comm_fit.json`) for a planner to read.
"""  # noqa: E501 - a Markdown table keeps each row on one line

from __future__ import annotations

import importlib
from typing import Any

from shardwise.comm.collectives import (
    WORLD,
    Group,
    Pending,
    all_gather,
    all_reduce,
    all_reduce_async,
    barrier,
    broadcast,
    broadcast_async,
    irecv,
    isend,
    monitored_barrier,
    new_group,
    recv,
    send,
)
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes

_LAZY = {
    "allreduce": "shardwise.comm.algorithms",
    "ALGORITHMS": "shardwise.comm.algorithms",
    "Workspace": "shardwise.comm.p2p",
    "get_codec": "shardwise.comm.codecs",
    "CodecState": "shardwise.comm.codecs",
    "compressed_allreduce": "shardwise.comm.compressed",
    "allreduce_traffic": "shardwise.comm.traffic",
    "make_comm_hook": "shardwise.comm.hooks",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwise.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "WORLD",
    "CommEvent",
    "Group",
    "Pending",
    "Recorder",
    "all_gather",
    "all_reduce",
    "all_reduce_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "irecv",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "send",
    "wire_bytes",
    *_LAZY,
]
