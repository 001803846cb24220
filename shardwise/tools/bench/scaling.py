"""``shardwise bench scaling``: measured speed-up and efficiency against the number of processes, beside the planner's.

::

    shardwise bench scaling --recipe digits --strategy ddp,zero1 --nproc 1,2,4 --max-steps 300 --json scaling.json --png scaling.png
    shardwise bench scaling --model mymodels:make_model --data mymodels:make_data --strategy ddp --nproc 1,2

Each configuration (a strategy at a process count) is a normal ``shardwise train`` run of its own,
started as a fresh ``python -m shardwise train`` (nothing of one run is left in the next), logged
every ``--log-every`` steps, validated and checkpointed only at the end. Its throughput is the
steady state: ``global batch / median step time`` over the logged intervals that end after
``--warmup`` steps (the first steps build buffers, warm caches and connections), read from the
run's ``metrics.jsonl``; the run's whole-run ``samples_per_s`` (``summary.json``, warm-up included)
and the whole command's wall time (interpreter start and data loading included) are kept beside it.

- **speed-up** = samples/s at N processes over samples/s of the baseline: the same strategy on
  one process, or, for a strategy whose plan refuses one process, ``single``'s run;
- **efficiency** = speed-up / N (1 is perfect scaling);
- **predicted**: the planner's step time for the same layout (`shardwise.tools.advisor.forecast.predict_step`
  on the measured ``cpu`` profile, the step timed here as ``shardwise plan`` does), samples/s and speed-up alike.

A speed-up below 1 means one process trains faster than N: distributing is a trade-off (each step
pays for its collectives and for its processes sharing the cores), not a free win. ``--global-batch``
stays fixed across N (strong scaling) unless ``--weak`` makes it ``batch x N`` (the batch per process fixed).
``--repeats R`` runs every configuration R times, in rounds, and keeps each one's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.config import add_arguments, flag
from shardwise.errors import ConfigError
from shardwise.launcher.env import standalone_env

REFERENCE = "single"
"""The one-process run a strategy that cannot run on one process is measured against."""
_DESCRIPTION = "Measured speed-up and efficiency against the number of processes, beside the planner's prediction."
_FACTORY = "MODULE:FACTORY"
_SOURCE = ("what to train", "a built-in recipe, or your own model as `shardwise train` takes it (MODULE:NAME, imported from the current directory first)")


@dataclass(frozen=True, kw_only=True)
class ScalingOptions:
    """``shardwise bench scaling``'s flags (`shardwise.config.flag`: each field's flag, default and help)."""

    recipe: str | None = flag(None, "a built-in recipe (digits, charlm)", group=_SOURCE)
    model: str | None = flag(None, "instead of --recipe: returns the torch.nn.Module (or (module, example_input))", metavar=_FACTORY, group=_SOURCE)
    data: str | None = flag(None, "with --model: returns the training data (a map-style Dataset, or a DataLoader over one)", metavar=_FACTORY, group=_SOURCE)
    loss: str | None = flag(None, "with --model: loss(output, batch) -> scalar (default: the model's own)", metavar="MODULE:FN", group=_SOURCE)
    optimizer: str | None = flag(None, "with --model: called with the parameters (default: AdamW, lr 1e-3)", metavar=_FACTORY, group=_SOURCE)
    strategy: list[str] = flag(help="strategies, comma or space separated (default ddp)", nargs="+", metavar="NAME,...", default_factory=lambda: ["ddp"])
    nproc: list[str] = flag(
        help="process counts, comma or space separated; 1 always runs (default 1,2)", nargs="+", metavar="N,...", default_factory=lambda: ["1,2"]
    )
    max_steps: int = flag(200, "training steps of each run (default 200)")
    warmup: int = flag(20, "steps left out of the throughput at the start of each run (default 20)")
    log_every: int = flag(5, "steps per logged interval; the throughput is the median interval's (default 5)")
    global_batch: int | None = flag(None, "samples per optimizer step over all processes (default: the recipe's, else 64)")
    threads: int | None = flag(None, "every run's threads per process (train --threads; default OMP_NUM_THREADS, else torch's / cores // N)", metavar="N")
    weak: bool = flag(False, "weak scaling: the global batch grows with N (--global-batch x N), the batch per process stays")
    repeats: int = flag(1, "runs of every configuration, taken in rounds; each keeps its median (default 1)")
    json: str | None = flag(None, "write the rows as a JSON list", metavar="FILE")
    png: str | None = flag(None, "draw speed-up (measured, predicted, ideal) and efficiency against processes (needs matplotlib)", metavar="FILE")
    out: str | None = flag(None, "keep each run's directory under DIR (default: a temporary directory, removed)", metavar="DIR")
    timeout: float = flag(1800.0, "stop a run after this many seconds (default 1800)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise bench scaling", description=_DESCRIPTION)
    add_arguments(p, ScalingOptions)
    return p


def _split(values: Sequence[str]) -> list[str]:
    return [v.strip() for chunk in values for v in chunk.split(",") if v.strip()]


def parse_nproc(values: Sequence[str]) -> list[int]:
    """``["1,2", "4"]`` -> ``[1, 2, 4]`` (sorted, 1 added: every speed-up is against one process)."""
    counts = set()
    for text in _split(values):
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"--nproc takes whole numbers >= 1 (e.g. --nproc 1,2,4); got {text!r}")
        counts.add(n)
    if not counts:
        raise ConfigError("--nproc needs at least one process count, e.g. --nproc 1,2,4")
    return sorted(counts | {1})


def check_options(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """Every flag checked before anything is built or launched: (strategies, process counts)."""
    from shardwise.strategies import check_name
    from shardwise.tools.recipes import available as recipes

    if (args.recipe is None) == (args.model is None):
        raise ConfigError("shardwise bench scaling trains --recipe NAME (digits, charlm) or your own --model MODULE:FACTORY --data MODULE:FACTORY: give one")
    if args.recipe is not None and args.recipe not in recipes():
        raise ConfigError(f"unknown recipe {args.recipe!r}; the recipes are {', '.join(recipes())} (or --model MODULE:FACTORY --data MODULE:FACTORY)")
    if args.model is not None and args.data is None:
        raise ConfigError(f"--model {args.model} needs --data MODULE:FACTORY (the training data), as `shardwise train --model` does")
    if args.recipe is not None and any(getattr(args, k) for k in ("data", "loss", "optimizer")):
        raise ConfigError("--data, --loss and --optimizer go with --model; a recipe brings its own")
    strategies = list(dict.fromkeys(_split(args.strategy)))
    if not strategies:
        raise ConfigError("--strategy needs at least one strategy, e.g. --strategy ddp,zero1")
    for name in strategies:
        check_name(name)
    nproc = parse_nproc(args.nproc)
    if args.log_every < 1 or args.warmup < 0 or args.repeats < 1:
        raise ConfigError(f"--log-every and --repeats must be >= 1 and --warmup >= 0; got {args.log_every}, {args.repeats}, {args.warmup}")
    if args.max_steps < args.warmup + 2 * args.log_every:
        raise ConfigError(
            f"--max-steps {args.max_steps} leaves fewer than 2 logged intervals of {args.log_every} steps after the {args.warmup} warm-up steps; "
            f"give --max-steps {args.warmup + 2 * args.log_every} or more (or a smaller --warmup)"
        )
    if args.out and Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise ConfigError(f"--out {args.out} is not empty (an earlier bench's runs?); give a new or empty directory, so no run is mixed with another's")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1 (intra-op threads of each process); got {args.threads}")
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError(f"--global-batch must be >= 1; got {args.global_batch}")
    return strategies, nproc


@dataclass(frozen=True)
class Config:
    """One measured configuration: a strategy at a process count, with the global batch it trains."""

    strategy: str
    nproc: int
    global_batch: int


def steady_samples_per_s(metrics: list[dict[str, Any]], global_batch: int, warmup: int) -> tuple[float, int]:
    """``global_batch / median step time`` over the logged intervals that end after ``warmup`` steps, and how many there were."""
    rates = [r["samples_per_s"] for r in metrics if "samples_per_s" in r and r.get("step", 0) > warmup]
    if not rates:
        raise ConfigError(f"the run logged no training interval after step {warmup}; give a larger --max-steps")
    step_s = statistics.median(global_batch / r for r in rates)
    return global_batch / step_s, len(rates)


def _source_args(args: argparse.Namespace) -> list[str]:
    if args.recipe is not None:
        return ["--recipe", args.recipe]
    return [x for key in ("model", "data", "loss", "optimizer") if getattr(args, key) for x in (f"--{key}", getattr(args, key))]


def run_one(args: argparse.Namespace, config: Config, out: Path) -> dict[str, Any]:
    """Train ``config`` as ``python -m shardwise train`` into ``out``; its measured figures (or its ``error``)."""
    steps = str(args.max_steps)
    cmd = [sys.executable, "-m", "shardwise", "train", *_source_args(args), "--strategy", config.strategy, "--nproc", str(config.nproc)]
    cmd += ["--max-steps", steps, "--log-every", str(args.log_every), "--val-every", steps, "--checkpoint-every", steps]
    cmd += ["--global-batch-size", str(config.global_batch), "--out", str(out), "--threads", str(run_threads(config.strategy, config.nproc, args.threads))]
    env = standalone_env()  # a job of its own: no launcher's variables passed on
    load = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within --timeout {args.timeout:g} s"}
    wall = time.perf_counter() - start
    if done.returncode != 0:
        lines = [x for x in (done.stderr or done.stdout).strip().splitlines() if x.strip()]
        return {"error": lines[-1] if lines else f"shardwise train exited with {done.returncode}"}
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((out / "summary.json").read_text())
    sps, intervals = steady_samples_per_s(metrics, config.global_batch, args.warmup)
    figures = {"samples_per_s": sps, "intervals": intervals, "run_samples_per_s": summary["samples_per_s"], "wall_s": wall, "load_1min": load}
    return figures | {"threads": summary["threads"]}  # as the run recorded it (it was given --threads)


def run_name(config: Config, round_: int, repeats: int) -> str:
    """A run's directory under ``--out``: ``ddp-2proc`` (``ddp-2proc-run1``, ... with ``--repeats``)."""
    return f"{config.strategy}-{config.nproc}proc" + (f"-run{round_ + 1}" if repeats > 1 else "")


