"""What expert parallelism costs: all-to-all bytes and expert memory per rank, pure numbers.

Not yet wired into ``shardwise plan`` (ep is an option of ddp and the sharded strategies, whose
``cost.py`` would price it with these); `tests/strategies/expert_parallel/test_dispatch.py` checks
`all_to_all_sent` against the bytes the Recorder counts. Formulas: docs/strategies/expert_parallel.md.
"""

from __future__ import annotations

from shardwise.strategies.cost.family import StrategyCost

PLAN_ORDER = 95
COSTS: dict[str, StrategyCost] = {}


def all_to_all_sent(out_pairs: int, in_pairs: int, hidden: int, elem: int, experts: int, ep: int, *, backward: bool = True) -> int:
    """Bytes one rank sends for one experts layer in one forward (and its backward): the per-expert
    counts ``(ep - 1) x experts / ep x 8``, its ``out_pairs`` rows routed to other ranks' experts
    (dispatch) and the ``in_pairs`` rows it computed for other ranks (combine), ``hidden x elem``
    bytes each; backward sends both row sets again. Received is the mirror: the same sum."""
    if ep <= 1:
        return 0
    rows = (out_pairs + in_pairs) * hidden * elem
    return (ep - 1) * (experts // ep) * 8 + rows * (2 if backward else 1)


def expected_all_to_all_sent(tokens: int, top_k: int, hidden: int, elem: int, experts: int, ep: int, layers: int = 1) -> float:
    """`all_to_all_sent` per step under balanced routing (what the load-balancing loss aims at): of a
    rank's ``tokens x top_k`` pairs, ``(ep - 1) / ep`` go elsewhere, and as many arrive."""
    remote = tokens * top_k * (ep - 1) / ep
    return layers * float(all_to_all_sent(0, 0, hidden, elem, experts, ep) + 4 * remote * hidden * elem) if ep > 1 else 0.0


def expert_bytes_per_rank(expert_params: int, bytes_per_param: float, ep: int) -> float:
    """Model state of the experts on one rank: each holds ``1 / ep`` of them (the rest of the model as its dp strategy keeps it)."""
    return expert_params * bytes_per_param / ep
