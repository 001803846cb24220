"""`engine.gather`, `engine.scatter` and `engine.reduce` in one two-process launch: what their
docstrings promise on every rank, and the bytes the recorder counts equal to their formulas
(docs/comm.md, "The six collectives"), written out here rather than read from the code under test.

For a piece of ``b`` bytes on ``p`` ranks: gather, payload ``p b``, the root receives ``(p - 1) b``,
every other rank sends ``b``; scatter the other way round, after an 80-byte header broadcast from
the source; reduce, payload ``b``, every other rank sends ``b`` and the root receives ``b``. Gather
and reduce first all-gather an 80-byte header (dtype and shape) from every rank: payload ``80 p``,
``80 (p - 1)`` each way on every rank; unequal inputs raise a ConfigError on every rank, no crash.
The same launch checks ddp's one-node note for ``allreduce='hierarchical'``.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
from torch import nn

from shardwise import Engine, launch
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies.data_parallel.ddp import DDP

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
        _check(fails, f"gather to {dst}: its shape header", _bytes(engine, "all_gather"), (1, 80 * P, 80 * (P - 1), 80 * (P - 1)))


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
    # Every rank passes the same list (a common pattern): the non-source ranks' lists are ignored.
    same = [torch.full((2,), float(j)) for j in range(P)]
    _check(fails, "scatter with the list on every rank", engine.scatter(same, src=1).tolist(), [float(r)] * 2)
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
            _check(fails, f"reduce {op} to {dst}: its shape header", _bytes(engine, "all_gather"), (1, 80 * P, 80 * (P - 1), 80 * (P - 1)))
    try:
        engine.reduce(xs[r].clone(), dst=2)
        fails.append("reduce to rank 2 of 2: no error")
    except ConfigError as exc:
        _check(fails, "reduce to rank 2: the error", "dst=2 is not a rank of group 'world' (size 2)" in str(exc), True)


def _mismatch(engine: Engine, fails: list[str]) -> None:
    """Unequal shapes or dtypes: the same ConfigError on every rank, naming each rank's, and nothing sent."""
    r = engine.rank
    dtype = torch.float32 if r == 0 else torch.float64
    cases = {
        "gather shapes": (lambda: engine.gather(torch.zeros(2 + r, 3), dst=0), "rank 0 (2, 3) torch.float32, rank 1 (3, 3) torch.float32"),
        "reduce dtypes": (lambda: engine.reduce(torch.zeros(4, dtype=dtype), dst=1), "rank 0 (4,) torch.float32, rank 1 (4,) torch.float64"),
        "gather dims": (lambda: engine.gather(torch.zeros(4) if r == 0 else torch.zeros(2, 2)), "rank 0 (4,) torch.float32, rank 1 (2, 2) torch.float32"),
    }
    for label, (call, names) in cases.items():
        engine.recorder.reset()
        try:
            call()
            fails.append(f"{label}: no error")
        except ConfigError as exc:
            _check(fails, f"{label}: the error names every rank's input", names in str(exc) and "every rank must pass one shape and dtype" in str(exc), True)
        _check(fails, f"{label}: nothing but the header sent", sorted(engine.recorder.totals()), ["all_gather"])
    # Still in step afterwards: the next collective works.
    _check(fails, "after the refusals", engine.reduce(torch.ones(3), dst=0) is not None, r == 0)


def _one_node_note(fails: list[str]) -> None:
    """ddp allreduce='hierarchical' without node_size on one machine (LOCAL_WORLD_SIZE = 2 = the world): rank 0 says so once."""
    r = torch.distributed.get_rank()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        DDP(allreduce="hierarchical").apply(nn.Linear(2, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), Mesh.build(world_size=P, rank=r), Recorder())
    lines = [x for x in out.getvalue().splitlines() if "hierarchical" in x]
    want = 1 if r == 0 else 0
    _check(fails, "one-node note: lines on this rank", len(lines), want)
    if lines:
        _check(fails, "one-node note: its words", "node size 2 = the world size: one node" in lines[0] and "--node-size N" in lines[0], True)


def _worker() -> list[str]:
    engine = Engine(strategy="ddp", accelerator="cpu")
    fails: list[str] = []
    _gather(engine, fails)
    _scatter(engine, fails)
    _reduce(engine, fails)
    _mismatch(engine, fails)
    _one_node_note(fails)
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