def measure(args: argparse.Namespace, configs: list[Config], root: Path) -> dict[Config, dict[str, Any]]:
    """Every configuration ``--repeats`` times, in rounds (a slow stretch of the machine lands on all alike); the median run of each."""
    runs: dict[Config, list[dict[str, Any]]] = {c: [] for c in configs}
    errors: dict[Config, str] = {}
    total, k = len(configs) * args.repeats, 0
    for r in range(args.repeats):
        for c in configs:
            k += 1
            got = run_one(args, c, root / run_name(c, r, args.repeats))
            if "error" in got:
                errors[c] = got["error"]
                print(f"  [{k}/{total}] {c.strategy} on {c.nproc}: failed: {got['error']}", flush=True)
                continue
            runs[c].append(got)
            print(
                f"  [{k}/{total}] {c.strategy} on {c.nproc} process{'es' if c.nproc > 1 else ''}: {got['samples_per_s']:,.0f} samples/s "
                f"(whole command {got['wall_s']:.1f} s, load {got['load_1min']:.1f})",
                flush=True,
            )
    out: dict[Config, dict[str, Any]] = {}
    for c, mine in runs.items():
        if mine:
            sps = statistics.median(x["samples_per_s"] for x in mine)
            out[c] = {
                "samples_per_s": sps,
                "step_s": c.global_batch / sps,
                "runs": len(mine),
                "runs_samples_per_s": [x["samples_per_s"] for x in mine],
                "run_samples_per_s": statistics.median(x["run_samples_per_s"] for x in mine),
                "wall_s": statistics.median(x["wall_s"] for x in mine),
                "load_1min": max(x["load_1min"] for x in mine),
                "threads": mine[0]["threads"],  # as the run recorded it (summary.json)
            }
        else:
            out[c] = {"error": errors[c]}
    return out


