"""``shardwise plan --calibrate``: measure this machine and write the ``cpu`` device profile.

Three measurements, each fitted and its error reported in the profile file:

1. **Collectives** on 2 processes (`shardwise.launch`, gloo over loopback): every allreduce
   algorithm of `shardwise.comm.algorithms` and the library's own allreduce, all-gather and
   broadcast, over message sizes from 1 KB to 8 MB. Each is fitted to the alpha-beta model
   (Hockney 1994; Thakur et al. 2005) ``time = alpha rounds + beta bytes_sent``, with rounds and
   bytes from `shardwise.comm.traffic` (our algorithms) or the ring schedule's counts (library
   collectives). The fit is non-negative least squares on relative error (each size weighs
   alike). **Alpha is checked**: a fitted alpha below ``ALPHA_FLOOR_S`` (a loopback round cannot
   take less than a microsecond, so such an alpha means the fit traded latency for bandwidth) is
   replaced by the smallest message's time per round, measured directly, and beta is refitted
   with that alpha fixed. Each fit reports its median and worst relative error.
2. **Compute**: the FLOP/s of fp32 matmuls (``2 n^3`` FLOPs) at training-sized shapes
   (n = 64 ... 512), one thread per process as the trainer runs with 2 processes on this
   machine; the median is the profile's ``flops["32"]`` with ``efficiency`` 1.0.
3. **Step overhead**: the seconds one training step of the `Trainer` costs beyond its FLOPs
   (a one-parameter model on ``single``): launch, Python, the loader, the optimizer's call.
4. **Runtime baseline**: the peak resident memory of a fresh interpreter that imported torch,
   transformers and shardwise (``runtime_baseline_bytes``), the floor of each process's predicted
   peak (`shardwise.strategies.cost.peak`); ``--calibrate --only baseline`` measures it alone.

The result is a JSON `DeviceProfile` (`shardwise.strategies.cost.cluster`) that ``--device PATH`` reads.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.errors import ConfigError
from shardwise.strategies.cost.cluster import PROFILES_DIR, profile_from_mapping

ALPHA_FLOOR_S = 1e-6
"""The smallest latency per round accepted from a fit (seconds)."""
BETA_FLOOR = 1e-13
"""The smallest seconds per byte accepted (10 TB/s): a fit with no bandwidth term is refitted."""
SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20]


def nnls_fit(rounds: list[float], sent: list[float], times: list[float]) -> dict[str, float]:
    """``alpha, beta`` with ``time = alpha rounds + beta sent``, non-negative, relative error minimized.

    Returns alpha, beta, the median and worst relative error, and whether alpha was fixed from
    the smallest message (see the module docstring).

    >>> f = nnls_fit([2, 2, 2], [1e3, 1e5, 1e7], [2e-5 + 1e-6, 2e-5 + 1e-4, 2e-5 + 1e-2])
    >>> round(f["alpha"] * 1e5, 3), round(f["beta"] * 1e9, 3)
    (1.0, 1.0)
    """
    r, s, t = (np.asarray(x, dtype=float) for x in (rounds, sent, times))
    a = np.stack([r / t, s / t], axis=1)
    # two unknowns: the least-squares solution, and the bound (alpha or beta at 0) when it is negative
    alpha, beta = (float(x) for x in np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0])
    fixed = False
    if alpha < ALPHA_FLOOR_S or beta <= 0:
        # the smallest message is nearly all latency: half its time per round, so bandwidth keeps a share
        i = int(np.argmin(s))
        alpha = max(ALPHA_FLOOR_S, float(t[i] / max(r[i], 1)) * 0.5)
        fixed = True
        rest = (t - alpha * r) / t
        beta = max(float(np.dot(s / t, rest) / np.dot(s / t, s / t)), BETA_FLOOR)
    rel = np.abs((alpha * r + beta * s) / t - 1)
    assert alpha >= ALPHA_FLOOR_S and beta > 0, (alpha, beta)
    return {"alpha": float(alpha), "beta": float(beta), "median_rel_error": float(np.median(rel)), "max_rel_error": float(rel.max()), "alpha_fixed": fixed}


def _time(fn: Any, reps: int = 5, iters: int = 5) -> float:
    from shardwise.comm.collectives import barrier

    out = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - start) / iters)
    return statistics.median(out)


def _measure_collectives(sizes: list[int]) -> list[dict[str, Any]] | None:
    """Runs on each of 2 ranks; rank 0 returns one row per (collective, size)."""
    import torch
    import torch.distributed as dist

    from shardwise.comm.algorithms import allreduce
    from shardwise.comm.collectives import all_gather, all_reduce, broadcast
    from shardwise.comm.p2p import Workspace
    from shardwise.comm.recorder import wire_bytes
    from shardwise.comm.traffic import ALGORITHMS, allreduce_traffic

    p, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for size in sizes:
        n = size // 4
        buf = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        runs: dict[str, tuple[Any, int, int]] = {}
        for alg in ALGORITHMS:
            if alg == "native":
                continue
            ws = Workspace()
            t = max((allreduce_traffic(alg, n, 4, p, k) for k in range(p)), key=lambda x: x.sent)
            runs[f"all_reduce/{alg}"] = (functools.partial(allreduce, buf, "sum", algorithm=alg, workspace=ws), t.steps, t.sent)
        runs["all_reduce"] = (functools.partial(all_reduce, buf, "sum"), 2 * (p - 1), wire_bytes("all_reduce", size, p)[0])
        runs["all_gather"] = (functools.partial(all_gather, buf), p - 1, wire_bytes("all_gather", size * p, p)[0])
        runs["broadcast"] = (functools.partial(broadcast, buf, 0), p - 1, size)
        for fn, _, _ in runs.values():
            fn()  # warm-up: connections and workspaces
        times = {name: _time(fn, iters=max(2, min(20, (4 << 20) // size))) for name, (fn, _, _) in runs.items()}
        stats = torch.tensor([times[k] for k in runs], dtype=torch.float64)
        all_reduce(stats, "max")
        for k, (name, (_, rounds, sent)) in enumerate(runs.items()):
            rows.append({"collective": name, "size_bytes": size, "rounds": rounds, "sent_bytes": sent, "time_s": float(stats[k])})
    return rows if rank == 0 else None


def measure_matmul_flops(sizes: tuple[int, ...] = (64, 128, 256, 512), threads: int = 1) -> dict[str, Any]:
    """fp32 matmul FLOP/s (``2 n^3`` per product) at each size, with ``threads`` threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per = {}
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            iters = max(3, int(2e8 // (2 * n**3)))
            torch.mm(a, b)
            best = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(iters):
                    torch.mm(a, b)
                best.append((time.perf_counter() - start) / iters)
            per[n] = 2 * n**3 / statistics.median(best)
    finally:
        torch.set_num_threads(old)
    return {"by_size": {str(k): v for k, v in per.items()}, "median": statistics.median(per.values()), "threads": threads}


def _mse(out: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(out, batch[1])


def _adam(params: Any) -> Any:
    import torch

    return torch.optim.Adam(params, lr=1e-3)


def measure_step_overhead(steps: int = 60) -> float:
    """Seconds per step of the Trainer on a one-parameter model (``single``, one process, one thread)."""
    import tempfile

    import torch

    from shardwise.trainer import Trainer, TrainerConfig

    data = torch.utils.data.TensorDataset(torch.randn(256, 1), torch.randn(256, 1))
    model = torch.nn.Linear(1, 1, bias=False)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as out:
            cfg = TrainerConfig(
                strategy="single", max_steps=steps, global_batch_size=8, log_every=10, out=out, accelerator="cpu", progress_bar=False, model_summary=False
            )
            trainer = Trainer(config=cfg, loss_fn=_mse, optimizer=_adam)
            trainer.fit(model, data)
            rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    finally:
        torch.set_num_threads(old)
    rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r][1:]
    return statistics.median(8 / r for r in rates)


BASELINE_IMPORTS = (
    "import torch, shardwise, shardwise.trainer, shardwise.launcher.memory\ntry:\n    from transformers import PreTrainedModel\nexcept ImportError:\n    pass\n"
)
"""What the baseline process imports: torch, shardwise's trainer, and transformers' modeling machinery
(``PreTrainedModel``: what any of its models loads, 120 MB beyond ``import transformers``, which is lazy)."""


def measure_runtime_baseline(repeats: int = 3) -> dict[str, Any]:
    """Peak resident memory of a fresh interpreter that imported torch, transformers (when installed) and
    shardwise's trainer: the floor every process of a run stands on (`shardwise.strategies.cost.peak`). The median
    of ``repeats`` fresh processes, each reading its own high-water mark (`shardwise.launcher.memory`)."""
    import subprocess
    import sys

    code = BASELINE_IMPORTS + "import json\nprint(json.dumps(shardwise.launcher.memory.host_memory()))\n"
    peaks = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        peaks.append(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"])
    return {"bytes": statistics.median(peaks), "runs": peaks, "imports": "torch, shardwise.trainer, transformers.PreTrainedModel"}


def calibrate(sizes: list[int] | None = None) -> dict[str, Any]:
    """Measure and fit; returns the profile as a JSON-ready mapping (with the raw rows and fit errors)."""
    from shardwise import launch
    from shardwise.tools.advisor.calibrate_framework import calibrate_framework

    rows = launch(_measure_collectives, sizes or SIZES, nproc=2, threads_per_proc=1)[0]
    profile = fit_profile(rows, measure_matmul_flops(), measure_step_overhead())
    baseline = measure_runtime_baseline()
    profile["runtime_baseline_bytes"] = baseline["bytes"]
    profile["calibration"]["runtime_baseline"] = baseline
    fits = calibrate_framework(profile_from_mapping(profile))
    profile["framework"] = {k: {n: f[n] for n in ("step_s", "per_unit_s", "per_param_s", "per_compute")} for k, f in fits.items()}
    profile["calibration"]["framework"] = fits
    profile_from_mapping(profile)
    return profile


def fit_profile(rows: list[dict[str, Any]], flops: dict[str, Any], overhead: float) -> dict[str, Any]:
    """The profile from measured rows (one per collective and size), matmul FLOP/s and step overhead."""
    fits: dict[str, dict[str, float]] = {}
    for name in sorted({r["collective"] for r in rows}):
        mine = [r for r in rows if r["collective"] == name]
        fits[name] = nnls_fit([r["rounds"] for r in mine], [r["sent_bytes"] for r in mine], [r["time_s"] for r in mine])
    ring = fits["all_reduce/ring"]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, os.cpu_count() or 1)
    profile = {
        "name": "cpu",
        "memory_bytes": memory,
        "flops": {"32": flops["median"], "64": flops["median"] / 2},
        "efficiency": 1.0,
        "memory_bandwidth": 5e9,
        "intra": {"alpha": ring["alpha"], "beta": ring["beta"]},
        "inter": {"alpha": ring["alpha"], "beta": ring["beta"]},
        "overlap": 0.0,
        "step_overhead_s": overhead,
        "local": True,
        "cores": os.cpu_count() or 1,
        "collectives": {k: {"alpha": v["alpha"], "beta": v["beta"]} for k, v in fits.items()},
        "source": (
            f"shardwise plan --calibrate on {platform.node()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()}), "
            f"{datetime.date.today().isoformat()}: gloo over loopback, 2 processes x 1 thread; memory is host memory / cores; "
            "memory_bandwidth 5 GB/s assumed; overlap 0 (gloo shares the cores with backward)"
        ),
        "calibration": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": "time_s = alpha_s * rounds + beta_s_per_byte * bytes_sent_per_rank (non-negative least squares on relative error)",
            "alpha_floor_s": ALPHA_FLOOR_S,
            "fits": fits,
            "matmul_flops": flops,
            "step_overhead_s": overhead,
            "rows": rows,
        },
    }
    profile_from_mapping(profile)  # the file must load as a profile
    return profile


def recalibrate(profile: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """``profile`` (a JSON mapping written by `calibrate`) with the strategy costs ``keys`` measured and
    fitted again (`calibrate_framework`, against the profile's own links and compute) and the rest kept;
    the calibration's record says which keys were refitted when."""
    from shardwise.tools.advisor.calibrate_framework import POINTS, calibrate_framework

    if "baseline" in keys:  # the runtime's own memory, not a strategy cost (`measure_runtime_baseline`)
        out = json.loads(json.dumps(profile))
        baseline = measure_runtime_baseline()
        out["runtime_baseline_bytes"] = baseline["bytes"]
        out.setdefault("calibration", {})["runtime_baseline"] = baseline
        rest = [k for k in keys if k != "baseline"]
        return recalibrate(out, rest) if rest else out
    unknown = [k for k in keys if k not in POINTS]
    if unknown or not keys:
        known = ", ".join([*POINTS, "baseline"])
        raise ConfigError(f"--calibrate --only takes strategy cost keys separated by ; (one of {known}); got {';'.join(keys) or 'none'}")
    if "framework" not in profile or "calibration" not in profile:
        raise ConfigError("--calibrate --only measures some strategy costs again in a profile measured here; this one has none: run --calibrate alone first")
    fits = calibrate_framework(profile_from_mapping(profile), keys)
    out = json.loads(json.dumps(profile))
    for k, f in fits.items():
        out["framework"][k] = {n: f[n] for n in ("step_s", "per_unit_s", "per_param_s", "per_compute")}
        out["calibration"].setdefault("framework", {})[k] = f
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out["calibration"].setdefault("refitted", []).append({"date": when, "keys": list(keys)})
    profile_from_mapping(out)
    return out


def cmd_calibrate(out: str | None, only: list[str] | None = None) -> int:
    """``shardwise plan --calibrate [--out FILE] [--only KEYS]``: measure, print the fits, write the profile
    (with ``only``: measure those strategy costs again in the profile at ``out``, `recalibrate`)."""
    path = Path(out) if out else PROFILES_DIR / "cpu.json"
    if only is not None:
        if not path.is_file():
            raise ConfigError(f"--calibrate --only updates an existing profile; {path} does not exist (give it with --out, or run --calibrate alone)")
        path.write_text(json.dumps(recalibrate(json.loads(path.read_text()), only), indent=1))
        print(f"wrote {path} ({', '.join(only)} measured again; the rest kept)")
        return 0
    profile = calibrate()
    cal = profile["calibration"]
    print(f"{'collective':28s} {'alpha (s)':>11s} {'beta (s/B)':>11s} {'GB/s':>7s} {'med err':>8s} {'max err':>8s}")
    for name, f in cal["fits"].items():
        mark = " (alpha from the smallest message)" if f["alpha_fixed"] else ""
        print(f"{name:28s} {f['alpha']:11.3e} {f['beta']:11.3e} {1e-9 / f['beta']:7.3g} {f['median_rel_error']:8.1%} {f['max_rel_error']:8.1%}{mark}")
    print(f"matmul fp32, 1 thread: {cal['matmul_flops']['median'] / 1e9:.3g} GFLOP/s (median of n = 64..512)")
    print(f"trainer step overhead: {cal['step_overhead_s'] * 1e3:.3g} ms")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1))
    print(f"wrote {path}")
    return 0
