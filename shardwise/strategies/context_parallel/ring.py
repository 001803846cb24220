"""Causal attention over a sequence split across the ``cp`` ranks: ring attention and Ulysses.

Ring attention (Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers", 2023): each rank
keeps its queries and passes its key/value block around the ring; every block's scores merge into the
output with the online softmax (Milakov & Gimelshein 2018: a running log-sum-exp), so no rank ever holds
the whole sequence's keys. Causal chunks are load-balanced by the zig-zag split (`zigzag.py`): rank r
holds chunks r and 2cp-1-r, so at each step a rank either attends all its queries to the first half of
the visiting block (a block from an earlier rank) or its second query chunk to the whole block (a later
rank), never half a mask (Brandon et al., "Striped Attention", 2023 and the zig-zag of ring-flash-attn).
Backward is a second ring: the key/value blocks go round again, and their gradients travel with them,
one hop more, home (the FlashAttention-2 backward per block, Dao 2023).

Ulysses (Jacobs et al., "DeepSpeed Ulysses", 2023): an all-to-all turns sequence shards into head
shards, each rank attends its heads over the whole sequence, and a second all-to-all turns back.

Every byte goes through `shardwise.comm` (`Peers` for the ring, recorded as one ``ring_attention`` and
one ``ring_attention_backward`` event per call; `all_to_all_autograd` for Ulysses).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.comm.collectives import Group, all_to_all_autograd
from shardwise.comm.p2p import Peers
from shardwise.comm.recorder import CommEvent, Recorder
from shardwise.errors import ConfigError

SDPA = F.scaled_dot_product_attention
"""torch's own attention, whatever `hooks.routed_sdpa` routes while a cp forward runs."""


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention ([b, hkv, s, d] -> [b, hkv*groups, s, d])."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: the repeated heads' gradients summed back."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _causal(n: int, device: torch.device) -> torch.Tensor:
    """True where a query may see a key of the rank's own two chunks (their positions are increasing)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


TILE = 256
"""Query rows whose scores are formed at once: a block's transient scores are ``TILE x n`` per head, not ``n x n``."""


def _tiles(n: int) -> list[slice]:
    return [slice(i, min(i + TILE, n)) for i in range(0, n, TILE)]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and log-sum-exp of its scores ([b, h, n, d], [b, h, n]), tile by tile of queries."""
    outs, lses = [], []
    for t in _tiles(q.shape[2]):
        scores = _scores(q[:, :, t], k, scale, None if mask is None else mask[t])
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2's backward of one block (Dao 2023, algorithm 2), tile by tile of queries: (dq, dk, dv)."""
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for t in _tiles(q.shape[2]):
        prob = torch.exp(_scores(q[:, :, t], k, scale, None if mask is None else mask[t]) - lse[:, :, t].unsqueeze(-1))
        dv += torch.matmul(prob.transpose(-1, -2), dout[:, :, t])
        ds = prob * (torch.matmul(dout[:, :, t], v.transpose(-1, -2)) - delta[:, :, t])
        dq[:, :, t] = torch.matmul(ds, k) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, t]) * scale
    return dq, dk, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, blk: torch.Tensor, blk_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: two partial outputs over disjoint keys merged by their log-sum-exps."""
    new = torch.logaddexp(lse, blk_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + blk * torch.exp(blk_lse - new).unsqueeze(-1), new


def _rows(step: int, src: int, rank: int, n: int) -> tuple[slice, slice, bool]:
    """At a ring step holding ``src``'s block: the query rows and key rows that interact, and whether a mask applies."""
    half = n // 2
    if step == 0:
        return slice(0, n), slice(0, n), True
    if src < rank:  # an earlier rank: its first chunk precedes all our queries; its second follows them all
        return slice(0, n), slice(0, half), False
    return slice(half, n), slice(0, n), False  # a later rank: only our second chunk sees it, all of it


class _Ring:
    """One pass of blocks around the cp ring: send to the next rank, receive from the previous."""

    def __init__(self, group: Group, op: str) -> None:
        self.peers = Peers(group, op)
        self.start = time.perf_counter()
        p, r = group.size, group.rank
        self.nxt, self.prv = (r + 1) % p, (r - 1) % p

    def start_shift(self, buf: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, Any, Any]:
        recv = torch.empty_like(buf)
        s = self.peers.isend(buf, self.nxt, tag)
        r = self.peers.irecv(recv, self.prv, tag)
        return recv, s, r

    def finish_shift(self, s: Any, r: Any) -> None:
        self.peers.wait(r, self.prv)
        self.peers.wait(s, self.nxt)
        self.peers.steps += 1

    def record(self, recorder: Recorder | None, payload: int) -> None:
        if recorder is not None:
            p = self.peers
            recorder.add(CommEvent(p.op, p.group.name, p.size, payload, p.sent, p.received, time.perf_counter() - self.start, p.steps))


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, like: torch.Tensor, count: int) -> list[torch.Tensor]:
    n = like.numel()
    return [buf[i * n : (i + 1) * n].view_as(like) for i in range(count)]


