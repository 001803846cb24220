"""One GPT training step near the device's limit: shardwise's Trainer beside a hand-written loop, in one process.

The model is charlm's ``CharGPT`` (SDPA attention, pre-norm blocks) scaled up to GPT-2's shapes,
its output projection tied to the token embedding as GPT-2's is (``--size``):

======= ======= ====== ===== ====== ====== ======= ============================================
size    d_model layers heads block  vocab  batch   parameters
======= ======= ====== ===== ====== ====== ======= ============================================
small   128     2      4     64     512    8       ~0.5 M: the CPU size a test runs
125m    768     12     12    1024   50304  32      ~124 M: GPT-2 small
350m    1024    24     16    1024   50304  16      ~354 M: GPT-2 medium
======= ======= ====== ===== ====== ====== ======= ============================================

Both sides train the same model (same seed), the same random tokens (made in memory), the same batch
order (the Trainer's: epoch ``e``'s permutation seeded ``seed * 1_000_003 + e``) with the same optimizer:
bf16 autocast on CUDA (``precision="bf16-mixed"``), float32 on CPU; compiled (``Trainer(compile=...)``
against ``torch.compile(model)``); AdamW, fused on CUDA. ``shardwise`` is ``Trainer(strategy="single")``
run in this process (no launch); ``hand`` is the loop a careful user writes (nanoGPT's). They alternate
in ``--pairs`` pairs (A B, then B A). The model is compiled once before the pairs (its code generated:
``first compile``); each side's first run then starts from a reset Dynamo cache, so its compile seconds
are tracing again with the generated code found in the compiler's caches, alike for both (later runs
reuse the compiled graph).

Timing: the first ``--warmup`` steps (compile included) are left out on both sides; the clock reads
after a device synchronisation at the end of step ``warmup`` and of the last step, so step time is
the mean of the steady steps. Reported per side: tokens/s; MFU by the benchmark's own count (PaLM,
Chowdhery et al. 2022, appendix B: ``6 N + 12 L d T`` FLOPs per token for forward and backward, N
the parameters that multiply (the tied embedding counted once, as the output projection; the position
table left out), the attention term over the full T x T score matrix as PaLM and nanoGPT count it),
against the device's peak: a published dense figure for the GPU (``PEAKS``; ``--peak-tflops``
overrides) or, on CPU, a matmul of this machine timed here at the run's threads; shardwise's own
``summary["mfu"]`` beside it where the Trainer reports one; the step-time ratio shardwise/hand (median
of the pairs and their range); compile seconds (Dynamo's own count, as the Trainer's); peak memory
(``torch.cuda.max_memory_allocated`` on CUDA, else the process's VmHWM, reset before each run through
``/proc/self/clear_refs``); and whether the two sides' per-step losses agree.

    python benchmarks/gpu_step.py --size 125m                     # CUDA: bf16-mixed, Inductor, fused AdamW
    python benchmarks/gpu_step.py --size small --device cpu --compile-backend aot_eager --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIZES: dict[str, dict[str, int]] = {
    "small": {"d_model": 128, "layers": 2, "heads": 4, "block": 64, "vocab": 512, "batch": 8},
    "125m": {"d_model": 768, "layers": 12, "heads": 12, "block": 1024, "vocab": 50304, "batch": 32},
    "350m": {"d_model": 1024, "layers": 24, "heads": 16, "block": 1024, "vocab": 50304, "batch": 16},
}
PEAKS: dict[str, dict[str, float]] = {
    # dense tensor-core figures of the datasheets (no sparsity); float32 the non-tensor figure
    "H200": {"bf16-mixed": 989e12, "32": 67e12},  # NVIDIA H200 SXM datasheet (2024)
    "H100": {"bf16-mixed": 989e12, "32": 67e12},  # NVIDIA H100 SXM5 datasheet (2023)
    "A100": {"bf16-mixed": 312e12, "32": 19.5e12},  # NVIDIA A100 SXM4 datasheet (2021)
}
LOG_EVERY = 10
LR = 3e-4
LOSS_RTOL = {"32": 1e-4, "bf16-mixed": 2e-2}
"""How far apart the two sides' per-step losses may be (relative): float32 round-off of the same kernels
in another order; bf16 autocast rounds each matmul to 8 bits of mantissa."""


# ---------------------------------------------------------------- settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from shardwise.errors import ConfigError

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="125m")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda where there is one")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), default=None, help="default: bf16-mixed on CUDA, 32 on CPU")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the size's)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 50 on CUDA, 12 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of the timing (default 10 on CUDA, 4 on CPU)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved (shardwise, hand) pairs")
    p.add_argument("--compile", choices=("on", "off"), default="on")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's own)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak TFLOP/s, for a device PEAKS does not know")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows and the settings here")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda, but this torch sees no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine or pass --device cpu"
        )
    cuda = args.device == "cuda"
    args.precision = args.precision or ("bf16-mixed" if cuda else "32")
    args.steps = args.steps if args.steps is not None else (50 if cuda else 12)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 4)
    args.batch = args.batch if args.batch is not None else SIZES[args.size]["batch"]
    if args.warmup < 1 or args.steps < args.warmup + 2:
        raise ConfigError(
            f"--steps must exceed --warmup by at least 2 and --warmup be >= 1 (compile happens in step 1); got --steps {args.steps} --warmup {args.warmup}"
        )
    for name in ("pairs", "batch", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be >= 1; got {value}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ConfigError(f"--peak-tflops must be > 0; got {args.peak_tflops}")
    return args


# ---------------------------------------------------------------- the model, the data, the FLOPs


def build_model(shape: dict[str, int], seed: int) -> nn.Module:
    """charlm's CharGPT at ``shape``, its output projection tied to the token embedding (GPT-2)."""
    from shardwise.tools.recipes.charlm import CharGPT

    torch.manual_seed(seed)
    model = CharGPT(shape["vocab"], shape["block"], shape["d_model"], shape["heads"], shape["layers"])
    model.head.out.weight = model.embed.tok.weight
    return model


