"""What local SGD, DiLoCo and gossip put on the wire, byte for byte, over a short 2-process run.

A round every H = 3 steps over 7 steps: rounds after steps 3 and 6, nothing recorded at the other
steps. The replica is a float64 MLP with a BatchNorm (227 elements: 195 parameters and 32 floating
buffer entries; the int64 ``num_batches_tracked`` is not averaged), N = 227 x 8 bytes:

- local SGD, DiLoCo: one ``dp/all_reduce`` of N bytes per round, N out and N in at p = 2
  (the library allreduce's bandwidth-optimal ``2(p-1)/p N``);
- DiLoCo with int8: one ``dp/compressed:int8`` per round with payload N (the pseudo-gradient),
  and on the wire its compressed size: at p = 2 each rank sends its neighbour's piece in the
  all-to-all and its own in the all-gather, ``e_0 + e_1`` with ``e_j = c_j + 2 m`` (pieces of
  114 and 113 elements, one byte each, plus a float64 scale and zero point, m = 8), in 2 rounds;
- gossip: one ``dp/gossip`` per round, N to and N from the one ring neighbour, one round.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import shardwise
from shardwise.comm.codecs import get_codec
from shardwise.comm.compressed import compressed_traffic
from shardwise.engine import Engine
from tests.support.models import ce, classification

pytestmark = pytest.mark.dist

H, STEPS = 3, 7
RUNS = {
    "local-sgd": ("local-sgd", {"sync_every": H}),
    "diloco": ("diloco", {"sync_every": H}),
    "diloco-int8": ("diloco", {"sync_every": H, "compression": "int8"}),
    "gossip": ("gossip", {"sync_every": H}),
}


def bn_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()


def _run(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """This rank's recorded totals after every step, and every event of the run."""
    engine = Engine(strategy=strategy, strategy_options=options, precision="64", accelerator="cpu")
    engine.recorder.keep_events = True
    model, opt = engine.setup(bn_mlp(), lambda p: torch.optim.AdamW(p, lr=0.01))
    x, y = classification(n=STEPS * 8, seed=30 + engine.rank).tensors  # every replica sees different data
    after: list[dict[str, Any]] = []
    for step in range(STEPS):
        batch = (x[step * 8 : (step + 1) * 8], y[step * 8 : (step + 1) * 8])
        engine.forward_backward(model, [batch], lambda m, b: ce(m(b[0]), b))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
        after.append({key: {k: v for k, v in t.items() if k != "seconds"} for key, t in engine.recorder.totals(by_group=True).items()})
    return {
        "after": after,
        "events": [(e.op, e.group, e.group_size, e.payload_bytes, e.sent_bytes, e.received_bytes, e.steps) for e in engine.recorder.events],
        "summary": engine.finish(),
    }


def _all() -> dict[str, Any]:
    return {name: _run(strategy, options) for name, (strategy, options) in RUNS.items()}


def per_round(name: str, n: int, rank: int) -> tuple[str, int, int, int, int]:
    """(op, payload, sent, received, steps) of one round on ``rank``, from the formulas above."""
    if name in ("local-sgd", "diloco"):
        return "all_reduce", n, 2 * (2 - 1) * n // 2, 2 * (2 - 1) * n // 2, 0
    if name == "diloco-int8":
        elements, m = n // 8, 8
        e = [(elements + 1) // 2 + 2 * m, elements // 2 + 2 * m]
        return "compressed:int8", n, e[0] + e[1], e[0] + e[1], 2
    return "gossip", n, n, n, 1


def test_each_round_sends_exactly_the_formula_and_nothing_between_rounds():
    results = shardwise.launch(_all, nproc=2, threads_per_proc=1, timeout=150)
    model = bn_mlp()
    elements = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert elements == 227
    n = elements * 8
    for rank, r in enumerate(results):
        for name in RUNS:
            op, payload, sent, received, steps = per_round(name, n, rank)
            if name == "diloco-int8":  # the closed form agrees with the comm layer's own formula
                t = compressed_traffic(get_codec("int8"), elements, torch.float64, 2, rank)
                assert (t.sent, t.received, t.steps) == (sent, received, steps) == (elements + 32, elements + 32, 2)
            got = r[name]
            for step, totals in enumerate(got["after"], start=1):
                rounds = step // H  # rounds after steps 3 and 6: the totals move at those steps only
                expected = (
                    {
                        f"dp/{op}": {
                            "count": rounds,
                            "payload_bytes": rounds * payload,
                            "sent_bytes": rounds * sent,
                            "received_bytes": rounds * received,
                            "steps": rounds * steps,
                        }
                    }
                    if rounds
                    else {}
                )
                assert totals == expected, (name, rank, step, totals)
            assert got["events"] == [(op, "dp", 2, payload, sent, received, steps)] * (STEPS // H), (name, rank)
            section = got["summary"]["local_sgd" if name == "local-sgd" else name.split("-")[0]]
            assert section["rounds"] == STEPS // H and section["steps"] == STEPS and section["sync_every"] == H
        assert results[rank]["diloco-int8"]["summary"]["diloco"]["compression"] == "int8"
        assert results[rank]["gossip"]["summary"]["gossip"]["topology"] == "ring"
    # The compressed pseudo-gradient is about 8 times smaller on the wire than the float64 one.
    assert per_round("diloco-int8", n, 0)[2] * 7 < per_round("diloco", n, 0)[2]