class RingAttention(torch.autograd.Function):
    """Causal ring attention over zig-zag chunks: q [b, h, n, d] local, k/v [b, hkv, n, d] local (n = 2 chunks)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: Group, recorder: Recorder | None) -> torch.Tensor:
        p, rank, n, groups = group.size, group.rank, q.shape[2], q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
        ring, kv = _Ring(group, "ring_attention"), _pack(k, v)
        for step in range(p):
            pending = ring.start_shift(kv) if step < p - 1 else None
            kb, vb = _unpack(kv, k, 2)
            qs, ks, masked = _rows(step, (rank - step) % p, rank, n)
            blk, blk_lse = _block(q[:, :, qs], _expand(kb[:, :, ks], groups), _expand(vb[:, :, ks], groups), scale, _causal(n, q.device) if masked else None)
            out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], blk, blk_lse)
            if pending is not None:
                kv, s, r = pending
                ring.finish_shift(s, r)
        ring.record(recorder, 2 * k.numel() * k.element_size())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group, ctx.recorder = scale, group, recorder
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        p, rank, n, groups = group.size, group.rank, q.shape[2], q.shape[1] // k.shape[1]
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        ring = _Ring(group, "ring_attention_backward")
        kv, dkv = _pack(k, v), torch.zeros(2 * k.numel(), dtype=k.dtype, device=k.device)
        for step in range(p):
            kv_next = ring.start_shift(kv) if step < p - 1 else None  # the next block travels while this one is computed
            kb, vb = _unpack(kv, k, 2)
            dkb, dvb = _unpack(dkv, k, 2)
            qs, ks, masked = _rows(step, (rank - step) % p, rank, n)
            ke, ve = _expand(kb[:, :, ks], groups), _expand(vb[:, :, ks], groups)
            mask = _causal(n, q.device) if masked else None
            dq_blk, dk_blk, dv_blk = _block_backward(q[:, :, qs], ke, ve, dout[:, :, qs], lse[:, :, qs], delta[:, :, qs], scale, mask)
            dq[:, :, qs] += dq_blk
            dkb[:, :, ks] += _fold(dk_blk, groups)
            dvb[:, :, ks] += _fold(dv_blk, groups)
            # the block's gradients travel with it; after the last step one more hop takes them home
            dkv, s, r = ring.start_shift(dkv, tag=1)
            ring.finish_shift(s, r)
            if kv_next is not None:
                kv, s2, r2 = kv_next
                ring.finish_shift(s2, r2)
        ring.record(ctx.recorder, 2 * k.numel() * k.element_size())
        dk, dv = _unpack(dkv, k, 2)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: Group, recorder: Recorder | None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag chunks against the whole sequence's keys (see the module)."""
    out: torch.Tensor = RingAttention.apply(q, k, v, scale, group, recorder)
    return out


def ring_bytes(k_local_bytes: int, cp: int) -> tuple[int, int]:
    """Bytes one rank sends per attention call, forward and backward: k and v (``k_local_bytes`` each)
    go round ``cp - 1`` hops each way, and backward's gradients of k and v ``cp`` hops (home included)."""
    kv = 2 * k_local_bytes
    return (cp - 1) * kv, (cp - 1) * kv + cp * kv


# -- Ulysses: all-to-all over heads --------------------------------------------------------------


def _seq_to_heads(t: torch.Tensor, group: Group, recorder: Recorder | None) -> torch.Tensor:
    """[b, h, n, d] (local sequence, all heads) -> [b, h/cp, cp*n, d] (all sequence in rank order, h/cp heads)."""
    p = group.size
    b, h, n, d = t.shape
    parts = t.reshape(b, p, h // p, n, d).permute(1, 0, 2, 3, 4).contiguous()  # dim 0: the rank that gets these heads
    got = all_to_all_autograd(parts, group=group, recorder=recorder)  # dim 0: the rank whose sequence this is
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * n, d)


def _heads_to_seq(t: torch.Tensor, group: Group, recorder: Recorder | None) -> torch.Tensor:
    """The inverse of `_seq_to_heads`."""
    p = group.size
    b, hp, pn, d = t.shape
    parts = t.reshape(b, hp, p, pn // p, d).permute(2, 0, 1, 3, 4).contiguous()
    got = all_to_all_autograd(parts, group=group, recorder=recorder)  # dim 0: the rank whose heads these are
    return got.permute(1, 0, 2, 3, 4).reshape(b, p * hp, pn // p, d)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: Group, recorder: Recorder | None, order: torch.Tensor
) -> torch.Tensor:
    """Causal attention by head shards: ``order`` maps the gathered rank-order sequence to positions
    (a permutation of ``range(s)``, the zig-zag's); heads (and key/value heads) must divide by cp."""
    groups = q.shape[1] // k.shape[1]
    if q.shape[1] % group.size:
        raise ConfigError(
            f"cp_style 'ulysses' splits this rank's {q.shape[1]} attention heads over cp {group.size}, which does not divide them "
            "(tensor parallelism leaves each rank heads / tp); use cp_style='ring'"
        )
    if k.shape[1] % group.size:
        k, v, groups = _expand(k, groups), _expand(v, groups), 1
    qh, kh, vh = (_seq_to_heads(t, group, recorder) for t in (q, k, v))
    inv = torch.argsort(order)
    qn, kn, vn = (t[:, :, inv] for t in (qh, kh, vh))  # natural order: position i at row i
    # the whole sequence for h/cp heads: torch's own attention (its memory-efficient kernels, its backward)
    out = SDPA(qn, kn, vn, is_causal=True, scale=scale, enable_gqa=groups > 1)
    return _heads_to_seq(out[:, :, order], group, recorder)


def ulysses_bytes(local_bytes: int, cp: int) -> int:
    """Bytes one rank sends in one all-to-all of a tensor of ``local_bytes``: all but its own share."""
    return local_bytes * (cp - 1) // cp
