"""`engine.gather`, `engine.scatter` and `engine.reduce` in one two-process launch: what their
docstrings promise on every rank, and the bytes the recorder counts equal to their formulas
(docs/comm.md, "The six collectives"), written out here rather than read from the code under test.

For a piece of ``b`` bytes on ``p`` ranks: gather, payload ``p b``, the root receives ``(p - 1) b``,
every other rank sends ``b``; scatter the other way round, after an 80-byte header broadcast from
the source; reduce, payload ``b``, every other rank sends ``b`` and the root receives ``b``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise import Engine, launch
from shardwise.errors import ConfigError

pytestmark = pytest.mark.dist

P = 2


def _bytes(engine: Engine, op: str) -> tuple[int, int, int, int]:
    t = engine.recorder.totals().get(op, {})
    return int(t.get("count", 0)), int(t.get("payload_bytes", 0)), int(t.get("sent_bytes", 0)), int(t.get("received_bytes", 0))


def _check(fails: list[str], label: str, got: Any, want: Any) -> None:
    if got != want:
        fails.append(f"{label}: got {got}, want {want}")


def _gather(engine: Engine, fails: list[str]) -> None:
    r = engine.rank
    mine = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r
    for dst in (0, 1):
        engine.recorder.reset()
        out = engine.gather(mine, dst=dst)
        if r == dst:
            ok = out is not None and len(out) == P and all(torch.equal(out[j], torch.arange(6.0).view(2, 3) + 10 * j) for j in range(P))
            _check(fails, f"gather to {dst}: the list on dst", ok, True)
            _check(fails, f"gather to {dst}: dst's own entry is a copy", out is not None and out[r].data_ptr() != mine.data_ptr(), True)
        else:
            _check(fails, f"gather to {dst}: rank {r} gets", out, None)
        b = 6 * 4
        want = (1, P * b, 0, (P - 1) * b) if r == dst else (1, P * b, b, 0)
        _check(fails, f"gather to {dst}: (count, payload, sent, received)", _bytes(engine, "gather"), want)


def _scatter(engine: Engine, fails: list[str]) -> None:
    r = engine.rank
    for src, dtype in ((0, torch.float64), (1, torch.int64)):
        engine.recorder.reset()
        pieces = [torch.arange(6, dtype=dtype).view(3, 2) * (j + 1) for j in range(P)] if r == src else None
        out = engine.scatter(pieces, src=src)
        _check(fails, f"scatter from {src}: rank {r}'s piece", (out.dtype, out.tolist()), (dtype, (torch.arange(6, dtype=dtype).view(3, 2) * (r + 1)).tolist()))
        b = 6 * 8
        want = (1, P * b, (P - 1) * b, 0) if r == src else (1, P * b, 0, b)
        _check(fails, f"scatter from {src}: (count, payload, sent, received)", _bytes(engine, "scatter"), want)
        header = (1, 80, 80, 0) if r == src else (1, 80, 0, 80)
        _check(fails, f"scatter from {src}: its shape header", _bytes(engine, "broadcast"), header)
    # src refuses its input (one piece for two ranks): a ConfigError on both ranks, nobody left waiting.
    try:
        engine.scatter([torch.ones(2)] if r == 0 else None, src=0)
        fails.append("scatter with one piece for two ranks: no error")
    except ConfigError as exc:
        want = "list of 2 tensors, one per rank; got 1" if r == 0 else "rank 0 refused its input"
        _check(fails, "scatter refused: the error", want in str(exc), True)


def _reduce(engine: Engine, fails: list[str]) -> None:
    r = engine.rank
    xs = [torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([4.0, 5.0, -6.0, 2.0])]
    expected = {
        "sum": xs[0] + xs[1],
        "mean": (xs[0] + xs[1]) / 2,
        "max": torch.maximum(xs[0], xs[1]),
        "min": torch.minimum(xs[0], xs[1]),
        "product": xs[0] * xs[1],
    }
    for op, want in expected.items():
        for dst in (0, 1):
            engine.recorder.reset()
            mine = xs[r].clone()
            out = engine.reduce(mine, dst=dst, op=op)
            if r == dst:
                _check(fails, f"reduce {op} to {dst}: on dst", out is mine and torch.equal(mine, want), True)
            else:
                _check(fails, f"reduce {op} to {dst}: rank {r} gets", (out, mine.tolist()), (None, xs[r].tolist()))
            b = 4 * 4
            _check(fails, f"reduce {op} to {dst}: bytes", _bytes(engine, "reduce"), (1, b, 0, b) if r == dst else (1, b, b, 0))
    try:
        engine.reduce(xs[r].clone(), dst=2)
        fails.append("reduce to rank 2 of 2: no error")
    except ConfigError as exc:
        _check(fails, "reduce to rank 2: the error", "dst=2 is not a rank of group 'world' (size 2)" in str(exc), True)


def _worker() -> list[str]:
    engine = Engine(strategy="ddp", accelerator="cpu")
    fails: list[str] = []
    _gather(engine, fails)
    _scatter(engine, fails)
    _reduce(engine, fails)
    engine.close()
    return fails


def test_gather_scatter_reduce_return_what_they_promise_and_record_their_formula_bytes():
    results = launch(_worker, nproc=P, threads_per_proc=1)
    for rank, fails in enumerate(results):
        assert fails == [], f"rank {rank}:\n" + "\n".join(fails)


def test_one_process_gets_its_own_pieces():
    engine = Engine(strategy="single", accelerator="cpu")
    x = torch.arange(4.0)
    assert [t.tolist() for t in engine.gather(x)] == [x.tolist()]
    assert engine.scatter([x]).tolist() == x.tolist()
    assert engine.reduce(x.clone(), op="mean").tolist() == x.tolist()
    with pytest.raises(ConfigError, match=r"list of 1 tensors, one per rank; got 2"):
        engine.scatter([x, x])