def best_one(rows: list[dict[str, Any]], prefix: str = "") -> dict[str, Any] | None:
    """The fastest one-process row (any strategy: ``single`` or a strategy's own one-process run), by ``prefix`` samples/s."""
    return max((r for r in rows if r["nproc"] == 1 and r.get(f"{prefix}samples_per_s")), key=lambda r: r[f"{prefix}samples_per_s"], default=None)


def speedups(rows: list[dict[str, Any]]) -> None:
    """Each row's speed-up and efficiency (measured and predicted) against its ``baseline`` row, and its
    ``speedup_vs_best_one`` against the fastest one-process row of any strategy (`best_one`), in place."""
    by_key = {(r["strategy"], r["nproc"]): r for r in rows}
    for r in rows:
        base = by_key.get((r["baseline"], 1))
        for prefix in ("", "predicted_"):
            sps, ref = r.get(f"{prefix}samples_per_s"), base.get(f"{prefix}samples_per_s") if base else None
            r[f"{prefix}speedup"] = sps / ref if sps and ref else None
            r[f"{prefix}efficiency"] = r[f"{prefix}speedup"] / r["nproc"] if r[f"{prefix}speedup"] else None
            best = best_one(rows, prefix)
            r[f"{prefix}speedup_vs_best_one"] = sps / best[f"{prefix}samples_per_s"] if sps and best else None
        best = best_one(rows)
        r["best_one"] = f"{best['strategy']}" if best else None


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _num(x: float | None, fmt: str, unit: str = "") -> str:
    return "-" if x is None else format(x, fmt) + unit


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table: measured, then predicted."""
    head = f"{'strategy':10s} {'procs':>5s} {'threads':>7s} {'step':>10s} {'samples/s':>10s} {'speed-up':>8s} {'effic.':>6s} {'vs best1':>8s} │ "
    head += f"{'pred. step':>10s} {'samples/s':>10s} {'speed-up':>8s} {'effic.':>6s} {'vs best1':>8s}"
    lines = [f"{'':25s}{'measured':^46s} │ {'predicted by the planner':^46s}", head, "─" * len(head)]
    for r in rows:
        base = f" (vs {r['baseline']})" if r["baseline"] != r["strategy"] else ""
        if r.get("error"):
            measured = f"{'failed: ' + r['error']:46.46s}"
        else:
            measured = (
                f"{_ms(r['step_s']):>10s} {_num(r['samples_per_s'], ',.0f'):>10s} {_num(r['speedup'], '.2f', 'x'):>8s} {_num(r['efficiency'], '.0%'):>6s} "
                f"{_num(r.get('speedup_vs_best_one'), '.2f', 'x'):>8s}"
            )
        predicted = (
            f"{_ms(r['predicted_step_s']):>10s} {_num(r['predicted_samples_per_s'], ',.0f'):>10s} "
            f"{_num(r['predicted_speedup'], '.2f', 'x'):>8s} {_num(r['predicted_efficiency'], '.0%'):>6s} "
            f"{_num(r.get('predicted_speedup_vs_best_one'), '.2f', 'x'):>8s}"
        )
        threads = f"{r['threads']}/{r['predicted_threads']}" if r.get("threads") and r.get("predicted_threads") else "-"
        lines.append(f"{r['strategy']:10s} {r['nproc']:5d} {threads:>7s} {measured} │ {predicted}{base}")
    return "\n".join(line.rstrip() for line in lines)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The summary: the fastest layout measured against the fastest one-process run of any strategy (`best_one`),
    saying plainly when one process wins, then one line per strategy that ran on several processes (its best
    multi-process layout against that same one-process run, with its own speed-up beside), and the planner's order."""
    best1 = best_one(rows)
    many = [r for r in rows if r["nproc"] > 1 and r.get("samples_per_s")]
    if best1 is None or not many:
        return []
    one = f"{best1['strategy']} on 1 process at {best1['samples_per_s']:,.0f} samples/s"
    fastest = max(many, key=lambda r: r["samples_per_s"])
    lines = []
    if fastest["samples_per_s"] <= best1["samples_per_s"]:
        lines.append(
            f"one process is fastest: {one}; the fastest on more processes, {fastest['strategy']} on {fastest['nproc']}, "
            f"reaches {fastest['speedup_vs_best_one']:.2f}x of it: here distributing costs more than it gains"
        )
    else:
        lines.append(
            f"fastest: {fastest['strategy']} on {fastest['nproc']} processes at {fastest['samples_per_s']:,.0f} samples/s, "
            f"{fastest['speedup_vs_best_one']:.2f}x the fastest one-process run ({one})"
        )
    for name in dict.fromkeys(r["strategy"] for r in many):
        top = max((r for r in many if r["strategy"] == name), key=lambda r: r["samples_per_s"])
        own = f"; {top['speedup']:.2f}x its own one-process run ({top['baseline']}), {top['efficiency']:.0%} efficiency" if top.get("speedup") else ""
        lines.append(f"  {name} on {top['nproc']} reaches {top['speedup_vs_best_one']:.2f}x of {best1['strategy']}'s one-process run{own}")
    if any(r.get("speedup") and r["efficiency"] > 1.1 for r in many):
        lines.append("  (efficiency above 100%: its own one-process run was slowed, e.g. by other load: compare with the fastest one-process run)")
    pred1, pred_many = best_one(rows, "predicted_"), [r for r in rows if r["nproc"] > 1 and r.get("predicted_samples_per_s")]
    if pred1 is not None and pred_many:
        top = max(pred_many, key=lambda r: r["predicted_samples_per_s"])
        if top["predicted_samples_per_s"] <= pred1["predicted_samples_per_s"]:
            said = f"one process fastest ({pred1['strategy']} on 1; {top['strategy']} on {top['nproc']} at {top['predicted_speedup_vs_best_one']:.2f}x of it)"
        else:
            said = f"{top['strategy']} on {top['nproc']} fastest, {top['predicted_speedup_vs_best_one']:.2f}x its fastest one-process run ({pred1['strategy']})"
        lines.append(f"the planner predicts {said}")
    return lines


