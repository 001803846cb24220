"""Exact traffic of each allreduce algorithm: bytes sent, bytes received and rounds, per rank.

Pure functions of (algorithm, number of elements, element size, world size, rank): no process
group. The algorithms in `shardwise.comm.algorithms` record what they actually send; the tests
check, byte for byte, that it equals what is written here. The conventions (pieces cut as
``torch.tensor_split`` cuts them, rounds in the single-port model, non-powers of two folded as
MPICH does) and the closed forms per algorithm: docs/comm.md, "Exact traffic per rank".
"""

from __future__ import annotations

from dataclasses import dataclass

ALGORITHMS = ("ring", "recursive-doubling", "rabenseifner", "tree", "master-worker", "all-to-all", "native")


@dataclass(frozen=True)
class Traffic:
    """What one rank puts on and takes off the wire in one operation."""

    sent: int
    """Bytes this rank sends."""
    received: int
    """Bytes this rank receives."""
    steps: int
    """Communication rounds this rank takes part in."""

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent + other.sent, self.received + other.received, self.steps + other.steps)


ZERO = Traffic(0, 0, 0)


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(n), parts)``: the first ``n % parts`` pieces get one more."""
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def pow2_floor(p: int) -> int:
    """The largest power of two not above ``p`` (``p >= 1``)."""
    return 1 << (p.bit_length() - 1)


def fold_role(rank: int, p: int) -> tuple[str, int]:
    """MPICH's folding of a non-power-of-two world: ('idle' | 'host' | 'plain', new rank).

    'idle' ranks (even, below ``2r``) hand their vector to ``rank + 1`` and sit out;
    'host' ranks (odd, below ``2r``) take it and play new rank ``rank // 2``;
    'plain' ranks play ``rank - r``.
    """
    rem = p - pow2_floor(p)
    if rank < 2 * rem:
        return ("host", rank // 2) if rank % 2 else ("idle", -1)
    return "plain", rank - rem


def real_rank(new_rank: int, p: int) -> int:
    """The group rank that plays ``new_rank`` in the folded power-of-two world."""
    rem = p - pow2_floor(p)
    return 2 * new_rank + 1 if new_rank < rem else new_rank + rem


def children(rank: int, p: int) -> list[int]:
    """Children of ``rank`` in the binomial tree rooted at 0, nearest first."""
    low = rank & -rank if rank else 1 << p.bit_length()
    out, m = [], 1
    while m < low and rank + m < p:
        out.append(rank + m)
        m <<= 1
    return out


def _rabenseifner_core(n: int, pof2: int, v: int) -> int:
    """Elements sent (= received) by new rank ``v`` in the power-of-two core."""
    c = split_sizes(n, pof2)
    s = 0
    size = 1
    while size < pof2:
        start = (v // size) * size
        s += sum(c[start : start + size])
        size <<= 1
    return n - c[v] + s


def allreduce_traffic(algorithm: str, n: int, itemsize: int, p: int, rank: int) -> Traffic:
    """Bytes and rounds for ``rank`` in an allreduce of ``n`` elements of ``itemsize`` bytes over ``p`` ranks.

    >>> allreduce_traffic("ring", 1000, 4, 4, 0)
    Traffic(sent=6000, received=6000, steps=6)
    >>> allreduce_traffic("recursive-doubling", 1000, 4, 8, 3).sent == 4000 * 3
    True
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is outside a world of size {p}")
    if p == 1 or n == 0:
        return ZERO
    N = n * itemsize
    if algorithm == "native":
        b = 2 * (p - 1) * N // p
        return Traffic(b, b, 0)
    if algorithm == "ring":
        c = split_sizes(n, p)
        sent = 2 * n - c[rank] - c[(rank + 1) % p]
        recv = 2 * n - c[(rank - 1) % p] - c[rank]
        return Traffic(sent * itemsize, recv * itemsize, 2 * (p - 1))
    if algorithm == "tree":
        links = len(children(rank, p)) + (rank != 0)
        return Traffic(N * links, N * links, 2 * links)
    if algorithm == "master-worker":
        return Traffic((p - 1) * N, (p - 1) * N, 2 * (p - 1)) if rank == 0 else Traffic(N, N, 2)
    if algorithm == "all-to-all":
        return Traffic((p - 1) * N, (p - 1) * N, p - 1)
    # recursive-doubling and rabenseifner: power-of-two core plus MPICH's fold.
    pof2 = pow2_floor(p)
    lg = pof2.bit_length() - 1
    role, v = fold_role(rank, p)
    if role == "idle":
        return Traffic(N, N, 2)
    extra = Traffic(N, N, 2) if role == "host" else ZERO
    if algorithm == "recursive-doubling":
        return Traffic(N * lg, N * lg, lg) + extra
    core = _rabenseifner_core(n, pof2, v) * itemsize
    return Traffic(core, core, 2 * lg) + extra


