"""``shardwise bench comm``: our allreduce algorithms and codecs against the backend's own allreduce.

::

    shardwise bench comm --nproc 2 --sizes 1KB,64KB,1MB,64MB --json comm.json

For each message size (1 KB to 64 MB by default) it times every algorithm and
codec side by side in one launch (interleaved repetitions, the median kept, so
a noisy neighbour hits them all alike) and prints, per row:

- ``time``: seconds per allreduce, the slowest rank's mean over back-to-back iterations;
- ``algbw = size / time`` and ``busbw = algbw x 2(p-1)/p``, as nccl-tests defines
  them for allreduce (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md),
  in GB/s (10^9 bytes per second);
- ``ratio_to_native``: time over the backend allreduce's time at the same size;
- ``bytes_sent_per_rank`` and ``steps``: what the `Recorder` counted (the largest
  over ranks; steps are null for native, whose schedule is hidden); for codecs
  also ``bytes_vs_fp32_ring``, the uncompressed ring's bytes over the codec's.

``--json FILE`` writes the rows as a JSON list. Every run also fits the
alpha-beta model of Hockney (1994), as Thakur, Rabenseifner & Gropp (2005) use
it, to our point-to-point algorithms: ``time = alpha x steps + beta x
bytes_sent_per_rank`` (largest over ranks), weighted least squares on relative
error, plus ``latency + seconds_per_byte x size`` per algorithm; it is saved as
JSON (``--fit FILE``, default ``comm_fit.json``) for a planner to read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.config import add_arguments, flag
from shardwise.errors import ConfigError

DEFAULT_SIZES = "1KB,4KB,16KB,64KB,256KB,1MB,4MB,16MB,64MB"
DEFAULT_CODECS = "fp16,bf16,int8,topk:0.01,randomk:0.01,sign"
_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """'64MB' -> 67108864 (binary units, as nccl-tests: 1 KB = 1024 bytes); a bare number is bytes."""
    t = text.strip().upper().replace("IB", "B")
    for unit in ("GB", "MB", "KB", "B"):
        if t.endswith(unit):
            number = t[: -len(unit)]
            break
    else:
        number, unit = t, "B"
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ConfigError(f"cannot read size {text!r}; write it as 4096, 64KB or 16MB") from None
    if value < 1 or value != int(value):
        raise ConfigError(f"size {text!r} must be a whole number of bytes >= 1")
    return int(value)


def _iters(size: int) -> int:
    # About 8 MB of traffic per timed chunk, at least 3 and at most 100 iterations.
    return max(3, min(100, (8 << 20) // size))


def _measure(algorithms: list[str], codecs: list[str], sizes: list[int], dtype_name: str, reps: int, iters: int | None) -> list[dict[str, Any]] | None:
    """Runs on every rank; rank 0 returns the rows."""
    import torch
    import torch.distributed as dist

    from shardwise.comm.algorithms import allreduce
    from shardwise.comm.codecs import Codec, CodecState, get_codec
    from shardwise.comm.collectives import all_reduce, barrier
    from shardwise.comm.compressed import compressed_allreduce
    from shardwise.comm.p2p import Workspace
    from shardwise.comm.recorder import Recorder
    from shardwise.comm.traffic import allreduce_traffic

    dtype = getattr(torch, dtype_name)
    p, rank = dist.get_world_size(), dist.get_rank()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows: list[dict[str, Any]] = []
    for size in sizes:
        n = max(1, size // itemsize)
        src = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dtype)
        buf = src.clone()
        runs: dict[str, Any] = {}
        for algo in algorithms:
            ws = Workspace()
            runs[algo] = (lambda b, a, w: lambda rec=None: allreduce(b, "sum", algorithm=a, recorder=rec, workspace=w))(buf, algo, ws)
        for spec in codecs:
            # One seed on every rank: random-k draws the same indices everywhere (shared randomness).
            codec, state, ws = get_codec(spec), CodecState(seed=0), Workspace()
            assert isinstance(codec, Codec)  # main() turned powersgd away
            runs[f"compressed:{codec.spec}"] = (lambda b, c, st, w: lambda rec=None: compressed_allreduce(b, c, st, op="sum", recorder=rec, workspace=w))(
                buf, codec, state, ws
            )
        # Rounds inside the backend's allreduce are hidden: native, and the 16-bit casts that ride on it.
        hidden = {"native"} | {f"compressed:{s}" for s in codecs if get_codec(s).exchange == "allreduce"}
        counted: dict[str, tuple[int, int, int]] = {}
        for name, run in runs.items():  # warm-up: connections, workspaces, and one recorded call
            buf.copy_(src)
            rec = Recorder()
            run(rec)
            (tot,) = rec.totals().values()
            counted[name] = (int(tot["sent_bytes"]), int(tot["received_bytes"]), int(tot["steps"]))
        count = iters or _iters(n * itemsize)
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(reps):
            for name, run in runs.items():
                buf.copy_(src)  # values stay bounded over the timed iterations
                barrier()
                start = time.perf_counter()
                for _ in range(count):
                    run()
                samples[name].append((time.perf_counter() - start) / count)
        names = list(runs)
        stats = torch.tensor([[statistics.median(samples[k]), *counted[k]] for k in names], dtype=torch.float64)
        all_reduce(stats, "max")  # the slowest rank, the busiest rank
        native_time = stats[names.index("native"), 0].item() if "native" in names else float("nan")
        ring_bytes = allreduce_traffic("ring", n, itemsize, p, 0).sent
        nbytes = n * itemsize
        for k, name in enumerate(names):
            t, sent, received, steps = stats[k].tolist()
            algbw = nbytes / t / 1e9
            row = {
                "algorithm": name,
                "kind": "compressed" if name.startswith("compressed:") else "allreduce",
                "world_size": p,
                "size_bytes": nbytes,
                "dtype": dtype_name,
                "bytes_sent_per_rank": int(sent),
                "bytes_received_per_rank": int(received),
                "steps": None if name in hidden else int(steps),
                "time_s": t,
                "algbw": algbw,
                "busbw": algbw * 2 * (p - 1) / p,
                "ratio_to_native": t / native_time,
                "iters": count,
                "reps": reps,
            }
            if row["kind"] == "compressed":
                row["bytes_vs_fp32_ring"] = ring_bytes / sent if sent else None
            rows.append(row)
    return rows if rank == 0 else None


def _wls(columns: list[list[float]], y: list[float]) -> tuple[list[float], float]:
    """Non-negative weighted least squares on relative error (a small, exact two-parameter solve)."""
    import numpy as np

    a = np.array(columns, dtype=float).T / np.array(y)[:, None]
    b = np.ones(len(y))
    coef = np.linalg.lstsq(a, b, rcond=None)[0]
    if (coef < 0).any():  # drop the negative term and refit the other one
        keep = int(np.argmax(coef))
        coef = np.zeros_like(coef)
        coef[keep] = np.linalg.lstsq(a[:, [keep]], b, rcond=None)[0][0]
    rel = np.abs(a @ coef - 1)
    return [float(c) for c in coef], float(rel.max())


def fit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Alpha (s per round) and beta (s per byte sent) from our point-to-point algorithms' rows."""
    ours = [r for r in rows if r["kind"] == "allreduce" and r["algorithm"] != "native"]
    out: dict[str, Any] = {
        "model": "time_s = alpha_s * steps + beta_s_per_byte * bytes_sent_per_rank (largest over ranks)",
        "fitted_on": sorted({r["algorithm"] for r in ours}),
        "world_size": rows[0]["world_size"] if rows else None,
        "dtype": rows[0]["dtype"] if rows else None,
        "host": platform.node(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if len(ours) >= 2:
        (alpha, beta), worst = _wls([[r["steps"] for r in ours], [r["bytes_sent_per_rank"] for r in ours]], [r["time_s"] for r in ours])
        out.update(alpha_s=alpha, beta_s_per_byte=beta, bandwidth_bytes_per_s=1 / beta if beta else None, max_relative_error=worst)
    per: dict[str, Any] = {}
    for name in sorted({r["algorithm"] for r in rows}):
        mine = [r for r in rows if r["algorithm"] == name]
        if len(mine) >= 2:
            (lat, spb), worst = _wls([[1.0] * len(mine), [r["size_bytes"] for r in mine]], [r["time_s"] for r in mine])
            per[name] = {"latency_s": lat, "seconds_per_byte": spb, "max_relative_error": worst}
    out["per_algorithm"] = per
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return out


def _human(nbytes: float) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{int(nbytes)}B"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table."""
    head = (
        f"{'algorithm':24s} {'size':>7s} {'time':>11s} {'algbw GB/s':>10s} {'busbw GB/s':>10s} "
        f"{'x native':>8s} {'sent/rank':>11s} {'steps':>5s} {'vs fp32':>7s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r["time_s"]
        shown = f"{t * 1e3:8.3f} ms" if t >= 1e-3 else f"{t * 1e6:8.1f} us"
        saving = f"{r['bytes_vs_fp32_ring']:6.1f}x" if r.get("bytes_vs_fp32_ring") else ""
        steps = "-" if r["steps"] is None else str(r["steps"])
        lines.append(
            f"{r['algorithm']:24s} {_human(r['size_bytes']):>7s} {shown:>11s} {r['algbw']:10.3f} {r['busbw']:10.3f} "
            f"{r['ratio_to_native']:8.3f} {r['bytes_sent_per_rank']:11d} {steps:>5s} {saving:>7s}"
        )
    return "\n".join(lines)


def _split(values: Sequence[str]) -> list[str]:
    return [v for chunk in values for v in chunk.split(",") if v]


@dataclass(frozen=True, kw_only=True)
class CommOptions:
    """``shardwise bench comm``'s flags (`shardwise.config.flag`: each field's flag, default and help)."""

    nproc: int = flag(2, "local processes (default 2)")
    algorithms: list[str] = flag(help="names (comma or space separated) or 'all' (default); native is always added", nargs="+", default_factory=lambda: ["all"])
    codecs: list[str] = flag(
        help=f"codecs to time as compressed allreduce, or 'none' (default {DEFAULT_CODECS})", nargs="+", default_factory=lambda: [DEFAULT_CODECS]
    )
    sizes: list[str] = flag(help=f"message sizes (default {DEFAULT_SIZES})", nargs="+", default_factory=lambda: [DEFAULT_SIZES])
    dtype: str = flag("float32", "element type of the messages (default float32)", choices=("float32", "float64", "float16", "bfloat16"))
    reps: int = flag(5, "interleaved repetitions per size; the median is kept (default 5)")
    iters: int | None = flag(None, "iterations per repetition (default: about 8 MB of traffic, 3 to 100)")
    json: str | None = flag(None, "write the rows as a JSON list", metavar="FILE")
    fit: str = flag("comm_fit.json", "where to save the alpha-beta fit (default comm_fit.json)", metavar="FILE")
    timeout: float = flag(3600.0, "stop the launch after this many seconds")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise bench comm", description=__doc__.split("\n\n")[0].strip("`: "))
    add_arguments(p, CommOptions)
    return p


def main(argv: Sequence[str]) -> int:
    """``shardwise bench comm``: measure, print the table, write the rows and the fit."""
    from shardwise.comm.algorithms import check_algorithm
    from shardwise.comm.codecs import PowerSGD, get_codec
    from shardwise.comm.traffic import ALGORITHMS
    from shardwise.launcher.spawn import launch

    args = build_parser().parse_args(list(argv))
    if args.nproc < 2:
        raise ConfigError(f"a communication benchmark needs --nproc >= 2; got {args.nproc}")
    if args.reps < 1 or (args.iters is not None and args.iters < 1):
        raise ConfigError(f"--reps and --iters must be >= 1; got {args.reps} and {args.iters}")
    names = _split(args.algorithms)
    algorithms = list(ALGORITHMS) if names == ["all"] else [check_algorithm(a) for a in names]
    if "native" not in algorithms:
        algorithms.append("native")  # every row's ratio is to native
    codec_names = [] if _split(args.codecs) == ["none"] else _split(args.codecs)
    for spec in codec_names:
        if isinstance(get_codec(spec), PowerSGD):
            raise ConfigError("powersgd compresses per weight matrix inside DDP's hook; it has no flat-buffer benchmark here. Drop it from --codecs")
    sizes = [parse_size(s) for s in _split(args.sizes)]
    print(f"shardwise bench comm: {args.nproc} processes, {args.dtype}, sizes {', '.join(_human(s) for s in sizes)}", flush=True)
    start = time.perf_counter()
    results = launch(_measure, algorithms, codec_names, sizes, args.dtype, args.reps, args.iters, nproc=args.nproc, timeout=args.timeout, threads_per_proc=1)
    rows = results[0]
    print(format_table(rows))
    model = fit(rows)
    if "alpha_s" in model:
        bandwidth = model["bandwidth_bytes_per_s"]
        # A fitted beta of 0 (sizes too small for bandwidth to show) has no bandwidth to print.
        bw = f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "no bandwidth term: add a larger size, e.g. 64MB"
        print(
            f"\nfit over {', '.join(model['fitted_on'])}: alpha = {model['alpha_s'] * 1e6:.1f} us per step, "
            f"beta = {model['beta_s_per_byte'] * 1e9:.3f} ns per byte ({bw}); "
            f"worst relative error {model['max_relative_error']:.0%}"
        )
    Path(args.fit).write_text(json.dumps(model, indent=2) + "\n")
    print(f"saved the fit to {args.fit}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0