def run_threads(strategy: str, nproc: int, given: int | None = None) -> int:
    """The intra-op threads each process of a run has: ``given`` (``--threads``), else a user's ``OMP_NUM_THREADS``, else
    torch's own count where the Trainer runs the one process itself (a strategy with no process group), the launcher's
    ``cores // N`` (at least 1) in the processes it starts."""
    import torch

    from shardwise.launcher.env import user_threads
    from shardwise.strategies import get_strategy

    if given or user_threads():
        return int(given or user_threads() or 1)
    if nproc == 1 and not get_strategy(strategy).needs_process_group:
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // nproc)


def default_batch(recipe: str | None) -> int:
    """The recipe's own global batch (what ``shardwise train --recipe`` trains), else 64."""
    from shardwise.tools.recipes import get_recipe

    return int(get_recipe(recipe).trainer_defaults["global_batch_size"]) if recipe else 64


def setup(args: argparse.Namespace, batch: int, counts: list[int]) -> Any:
    """The `PlannedModel` the predictions read: ``--recipe`` or ``--model`` loaded as ``shardwise plan --model`` loads it
    (`shardwise.tools.advisor.forecast.planned_model`: its step timed here at every thread count the runs use)."""
    from shardwise.tools.advisor.forecast import planned_model

    timed = batch * (max(counts) if args.weak else 1)  # the largest global batch a run trains
    return planned_model(args.recipe or args.model, global_batch=timed, nprocs=counts, data=args.data)


