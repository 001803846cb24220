"""``compile=`` measured: step time compiled vs uncompiled under each strategy, through the Trainer.

Each row trains charlm's ``CharGPT`` (``--d-model``, ``--layers``, 4 heads, block ``--block``, global
batch ``--batch``, fp32, AdamW) on Python's own documentation text, once eager (``compile="off"``) and
once compiled (``compile="on"``, or ``on:BACKEND`` with ``--backend``), under ``single`` (1 process)
and ``ddp``, ``zero3``, ``tp`` and ``pipeline`` (2 processes on gloo, one thread each). ``tp-nocount``
is tp with the collective counter off (``count_collectives=False``), so the counter's cost shows both
eager and compiled.

Step time: rank 0's median step after ``--warmup`` steps (compilation happens inside the first steps and
is left out; a recompile after the warm-up would show in the median and in ``recompiles``). ``compile
s``: ``summary["compile"]["compile_s"]``, Dynamo's and the backend's seconds in the run. Inductor's
on-disk cache is a fresh folder (``--cache-dir`` to reuse one): a first pass of compiled runs (not
timed) compiles cold and fills it; the timed repeats then compile warm (Dynamo still traces every run:
each run resets Dynamo, as a new process would). ``loss diff``: the largest ``|train_loss compiled -
train_loss eager|`` over the repeats (the mean loss of the last ``--log-every`` steps, same seed, same
batches; fp32 compiled kernels round differently, so it is small, not zero).

Eager and compiled runs alternate (eager first in even repeats, compiled first in odd ones), ``--repeats``
times: a slow spell on a shared machine weighs on both sides alike. Each side's step time is its fastest
repeat (other work on the machine only ever adds time), and ``pairs`` the median and range of the
per-pair ratios eager / compiled (one pair: the two runs of one repeat, back to back). On CPU this
measures what Inductor's fused C++ kernels save over eager dispatch at this size, not a GPU's speed-up.

    python benchmarks/compile_speedup.py [--d-model 128] [--layers 4] [--steps 40] [--warmup 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

import shardwise
from shardwise.tools.recipes.charlm import CharGPT, adamw, lm_loss, load_charlm_split

STRATEGIES = ("single", "ddp", "zero3", "tp", "tp-nocount", "pipeline")
"""The rows, in order; ``single`` runs in this process, the others on 2 processes."""

OPTIONS: dict[str, dict[str, Any]] = {
    "single": {}, "ddp": {}, "zero3": {}, "tp": {"tp": 2}, "tp-nocount": {"tp": 2, "count_collectives": False},
    "pipeline": {"pp": 2},
}


class StepTimer:
    """Step times after the warm-up (the compiled steps' compilation falls in the warm-up)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.last = warmup, [], 0.0

    def on_fit_start(self, trainer: Any, engine: Any) -> None:
        self.last = time.perf_counter()

    def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        if step > self.warmup:
            self.times.append(now - self.last)
        self.last = now


def fit(name: str, compiled: bool, args: argparse.Namespace, steps: int | None = None) -> dict[str, Any]:
    """One run of row ``name``, eager or compiled; its median step time and what it compiled."""
    torch._dynamo.reset()  # every run traces afresh, as a new process would (the on-disk cache stays)
    steps = steps or args.steps
    vocab, train, _ = load_charlm_split(args.block)
    torch.manual_seed(0)
    model = CharGPT(len(vocab), args.block, args.d_model, 4, args.layers)
    timer = StepTimer(args.warmup)
    setting = ("on" if args.backend == "inductor" else f"on:{args.backend}") if compiled else "off"
    trainer = shardwise.Trainer(
        strategy=name.split("-")[0], strategy_options=OPTIONS[name], optimizer=functools.partial(adamw, lr=1e-3, weight_decay=0.01),
        loss_fn=lm_loss, callbacks=[timer], global_batch_size=args.batch, max_steps=steps, log_every=min(args.log_every, steps),
        progress_bar=False, model_summary=False, announce_outputs=False, compile=setting,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's own lines, per run: the table is the output
        summary = trainer.fit(model, train)
    report = summary.get("compile") or {}
    return {
        "step_s": statistics.median(timer.times) if timer.times else None,  # none in the cold pass
        "timed_steps": len(timer.times),
        "train_loss": summary["train_loss"],
        "compile_s": report.get("compile_s", 0.0),
        "recompiles": report.get("recompiles", 0),
        "graphs": report.get("graphs", 0),
        "graph_breaks": report.get("graph_breaks", 0),
        "reasons": report.get("recompile_reasons", []),
    }


def measure(names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The cold pass, then ``--repeats`` interleaved eager/compiled pairs of every row in ``names``."""
    out: dict[str, Any] = {n: {"cold": None, "eager": [], "compiled": []} for n in names}
    if args.backend == "inductor":
        for n in names:  # cold: fills the on-disk cache; long enough to run the backward once
            out[n]["cold"] = fit(n, True, args, steps=2)["compile_s"]
    for i in range(args.repeats):
        for n in names:
            order = (False, True) if i % 2 == 0 else (True, False)
            for compiled in order:
                out[n]["compiled" if compiled else "eager"].append(fit(n, compiled, args))
    return out


def _two(names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    return measure(names, args)


def row(name: str, runs: dict[str, Any]) -> dict[str, Any]:
    """Each side's fastest repeat, the speed-up (eager / compiled step time), the per-pair ratios and the loss difference."""
    eager = min(r["step_s"] for r in runs["eager"])
    comp = min(r["step_s"] for r in runs["compiled"])
    pairs = [e["step_s"] / c["step_s"] for e, c in zip(runs["eager"], runs["compiled"], strict=True)]
    last = runs["compiled"][-1]
    return {
        "strategy": name,
        "eager_ms": eager * 1e3,
        "compiled_ms": comp * 1e3,
        "speedup": eager / comp,
        "pairs": [statistics.median(pairs), min(pairs), max(pairs)],
        "cold_compile_s": runs["cold"],
        "compile_s": statistics.median(r["compile_s"] for r in runs["compiled"]),
        "recompiles": max(r["recompiles"] for r in runs["compiled"]),
        "eager_graphs": max(r["graphs"] for r in runs["eager"]),
        "timed_steps": min(r["timed_steps"] for r in runs["eager"] + runs["compiled"]),
        "graphs": last["graphs"],
        "graph_breaks": last["graph_breaks"],
        "recompile_reasons": sorted({s for r in runs["compiled"] for s in r["reasons"]}),
        "loss_diff": max(abs(c["train_loss"] - e["train_loss"]) for c, e in zip(runs["compiled"], runs["eager"], strict=True)),
        "eager_loss": runs["eager"][0]["train_loss"],
        "eager_ms_all": [r["step_s"] * 1e3 for r in runs["eager"]],
        "compiled_ms_all": [r["step_s"] * 1e3 for r in runs["compiled"]],
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table, and the counter's cost (tp over tp without the counter) eager and compiled."""
    warm = "warm (Inductor's cache filled by a first, cold pass)" if args.backend == "inductor" else f"{args.backend}: no code generated, no cache"
    lines = [
        f"charlm CharGPT d_model {args.d_model}, {args.layers} blocks, 4 heads, block {args.block}, global batch {args.batch}, fp32, CPU, "
        f"one thread per process; median step of steps {args.warmup + 1}-{args.steps}, fastest of {args.repeats} interleaved repeats; "
        f"backend {args.backend}; compile s {warm}",
        "",
        "| strategy | procs | eager ms/step | compiled ms/step | speed-up | pairs | compile s (cold) | compile s | graphs | recompiles | loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pair = f"{r['pairs'][0]:.2f}x ({r['pairs'][1]:.2f}-{r['pairs'][2]:.2f})"
        cold = f"{r['cold_compile_s']:.1f}" if r["cold_compile_s"] is not None else "-"
        lines.append(
            f"| {r['strategy']} | {1 if r['strategy'] == 'single' else 2} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['speedup']:.2f}x | "
            f"{pair} | {cold} | {r['compile_s']:.1f} | {r['graphs']} | {r['recompiles']} | {r['loss_diff']:.1e} |"
        )
    by = {r["strategy"]: r for r in rows}
    if "tp" in by and "tp-nocount" in by:
        on, off = by["tp"], by["tp-nocount"]
        lines += ["", f"collective counter's cost under tp (tp / tp-nocount): eager {on['eager_ms'] / off['eager_ms']:.3f}x, "
                      f"compiled {on['compiled_ms'] / off['compiled_ms']:.3f}x"]
    reasons = [f"{r['strategy']}: {s}" for r in rows for s in r["recompile_reasons"]]
    if reasons:
        lines += ["", "recompile reasons:", *[f"- {s}" for s in reasons]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=128, help="charlm's recipe size: 128")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8, help="steps left out of the median (the compile falls in them)")
    ap.add_argument("--log-every", type=int, default=10, help="train_loss is the mean of the last interval")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend: inductor, or aot_eager for a quick run")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated rows among: {', '.join(STRATEGIES)}")
    ap.add_argument("--cache-dir", default=None, help="Inductor's cache folder (default: a fresh one, so the first pass is cold)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        ap.error(f"--strategies takes rows among {', '.join(STRATEGIES)}; got {args.strategies!r}")
    if args.steps <= args.warmup + 1:
        ap.error(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}; take --steps of at least {args.warmup + 2}")
    args.names = names
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="compile_speedup_") as fresh:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or fresh  # the workers inherit it
        torch.set_num_threads(1)
        single = [n for n in args.names if n == "single"]
        runs = measure(single, args) if single else {}
        two = [n for n in args.names if n != "single"]
        if two:
            runs.update(shardwise.launch(_two, two, args, nproc=2, threads_per_proc=1, timeout=3600)[0])
    rows = [row(n, runs[n]) for n in args.names]
    print(table(rows, args), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
