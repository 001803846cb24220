"""``shardwise plan``: its flags, and what it prints and writes.

::

    shardwise plan --model charlm|digits|PATH.json|module:factory [--params 7.5e9] \\
                   --nproc 64 [--nodes 8] [--device cpu|h100-80gb|a100-40gb|custom.toml] \\
                   [--global-batch 512 (or --global-batch-size)] [--seq 2048] [--precision bf16-mixed] [--json out.json] [--png out.png]
    shardwise plan --calibrate [--out shardwise/strategies/cost/profiles/cpu.json]
    shardwise plan --validate --model digits --nproc 2 [--steps 20]

This module parses and prints; the work is in `candidates` (every candidate through its
strategy's ``plan``, costed by `shardwise.strategies.cost.estimate`), `recommend`, `calibrate` and `validate`.
Heavy imports happen inside `cmd_plan`, so ``shardwise --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.config import add_arguments, flag
from shardwise.errors import ConfigError

PLAN_HELP = "which strategy fits a model and a cluster, and what each candidate costs (memory, traffic, step time)"


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The flags of ``shardwise plan`` (`shardwise.config.flag`: each field's flag, default and help)."""

    model: str = flag("", "a recipe (charlm, digits), a Hugging Face config .json, or module:factory")
    data: str | None = flag(
        None, "with a module:factory --model that returns the module alone: its data (MODULE:FACTORY), whose first sample is the example input"
    )
    params: float | None = flag(None, "a parameter count instead of --model (e.g. 7.5e9): a GPT-shaped model")
    layers: int | None = flag(None, "with --params: transformer layers")
    hidden: int | None = flag(None, "with --params: hidden size")
    heads: int | None = flag(None, "with --params: attention heads")
    nproc: int | None = flag(None, "processes in the job (all nodes)")
    nodes: int = flag(1, "nodes the processes are spread over (default 1)")
    device: str | None = flag(
        None, "cpu (this machine, measured), h100-80gb, a100-40gb, or a profile .toml/.json (default: cpu for a recipe or module:factory, else h100-80gb)"
    )
    global_batch: int | None = flag(
        None,
        "samples per optimizer step over all ranks (default: the recipe's, else 512)",
        names=("--global-batch", "--global-batch-size"),  # train's and tune's name, which the strategies' messages give
    )
    accumulate: int = flag(1, "micro-batches each rank accumulates per step (default 1)")
    seq: int | None = flag(None, "sequence length for --params or a config .json (default 2048 / the config's)")
    precision: str | None = flag(None, "default: bf16-mixed on GPU profiles, 32 on cpu", choices=("32", "64", "bf16-mixed", "16-mixed"))
    optimizer: str = flag("adam", "optimizer state per parameter (default adam)", choices=("adam", "adamw", "sgd", "momentum"))
    unreliable: bool = flag(False, "workers are unreliable or slow: recommend asynchronous or local-update strategies")
    load: float | None = flag(
        None,
        "other work's runnable threads on this machine, which the planned processes share its cores with "
        "(default: sampled now from /proc/stat, else the 1-minute load average, when planning for this machine; 0 for another device); "
        "0 plans for a quiet machine",
    )
    all: bool = flag(False, "print every candidate, not only the 20 fastest that fit")
    json: str | None = flag(None, "write every candidate (and the recommendation) to this JSON file")
    png: str | None = flag(None, "write a picture of the candidates (memory per rank against step time; needs matplotlib)")
    calibrate: bool = flag(False, "measure this machine (collectives' alpha and beta, matmul FLOP/s) and write a profile")
    out: str | None = flag(None, "--calibrate: the profile file to write (default shardwise/strategies/cost/profiles/cpu.json)")
    validate: bool = flag(False, "run each candidate that fits here for a few steps and print predicted against measured")
    steps: int | None = flag(None, "--validate: steps per candidate (default: 30, or more for a short step, about 2 s of training each)")
    repeats: int = flag(1, "--validate: runs per candidate; its step time is their median (default 1)")
    only: str | None = flag(
        None,
        "--validate: candidate labels or strategy names to run, separated by ;  --calibrate: the strategy costs to "
        "measure again (keys of the profile's framework, such as 'local-sgd;diloco'), the rest of the profile (--out) kept",
    )


