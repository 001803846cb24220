"""Resident memory of a 2-process run over a corpus larger than it should hold: >= 2 GB of tokens against 20 MB.

Each corpus is written by ``write_token_shards`` (random token ids in documents of about 1M tokens, uint16,
``--shards`` shards) into a temporary directory, deleted afterwards. A tiny model (an embedding averaged
over the block, then a linear layer predicting the block's last target) trains through ``--fraction`` of
one epoch of it with ``Trainer(nproc=2, strategy="ddp")`` over ``TokenShards`` (blocks of ``--seq`` + 1
tokens, global batch ``--batch``), each corpus in a fresh launching process (a peak only rises: a second
run in the same process would carry the first's). The run's summary.json has every process's peak resident
memory (VmHWM: ``memory.ranks[r].end`` and ``memory.launcher``); they are printed side by side with the
difference, which must stay within 200 MB (issue 41). ``--sources files,stream`` also streams the same
blocks, in file order, through ``StreamLoader`` (an ``IterableDataset`` over the shards: every rank reads
the whole stream and keeps its stride).

    python benchmarks/stream_memory.py [--big-gb 2.0] [--small-mb 20] [--sources files,stream]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 256
MB = 1 << 20
ROLES = ("rank 0", "rank 1", "launcher")


def write_corpus(directory: Path, nbytes: int, shards: int, doc_tokens: int = 1 << 20) -> dict[str, Any]:
    """About ``nbytes`` of uint16 tokens (random ids in documents of ``doc_tokens``) in ``shards`` shards."""
    from shardwise.data.files import write_token_shards

    tokens = nbytes // 2
    rng = np.random.default_rng(0)

    def docs() -> Iterator[np.ndarray]:
        left = tokens
        while left > 0:
            n = min(left, doc_tokens)
            yield rng.integers(1, VOCAB, size=n, dtype=np.uint16)
            left -= n + 1

    return write_token_shards(docs(), directory, sep=0, shard_tokens=max(1, tokens // shards))


def _run(args: argparse.Namespace) -> None:
    """One training run (a fresh process): the corpus ``args.corpus`` through ``args.source``."""
    import torch
    from torch.utils.data import IterableDataset

    import shardwise
    from shardwise.data.files import TokenShards

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x).mean(1))  # type: ignore[no-any-return]

    class InFileOrder(IterableDataset):  # type: ignore[type-arg]
        def __init__(self, blocks: TokenShards) -> None:
            self.blocks = blocks

        def __iter__(self) -> Iterator[Any]:
            return (self.blocks[i] for i in range(len(self.blocks)))

    blocks = TokenShards(args.corpus, args.seq)
    data: Any = blocks if args.source == "files" else InFileOrder(blocks)
    steps = max(1, int(len(blocks) // args.batch * args.fraction))
    shardwise.Trainer(
        strategy="ddp",
        nproc=2,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1][:, -1]),
        global_batch_size=args.batch,
        max_steps=steps,
        out=args.out,
        log_every=max(1, steps // 4),
        progress_bar=False,
        model_summary=False,
        timeout_s=600,
    ).fit(Pooled(), data)


def peaks(out: Path) -> dict[str, float]:
    """Each process's peak resident memory (MB) from a run's summary.json."""
    memory = json.loads((out / "summary.json").read_text())["memory"]
    ranks = {f"rank {r['rank']}": r["end"]["peak_bytes"] / MB for r in memory["ranks"] if r}
    return {**ranks, "launcher": memory["launcher"]["peak_bytes"] / MB}


def measure(nbytes: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    corpus = root / f"corpus-{nbytes}"
    start = time.perf_counter()
    index = write_corpus(corpus, nbytes, args.shards)
    written = time.perf_counter() - start
    out: dict[str, Any] = {"bytes": sum((corpus / s["file"]).stat().st_size for s in index["shards"]), "tokens": index["tokens"], "write_s": written}
    try:
        for source in args.sources.split(","):
            run_dir = root / f"run-{nbytes}-{source}"
            cmd = [sys.executable, __file__, "--run", "--corpus", str(corpus), "--out", str(run_dir), "--source", source]
            cmd += ["--seq", str(args.seq), "--batch", str(args.batch), "--fraction", str(args.fraction)]
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if done.returncode:
                raise SystemExit(f"the {source} run over {nbytes / MB:.0f} MB failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            summary = json.loads((run_dir / "summary.json").read_text())
            out[source] = {"peaks": peaks(run_dir), "steps": summary["steps"], "train_s": time.perf_counter() - start}
    finally:
        shutil.rmtree(corpus, ignore_errors=True)
    return out


def report(small: dict[str, Any], big: dict[str, Any], sources: list[str], limit_mb: float = 200.0) -> bool:
    """Print the table; True when every difference is within ``limit_mb``."""
    print(
        f"corpora: {small['bytes'] / MB:,.1f} MB ({small['tokens']:,} tokens) and {big['bytes'] / MB:,.1f} MB ({big['tokens']:,} tokens), written in "
        f"{small['write_s']:.1f} s and {big['write_s']:.1f} s"
    )
    ok = True
    for source in sources:
        s, b = small[source], big[source]
        print(f"\n{source}: {s['steps']} and {b['steps']} steps ({s['train_s']:.0f} s and {b['train_s']:.0f} s, launch included); peak RSS, MB (VmHWM)")
        print(f"{'process':>9} | {'small':>7} | {'big':>7} | {'big - small':>11}")
        for role in ROLES:
            diff = b["peaks"][role] - s["peaks"][role]
            ok &= diff <= limit_mb
            print(f"{role:>9} | {s['peaks'][role]:>7.0f} | {b['peaks'][role]:>7.0f} | {diff:>+11.0f}")
    print(f"\nevery difference within {limit_mb:.0f} MB: {'yes' if ok else 'NO'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-gb", type=float, default=2.0, help="the large corpus, GB of tokens on disk (2**30 bytes)")
    parser.add_argument("--small-mb", type=float, default=20.0, help="the small corpus, MB on disk")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--fraction", type=float, default=0.9, help="of one epoch trained")
    parser.add_argument("--sources", default="files", help="files (TokenShards through the Trainer's loader), stream (StreamLoader)")
    parser.add_argument("--dir", default=None, help="where the corpora are written (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--source", default="files", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        _run(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="sw-stream-memory-", dir=args.dir) as tmp:
        small = measure(int(args.small_mb * MB), args, Path(tmp))
        big = measure(int(args.big_gb * (1 << 30)), args, Path(tmp))
        return 0 if report(small, big, args.sources.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
