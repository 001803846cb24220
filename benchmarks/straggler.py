"""What a straggler costs each strategy: throughput, accuracy after a fixed time, bytes per step.

Two workers train the digits MLP for a fixed wall-clock budget, once with both at full speed
and once with worker 1 three times slower (`shardwise.trainer.straggler.Straggler`). The
data-parallel strategies (ddp, local-sgd, diloco) run on 2 processes; the parameter-server
modes run on 3 (2 workers + 1 server), so every row has two workers computing.

    .venv/bin/python benchmarks/straggler.py [--seconds 4] [--factor 3] [--repeats 3] [--json out.json]

Runs are interleaved and repeated: ``--repeats`` rounds, each running every strategy with and
without the straggler, the pair's order alternating and the strategies' order rotating round by
round, so a machine that slows down during the benchmark weighs on every row alike. Each figure
is the median over rounds; "kept" is the median of the per-round ratios (its range beside it).

Throughput counts the samples every worker processed in the budget. Synchronous strategies
stop together: a one-element allreduce (max of "my budget ran out") carries the decision (not
counted in the bytes; local SGD and DiLoCo take it at their averaging rounds, every H steps, where
they wait for each other anyway). Parameter-server workers stop on their own clock (a worker that
finishes tells the servers, which go on with the rest). Accuracy is worker 0's model on the
360 validation images when the budget ran out (for ps, the servers' final parameters).
Target (issue 6): async keeps at least (n-1)/n of its no-straggler throughput, sync falls to
the slowest worker's pace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.engine import Engine
from shardwise.launcher.spawn import launch
from shardwise.trainer.straggler import Straggler

BATCH = 64
RUNS_DP = [("ddp", "ddp", {}), ("local-sgd H=8", "local-sgd", {"sync_every": 8}),
           ("diloco H=8", "diloco", {"sync_every": 8, "outer_lr": 0.7, "outer_momentum": 0.5})]
RUNS_PS = [("ps sync", "ps", {"servers": 1, "mode": "sync"}), ("ps async", "ps", {"servers": 1, "mode": "async"}),
           ("ps ssp S=2", "ps", {"servers": 1, "mode": "ssp", "staleness": 2})]


def _run(strategy: str, options: dict[str, Any], seconds: float, straggler: Straggler | None) -> dict[str, Any] | None:
    from shardwise.tools.recipes.digits import DigitsMLP, load_digits_split

    train, val = load_digits_split()
    engine = Engine(strategy=strategy, strategy_options=options, accelerator="cpu", seed=0)
    model, opt = engine.setup(DigitsMLP(hidden=256), lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=1e-4))
    if not engine.trains:
        return None
    x, y = train.tensors
    workers, w = engine.data_mesh.size("dp"), engine.data_mesh.coordinate("dp")
    per = BATCH // workers
    collective_stop = strategy != "ps"
    g = torch.Generator().manual_seed(1 + w)
    steps, start = 0, time.perf_counter()
    if straggler is not None:
        straggler.on_fit_start(None, engine)
    # Local SGD and DiLoCo meet only every H steps: check the clock there, not every step.
    check_every = int(options.get("sync_every", 1))
    while True:
        if collective_stop:
            if steps % check_every == 0:
                flag = torch.tensor([float(time.perf_counter() - start > seconds)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=engine.group.pg)
                if flag.item():
                    break
        elif time.perf_counter() - start > seconds:
            break
        idx = torch.randint(len(x), (per,), generator=g)
        engine.forward_backward(model, [(x[idx], y[idx])], lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        engine.step(opt)
        opt.zero_grad(set_to_none=True)
        steps += 1
        if straggler is not None:
            straggler.on_train_step_end(None, engine, steps, None)
    elapsed = time.perf_counter() - start
    section = engine.finish()  # ps: ends the session; worker 0 gets the final parameters
    sent = sum(t["sent_bytes"] for t in engine.recorder.totals().values())
    total = torch.tensor([float(steps * per)])
    dist.all_reduce(total, group=engine.data_mesh.group("dp").pg)  # every worker (async ones loop alone)
    if w != 0:
        return None
    module = engine.unwrap(model).eval()
    with torch.no_grad():
        acc = float((module(val.tensors[0]).argmax(-1) == val.tensors[1]).double().mean() * 100)
    ps = section.get("ps", {})
    return {"samples_per_s": total.item() / elapsed, "val_accuracy": acc, "steps_worker0": steps,
            "bytes_per_step": sent / max(steps, 1), "max_staleness": ps.get("max_staleness"), "updates": ps.get("updates_per_server")}


def _all(runs: list[tuple[str, str, dict[str, Any]]], seconds: float, factor: float, repeats: int) -> dict[str, Any]:
    """Every (strategy, straggler or not) run ``repeats`` times, interleaved; worker 0's results per key, one per round."""
    out: dict[str, list[Any]] = {f"{label}|{slow}": [] for label, _, _ in runs for slow in (False, True)}
    for round_ in range(repeats):
        shift = round_ % len(runs)
        for label, strategy, options in runs[shift:] + runs[:shift]:
            for slow in ((False, True) if round_ % 2 == 0 else (True, False)):
                out[f"{label}|{slow}"].append(_run(strategy, options, seconds, Straggler(1, factor) if slow else None))
                dist.barrier()
    return out


def _median(results: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="training budget per run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every run (medians over rounds)")
    parser.add_argument("--factor", type=float, default=3.0, help="how many times slower worker 1 is")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {**launch(_all, RUNS_DP, args.seconds, args.factor, args.repeats, nproc=2, threads_per_proc=1)[0],
               **launch(_all, RUNS_PS, args.seconds, args.factor, args.repeats, nproc=3, threads_per_proc=1)[0]}
    print(f"\ntwo workers, digits MLP (hidden 256), global batch {BATCH}, {args.seconds:g} s per run, worker 1 {args.factor:g}x slower, "
          f"median of {args.repeats} interleaved rounds\n")
    print(f"| strategy | samples/s, no straggler | samples/s, straggler | kept (range) | val acc % after {args.seconds:g} s (straggler) | bytes sent per step (worker 0) | max staleness |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, _, _ in RUNS_DP + RUNS_PS:
        fast, slow = results[f"{label}|False"], results[f"{label}|True"]
        kept = sorted(s["samples_per_s"] / f["samples_per_s"] for f, s in zip(fast, slow))
        stale = [s["max_staleness"] for s in slow if s["max_staleness"] is not None]
        print(f"| {label} | {_median(fast, 'samples_per_s'):.0f} | {_median(slow, 'samples_per_s'):.0f} | {statistics.median(kept):.2f} ({kept[0]:.2f}-{kept[-1]:.2f}) "
              f"| {_median(slow, 'val_accuracy'):.1f} | {_median(slow, 'bytes_per_step'):.0f} | {max(stale) if stale else ''} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