def plan_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shardwise plan``."""
    add_arguments(p, PlanOptions)


def si(n: float, unit: str = "B") -> str:
    """``1.5e9 -> '1.5 GB'`` (powers of 1000, as the ZeRO paper's GB)."""
    if n is None or not math.isfinite(n):
        return "-"
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            return f"{n:.3g} {prefix}{unit}"
        n /= 1000
    return f"{n:.3g} P{unit}"


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def table(records: list[dict[str, Any]], show_all: bool, limit: int = 20) -> str:
    fits = sorted((r for r in records if r["fits"]), key=lambda r: r["step_time_s"])
    shown = fits if show_all else fits[:limit]
    head = f"{'candidate':58s} {'mesh':>12s} {'mem/rank':>9s} {'state':>9s} {'activ.':>9s} {'comm/step':>10s} "
    head += f"{'step':>9s} {'compute':>9s} {'bubble':>8s} {'exp.comm':>9s}"
    lines = [head, "-" * len(head)]
    for r in shown:
        m, t = r["memory_breakdown"], r["time_breakdown"]
        mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1"
        mem = f"{si(r['memory_per_rank_bytes']):>9s} {si(m['model_state']):>9s} {si(m['activations']):>9s} {si(r['comm_bytes_per_step']):>10s}"
        times = f"{seconds(r['step_time_s']):>9s} {seconds(t['compute_s']):>9s} {seconds(t['bubble_s']):>8s} {seconds(t['exposed_comm_s']):>9s}"
        lines.append(f"{r['label'][:58]:58s} {mesh:>12s} {mem} {times}")
    if len(fits) > len(shown):
        lines.append(f"... {len(fits) - len(shown)} more that fit (--all, or --json for every candidate)")
    refused = [r for r in records if not r["fits"]]
    if refused:
        lines.append(f"{len(refused)} candidate(s) do not fit or are refused:")
        seen: set[str] = set()
        hidden = 0
        for r in refused:
            key = r["strategy"] + r["reason"][:40]
            if key in seen and not show_all:
                hidden += 1  # the same strategy refused for the same reason: one line stands for them
                continue
            seen.add(key)
            lines.append(f"  {r['label']:58s} {r['reason']}")
        if hidden:
            lines.append(f"  ... and {hidden} more, each refused as a line above of its strategy (--all lists every one)")
    return "\n".join(lines)


def write_png(records: list[dict[str, Any]], path: str, choice: str | None, title: str) -> None:
    """Memory per rank against step time, one point per candidate (refused ones hollow)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("the plan PNG needs matplotlib (pip install 'shardwise[plot]'); the table and --json need nothing") from None
    fig, ax = plt.subplots(figsize=(9, 6))
    families = sorted({r["strategy"] for r in records})
    cmap = plt.get_cmap("tab20")
    for i, fam in enumerate(families):
        rows = [r for r in records if r["strategy"] == fam and r["step_time_s"] > 0]
        for fits in (True, False):
            sel = [r for r in rows if r["fits"] == fits]
            if sel:
                ax.scatter(
                    [r["step_time_s"] for r in sel],
                    [r["memory_per_rank_bytes"] / 1e9 for r in sel],
                    label=fam if fits else None,
                    facecolors=cmap(i % 20) if fits else "none",
                    edgecolors=cmap(i % 20),
                    s=36,
                )
    mem = records[0].get("device_memory_bytes")
    if mem:
        ax.axhline(mem / 1e9, color="grey", linestyle="--", linewidth=1, label="device memory")
    best = next((r for r in records if r["label"] == choice), None)
    if best:
        ax.annotate(
            f"recommended: {best['label']}", (best["step_time_s"], best["memory_per_rank_bytes"] / 1e9), xytext=(10, 10), textcoords="offset points", fontsize=8
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("memory per rank (GB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _settings_and_cluster(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from shardwise.strategies.cost.cluster import Cluster, load_profile
    from shardwise.strategies.cost.estimate import Settings
    from shardwise.tools.advisor.candidates import planned_threads
    from shardwise.tools.advisor.forecast import machine_load
    from shardwise.tools.advisor.models import load_model
    from shardwise.tools.recipes import available, get_recipe

    if args.nproc is None:
        raise ConfigError("shardwise plan needs --nproc N (the processes of the job, e.g. --nproc 64 --nodes 8)")
    if not args.model and args.params is None:
        raise ConfigError("shardwise plan needs --model (charlm, digits, PATH.json, module:factory) or --params N (e.g. --params 7.5e9)")
    # A recipe or a module:factory is a real module here: its step is timed on this machine (a datasheet device would
    # cost it by FLOPs alone: a small model's step then reads nanoseconds, 1e4x below its own timed step); --validate
    # measures here too. A config .json or --params is planned for a datasheet device.
    factory = bool(args.model) and ":" in args.model and not args.model.endswith(".json")
    here = args.model in available() or factory or getattr(args, "validate", False)
    device = load_profile(args.device or ("cpu" if here else "h100-80gb"))
    cluster = Cluster(device, args.nproc, args.nodes, load=machine_load(args.load, device))
    batch = args.global_batch or (int(get_recipe(args.model).trainer_defaults["global_batch_size"]) if args.model in available() else 512)
    if batch < 1:
        raise ConfigError(f"--global-batch must be >= 1; got {batch}")
    # on a profile measured here, a real module's own step is timed here too (see plan.cost.local_compute)
    timed = batch if device.local else None
    one_process = not (getattr(args, "validate", False) and args.only and "single" not in args.only.split(";"))
    threads = planned_threads(cluster, one_process) if device.local else None  # each count a planned process runs, timed
    model = load_model(
        args.model,
        params=args.params,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        timed_batch=timed,
        threads=threads,
        data=getattr(args, "data", None),
    )
    if args.accumulate < 1:
        raise ConfigError(f"--accumulate must be >= 1; got {args.accumulate}")
    precision = args.precision or ("32" if device.name.startswith("cpu") else "bf16-mixed")
    return model, cluster, Settings(batch, precision, args.optimizer, args.accumulate)


def load_line(cluster: Any, records: list[dict[str, Any]], given: bool = False) -> str:
    """What the planner saw of this machine's cores and how it costs them: the load (other work's runnable threads),
    the threads a single process and each launched process run, and the stretch the sharing puts on the step."""
    import torch

    from shardwise.tools.advisor.candidates import own_threads
    from shardwise.tools.advisor.forecast import load_method

    cores, load = cluster.device.cores, cluster.load
    single = next((r for r in records if r["in_process"]), None)
    capped, default = own_threads(cluster), torch.get_num_threads()
    own = single["threads"] if single is not None else capped
    line = (
        f"cores: {cores}, load {load:.2f} (other work's runnable threads: {load_method(load if given else None)}); "
        f"one process runs {own} thread(s), each of {cluster.nproc} processes {cluster.threads_per_process}"
    )
    if own < default:
        if capped < default:
            why = (
                f"the load leaves {cluster.free_cores()} core(s) free, and a process with more threads than free cores waits at every "
                "operation for the descheduled ones"
            )
        else:
            why = (
                f"its step timed with {capped} threads was slower than with {own} (threads waiting on each other: a machine busier "
                "than its load says, or a step too small to share)"
            )
        line += f"; single is costed at {own} thread(s), not torch's {default}: {why} (run it with --threads {own}; OMP_NUM_THREADS={own} also works)"
    stretched = max((r["time_breakdown"].get("shared", 1.0) for r in records if r["fits"] and r["world_size"] == cluster.nproc), default=1.0)
    if load and stretched > 1:
        line += f"; the {cluster.nproc} processes share the cores with it: their steps take {stretched:.3g}x as long as the model's step timed now"
    elif single is not None and load:
        line += "; the cores are enough for the planned processes and the load: no stretch"
    return line


def _saves_memory(rec: dict[str, Any]) -> bool:
    """A record of `candidates.memory_savers`: activation checkpointing or CPU offload."""
    return rec.get("activation_checkpointing", "off") != "off" or bool(rec["options"].get("offload"))


def saver_note(rec: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """What a record's activation checkpointing or CPU offload (`candidates.memory_savers`) buys and costs against the
    same layout without them: how to ask for it, the memory per rank, and the step time the recompute and the copies add."""
    ac, offload = rec.get("activation_checkpointing", "off") != "off", bool(rec["options"].get("offload"))
    if not ac and not offload:
        return ""
    plain_options = {k: v for k, v in rec["options"].items() if k != "offload"}
    plain = next(
        (r for r in records if r["strategy"] == rec["strategy"] and r["options"] == plain_options and r.get("activation_checkpointing", "off") == "off"),
        None,
    )
    t = rec["time_breakdown"]
    asks, costs = [], []
    if ac:
        asks.append(f"--activation-checkpointing {rec['activation_checkpointing']}")
        costs.append(f"recompute {seconds(t.get('recompute_s', 0.0))} (one more forward of the checkpointed blocks)")
    if offload:
        asks.append("--offload")
        costs.append(f"host copies {seconds(t.get('offload_s', 0.0))} (parameters in and gradients out over the host link; the optimizer steps on the CPU)")
    against = (
        f" than {plain['label']}'s {seconds(plain['step_time_s'])}, which needs {si(plain['memory_per_rank_bytes'])} per rank" if plain is not None else ""
    )
    return (
        f"fits only with {' and '.join(asks)}: {si(rec['memory_per_rank_bytes'])} per rank; the step takes "
        f"{seconds(rec['step_time_s'] - plain['step_time_s']) if plain is not None else seconds(rec['step_time_s'])} "
        f"{'longer' if plain is not None else ''}{against}: {', '.join(costs)}"
    )


_ACCUMULATIONS_TRIED = 24


def fits_with_accumulation(model: Any, cluster: Any, settings: Any) -> str:
    """What to do when nothing fits, found by planning again: with each rank's batch split into 2, 4, 8, ...
    micro-batches (activations are held for one at a time; each accumulation that divides the global batch), the first accumulation at which a candidate
    fits, and the fastest candidate then; or, when none fits even at one sample per micro-batch, more
    processes or a bigger device."""
    from dataclasses import replace

    from shardwise.tools.advisor.candidates import plan_all

    # Every accumulation that divides the global batch, smallest first (each plan is a few ms of formulas
    # per candidate); a capped search says so rather than claim that nothing fits.
    steps = [a for a in range(settings.accumulate + 1, settings.global_batch + 1) if settings.global_batch % a == 0]
    for accumulate in steps[:_ACCUMULATIONS_TRIED]:
        planned = plan_all(model.spec, cluster, replace(settings, accumulate=accumulate), model.module)
        again = [r for r in planned if r["fits"] and not _saves_memory(r)]  # plain layouts: smaller micro-batches instead
        if again:
            best = min(again, key=lambda r: r["step_time_s"])
            return (
                f"With --accumulate {accumulate} (micro-batches {accumulate / settings.accumulate:.3g}x smaller) {len(again)} candidate(s) fit, "
                f"the fastest {best['label']} at {si(best['memory_per_rank_bytes'])} per rank: run plan again with --accumulate {accumulate}"
            )
    if len(steps) > _ACCUMULATIONS_TRIED:
        last = steps[_ACCUMULATIONS_TRIED - 1]
        return f"Nothing fits with --accumulate up to {last} either: more processes (--nproc), or a device with more memory (--device)"
    return "Nothing fits at any accumulation either: more processes (--nproc) to shard the model state over, or a device with more memory (--device)"


def _source(args: argparse.Namespace) -> str:
    """How ``shardwise train`` is told the planned model: a recipe, a module's factory, else a placeholder (a spec or
    --params is a size, not a model to train)."""
    from shardwise.tools.recipes import available

    if args.model in available():
        return f"--recipe {args.model}"
    return f"--model {args.model if args.model and ':' in args.model else 'MODULE:FACTORY'}"


def _settings_flags(args: argparse.Namespace) -> list[str]:
    """The plan's settings that a run must be given too (those the user set)."""
    flags = ["--global-batch-size", str(args.global_batch)] if args.global_batch else []
    flags += ["--precision", args.precision] if args.precision else []
    return flags + (["--accumulate", str(args.accumulate)] if args.accumulate > 1 else [])


