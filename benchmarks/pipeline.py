"""Pipeline bubble, measured against the formula, for p in {2, 4}, m in {2, 4, 8, 16} and each schedule.

The benchmark model has equal stage costs by construction: no embedding and no head, an
``nn.Sequential`` of identical ``Linear(width, width) + tanh`` blocks, ``--layers-per-rank`` of
them on every rank (interleaved: ``v`` chunks of ``layers / v``), the input requiring a gradient
so the first stage's backward does the same work as the others, and a loss (mean square) too
small to matter. Every micro-batch has ``--rows`` rows whatever m, so each forward and backward
costs the same in every configuration.

Measured bubble (``summary()['pipeline']['bubble_measured']``): for each stage, 1 - (time inside
its forward and backward actions) / (the step's wall time from the first rank's start to the
last rank's end, on a clock aligned across ranks at setup), averaged over stages and over the
steps after ``--warmup``. Predicted (Narayanan et al. 2021): (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v m+p-1) interleaved. The formula counts no communication and no scheduling overhead,
so the measured value sits above it by what those cost next to one action (``--width`` and
``--rows`` set the action's size).

One thread per process. On a machine with fewer cores than p (p=4 here on 2 cores) the
processes share cores: an action that overlaps another rank's runs slower, which inflates busy
time and changes the measured bubble in ways the formula does not model; the table marks
those rows ``oversubscribed``.

    python benchmarks/pipeline.py [--pp 2 4] [--microbatches 2 4 8 16] [--steps 4] [--timeline /tmp/pipeline_timeline.png]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch import nn

import shardwise
from shardwise.plan.bubble import predicted_bubble

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def equal_blocks(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


def _mean_square(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return output.pow(2).mean()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-4)


def _run(configs: list[dict[str, Any]], width: int, layers_per_rank: int, rows: int, steps: int, warmup: int, timeline: str | None) -> list[dict[str, Any]]:
    out = []
    for cfg in configs:
        p, m, schedule = cfg["pp"], cfg["microbatches"], cfg["schedule"]
        options: dict[str, Any] = dict(pp=p, microbatches=m, schedule=schedule, warmup_steps=warmup)
        if timeline and cfg.get("timeline"):
            options["timeline"] = timeline
        engine = shardwise.Engine(strategy="pipeline", strategy_options=options, accelerator="cpu")
        model, opt = engine.setup(equal_blocks(width, layers_per_rank * p), _sgd)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(rows * m, width, generator=g).requires_grad_(True)  # the first stage computes dx too: equal backward cost
        y = torch.zeros(rows * m)
        for _ in range(warmup + steps):
            engine.forward_backward(model, [(x, y)], lambda mod, b: _mean_square(mod(b[0]), b))
            engine.step(opt)
            opt.zero_grad(set_to_none=True)
        section = engine.strategy.summary()["pipeline"]
        out.append({**cfg, "measured": section["bubble_measured"], "median": section["bubble_measured_median_step"], "predicted": section["bubble_predicted"],
                    "per_stage": [s["bubble"] for s in section["per_stage"]], "step_s": section["step_wall_s"],
                    "virtual_stages": section["virtual_stages"], "timeline": section.get("timeline")})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=128, help="rows per micro-batch")
    ap.add_argument("--layers-per-rank", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeline", default=None, help="PNG for one configuration (interleaved, p=2, m=4), events as JSON next to it")
    ap.add_argument("--json", default=None, help="write the rows as JSON")
    args = ap.parse_args(argv)

    cores = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    for p in args.pp:
        configs = []
        for schedule in args.schedules:
            for m in args.microbatches:
                if schedule == "1f1b" and m < p:
                    continue  # refused by design (fewer micro-batches than stages)
                if schedule == "interleaved" and m % max(1, m // p):
                    continue
                configs.append({"pp": p, "microbatches": m, "schedule": schedule,
                                "timeline": schedule == "interleaved" and p == 2 and m == 4})
        results = shardwise.launch(_run, configs, args.width, args.layers_per_rank, args.rows, args.steps, args.warmup, args.timeline,
                                   nproc=p, threads_per_proc=1, timeout=1800)
        for r in results[0]:
            r["oversubscribed"] = p > cores
            rows.append(r)

    print(f"pipeline bubble: width {args.width}, {args.rows} rows per micro-batch, {args.layers_per_rank} blocks per rank, "
          f"{args.steps} steps after {args.warmup} warm-up, {cores} cores")
    print(f"{'p':>2} {'schedule':<12} {'v':>2} {'m':>3} {'measured':>9} {'median':>7} {'predicted':>9} {'ratio':>6} {'step s':>7}  per-stage")
    for r in rows:
        ratio = r["measured"] / r["predicted"] if r["predicted"] else float("nan")
        flag = "  oversubscribed" if r["oversubscribed"] else ""
        stages = " ".join(f"{b:.3f}" for b in r["per_stage"])
        print(f"{r['pp']:>2} {r['schedule']:<12} {r['virtual_stages']:>2} {r['microbatches']:>3} {r['measured']:>9.3f} {r['median']:>7.3f} {r['predicted']:>9.3f} {ratio:>6.2f} {r['step_s']:>7.3f}  {stages}{flag}")
    timelines = [r["timeline"] for r in rows if r.get("timeline")]
    if timelines:
        print(f"timeline: {timelines[0]} (events: {timelines[0]}.json)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
