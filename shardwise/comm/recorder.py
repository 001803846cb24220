"""A record of every collective shardwise issues: operation, group, bytes, seconds.

Bytes are counted per rank in two ways:

- ``payload_bytes``: the size of the tensor handed to the operation (what the
  user asked to reduce, gather, or send).
- ``sent_bytes`` / ``received_bytes``: what this rank puts on and takes off the
  wire. Our own algorithms over point-to-point messages count these exactly. For
  a library collective (gloo's, NCCL's) the algorithm is hidden, so these are
  the bandwidth-optimal figures that nccl-tests uses for bus bandwidth: an
  allreduce of n bytes over p ranks moves 2(p-1)/p n each way, an all-gather or
  reduce-scatter (p-1)/p n of the full buffer, a broadcast n out of the root, a
  reduce n out of every other rank and into the root, a gather (scatter) of p
  pieces of n/p bytes (p-1)/p n into (out of) the root and n/p out of (into) each
  other rank (docs/comm.md, "The six collectives").

``steps`` counts communication rounds this rank took part in (a round: at most one
message out and one in, to and from any peers). Our own algorithms count them
exactly (``shardwise.comm.traffic`` gives the formulas); for a library collective
the schedule is hidden and ``steps`` is 0.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CommEvent:
    op: str
    group: str
    group_size: int
    payload_bytes: int
    sent_bytes: int
    received_bytes: int
    seconds: float | None
    """Wall time of the call; None when it is not measured (DDP's own bucket allreduce runs in C++)."""
    steps: int = 0


def wire_bytes(op: str, payload: int, p: int, *, is_root: bool = False) -> tuple[int, int]:
    """Bytes (sent, received) by one rank for a library collective of ``payload`` bytes over ``p`` ranks."""
    if p <= 1:
        return 0, 0
    if op == "all_reduce":
        b = 2 * (p - 1) * payload // p
        return b, b
    if op in ("all_gather", "reduce_scatter"):
        # payload is the full (gathered / unreduced) buffer.
        b = (p - 1) * payload // p
        return b, b
    if op in ("gather", "scatter"):
        # payload is the full buffer of p pieces: the root keeps its own piece and moves the other p - 1.
        root, other = (p - 1) * payload // p, payload // p
        if op == "gather":
            return (0, root) if is_root else (other, 0)
        return (root, 0) if is_root else (0, other)
    if op == "broadcast":
        return (payload, 0) if is_root else (0, payload)
    if op == "reduce":
        return (0, payload) if is_root else (payload, 0)
    if op == "all_to_all":
        b = (p - 1) * payload // p
        return b, b
    if op == "send":
        return payload, 0
    if op == "recv":
        return 0, payload
    return 0, 0  # barrier and friends carry no user bytes


class Recorder:
    """Counts collectives; one per engine, passed explicitly to whatever communicates.

    >>> rec = Recorder()
    >>> rec.add(CommEvent("all_reduce", "dp", 2, 400, 400, 400, 0.001))
    >>> rec.totals()["all_reduce"]["count"]
    1
    """

    def __init__(self, *, keep_events: bool = False) -> None:
        self.keep_events = keep_events
        self.events: list[CommEvent] = []
        self._totals: dict[tuple[str, str], dict[str, float]] = defaultdict(
            lambda: {"count": 0, "payload_bytes": 0, "sent_bytes": 0, "received_bytes": 0, "seconds": 0.0, "steps": 0}
        )
        self.enabled = True

    def add(self, event: CommEvent) -> None:
        if not self.enabled:
            return
        t = self._totals[(event.op, event.group)]
        t["count"] += 1
        t["payload_bytes"] += event.payload_bytes
        t["sent_bytes"] += event.sent_bytes
        t["received_bytes"] += event.received_bytes
        if event.seconds is None:
            t["untimed"] = 1  # a seconds total that leaves out untimed calls would mislead: drop it
        else:
            t["seconds"] += event.seconds
        t["steps"] += event.steps
        if self.keep_events:
            self.events.append(event)

    @contextmanager
    def timed(self, op: str, group: str, group_size: int, payload: int, sent: int, received: int, steps: int = 0) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.add(CommEvent(op, group, group_size, payload, sent, received, time.perf_counter() - start, steps))

    def totals(self, by_group: bool = False) -> dict[str, Any]:
        """Totals per operation (or per ``group/op`` when ``by_group``)."""
        out: dict[str, dict[str, float]] = {}
        for (op, group), t in self._totals.items():
            key = f"{group}/{op}" if by_group else op
            acc = out.setdefault(key, {k: 0 for k in t})
            for k, v in t.items():
                acc[k] = acc.get(k, 0) + v
        return out

    def count(self, op: str, group: str | None = None) -> int:
        return int(sum(t["count"] for (o, g), t in self._totals.items() if o == op and (group is None or g == group)))

    def reset(self) -> None:
        self._totals.clear()
        self.events.clear()

    def report(self, steps: int) -> dict[str, Any]:
        """The ``comm`` section of summary.json: totals and bytes per step by operation."""
        steps = max(steps, 1)
        per_op = self.totals(by_group=True)
        for t in per_op.values():
            if t.pop("untimed", 0):
                t.pop("seconds", None)
        return {
            "steps": steps,
            "by_op": per_op,
            "sent_bytes_per_step": sum(t["sent_bytes"] for t in per_op.values()) / steps,
            "events": [asdict(e) for e in self.events[:1000]] if self.keep_events else None,
        }
