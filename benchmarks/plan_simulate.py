"""`shardwise simulate`: how long the simulator takes, and how well it predicts real steps here.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_simulate.py [--skip-real] [--hidden 1024] [--steps 30]

Part 1 (timing): wall seconds of one `simulate` call at 4,096 workers for every algorithm
(20 steps, lognormal stragglers), and a full sweep 1 ... 4,096 (target: each under 10 s).

Part 2 (agreement with real runs, CPU and gloo, 1, 2 and 4 processes): a digits MLP trained
through `shardwise.Engine` with the ``ddp`` strategy; measured per process count, side by side
in the same launch: the compute-only step (the same model, forward, backward and optimizer step,
no communication, every process busy at once so the CPU is shared as in the real step) and the
ddp step. The network's alpha and beta come from a 2-process timing of `shardwise.comm`'s
allreduce over 4 KB ... 16 MB (`shardwise.tools.simulate.measure`). The simulator, fed those
three numbers, predicts the ddp step; printed: measured, predicted, predicted / measured.
DDP overlaps its bucketed allreduce with backward; the simulator is run here without its --overlap, so a
prediction above the measurement by up to the exchange time is expected.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.engine import Engine
from shardwise.launcher.spawn import launch
from shardwise.tools.simulate.measure import fit_alpha_beta, time_allreduce
from shardwise.tools.simulate.network import ALGORITHMS, Exchange, Network, Straggler, simulate, sweep

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
BATCH = 64


def _timed_steps(fn: Any, steps: int) -> float:
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        fn()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _real(hidden: int, steps: int) -> dict[str, float]:
    from shardwise.comm import collectives
    from shardwise.tools.recipes.digits import DigitsMLP

    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
    plain = DigitsMLP(hidden=hidden)
    opt = torch.optim.SGD(plain.parameters(), lr=0.01)

    def local() -> None:
        F.cross_entropy(plain(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    engine = Engine(strategy="ddp", accelerator="cpu", seed=0)
    model, dopt = engine.setup(DigitsMLP(hidden=hidden), lambda p: torch.optim.SGD(p, lr=0.01))

    def ddp() -> None:
        engine.forward_backward(model, [(x, y)], lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        engine.step(dopt)
        dopt.zero_grad(set_to_none=True)

    compute, step = [], []
    for _ in range(3):  # interleaved rounds: a noisy neighbour hits both alike
        compute.append(_timed_steps(local, steps))
        step.append(_timed_steps(ddp, steps))
    out = torch.tensor([statistics.median(compute), statistics.median(step)])
    collectives.all_reduce(out, "max")
    return {"compute_s": float(out[0]), "step_s": float(out[1]), "params": float(sum(p.numel() for p in plain.parameters()))}


def timing() -> None:
    net = Network.from_gbps(25, 10, gpus_per_node=8, intra_gbps=300)
    print("simulate at 4,096 workers (20 steps, lognormal:0.2 stragglers), wall seconds per call:")
    for alg in ALGORITHMS:
        t0 = time.perf_counter()
        r = simulate(4096, params=25.5e6, compute_s=0.12, net=net, exchange=Exchange(algorithm=alg, servers=64), straggler=Straggler.parse("lognormal:0.2"))
        print(f"  {alg:<20} {time.perf_counter() - t0:6.2f} s   (efficiency {r.efficiency:.3f})")
    t0 = time.perf_counter()
    sweep([2**i for i in range(13)], params=25.5e6, compute_s=0.12, net=net, exchange=Exchange(algorithm="hierarchical"))
    print(f"  sweep 1 ... 4096 (13 counts), hierarchical: {time.perf_counter() - t0:.2f} s")


def real(hidden: int, steps: int) -> None:
    fits = {}
    for p in (2, 4):  # the brief's 2-process fit, and one at 4 processes (CPU shared as in the 4-process run)
        secs = launch(time_allreduce, SIZES, nproc=p, threads_per_proc=1)[0]
        fits[p] = fit_alpha_beta(SIZES, secs, p)
        alpha, beta = fits[p]
        print(f"\nallreduce at {p} processes: {', '.join(f'{s >> 10} KB {t * 1e3:.3f} ms' for s, t in zip(SIZES, secs, strict=True))}")
        print(f"fit: alpha {alpha * 1e6:.1f} us, beta {beta * 1e9:.3f} ns/byte ({8 / beta / 1e9 if beta else float('inf'):.2f} Gbit/s)")
    print(f"\ndigits MLP hidden {hidden}, batch {BATCH} per process, ddp on gloo, medians of {steps} steps x 3 rounds")
    print("| processes | compute ms | ddp step ms, measured | simulated (2-process fit) | ratio | simulated (fit at p) | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for p in (1, 2, 4):
        m = launch(_real, hidden, steps, nproc=p, threads_per_proc=1)[0]
        row = f"| {p} | {m['compute_s'] * 1e3:.2f} | {m['step_s'] * 1e3:.2f}"
        for fit in (fits[2], fits.get(p, fits[2])):
            sim = simulate(p, params=m["params"], compute_s=m["compute_s"], net=Network(alpha_s=fit[0], beta_s_per_byte=fit[1]), steps=10)
            row += f" | {sim.step_s * 1e3:.2f} | {sim.step_s / m['step_s']:.2f}"
        print(row + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-real", action="store_true", help="only the simulator's timing")
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's width (1024: 1.1M parameters)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    timing()
    if not args.skip_real:
        real(args.hidden, args.steps)


if __name__ == "__main__":
    main()