def baselines(strategies: list[str], counts: list[int], batch: int, weak: bool, planned: Any) -> tuple[list[tuple[Config, str]], list[str]]:
    """The configurations to run, each with the strategy its speed-up is measured against, and the ones skipped.

    Each (strategy, N) is planned by the strategy's own ``plan`` here, as the launch will: one it refuses is
    skipped with its reason. A strategy that refuses one process is measured against `REFERENCE`'s one-process run."""
    from shardwise.strategies import Batch, get_strategy

    chosen: list[tuple[Config, str]] = []
    skipped: list[str] = []
    for name in strategies:
        accepted = []
        for n in counts:
            config = Config(name, n, batch * n if weak else batch)
            try:
                get_strategy(name).plan(n, model=planned.module, batch=Batch(config.global_batch))
            except ConfigError as exc:
                skipped.append(f"{name} on {n} process{'es' if n > 1 else ''}: {str(exc).splitlines()[0][:160]}")
                continue
            accepted.append(config)
        alone = any(c.nproc == 1 for c in accepted)
        chosen += [(c, name if alone else REFERENCE) for c in accepted]
    reference = Config(REFERENCE, 1, batch)
    if any(base != c.strategy for c, base in chosen) and reference not in [c for c, _ in chosen]:
        chosen.insert(0, (reference, REFERENCE))
    return chosen, skipped


def predictions(configs: list[tuple[Config, str]], planned: Any, load: float) -> dict[Config, dict[str, Any]]:
    """The planner's figures for each configuration (`shardwise.tools.advisor.forecast.predict_step` on the measured
    ``cpu`` profile, with ``load``, other work's runnable threads before this command started, and the threads each process runs)."""
    from shardwise.tools.advisor.forecast import predict_step

    out = {}
    for config, _ in configs:
        p = predict_step(planned, config.strategy, config.nproc, global_batch=config.global_batch, load=load)
        out[config] = {
            "predicted_step_s": p.step_s,
            "predicted_samples_per_s": p.samples_per_s,
            "predicted_threads": p.threads,
            "predicted_load": p.load,
            "predicted_fits": p.fits,
        }
    return out