def ring_allgather_traffic(block_bytes: list[int], rank: int) -> Traffic:
    """Ring all-gather where rank ``j`` contributes ``block_bytes[j]`` bytes.

    Rank ``k`` forwards every block but ``k+1``'s and receives every block but its own,
    in ``p - 1`` rounds.
    """
    p = len(block_bytes)
    if p == 1:
        return ZERO
    total = sum(block_bytes)
    return Traffic(total - block_bytes[(rank + 1) % p], total - block_bytes[rank], p - 1)


def pairwise_alltoall_traffic(send_bytes: list[int], recv_bytes: list[int], rank: int) -> Traffic:
    """Pairwise exchange: ``send_bytes[j]`` to rank ``j``, ``recv_bytes[j]`` from it, ``p - 1`` rounds."""
    p = len(send_bytes)
    if p == 1:
        return ZERO
    return Traffic(sum(send_bytes) - send_bytes[rank], sum(recv_bytes) - recv_bytes[rank], p - 1)


HIERARCHICAL = "hierarchical"
"""Reduce inside each node, all-reduce among the node leaders, broadcast inside each node (`shardwise.comm.hierarchical`):
not one of `ALGORITHMS`, which run over one flat group; it needs the node size too."""


def hierarchical_traffic(n: int, itemsize: int, p: int, node_size: int, rank: int, inter: str = "native") -> dict[str, Traffic]:
    """Traffic of ``rank`` at each level of a hierarchical allreduce, keyed as the recorder keys it (``group/op``).

    ``p / node_size`` nodes of ``node_size`` consecutive ranks; the first rank of each node is its
    leader. Intra-node reduce and broadcast are library collectives (their bandwidth-optimal
    figures, `shardwise.comm.recorder.wire_bytes`, 0 rounds); the leaders' all-reduce is ``inter``'s
    (`allreduce_traffic`). A level with one rank is absent (nothing moves).

    >>> hierarchical_traffic(1000, 4, 4, 2, 0)["leaders/all_reduce:native"]
    Traffic(sent=4000, received=4000, steps=0)
    """
    if node_size < 1 or p % node_size:
        raise ValueError(f"hierarchical allreduce needs whole nodes: world size {p} is not a multiple of node size {node_size}")
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is outside a world of size {p}")
    if n == 0:
        return {}
    N, nodes = n * itemsize, p // node_size
    leader = rank % node_size == 0
    out: dict[str, Traffic] = {}
    if node_size > 1:
        out["node/reduce"] = Traffic(0, N, 0) if leader else Traffic(N, 0, 0)
    if nodes > 1 and leader:
        out[f"leaders/all_reduce:{inter}"] = allreduce_traffic(inter, n, itemsize, nodes, rank // node_size)
    if node_size > 1:
        out["node/broadcast"] = Traffic(N, 0, 0) if leader else Traffic(0, N, 0)
    return out
