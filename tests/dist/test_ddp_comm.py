"""DDP with our allreduce algorithms and codecs: parity with native, training with compression, bytes recorded.

Everything runs inside one launch of 2 processes (process start costs seconds on
two cores); each worker returns a list of failures, and the parent asserts the
list is empty, so a failure message names the check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise import launch
from shardwise.comm.algorithms import ALGORITHMS
from shardwise.comm.compressed import compressed_traffic
from shardwise.comm.codecs import get_codec
from shardwise.comm.recorder import Recorder
from shardwise.comm.traffic import allreduce_traffic
from shardwise.mesh import Mesh
from shardwise.strategies.ddp import DDP

CODECS = ("fp16", "bf16", "int8", "topk:0.1", "randomk:0.1", "sign", "powersgd:2")


def _tiny_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def _batch(step: int, rank: int, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8 * world, 6, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, :3] * 2) + x[:, 3:] ** 2  # a smooth target the model can fit
    return x[rank::world].to(dtype), y[rank::world].to(dtype)


def _train(options: dict, steps: int, dtype: torch.dtype, lr: float = 0.05) -> tuple[list[torch.Tensor], list[float], Recorder]:
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = DDP(**options)
    rec = Recorder()
    model, opt = strategy.setup(_tiny_model(dtype), lambda ps: torch.optim.SGD(ps, lr=lr), Mesh.build(world_size=world, rank=rank), rec)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank, world, dtype)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().double().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return [p.detach().clone() for p in model.parameters()], losses, rec


def _algorithms_and_codecs() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    fails: list[str] = []
    steps = 10
    ref, ref_losses, _ = _train({}, steps, torch.float64)
    n = sum(p.numel() for p in ref)  # one bucket: the model is far below 25 MB
    for algo in ALGORITHMS:
        params, _, rec = _train({"allreduce": algo}, steps, torch.float64)
        worst = max((a - b).abs().max().item() for a, b in zip(params, ref))
        if worst > 1e-12:
            fails.append(f"{algo}: parameters after {steps} steps differ from native ddp by {worst:.3g}")
        tot = rec.totals()["all_reduce" if algo == "native" else f"all_reduce:{algo}"]  # native: ddp's default hook
        want = allreduce_traffic(algo, n, 8, world, rank)
        if (tot["count"], tot["sent_bytes"], tot["received_bytes"], tot["steps"]) != (steps, steps * want.sent, steps * want.received, steps * want.steps):
            fails.append(f"{algo}: recorded {tot} for {steps} buckets of {n} float64, formula says {want} each")

    long = 40
    base, base_losses, base_rec = _train({}, long, torch.float32)
    fp32_sent = base_rec.totals()["all_reduce"]["sent_bytes"]
    for spec in CODECS:
        params, losses, rec = _train({"compression": spec}, long, torch.float32)
        if not losses[-1] < 0.5 * losses[0]:
            fails.append(f"{spec}: loss went {losses[0]:.4f} -> {losses[-1]:.4f}, not below half the start")
        tot = rec.totals()[f"compressed:{get_codec(spec).spec}"]
        if tot["count"] != long:
            fails.append(f"{spec}: {tot['count']} buckets recorded over {long} steps")
        if not spec.startswith("powersgd"):
            want = compressed_traffic(get_codec(spec), n, torch.float32, world, rank)
            if tot["sent_bytes"] != long * want.sent:
                fails.append(f"{spec}: sent {tot['sent_bytes']} bytes, formula says {long} x {want.sent}")
        if tot["sent_bytes"] >= fp32_sent:
            fails.append(f"{spec}: sent {tot['sent_bytes']} bytes, no fewer than uncompressed {fp32_sent}")
        if spec == "fp16":
            worst = max((a - b).abs().max().item() for a, b in zip(params, base))
            if worst > 2e-3:
                fails.append(f"fp16: parameters differ from uncompressed by {worst:.3g} after {long} steps")
    return fails


class _Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(16, 16, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y @ self.w @ x


def _powersgd_is_exact_on_low_rank_gradients() -> list[str]:
    """The gradient of sum(y^T W x) is y x^T: rank 1 per rank, rank 2 averaged; powersgd:2 must send it exactly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Bilinear()
    rec = Recorder()
    ddp, _ = DDP(compression="powersgd:2").setup(model, lambda ps: torch.optim.SGD(ps, lr=0.0), Mesh.build(world_size=world, rank=rank), rec)
    fails = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        xs = torch.randn(world, 16, generator=g, dtype=torch.float64)
        ys = torch.randn(world, 16, generator=g, dtype=torch.float64)
        model.w.grad = None
        ddp(xs[rank], ys[rank]).backward()
        want = sum(torch.outer(ys[j], xs[j]) for j in range(world)) / world
        err = (model.w.grad - want).abs().max().item()
        if err > 1e-10:
            fails.append(f"powersgd step {step}: averaged gradient off by {err:.3g}")
    tot = rec.totals()["compressed:powersgd:2"]
    # 2 plain steps of 256 elements, then 3 of P and Q (16 x 2 each): bandwidth-optimal allreduce bytes.
    want_sent = 2 * (2 * (world - 1) * 256 * 8 // world) + 3 * (2 * (world - 1) * 64 * 8 // world)
    if tot["sent_bytes"] != want_sent:
        fails.append(f"powersgd: recorded {tot['sent_bytes']} bytes sent, expected {want_sent}")
    return fails


def _all_checks() -> list[str]:
    return _algorithms_and_codecs() + _powersgd_is_exact_on_low_rank_gradients()


def test_ddp_with_every_algorithm_and_codec():
    results = launch(_all_checks, nproc=2, threads_per_proc=1)
    for rank, fails in enumerate(results):
        assert fails == [], f"rank {rank}: " + "\n".join(fails)