def write_png(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Speed-up against processes (measured solid, predicted dashed, ideal dotted), and efficiency beside it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("bench scaling --png needs matplotlib: pip install 'shardwise[plot]' (the table and --json need nothing)") from None
    fig, (ax, eff) = plt.subplots(1, 2, figsize=(11.0, 4.5))
    counts = sorted({r["nproc"] for r in rows})
    ax.plot(counts, counts, ":", color="grey", label="ideal (speed-up = N)")
    eff.axhline(1.0, linestyle=":", color="grey", label="ideal")
    cmap = plt.get_cmap("tab10")
    for i, name in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
        mine = sorted((r for r in rows if r["strategy"] == name), key=lambda r: r["nproc"])
        if len(mine) < 2:
            continue  # one process only (single): its speed-up is 1 by definition, under the others' first point
        for key, style, label in (("speedup", "o-", "measured"), ("predicted_speedup", "s--", "predicted")):
            pts = [(r["nproc"], r[key]) for r in mine if r.get(key)]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, color=cmap(i % 10), label=f"{name} {label}")
        for key, style, label in (("efficiency", "o-", "measured"), ("predicted_efficiency", "s--", "predicted")):
            pts = [(r["nproc"], r[key]) for r in mine if r.get(key)]
            if pts:
                eff.plot(*zip(*pts, strict=True), style, color=cmap(i % 10), label=f"{name} {label}")
    ax.axhline(1.0, color="black", linewidth=0.6, label="one process (below: slower than one)")
    ax.set_xlabel("processes")
    ax.set_ylabel("speed-up over one process")
    ax.set_xticks(counts)
    ax.legend(fontsize=7)
    eff.set_xlabel("processes")
    eff.set_ylabel("efficiency (speed-up / processes)")
    eff.set_xticks(counts)
    eff.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    """``shardwise bench scaling``: check, predict, measure, print the table, write --json and --png."""
    args = build_parser().parse_args(list(argv))
    strategies, counts = check_options(args)
    from shardwise.strategies.cost.cluster import load_profile
    from shardwise.tools.advisor.forecast import load_method, machine_load

    batch = args.global_batch or default_batch(args.recipe)
    source = args.recipe or args.model
    load, now = os.getloadavg(), machine_load(None, load_profile("cpu"))  # the planner's: other work's threads now
    print(f"shardwise bench scaling: {source}, {', '.join(strategies)} on {', '.join(map(str, counts))} process(es), {args.max_steps} steps each", flush=True)
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} (1 min), other work's runnable threads {now:.2f} before starting", flush=True)
    planned = setup(args, batch, counts)
    configs, skipped = baselines(strategies, counts, batch, args.weak, planned)
    for line in skipped:
        print(f"  skipped: {line}", flush=True)
    if not configs:
        raise ConfigError("no strategy can run at the process counts asked; see the lines above")
    predicted = predictions(configs, planned, now)
    timed = [f for f in (planned.spec.step_fit, *planned.spec.step_fits) if f is not None]
    fits = ", ".join(f"{f.seconds(batch) * 1e3:.2f} ms at {f.threads} thread{'s' if f.threads > 1 else ''}" for f in timed)
    print(
        f"predictions: the model's step timed here{' (' + fits + ', each the fastest of its timing runs)' if fits else ''}, "
        f"stretched for a load of {now:.2f} (other work's runnable threads: {load_method(None)} before starting)",
        flush=True,
    )
    threads = {c: run_threads(c.strategy, c.nproc, args.threads) for c, _ in configs}
    with tempfile.TemporaryDirectory(prefix="shardwise-scaling-") as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        measured = measure(args, [c for c, _ in configs], root)
    rows = []
    for config, base in configs:
        pred = predicted[config]
        row: dict[str, Any] = {"strategy": config.strategy, "nproc": config.nproc, "threads": threads[config], "global_batch": config.global_batch}
        row["baseline"] = base
        row.update({"samples_per_s": None, "step_s": None} | measured[config])
        row.update(pred)
        rows.append(row)
    speedups(rows)
    print()
    print(format_table(rows))
    for line in verdicts(rows):
        print(line)
    print(
        f"load average after the runs: {os.getloadavg()[0]:.2f} (1 min); samples/s: the median logged interval after step {args.warmup}; "
        "threads: each process's, as run / as the planner costs it (no more than the cores the load leaves free)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    if args.png:
        kind = "weak" if args.weak else "strong"
        write_png(rows, args.png, f"{source}: {kind} scaling, global batch {batch}{' x N' if args.weak else ''}, {os.cpu_count()} cores")
        print(f"wrote {args.png}")
    return 1 if any(r.get("error") for r in rows) else 0


__all__ = ["Config", "ScalingOptions", "format_table", "main", "parse_nproc", "predictions", "speedups", "steady_samples_per_s"]
