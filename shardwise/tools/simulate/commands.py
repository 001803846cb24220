"""``shardwise simulate``: throughput and scaling efficiency against worker count, by simulation.

::

    shardwise simulate --algorithm ring --workers 1 8 64 512 4096 --params 25.5e6 --compute-ms 120 \\
        --bandwidth-gbps 25 --latency-us 10 --gpus-per-node 8 --intra-gbps 300 [--json out.json] [--plot out.png]
    shardwise simulate --preset goyal-2017          # a published result: the paper's inputs, its figure beside ours
    shardwise simulate --pipeline 1f1b --stages 4 --microbatches 8 --stage-ms 10,20 \
        --activation-bytes 16e6 --bandwidth-gbps 100 --latency-us 5   # one pipeline step, by events

Prints one row per worker count (step time, samples/s, efficiency, the exchange's time, idle time
per worker and step); ``--json`` writes the inputs and rows, ``--plot`` a PNG of samples/s and
efficiency against workers (matplotlib, the ``plot`` extra). The model: `shardwise.tools.simulate.network`.
``--pipeline`` is a separate mode: one row per stage (bubble, peak micro-batches held) and the
step time; the model: `shardwise.tools.simulate.pipeline`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shardwise.config import add_arguments as add_flags
from shardwise.config import flag
from shardwise.errors import ConfigError

# flags of the data-parallel mode that --pipeline refuses, and the pipeline's own flags
_DATA_PARALLEL_ONLY = ("preset", "algorithm", "workers", "params", "compute_ms", "batch", "servers", "plot")
_PIPELINE_ONLY = ("stages", "microbatches", "chunks", "stage_ms", "activation_bytes")
# flags a preset sets itself (a preset with any of them given is refused, so no input is silently dropped)
_PRESET_SETS = ("algorithm", "params", "compute_ms", "bandwidth_gbps", "latency_us", "gpus_per_node", "intra_gbps", "intra_latency_us", "servers", "batch")


SIMULATE_HELP = "throughput and scaling efficiency against worker count, by simulation"


@dataclass(frozen=True, kw_only=True)
class SimulateOptions:
    """The flags of ``shardwise simulate`` (`shardwise.config.flag`: each field's flag, default and help)."""

    preset: str | None = flag(None, "a published result to reproduce: goyal-2017 or horovod-2018 (sets the model and the cluster)")
    algorithm: str | None = flag(None, "ring, tree, recursive_doubling, hierarchical or ps (default ring)")
    workers: list[int] | None = flag(None, "worker counts to simulate (default 1 2 4 ... 4096)", nargs="+")
    params: float | None = flag(None, "model parameters, e.g. 25.5e6")
    bytes_per_param: int = flag(4, "gradient bytes per parameter (default 4, float32)")
    compute_ms: float | None = flag(None, "one worker's forward and backward per step, milliseconds")
    batch: int | None = flag(None, "samples per worker and step (default 32)")
    bandwidth_gbps: float | None = flag(None, "each node's NIC, Gbit/s (default 25)")
    latency_us: float | None = flag(None, "latency between nodes, microseconds (default 10)")
    gpus_per_node: int | None = flag(None, "workers per node, sharing its NIC (default 1)")
    intra_gbps: float | None = flag(None, "link inside a node, Gbit/s (default: the NIC's)")
    intra_latency_us: float | None = flag(None, "latency inside a node (default: --latency-us)")
    servers: int | None = flag(None, "parameter servers for --algorithm ps (default 1)")
    mode: str = flag("sync", "sync, async (parameter servers) or local_sgd (default sync)")
    sync_every: int = flag(1, "local SGD's H: average every H steps")
    straggler: str = flag("constant", "constant, normal:SIGMA, lognormal:SIGMA or slow:FRACTION:FACTOR")
    steps: int = flag(20, "steps simulated per worker count (default 20)")
    seed: int = flag(0, "seed of the simulated step times' randomness (default 0)")
    overlap: float = flag(0.0, "fraction of the backward during which gradient buckets are already reduced (0 to 1, default 0)")
    pipeline: str | None = flag(None, "simulate one pipeline step instead: gpipe, 1f1b or interleaved")
    stages: int | None = flag(None, "--pipeline: stages (ranks) P")
    microbatches: int | None = flag(None, "--pipeline: micro-batches per step M")
    chunks: int | None = flag(None, "--pipeline interleaved: model chunks per rank V")
    stage_ms: list[str] | None = flag(None, "--pipeline: F,B (forward and backward ms of one micro-batch through a stage), once or once per stage", nargs="+")
    activation_bytes: float | None = flag(None, "--pipeline: bytes sent between stages per micro-batch (default 0)")
    json: str | None = flag(None, "write the inputs and results here")
    plot: str | None = flag(None, "write a PNG of samples/s and efficiency against workers here")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shardwise simulate``."""
    add_flags(p, SimulateOptions)


def main(args: argparse.Namespace) -> int:
    """Run ``shardwise simulate`` for parsed ``args``."""
    from shardwise.tools.simulate.network import Exchange, Network, Straggler, sweep
    from shardwise.tools.simulate.presets import preset_config, reproduce

    if args.pipeline is not None:
        return _pipeline_main(args)
    given = [f"--{k.replace('_', '-')}" for k in _PIPELINE_ONLY if getattr(args, k) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} describe a pipeline; add --pipeline gpipe|1f1b|interleaved or drop them")
    reproductions = []
    if args.preset is not None:
        given = [f"--{k.replace('_', '-')}" for k in _PRESET_SETS if getattr(args, k) is not None]
        if given:
            raise ConfigError(f"--preset {args.preset} sets the model and cluster itself; drop {', '.join(given)} or drop --preset")
        config, workers = preset_config(args.preset)
        reproductions = reproduce(args.preset)
        config["exchange"] = replace(config["exchange"], mode=args.mode, sync_every=args.sync_every, overlap=args.overlap)
    else:
        if args.params is None or args.compute_ms is None:
            raise ConfigError("shardwise simulate needs --params and --compute-ms (e.g. --params 25.5e6 --compute-ms 120), or a --preset")
        net = Network.from_gbps(_or(args.bandwidth_gbps, 25.0), _or(args.latency_us, 10.0), _or(args.gpus_per_node, 1), args.intra_gbps, args.intra_latency_us)
        algorithm = _or(args.algorithm, "ring")
        exchange = Exchange(algorithm=algorithm, mode=args.mode, servers=_or(args.servers, 1), sync_every=args.sync_every, overlap=args.overlap)
        config = {"params": args.params, "compute_s": args.compute_ms / 1e3, "net": net, "exchange": exchange, "batch": _or(args.batch, 32)}
        workers = [2**i for i in range(13)]
    if args.bytes_per_param < 1:
        raise ConfigError(f"--bytes-per-param must be >= 1; got {args.bytes_per_param}")
    workers = args.workers or workers
    results = sweep(workers, **config, bytes_per_param=args.bytes_per_param, straggler=Straggler.parse(args.straggler), steps=args.steps, seed=args.seed)
    ex = config["exchange"]
    overlap = f", overlap {ex.overlap:g}" if ex.overlap else ""
    title = f"{ex.algorithm} ({ex.mode}{overlap}), {config['params'] / 1e6:g}M params, {config['compute_s'] * 1e3:.1f} ms compute, straggler {args.straggler}"
    print(title)
    print(f"{'workers':>8} {'step ms':>10} {'samples/s':>12} {'efficiency':>10} {'exchange ms':>12} {'idle ms':>9}")
    for r in results:
        print(f"{r.workers:>8} {r.step_s * 1e3:>10.2f} {r.samples_per_s:>12.0f} {r.efficiency:>10.3f} {r.exchange_s * 1e3:>12.2f} {r.idle_mean_s * 1e3:>9.2f}")
    changed = args.mode != "sync" or args.sync_every != 1 or args.overlap != 0
    for rep in reproductions:  # always the preset's own inputs, whatever --mode or --overlap did to the table
        own = " with the preset's inputs (sync, no overlap)" if changed else ""
        print(f"{rep.name}: simulated {rep.simulated:.3f}{own}, published {rep.published:.2f} ({rep.relative_error:.1%} off; {rep.citation})")
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


def _pipeline_main(args: argparse.Namespace) -> int:
    """``shardwise simulate --pipeline ...``: one pipeline step by events, a row per stage."""
    from shardwise.tools.simulate.network import Network, Straggler
    from shardwise.tools.simulate.pipeline import simulate_pipeline

    given = [f"--{k.replace('_', '-')}" for k in _DATA_PARALLEL_ONLY if getattr(args, k) is not None]
    given += [flag for flag, bad in (("--mode", args.mode != "sync"), ("--sync-every", args.sync_every != 1), ("--overlap", args.overlap != 0)) if bad]
    if given:
        raise ConfigError(f"--pipeline simulates one pipeline, not a data-parallel sweep; drop {', '.join(given)} or drop --pipeline")
    if args.stages is None or args.microbatches is None or args.stage_ms is None:
        raise ConfigError("--pipeline needs --stages, --microbatches and --stage-ms F,B (e.g. --stages 4 --microbatches 8 --stage-ms 10,20)")
    fb = []
    for text in args.stage_ms:
        try:
            f, b = (float(x) / 1e3 for x in text.split(","))
        except ValueError:
            raise ConfigError(f"--stage-ms takes F,B in milliseconds (e.g. 10,20), once or once per stage; got {text!r}") from None
        fb.append((f, b))
    if len(fb) not in (1, args.stages):
        raise ConfigError(f"--stage-ms takes one F,B for every stage or one per stage ({args.stages}); got {len(fb)}")
    net = Network.from_gbps(_or(args.bandwidth_gbps, 25.0), _or(args.latency_us, 10.0), _or(args.gpus_per_node, 1), args.intra_gbps, args.intra_latency_us)
    r = simulate_pipeline(
        args.pipeline,
        args.stages,
        args.microbatches,
        chunks=_or(args.chunks, 1),
        forward_s=fb[0][0] if len(fb) == 1 else [f for f, _ in fb],
        backward_s=fb[0][1] if len(fb) == 1 else [b for _, b in fb],
        activation_bytes=_or(args.activation_bytes, 0.0),
        net=net,
        straggler=Straggler.parse(args.straggler),
        steps=args.steps,
        seed=args.seed,
    )
    print(f"{r.schedule}, {r.stages} stages x {r.chunks} chunks, {r.microbatches} micro-batches, send {r.send_s * 1e3:.3f} ms, straggler {args.straggler}")
    print(f"step {r.step_s * 1e3:.2f} ms (mean of {args.steps}); predicted bubble (equal stages, free sends) {r.predicted_bubble:.4f}")
    print(f"{'stage':>6} {'bubble':>8} {'peak micro-batches held':>24}")
    for s, (b, held) in enumerate(zip(r.bubble, r.peak_in_flight, strict=True)):
        print(f"{s:>6} {b:>8.4f} {held:>24g}")
    if args.json:
        inputs = {k: getattr(args, k) for k in _PIPELINE_ONLY}
        inputs.update(schedule=args.pipeline, network=asdict(net), straggler=args.straggler, steps=args.steps, seed=args.seed)
        doc = {"inputs": inputs, "result": asdict(r)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
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
