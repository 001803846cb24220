"""Local SGD, DiLoCo and gossip: parity with ddp where the maths says so, replicas identical
after each averaging round, neighbour-only mixing, and DiLoCo's accuracy on digits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.engine import Engine
from tests.support.models import ce, classification, max_diff, mlp, params

pytestmark = pytest.mark.dist

COMMON = dict(precision="64", global_batch_size=16, accumulate=2, max_steps=10, log_every=5, progress_bar=False)


def sgd_momentum(params: Any) -> torch.optim.Optimizer:
    # Linear in the gradient: averaging replicas after each step is averaging gradients.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def _train(strategy: str, options: dict[str, Any], steps: int = 10) -> dict[str, Any]:
    """The trainer's step by hand on the engine: global batch 16, this rank's 8 in 2 micro-batches."""
    engine = Engine(strategy=strategy, strategy_options=options, precision="64", accelerator="cpu")
    model, opt = engine.setup(mlp(), sgd_momentum)
    x, y = classification().tensors
    r, p = engine.rank, engine.world_size
    for step in range(steps):
        lo = (step * 16) % 96 + r * 16 // p
        micro = [(x[lo + i * 4 : lo + (i + 1) * 4], y[lo + i * 4 : lo + (i + 1) * 4]) for i in range(2)]
        engine.forward_backward(model, micro, lambda m, b: ce(m(b[0]), b))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
    return {"params": params(engine.unwrap(model)), "summary": engine.finish(), "comm": engine.recorder.report(steps)}


def _all_strategies() -> dict[str, Any]:
    return {
        "ddp": _train("ddp", {}),
        "local": _train("local-sgd", {"sync_every": 1}),
        # DiLoCo with outer SGD lr 1 and no momentum, H = 1: theta <- mean of the replicas.
        "diloco": _train("diloco", {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}),
        # Two ranks on a ring have one neighbour: the gossip mix is the full average.
        "gossip": _train("gossip", {}),
    }


def test_sync_every_one_equals_ddp_for_local_sgd_diloco_and_two_rank_gossip():
    results = shardwise.launch(_all_strategies, nproc=2, threads_per_proc=1, timeout=150)
    n_bytes = sum(p.numel() for p in mlp().parameters()) * 8
    for r in results:
        ref = r["ddp"]["params"]
        assert max_diff(ref, results[0]["ddp"]["params"]) == 0.0
        for name in ("local", "diloco", "gossip"):
            assert max_diff(ref, r[name]["params"]) < 1e-10, name
        assert max_diff(ref, mlp().state_dict()) > 1e-3  # it did train
    r = results[0]
    assert r["local"]["summary"]["local_sgd"] == {"sync_every": 1, "rounds": 10, "steps": 10}
    # One parameter allreduce per step in place of ddp's gradient allreduce: the same bytes.
    local_ops = r["local"]["comm"]["by_op"]
    assert local_ops["dp/all_reduce"]["count"] == 10 and local_ops["dp/all_reduce"]["payload_bytes"] == 10 * n_bytes
    assert r["diloco"]["summary"]["diloco"]["rounds"] == 10
    gossip_ops = r["gossip"]["comm"]["by_op"]
    assert gossip_ops["dp/gossip"]["count"] == 10 and gossip_ops["dp/gossip"]["sent_bytes"] == 10 * n_bytes
    assert "dp/all_reduce" not in gossip_ops  # no global allreduce at all


def _gather(model: torch.nn.Module) -> list[torch.Tensor]:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _replica_rounds(strategy: str, options: dict[str, Any], steps: int) -> dict[str, Any]:
    """Run ``steps`` steps with rank-dependent data; after each, whether all replicas agree."""
    engine = Engine(strategy=strategy, strategy_options=options, precision="64", accelerator="cpu")
    model, opt = engine.setup(mlp(), lambda p: torch.optim.AdamW(p, lr=0.01))
    data = classification(n=64, seed=10 + engine.rank)  # every rank sees different data
    identical, spread = [], []
    for step in range(steps):
        x, y = data.tensors[0][step * 8 : (step + 1) * 8], data.tensors[1][step * 8 : (step + 1) * 8]
        engine.forward_backward(model, [(x, y)], lambda m, b: ce(m(b[0]), b))
        engine.step(opt)
        opt.zero_grad()
        replicas = _gather(model)
        diff = max((r - replicas[0]).abs().max().item() for r in replicas)
        identical.append(diff == 0.0)
        spread.append(diff)
    return {"identical": identical, "spread": spread, "summary": engine.finish(), "comm": engine.recorder.report(steps)}


def _gossip_mix() -> dict[str, Any]:
    """One gossip round on 4 ranks from known parameters: rank k gets the mean of k-1, k, k+1."""
    from shardwise.comm.collectives import WORLD
    from shardwise.comm.recorder import Recorder
    from shardwise.strategies.replicas.gossip import gossip_round

    k, p = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(3, 2).double()
    with torch.no_grad():
        for i, t in enumerate(model.parameters()):
            t.fill_(float(10**i * (k + 1)))
    rec = Recorder()
    gossip_round(model, WORLD, rec)
    expected = [float(10**i * ((k - 1) % p + 1 + k + 1 + (k + 1) % p + 1)) / 3 for i in range(2)]
    got = [t.detach().flatten().unique().tolist() for t in model.parameters()]
    return {"got": got, "expected": expected, "totals": rec.totals()}


def _four_ranks() -> dict[str, Any]:
    out = {"mix": _gossip_mix()}
    dist.barrier()
    out["local"] = _replica_rounds("local-sgd", {"sync_every": 3}, 7)
    out["diloco"] = _replica_rounds("diloco", {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}, 5)
    out["diloco_int8"] = _replica_rounds("diloco", {"sync_every": 2, "compression": "int8"}, 4)
    out["gossip"] = _replica_rounds("gossip", {}, 4)
    return out


def test_replicas_agree_exactly_after_each_averaging_round_and_gossip_mixes_neighbours_only():
    results = shardwise.launch(_four_ranks, nproc=4, threads_per_proc=1, timeout=150)
    for rank, r in enumerate(results):
        mix = r["mix"]
        assert mix["got"] == [[mix["expected"][0]], [mix["expected"][1]]], (rank, mix)
        # Two neighbours on a ring of four: two messages out and two in, the parameters' bytes each.
        n = (3 * 2 + 2) * 8
        assert mix["totals"]["gossip"]["sent_bytes"] == 2 * n and mix["totals"]["gossip"]["received_bytes"] == 2 * n
    r0 = results[0]
    # local SGD, H = 3: identical exactly after steps 3 and 6, apart in between.
    assert r0["local"]["identical"] == [False, False, True, False, False, True, False]
    assert r0["local"]["summary"]["local_sgd"]["rounds"] == 2
    assert r0["local"]["comm"]["by_op"]["dp/all_reduce"]["count"] == 2
    assert r0["diloco"]["identical"] == [False, True, False, True, False]
    assert r0["diloco_int8"]["identical"] == [False, True, False, True]
    assert "dp/compressed:int8" in r0["diloco_int8"]["comm"]["by_op"]
    # Gossip on four ranks never reaches exact consensus, but replicas stay close.
    assert not any(r0["gossip"]["identical"]) and max(r0["gossip"]["spread"]) < 0.1
    assert all(r["local"]["identical"] == r0["local"]["identical"] for r in results)


def _digits(strategy: str, options: dict[str, Any], steps: int) -> float:
    """Validation accuracy (%) of the digits MLP after ``steps`` AdamW steps (global batch 64)."""
    from shardwise.tools.recipes.digits import DigitsMLP, load_digits_split

    train, val = load_digits_split()
    engine = Engine(strategy=strategy, strategy_options=options, accelerator="cpu", seed=0)
    model, opt = engine.setup(DigitsMLP(), lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=1e-4))
    x, y = train.tensors
    per = 64 // engine.world_size
    g = torch.Generator().manual_seed(1)
    steps_per_epoch = len(x) // 64
    for step in range(steps):
        if step % steps_per_epoch == 0:
            perm = torch.randperm(len(x), generator=g)  # the same order on every rank
        lo = (step % steps_per_epoch) * 64 + engine.rank * per
        idx = perm[lo : lo + per]
        engine.forward_backward(model, [(x[idx], y[idx])], lambda m, b: ce(m(b[0]), b))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
    module = engine.unwrap(model).eval()
    with torch.no_grad():
        acc = (module(val.tensors[0]).argmax(-1) == val.tensors[1]).double().mean() * 100
    engine.all_reduce(acc.reshape(1), "mean")  # replicas are identical after the last round: a no-op check
    return float(acc)


def _digits_ddp_and_diloco() -> dict[str, float]:
    # 304 steps: DiLoCo ends on its 38th outer round, where the replicas are one model again.
    # Outer momentum 0.5: the paper's 0.9 is tuned for H = 500; at H = 8 it overshoots
    # (measured here: 94.4% against ddp's 96.7%; 0.5 gives 96.9%).
    return {"ddp": _digits("ddp", {}, 304), "diloco": _digits("diloco", {"sync_every": 8, "outer_lr": 0.7, "outer_momentum": 0.5}, 304)}


def test_diloco_every_eight_steps_on_digits_is_within_one_point_of_ddp():
    accs = shardwise.launch(_digits_ddp_and_diloco, nproc=2, threads_per_proc=1, timeout=150)[0]
    assert accs["ddp"] > 90
    assert abs(accs["diloco"] - accs["ddp"]) <= 1.0, accs
