"""After training: int8 latency, prediction throughput, parallel preprocessing, measured side by side.

1. Dynamic int8 against fp32 (``shardwise.tools.compress.quantize.dynamic_int8``), the digits MLP and the
   charlm GPT: size on disk, and the latency of one batch (the recipe's global batch) at 1 thread
   and at every thread torch uses. fp32 and int8 are timed in interleaved blocks (A B, then B A,
   ...), so a machine that slows down weighs on both alike; the ratio of medians is printed with
   the per-pair range. Latency does not depend on the weights' values, so the models keep their
   seeded initial weights (the README's table gives the trained models' accuracy).
2. ``shardwise predict`` on a digits checkpoint at 2 processes against 1 (the index's own
   throughput figures: the prediction loop on rank 0, and the whole call with process start).
3. ``shardwise preprocess`` (charlm's tokenization through ``shardwise.data.map``) at 1 and 2
   workers with the cache off, then the cache hit.

    python benchmarks/inference.py [--repeats 5] [--blocks 20]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from shardwise.tools.compress.measure import saved_bytes
from shardwise.tools.compress.quantize import dynamic_int8
from shardwise.tools.recipes import get_recipe


def _block_ms(model: torch.nn.Module, x: torch.Tensor, threads: int, n: int) -> float:
    """Median milliseconds of one forward over ``n`` calls at ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    times = []
    with torch.inference_mode():
        model(x)  # warm-up
        for _ in range(n):
            t0 = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def quantized_rows(repeats: int, blocks: int) -> list[dict[str, Any]]:
    all_threads = torch.get_num_threads()
    rows = []
    for recipe in ("digits", "charlm"):
        torch.manual_seed(0)
        parts = get_recipe(recipe).parts()
        fp32 = parts.model.eval()
        int8 = dynamic_int8(fp32)
        size = int(get_recipe(recipe).trainer_defaults.get("global_batch_size", 32))
        x = torch.stack([parts.val[i][0] for i in range(size)])
        for threads in sorted({1, all_threads}):
            a: list[float] = []
            b: list[float] = []
            for r in range(repeats):
                pair = [(a, fp32), (b, int8)] if r % 2 == 0 else [(b, int8), (a, fp32)]
                for times, model in pair:
                    times.append(_block_ms(model, x, threads, blocks))
            ratios = sorted(q / f for f, q in zip(a, b, strict=True))
            rows.append({
                "recipe": recipe, "threads": threads, "batch": size,
                "fp32_ms": statistics.median(a), "int8_ms": statistics.median(b),
                "ratio": statistics.median(b) / statistics.median(a), "pair_range": (ratios[0], ratios[-1]),
                "size_ratio": saved_bytes(fp32.state_dict()) / saved_bytes(int8.state_dict()),
            })  # fmt: skip
    torch.set_num_threads(all_threads)
    return rows


def predict_rows(root: Path, repeats: int) -> list[dict[str, Any]]:
    from shardwise.tools.predict import predict_checkpoint
    from shardwise.trainer.loop import Trainer

    parts = get_recipe("digits").parts()
    run = root / "digits"
    Trainer(optimizer=parts.optimizer, loss_fn=parts.loss_fn, max_steps=2, global_batch_size=64, checkpoint_every=2, out=str(run), model_summary=False,
            progress_bar=False).fit(parts.model, parts.train)  # fmt: skip
    rows = []
    for r in range(repeats):
        with contextlib.redirect_stdout(io.StringIO()):
            index = predict_checkpoint(run, "digits", root / f"pred-{r}", nproc=2, rows_per_shard=128)
        t = index["throughput"]
        rows.append({"two": t["samples_per_s"], "one": t["one_process"]["samples_per_s"], "wall_two": t["wall_seconds_with_start"], "rows": index["rows"]})
    return rows


def preprocess_rows(root: Path, repeats: int) -> list[list[dict[str, Any]]]:
    from shardwise.tools.preprocess import run

    out = []
    for r in range(repeats):
        with contextlib.redirect_stdout(io.StringIO()):
            out.append(run("charlm", [1, 2], cache_dir=str(root / f"cache-{r}")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved pairs (latency) and repeated runs (predict, preprocess)")
    parser.add_argument("--blocks", type=int, default=20, help="forward passes per latency block (median kept)")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("dynamic int8 vs fp32, one batch (ratio < 1: int8 faster)")
    print(f"{'model':<8}{'threads':>8}{'batch':>6}{'fp32 ms':>9}{'int8 ms':>9}{'int8/fp32':>10}  {'pair range':<13}{'size fp32/int8':>15}")
    for q in quantized_rows(args.repeats, args.blocks):
        lo, hi = q["pair_range"]
        head = f"{q['recipe']:<8}{q['threads']:>8}{q['batch']:>6}{q['fp32_ms']:>9.3f}{q['int8_ms']:>9.3f}"
        print(f"{head}{q['ratio']:>9.2f}x  {lo:.2f}-{hi:.2f}x{'':>4}{q['size_ratio']:>14.2f}x")
    with tempfile.TemporaryDirectory() as tmp:
        p = predict_rows(Path(tmp), args.repeats)
        two, one = statistics.median(r["two"] for r in p), statistics.median(r["one"] for r in p)
        print(f"\nshardwise predict, digits validation ({p[0]['rows']} rows), median of {args.repeats}")
        wall = statistics.median(r["wall_two"] for r in p)
        print(f"  1 process {one:.0f} samples/s, 2 processes {two:.0f} samples/s ({two / one:.2f}x); whole call with process start {wall:.2f} s")
        runs = preprocess_rows(Path(tmp), args.repeats)
        print(f"\nshardwise preprocess, charlm tokenization, median of {args.repeats}")
        for i, label in enumerate(("1 worker, no cache", "2 workers, no cache", "2 workers, cache written", "2 workers, cache hit")):
            print(f"  {label:<26} {statistics.median(r[i]['seconds'] for r in runs):.3f} s")


if __name__ == "__main__":
    main()
