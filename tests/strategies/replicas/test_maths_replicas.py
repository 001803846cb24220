"""Local SGD's average, DiLoCo's outer Nesterov step and the parameter server's update against the
maths written out by hand, in one launch of two processes.

The parity test in `test_local_sgd.py` checks DiLoCo only at outer momentum 0 (where it is local
SGD), so an outer step that ignored momentum or Nesterov passed it. Here each replica's inner steps
are simulated in the parent with its own optimizer on its own data, and the rounds are computed
from their definitions:

    local SGD, after steps H, 2H, ...:  theta_r <- mean_r theta_r
    DiLoCo (Douillard et al. 2023):     delta = mean_r (theta - theta_r)
                                        b <- mu * b + delta         (b = delta on the first round)
                                        theta <- theta - lr * (delta + mu * b)   (Nesterov, as torch's SGD)
    parameter server (central, 1 worker + 1 server): the server's SGD with momentum and weight decay
                                        at the learning rate the worker's scheduler pushed.

Every replica's parameters after every step must match (1e-12, float64); the hand DiLoCo without
Nesterov and at momentum 0 must not (so the check can tell them apart).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.engine import Engine
from tests.support.models import classification, mlp

pytestmark = pytest.mark.dist

STEPS, H, PER = 5, 2, 8  # five steps, a round every two: the last step ends mid-round
OUTER_LR, OUTER_MU = 0.7, 0.9
TOL = 1e-12


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return classification(n=STEPS * PER, seed=20 + rank).tensors  # every replica sees different data


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = rank_data(rank)
    return x[step * PER : (step + 1) * PER], y[step * PER : (step + 1) * PER]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)  # not linear in the gradient


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _run_replicas(strategy: str, options: dict[str, Any], make_opt: Any) -> list[torch.Tensor]:
    """This rank's parameters after every step, two micro-batches a step."""
    engine = Engine(strategy=strategy, strategy_options=options, precision="64", accelerator="cpu")
    model, opt = engine.setup(mlp(), make_opt)
    out = []
    for step in range(STEPS):
        x, y = batch(engine.rank, step)
        engine.forward_backward(model, [(x[:4], y[:4]), (x[4:], y[4:])], lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
        out.append(flat(model))
    return out


def ps_lr(step: int) -> float:
    return 0.5 ** (step // 2)


def _run_central() -> list[torch.Tensor] | None:
    engine = Engine(strategy="central", precision="64", accelerator="cpu")
    model, opt = engine.setup(mlp(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01))
    if not engine.trains:
        return None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ps_lr)
    out = []
    for step in range(STEPS):
        x, y = batch(0, step)
        engine.forward_backward(model, [(x, y)], lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
        sched.step()
        out.append(flat(model))
    engine.finish()  # ends the session with the server
    return out


def _broadcast_and_print() -> dict[str, Any]:
    """README: ``engine.broadcast`` and ``engine.print`` (rank 0 only)."""
    engine = Engine(strategy="ddp", precision="64", accelerator="cpu")  # joins the launcher's group
    value = torch.tensor([10.0 * (engine.rank + 1)], dtype=torch.float64)
    engine.broadcast(value, src=1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        engine.print("hello from rank", engine.rank)
    return {"value": value.item(), "printed": printed.getvalue()}


def _two_processes() -> dict[str, Any]:
    out = {
        "engine": _broadcast_and_print(),
        "local": _run_replicas("local-sgd", {"sync_every": H}, adamw),
        "diloco": _run_replicas("diloco", {"sync_every": H, "outer_lr": OUTER_LR, "outer_momentum": OUTER_MU}, sgd),
    }
    out["central"] = _run_central()
    dist.barrier()
    return out


# -- the maths, by hand, in the parent ---------------------------------------------------------------
def inner_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    loss = F.cross_entropy(model(x), y)  # the mean over the step's 8 samples
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def set_flat(model: nn.Module, value: torch.Tensor) -> None:
    # A copy into each parameter: vector_to_parameters would make the replicas share one storage.
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(value[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def hand_local_sgd() -> list[list[torch.Tensor]]:
    replicas = [mlp(), mlp()]
    opts = [adamw(m.parameters()) for m in replicas]
    steps: list[list[torch.Tensor]] = [[], []]
    for step in range(STEPS):
        for r in (0, 1):
            inner_step(replicas[r], opts[r], r, step)
        if (step + 1) % H == 0:
            mean = (flat(replicas[0]) + flat(replicas[1])) / 2
            for m in replicas:
                set_flat(m, mean)
        for r in (0, 1):
            steps[r].append(flat(replicas[r]))
    return steps


def hand_diloco(momentum: float, nesterov: bool) -> list[list[torch.Tensor]]:
    replicas = [mlp(), mlp()]
    opts = [sgd(m.parameters()) for m in replicas]  # inner state stays with each replica across rounds
    theta, buf = flat(replicas[0]), None
    steps: list[list[torch.Tensor]] = [[], []]
    for step in range(STEPS):
        for r in (0, 1):
            inner_step(replicas[r], opts[r], r, step)
        if (step + 1) % H == 0:
            delta = ((theta - flat(replicas[0])) + (theta - flat(replicas[1]))) / 2
            buf = delta.clone() if buf is None else momentum * buf + delta
            theta = theta - OUTER_LR * ((delta + momentum * buf) if nesterov else buf)
            for m in replicas:
                set_flat(m, theta)
        for r in (0, 1):
            steps[r].append(flat(replicas[r]))
    return steps


def hand_central() -> list[torch.Tensor]:
    """SGD with momentum 0.9 and weight decay 0.01 written out, at the scheduled rate."""
    model = mlp()
    p, buf, out = flat(model), None, []
    for step in range(STEPS):
        set_flat(model, p)
        x, y = batch(0, step)
        g = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        d = torch.cat([t.reshape(-1) for t in g]) + 0.01 * p
        buf = d.clone() if buf is None else 0.9 * buf + d
        p = p - 0.1 * ps_lr(step) * buf
        out.append(p.clone())
    return out


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_local_sgd_diloco_and_the_parameter_server_equal_their_maths_by_hand():
    got = shardwise.launch(_two_processes, nproc=2, threads_per_proc=1, timeout=150)
    init = flat(mlp())
    # README claims checked in the same launch: broadcast from rank 1 reaches rank 0; print is rank 0's only.
    assert [g["engine"]["value"] for g in got] == [20.0, 20.0]
    assert [g["engine"]["printed"] for g in got] == ["hello from rank 0\n", ""]

    local = hand_local_sgd()
    for r in (0, 1):
        assert gap(local[r], got[r]["local"]) < TOL, ("local-sgd", r, gap(local[r], got[r]["local"]))
    assert gap(local[0], local[1]) > 1e-3  # the replicas do differ between rounds (different data)
    assert (local[0][-1] - init).abs().max() > 1e-2  # it trained

    diloco = hand_diloco(OUTER_MU, nesterov=True)
    for r in (0, 1):
        assert gap(diloco[r], got[r]["diloco"]) < TOL, ("diloco", r, gap(diloco[r], got[r]["diloco"]))
    # The check can tell the outer step apart from its likely mistakes: heavy-ball momentum
    # without Nesterov's look-ahead, and no momentum at all (plain local SGD with lr 0.7).
    assert gap(hand_diloco(OUTER_MU, nesterov=False)[0], diloco[0]) > 1e-3
    assert gap(hand_diloco(0.0, nesterov=True)[0], diloco[0]) > 1e-3

    central = hand_central()
    assert got[1]["central"] is None  # rank 1 served
    assert gap(central, got[0]["central"]) < TOL, gap(central, got[0]["central"])
