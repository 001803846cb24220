"""The event loops of `shardwise.tools.simulate.network`: one heap of (time, sequence, kind, who, round).

Split from `simulate.py` along its seam: that module turns a cluster and an algorithm into round
times and message costs; this one plays them out worker by worker. The model: docs/simulator.md.
"""

from __future__ import annotations

import heapq

import numpy as np

_COMPUTE, _PRE, _GLOBAL, _POST, _ARRIVE, _RELEASE = range(6)


def collective_loop(
    compute: np.ndarray, g: int, pre: list[float], glob: list[float], post: list[float], sync_every: int, lead: np.ndarray | None = None
) -> np.ndarray:
    """Each worker's end time: compute, then (every ``sync_every`` steps) the allreduce's rounds.

    Per-node phases (``pre``, ``post``) start in a node when its last worker arrives; the global
    phase when the last node is ready. One event per round per group. ``lead[step, w]``: how long
    before the end of its compute a worker joins the exchange (overlap with the backward); it
    computes again at the later of the exchange's end and its own compute's end."""
    steps, p = compute.shape
    lead = np.zeros_like(compute) if lead is None else lead
    own_end = compute[0].astype(float)
    nodes = -(-p // g)
    members = [range(i * g, min(p, (i + 1) * g)) for i in range(nodes)] if pre or post else [range(p)]
    group_of = (np.arange(p) // g) if pre or post else np.zeros(p, dtype=int)
    step = np.zeros(p, dtype=int)
    arrived = np.zeros(len(members), dtype=int)
    ready = 0
    end = np.zeros(p)
    heap: list[tuple[float, int, int, int, int]] = [(float(compute[0, w] - lead[0, w]), w, _COMPUTE, w, 0) for w in range(p)]
    heapq.heapify(heap)
    seq = p

    def push(t: float, kind: int, who: int, r: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, who, r))

    def release(t: float, ws: range) -> None:
        for w in ws:
            t_w = max(t, float(own_end[w]))
            step[w] += 1
            if step[w] < steps:
                own_end[w] = t_w + float(compute[step[w], w])
                push(float(own_end[w] - lead[step[w], w]), _COMPUTE, w, 0)
            else:
                end[w] = t_w

    def start_post(t: float, who: int = 0) -> None:
        for grp in range(len(members)):
            if post:
                push(t + post[0], _POST, grp, 0)
            else:
                release(t, members[grp])

    def group_ready(t: float, who: int = 0) -> None:
        nonlocal ready
        ready += 1
        if ready == len(members):
            ready = 0
            if glob:
                push(t + glob[0], _GLOBAL, 0, 0)
            else:
                start_post(t)

    phases = {_PRE: (pre, group_ready), _GLOBAL: (glob, start_post), _POST: (post, lambda t, grp: release(t, members[grp]))}
    while heap:
        t, _, kind, who, r = heapq.heappop(heap)
        if kind == _COMPUTE:
            if (step[who] + 1) % sync_every:
                release(float(own_end[who]), range(who, who + 1))  # a local step: no exchange, no waiting
                continue
            grp = int(group_of[who])
            arrived[grp] += 1
            if arrived[grp] == len(members[grp]):
                arrived[grp] = 0
                if pre:
                    push(t + pre[0], _PRE, grp, 0)
                else:
                    group_ready(t)
        else:  # a round of a phase ends: its next round, or the next phase
            rounds, then = phases[kind]
            if r + 1 < len(rounds):
                push(t + rounds[r + 1], kind, who, r + 1)
            else:
                then(t, who)
    return end


def ps_loop(compute: np.ndarray, alpha: float, shard_s: float, nic_s: float, asynchronous: bool) -> np.ndarray:
    """Each worker's end time with parameter servers: one representative server queue.

    ``shard_s``: one shard's time through a server NIC (``N/k beta``); ``nic_s``: a worker's whole
    push or pull through its node's shared NIC (``g N beta``). A server NIC serves pushes (in)
    and pulls (out) one at a time, first come first served."""
    steps, p = compute.shape
    step = np.zeros(p, dtype=int)
    end = np.zeros(p)
    in_free = out_free = 0.0
    waiting: list[int] = []
    last_done = 0.0
    heap: list[tuple[float, int, int, int]] = [(float(compute[0, w]) + alpha, w, _ARRIVE, w) for w in range(p)]
    heapq.heapify(heap)
    seq = p

    def pull(t_ready: float, w: int) -> None:
        nonlocal out_free, seq
        out_free = max(out_free, t_ready) + shard_s
        seq += 1
        heapq.heappush(heap, (max(out_free, t_ready + nic_s) + alpha, seq, _RELEASE, w))

    while heap:
        t, _, kind, w = heapq.heappop(heap)
        if kind == _ARRIVE:  # a push reaches the server's NIC
            in_free = max(in_free, t) + shard_s
            done = max(in_free, t + nic_s)
            if asynchronous:
                pull(done, w)
                continue
            waiting.append(w)
            last_done = max(last_done, done)
            if len(waiting) == p:
                for v in waiting:
                    pull(last_done, v)
                waiting, last_done = [], 0.0
        else:
            step[w] += 1
            if step[w] < steps:
                seq += 1
                heapq.heappush(heap, (t + float(compute[step[w], w]) + alpha, seq, _ARRIVE, w))
            else:
                end[w] = t
    return end