def cmd_plan(args: argparse.Namespace) -> int:
    """Run ``shardwise plan`` (or ``--calibrate`` / ``--validate``)."""
    if args.calibrate:
        from shardwise.tools.advisor.calibrate import cmd_calibrate

        return cmd_calibrate(args.out, args.only.split(";") if args.only else None)
    model, cluster, settings = _settings_and_cluster(args)
    if args.validate:
        from shardwise.tools.advisor.validate import cmd_validate

        return cmd_validate(args, model, cluster, settings)
    from shardwise.tools.advisor.candidates import plan_all
    from shardwise.tools.advisor.recommend import recommend, run_command

    records = plan_all(model.spec, cluster, settings, model.module)
    for r in records:
        r["device_memory_bytes"] = cluster.device.memory_bytes
    advice = recommend(records, model.spec, cluster, settings, unreliable=args.unreliable)
    if advice["choice"] is None:
        advice["why"] += ". " + fits_with_accumulation(model, cluster, settings)
    elif _saves_memory(advice["choice_record"]) and not any(r["fits"] and not _saves_memory(r) for r in records):
        # the alternative that costs no recompute or host copies: smaller micro-batches, where they are enough
        advice["why"] += ". Without activation checkpointing or offload: " + fits_with_accumulation(model, cluster, settings)
    spec = model.spec
    print(
        f"model {spec.name}: {si(spec.params, '')} parameters, {spec.layers} layers, hidden {spec.hidden}, seq {spec.seq}, "
        f"{si(spec.flops_per_sample, 'FLOP')} per sample (forward + backward)"
    )
    dev = cluster.device
    print(
        f"cluster: {cluster.nproc} processes on {cluster.nodes} node(s), {dev.name}: {si(dev.memory_bytes)}, "
        f"{si(dev.flops_for(settings.precision) * dev.efficiency, 'FLOP/s')} sustained; "
        f"global batch {settings.global_batch} (accumulate {settings.accumulate}), precision {settings.precision}, {settings.optimizer}"
    )
    if dev.cores:
        print(load_line(cluster, records, given=args.load is not None))
    print(table(records, args.all))
    rec = advice["choice_record"]
    if rec:
        advice["run"] = run_command(rec, _source(args), _settings_flags(args), cores_here=bool(dev.cores) and cluster.nodes == 1)
    print(f"recommendation: {advice['choice'] or 'none fits'}  ({advice['why']})" + (f"; run it: {advice['run']}" if rec else ""))
    if rec:
        m, t = rec["memory_breakdown"], rec["time_breakdown"]
        print(
            f"  memory per rank {si(m['total'])}: params {si(m['params'])}, grads {si(m['grads'])}, optimizer {si(m['optimizer'])}, "
            f"activations {si(m['activations'])}, buffers {si(m['buffers'])}; sends {si(rec['comm_bytes_per_step'])} per step; "
            f"step {seconds(t['step_s'])} = compute {seconds(t['compute_s'])} + bubble {seconds(t['bubble_s'])} + optimizer {seconds(t['optimizer_s'])} "
            f"+ exposed comm {seconds(t['exposed_comm_s'])} + overhead {seconds(t['overhead_s'])}"
            + (f" + host copies {seconds(t['offload_s'])}" if t.get("offload_s") else "")
        )
    if rec and (saving := saver_note(rec, records)):
        print(f"  {saving}")
    if advice["fastest"] and advice["fastest"] != advice["choice"]:
        print(f"  fastest multi-process candidate that fits: {advice['fastest']}")
    if args.json:
        out = {
            "model": spec.to_json(),
            "cluster": {
                "nproc": cluster.nproc,
                "nodes": cluster.nodes,
                "device": dev.to_json(),
                "load": cluster.load,
                "cores": dev.cores,
                "threads_per_process": cluster.threads_per_process,
            },
            "settings": {
                "global_batch": settings.global_batch,
                "accumulate": settings.accumulate,
                "precision": settings.precision,
                "optimizer": settings.optimizer,
            },
            "recommendation": {k: v for k, v in advice.items() if k != "choice_record"},
            "candidates": records,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json} ({len(records)} candidates)")
    if args.png:
        write_png(records, args.png, advice["choice"], f"{spec.name} on {cluster.nproc} x {dev.name}, batch {settings.global_batch}")
        print(f"wrote {args.png}")
    return 0
