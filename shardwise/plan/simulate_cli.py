"""``shardwise simulate``: throughput and scaling efficiency against worker count, by simulation.

::

    shardwise simulate --algorithm ring --workers 1 8 64 512 4096 --params 25.5e6 --compute-ms 120 \\
        --bandwidth-gbps 25 --latency-us 10 --gpus-per-node 8 --intra-gbps 300 [--json out.json] [--plot out.png]
    shardwise simulate --preset goyal-2017          # a published result: the paper's inputs, its figure beside ours

Prints one row per worker count (step time, samples/s, efficiency, the exchange's time, idle time
per worker and step); ``--json`` writes the inputs and rows, ``--plot`` a PNG of samples/s and
efficiency against workers (matplotlib, the ``plot`` extra). The model: `shardwise.plan.simulate`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

# flags a preset sets itself (a preset with any of them given is refused, so no input is silently dropped)
_PRESET_SETS = ("algorithm", "params", "compute_ms", "bandwidth_gbps", "latency_us", "gpus_per_node", "intra_gbps", "intra_latency_us", "servers", "batch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shardwise simulate``."""
    p.add_argument("--preset", help="a published result to reproduce: goyal-2017 or horovod-2018 (sets the model and the cluster)")
    p.add_argument("--algorithm", help="ring, tree, recursive_doubling, hierarchical or ps (default ring)")
    p.add_argument("--workers", type=int, nargs="+", help="worker counts to simulate (default 1 2 4 ... 4096)")
    p.add_argument("--params", type=float, help="model parameters, e.g. 25.5e6")
    p.add_argument("--bytes-per-param", type=int, default=4, help="gradient bytes per parameter (default 4, float32)")
    p.add_argument("--compute-ms", type=float, help="one worker's forward and backward per step, milliseconds")
    p.add_argument("--batch", type=int, help="samples per worker and step (default 32)")
    p.add_argument("--bandwidth-gbps", type=float, help="each node's NIC, Gbit/s (default 25)")
    p.add_argument("--latency-us", type=float, help="latency between nodes, microseconds (default 10)")
    p.add_argument("--gpus-per-node", type=int, help="workers per node, sharing its NIC (default 1)")
    p.add_argument("--intra-gbps", type=float, help="link inside a node, Gbit/s (default: the NIC's)")
    p.add_argument("--intra-latency-us", type=float, help="latency inside a node (default: --latency-us)")
    p.add_argument("--servers", type=int, help="parameter servers for --algorithm ps (default 1)")
    p.add_argument("--mode", default="sync", help="sync, async (parameter servers) or local_sgd (default sync)")
    p.add_argument("--sync-every", type=int, default=1, help="local SGD's H: average every H steps")
    p.add_argument("--straggler", default="constant", help="constant, normal:SIGMA, lognormal:SIGMA or slow:FRACTION:FACTOR")
    p.add_argument("--steps", type=int, default=20, help="steps simulated per worker count (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the inputs and results here")
    p.add_argument("--plot", help="write a PNG of samples/s and efficiency against workers here")


def main(args: argparse.Namespace) -> int:
    """Run ``shardwise simulate`` for parsed ``args``."""
    from shardwise.plan.simulate import Exchange, Network, Straggler, sweep
    from shardwise.plan.simulate_presets import preset_config, reproduce

    reproductions = []
    if args.preset is not None:
        given = [f"--{k.replace('_', '-')}" for k in _PRESET_SETS if getattr(args, k) is not None]
        if given:
            raise ConfigError(f"--preset {args.preset} sets the model and cluster itself; drop {', '.join(given)} or drop --preset")
        config, workers = preset_config(args.preset)
        reproductions = reproduce(args.preset)
        if args.mode != "sync" or args.sync_every != 1:
            config["exchange"] = Exchange(algorithm=config["exchange"].algorithm, mode=args.mode, sync_every=args.sync_every)
    else:
        if args.params is None or args.compute_ms is None:
            raise ConfigError("shardwise simulate needs --params and --compute-ms (e.g. --params 25.5e6 --compute-ms 120), or a --preset")
        net = Network.from_gbps(_or(args.bandwidth_gbps, 25.0), _or(args.latency_us, 10.0), _or(args.gpus_per_node, 1), args.intra_gbps, args.intra_latency_us)
        exchange = Exchange(algorithm=_or(args.algorithm, "ring"), mode=args.mode, servers=_or(args.servers, 1), sync_every=args.sync_every)
        config = {"params": args.params, "compute_s": args.compute_ms / 1e3, "net": net, "exchange": exchange, "batch": _or(args.batch, 32)}
        workers = [2**i for i in range(13)]
    if args.bytes_per_param < 1:
        raise ConfigError(f"--bytes-per-param must be >= 1; got {args.bytes_per_param}")
    workers = args.workers or workers
    results = sweep(workers, **config, bytes_per_param=args.bytes_per_param, straggler=Straggler.parse(args.straggler), steps=args.steps, seed=args.seed)
    ex = config["exchange"]
    title = f"{ex.algorithm} ({ex.mode}), {config['params'] / 1e6:g}M params, {config['compute_s'] * 1e3:.1f} ms compute, straggler {args.straggler}"
    print(title)
    print(f"{'workers':>8} {'step ms':>10} {'samples/s':>12} {'efficiency':>10} {'exchange ms':>12} {'idle ms':>9}")
    for r in results:
        print(f"{r.workers:>8} {r.step_s * 1e3:>10.2f} {r.samples_per_s:>12.0f} {r.efficiency:>10.3f} {r.exchange_s * 1e3:>12.2f} {r.idle_mean_s * 1e3:>9.2f}")
    for rep in reproductions:
        print(f"{rep.name}: simulated {rep.simulated:.3f}, published {rep.published:.2f} ({rep.relative_error:.1%} off; {rep.citation})")
    if args.json:
        inputs = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in config.items()}
        doc = {
            "inputs": {**inputs, "straggler": args.straggler, "steps": args.steps, "seed": args.seed, "preset": args.preset},
            "results": [asdict(r) for r in results],
            "reproductions": [{**asdict(r), "relative_error": r.relative_error} for r in reproductions],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        _plot(args.plot, results, title)
    return 0


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _plot(path: str, results: list[Any], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("the simulate plot needs matplotlib (pip install 'shardwise[plot]'); use --json for the numbers") from exc
    w = [r.workers for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(w, [r.samples_per_s for r in results], "o-", label="simulated")
    a.plot(w, [r.workers * results[0].samples_per_s / results[0].workers / results[0].efficiency for r in results], "--", label="linear")
    a.set(xscale="log", yscale="log", xlabel="workers", ylabel="samples/s", title="throughput")
    a.legend()
    b.plot(w, [r.efficiency for r in results], "o-")
    b.set(xscale="log", ylim=(0, 1.05), xlabel="workers", ylabel="efficiency vs 1 worker", title="scaling efficiency")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