def matmul_params(model: Any) -> int:
    """N of ``6 N``: every parameter once, less the position table (a lookup, not a product); the token
    table stays, being the output projection's weight too."""
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    return total - model.embed.pos.weight.numel()


def flops_per_token(n: int, shape: dict[str, int]) -> float:
    """Forward + backward FLOPs per token (PaLM appendix B): ``6 N + 12 L d T``."""
    return 6.0 * n + 12.0 * shape["layers"] * shape["d_model"] * shape["block"]


def make_data(shape: dict[str, int], samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token windows (inputs, next-token targets), on the CPU like a dataset's."""
    ids = torch.randint(0, shape["vocab"], (samples, shape["block"] + 1), generator=torch.Generator().manual_seed(seed + 1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(params: Any, cuda: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)


def peak_flops(args: argparse.Namespace) -> tuple[float | None, str]:
    """(peak FLOP/s of one device at the run's precision, where the figure comes from)."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        for key, figures in PEAKS.items():
            if key in name:
                return figures[args.precision], f"{key} datasheet, {args.precision}"
        return None, f"no peak figure for {name}: pass --peak-tflops"
    return measured_cpu_peak(), f"measured: float32 matmul at {torch.get_num_threads()} threads"


def measured_cpu_peak(sizes: tuple[tuple[int, int], ...] = ((512, 40), (1024, 8))) -> float:
    """This CPU's float32 matmul FLOP/s at the current thread count: the fastest of many timed products
    (``(n, repeats)`` each; the best, because on a shared machine other work only ever slows one down)."""
    best = 0.0
    for n, repeats in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    return best


# ---------------------------------------------------------------- one run of either side


@dataclass
class Run:
    side: str
    step_s: float = math.nan
    losses: list[float] = field(default_factory=list)
    compile_s: float = 0.0
    peak_bytes: int = 0
    summary_mfu: float | None = None


class Clock:
    """Per-step losses (kept on the device: no read per step) and the steady window's two clock readings."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.warmup, self.steps, self.device = warmup, steps, device
        self.losses: list[torch.Tensor] = []
        self.start = self.end = math.nan

    def step_end(self, step: int, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach().float().reshape(()))
        if step in (self.warmup, self.steps):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.start, self.end = (now, self.end) if step == self.warmup else (self.start, now)

    def into(self, run: Run) -> Run:
        run.step_s = (self.end - self.start) / (self.steps - self.warmup)
        run.losses = torch.stack(self.losses).tolist()
        return run


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # 5: reset the peak resident set (Linux >= 4.0); elsewhere the process's peak
        Path("/proc/self/clear_refs").write_text("5")


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    from shardwise.launcher.memory import host_memory

    return int(host_memory()["peak_bytes"] or 0)


def batch_order(samples: int, batch: int, steps: int, seed: int) -> Any:
    """The Trainer's batch order, written out: epoch ``e`` a permutation seeded ``seed * 1_000_003 + e``."""
    step, epoch = 0, 0
    while True:
        perm = torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for i in range(samples // batch):
            yield perm[i * batch : (i + 1) * batch]
            step += 1
            if step == steps:
                return
        epoch += 1


def hand(args: argparse.Namespace, shape: dict[str, int], data: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> Run:
    """The loop a careful user writes: compiled model, autocast, fused AdamW, the loss read every LOG_EVERY steps."""
    cuda = device.type == "cuda"
    model = build_model(shape, args.seed).to(device)
    step_model = torch.compile(model, backend=args.compile_backend) if args.compile == "on" else model
    optimizer = make_optimizer(model.parameters(), cuda)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else contextlib.nullcontext()
    clock = Clock(args.warmup, args.steps, device)
    x, y = data
    model.train()
    for step, idx in enumerate(batch_order(len(x), args.batch, args.steps, args.seed), start=1):
        xb, yb = x[idx].to(device), y[idx].to(device)
        with autocast:
            loss = lm_loss(step_model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            loss.item()  # what a loop that prints its loss waits for
        clock.step_end(step, loss)
    return clock.into(Run("hand"))


def ours(args: argparse.Namespace, shape: dict[str, int], data: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> Run:
    """``shardwise.Trainer(strategy="single")`` in this process on the same work; its own lines kept out of the table."""
    from torch.utils.data import TensorDataset

    import shardwise
    from shardwise.trainer.callbacks import Callback

    clock = Clock(args.warmup, args.steps, device)

    class StepEnd(Callback):
        def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: Any) -> None:
            clock.step_end(step, loss)

    trainer = shardwise.Trainer(
        strategy="single",
        accelerator=device.type,
        precision=args.precision,
        compile=f"on:{args.compile_backend}" if args.compile == "on" else "off",
        global_batch_size=args.batch,
        max_steps=args.steps,
        log_every=LOG_EVERY,
        seed=args.seed,
        threads=args.threads,
        optimizer=lambda params: make_optimizer(params, device.type == "cuda"),
        loss_fn=lambda logits, batch: lm_loss(logits, batch[1]),
        callbacks=[StepEnd()],
        progress_bar=False,
        model_summary=False,
        announce_outputs=False,
    )
    quiet = io.StringIO()  # the Trainer's log lines would break up the table
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        summary = trainer.fit(build_model(shape, args.seed), TensorDataset(*data))
    run = clock.into(Run("shardwise"))
    run.summary_mfu = summary.get("mfu")
    return run


def timed(side: str, args: argparse.Namespace, shape: dict[str, int], data: Any, device: torch.device, cold: bool) -> Run:
    """One run of ``side`` with its compile seconds (Dynamo's count) and peak memory; ``cold``: compiler caches reset first."""
    from shardwise.strategies.compiling import compile_seconds

    if cold:
        torch._dynamo.reset()
    reset_peak(device)
    before = compile_seconds()
    run = (ours if side == "shardwise" else hand)(args, shape, data, device)
    run.compile_s = compile_seconds() - before
    run.peak_bytes = peak_bytes(device)
    return run


# ---------------------------------------------------------------- pairs, rows, table


def first_compile(args: argparse.Namespace, shape: dict[str, int], data: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> float:
    """Seconds of the model's first compile in this process (one forward and backward, as the sides run it):
    the code generation both sides' compiles then find in the compiler's caches, so neither pays it alone."""
    from shardwise.strategies.compiling import compile_seconds

    if args.compile != "on":
        return 0.0
    before = compile_seconds()
    model = build_model(shape, args.seed).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else contextlib.nullcontext()
    x, y = (t[: args.batch].to(device) for t in data)
    with autocast:
        loss = lm_loss(torch.compile(model, backend=args.compile_backend)(x), y)
    loss.backward()
    del model, loss
    return compile_seconds() - before


def run_pairs(args: argparse.Namespace, shape: dict[str, int], device: torch.device) -> tuple[float, list[dict[str, Run]]]:
    """The first compile's seconds, and ``--pairs`` interleaved pairs (A B, then B A); each side's first run
    from a reset Dynamo cache (its compile: tracing again, the generated code from the compiler's caches)."""
    data = make_data(shape, args.batch * args.steps, args.seed)
    first = first_compile(args, shape, data, device)
    pairs = []
    for i in range(args.pairs):
        got = {}
        for side in ("shardwise", "hand") if i % 2 == 0 else ("hand", "shardwise"):
            got[side] = timed(side, args, shape, data, device, cold=i == 0)
            print(
                f"  pair {i + 1}/{args.pairs} {side:>9}: {got[side].step_s * 1e3:9.2f} ms/step  compile {got[side].compile_s:.1f}s", file=sys.stderr, flush=True
            )
        pairs.append(got)
    return first, pairs


def loss_gap(pairs: list[dict[str, Run]]) -> float:
    """The largest relative difference between the two sides' losses at the same step, over every pair."""
    gap = 0.0
    for p in pairs:
        a, b = p["shardwise"].losses, p["hand"].losses
        if len(a) != len(b):
            return math.inf
        gap = max([gap, *(abs(u - v) / max(abs(v), 1e-12) for u, v in zip(a, b, strict=True))])
    return gap


def rows(
    args: argparse.Namespace, shape: dict[str, int], model: nn.Module, pairs: list[dict[str, Run]], peak: tuple[float | None, str]
) -> list[dict[str, Any]]:
    """One row per side: medians over the pairs; the ratio per pair, then its median and range."""
    params = sum(p.numel() for p in model.parameters())
    per_token = flops_per_token(matmul_params(model), shape)
    tokens = args.batch * shape["block"]
    ratios = [p["shardwise"].step_s / p["hand"].step_s for p in pairs]
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    out = []
    for side in ("shardwise", "hand"):
        runs = [p[side] for p in pairs]
        step_s = statistics.median(r.step_s for r in runs)
        mfus = [r.summary_mfu for r in runs if r.summary_mfu is not None]
        side_ratios = ratios if side == "shardwise" else [1.0] * len(ratios)
        out.append(
            {
                "side": side,
                "device": device,
                "size": args.size,
                "precision": args.precision,
                "compile": f"{args.compile}:{args.compile_backend}" if args.compile == "on" else "off",
                "params": params,
                "batch": args.batch,
                "tokens_per_step": tokens,
                "flops_per_token": per_token,
                "step_s": step_s,
                "tokens_per_s": tokens / step_s,
                "mfu": per_token * tokens / step_s / peak[0] if peak[0] else None,
                "peak_flops_per_s": peak[0],
                "peak_source": peak[1],
                "summary_mfu": statistics.median(mfus) if mfus else None,
                "runs_step_s": [r.step_s for r in runs],
                "ratio": statistics.median(side_ratios),
                "ratio_min": min(side_ratios),
                "ratio_max": max(side_ratios),
                "compile_s": runs[0].compile_s,
                "peak_memory_bytes": max(r.peak_bytes for r in runs),
                "final_loss": runs[-1].losses[-1],
            }
        )
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


COLUMNS: list[tuple[str, int, Any]] = [  # (heading, width, the cell of a row)
    ("side", -10, lambda r: r["side"]),
    ("params", 8, lambda r: f"{r['params'] / 1e6:.1f}M"),
    ("tokens/s", 11, lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("MFU", 7, lambda r: _pct(r["mfu"])),
    ("MFU(summary)", 13, lambda r: _pct(r["summary_mfu"])),
    ("step ms", 9, lambda r: f"{r['step_s'] * 1e3:.2f}"),
    ("ratio (range)", 20, lambda r: f"{r['ratio']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"),
    ("compile s", 10, lambda r: f"{r['compile_s']:.1f}"),
    ("peak MB", 14, lambda r: f"{r['peak_memory_bytes'] / 2**20:,.0f}"),
    ("final loss", 11, lambda r: f"{r['final_loss']:.4f}"),
]


def table(out: list[dict[str, Any]], gap: float, rtol: float, pairs: int, memory: str) -> str:
    def line(cells: list[str]) -> str:
        return " ".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, (_, w, _) in zip(cells, COLUMNS, strict=True))

    first = out[0]
    shape = f"{first['size']}, {first['precision']}, compile {first['compile']}, batch {first['batch']} x {first['tokens_per_step'] // first['batch']} tokens"
    lines = [f"device: {first['device']}; {shape}"]
    lines += [line([h for h, _, _ in COLUMNS]), *(line([cell(r) for _, _, cell in COLUMNS]) for r in out)]
    lines.append(f"MFU: 6N + 12 L d T FLOPs per token (PaLM, appendix B) over the peak ({first['peak_source']}); peak MB: {memory}")
    lines.append(f"ratio: shardwise/hand step time, median of {pairs} pairs (range)")
    lines.append(f"losses agree: {'yes' if gap <= rtol else 'NO'} (largest relative difference at a step {gap:.2e}, tolerance {rtol:g})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    shape, peak = SIZES[args.size], peak_flops(args)
    model = build_model(shape, args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"gpu_step: {args.size} ({params / 1e6:.1f} M parameters) on {device}, {args.pairs} pairs of {args.steps} steps ({args.warmup} left out)")
    first, pairs = run_pairs(args, shape, device)
    out = rows(args, shape, model, pairs, peak)
    gap, rtol = loss_gap(pairs), LOSS_RTOL[args.precision]
    print(table(out, gap, rtol, args.pairs, "torch.cuda.max_memory_allocated" if device.type == "cuda" else "VmHWM"))
    print(f"first compile of the model in this process (before the pairs): {first:.1f}s; compile s: each side's first run, code generated then cached")
    if args.json:
        report = {"rows": out, "first_compile_s": first, "losses_agree": gap <= rtol, "loss_gap": gap, "loss_rtol": rtol}
        report |= {"pairs": args.pairs, "steps": args.steps, "warmup": args.warmup, "date": datetime.date.today().isoformat()}
        report |= {"torch": torch.__version__, "python": platform.python_version(), "argv": sys.argv[1:] if argv is None else argv}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if gap <= rtol else 1


if __name__ == "__main__":
    from shardwise.errors import ConfigError

    try:
        sys.exit(main())
    except ConfigError as exc:  # a setting this machine cannot run: one line, not a traceback
        sys.exit(f"gpu_step: {exc}")
