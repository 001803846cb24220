"""``shardwise preprocess --recipe charlm --workers N``: a recipe's data step through
`shardwise.data.map`, timed per worker count, checked against the recipe's own result.

What each recipe's data step is, honestly:

- ``charlm``: tokenization. The text (Python's help topics, ~465,000 characters) becomes
  character ids (`CharVocab.encode`, one dictionary look-up per character). Here the text is
  cut into pieces of ``--piece-chars`` characters, the vocabulary (every character of the whole
  text, sorted) is built once, and `map` encodes the pieces in worker processes; the pieces'
  ids, joined, are compared with the recipe's own single-process ``vocab.encode(text)``.
- ``digits``: standardization. Each 8x8 image's 64 pixels become ``(x - mean) / std`` with the
  training images' statistics (`load_digits_split`); here `map` standardizes rows of images,
  and the result is compared with the recipe's features, row for row.

Both steps are light (well under a second on one core): the timings show what process start
and pickling cost against the work, which is the honest answer for data this small. ``--workers
1,2`` runs each count in turn with the cache off (each computes), then once more with the cache
on, twice, to show the second run reading it ("cached").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.config import add_arguments as add_flags
from shardwise.config import flag
from shardwise.data import map as pmap
from shardwise.errors import ConfigError

HELP = "run a recipe's tokenization / feature step in parallel worker processes, cached (shardwise.data.map)"
RECIPES = ("charlm", "digits")


def encode_piece(text: str, chars: str) -> torch.Tensor:
    """``text``'s character ids in the sorted vocabulary ``chars`` (the recipe's `CharVocab.encode`)."""
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def standardize_rows(rows: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The recipe's feature step for a block of images: ``(x - mean) / std`` in float64, then float32."""
    return ((rows - mean) / std).to(torch.float32)


def charlm_step(piece_chars: int) -> tuple[Any, list[Any], Any, str]:
    """(fn, items, the recipe's own result, a description) for charlm's tokenization."""
    from shardwise.tools.recipes.charlm import CharVocab, python_docs_text

    text = python_docs_text()
    vocab = CharVocab(text)
    pieces = [text[i : i + piece_chars] for i in range(0, len(text), piece_chars)]
    fn = functools.partial(encode_piece, chars="".join(vocab.chars))
    return fn, pieces, vocab.encode(text), f"charlm: {len(text):,} characters in {len(pieces)} pieces of {piece_chars:,} -> ids (vocabulary {len(vocab)})"


def digits_step(rows_per_item: int) -> tuple[Any, list[Any], Any, str]:
    """(fn, items, the recipe's own features in original order, a description) for digits."""
    from shardwise.tools.recipes.digits import digits_arrays, load_digits_split

    x = torch.tensor(digits_arrays()[0], dtype=torch.float64)
    # The recipe's statistics: the same seeded split (load_digits_split with its defaults).
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    n_val = int(round(len(x) * 0.2))
    train_idx = perm[n_val:]
    mean, std = x[train_idx].mean(0), x[train_idx].std(0)
    std = torch.where(std < 1e-3, torch.ones_like(std), std)
    train, val = load_digits_split()
    expected = torch.empty(len(x), x.shape[1], dtype=torch.float32)
    expected[perm[:n_val]], expected[train_idx] = val.tensors[0], train.tensors[0]
    items = [x[i : i + rows_per_item] for i in range(0, len(x), rows_per_item)]
    fn = functools.partial(standardize_rows, mean=mean, std=std)
    return fn, items, expected, f"digits: {len(x):,} images x {x.shape[1]} pixels in {len(items)} blocks of {rows_per_item} -> standardized features"


def parse_workers(text: str) -> list[int]:
    try:
        counts = [int(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise ConfigError(f"--workers takes whole numbers >= 1, comma-separated (e.g. 1,2); got {text!r}")
    return counts


def run(recipe: str, workers: Sequence[int], *, cache_dir: str | None = None, piece: int | None = None, backend: str = "processes") -> list[dict[str, Any]]:
    """Time the recipe's step at each worker count (no cache), then twice with the cache; each
    result is checked against the recipe's own. Returns one row per run."""
    if recipe not in RECIPES:
        raise ConfigError(f"preprocess knows the data steps of {', '.join(RECIPES)}; got recipe {recipe!r}")
    fn, items, expected, what = charlm_step(piece or 8192) if recipe == "charlm" else digits_step(piece or 64)
    print(what, flush=True)
    rows = []
    plan = [(w, False) for w in workers] + [(workers[-1], True), (workers[-1], True)]
    for w, cached in plan:
        out = pmap(fn, items, workers=w, cache=cached, cache_dir=cache_dir, backend=backend)  # type: ignore[arg-type]
        got = torch.cat(list(out))
        if not torch.equal(got, expected):
            raise AssertionError(f"preprocess with {w} workers differs from the recipe's own {recipe} data step")  # a bug, not a user error
        row = {"workers": w, "cache": cached, "seconds": out.seconds, "cached_chunks": out.cached_chunks, "computed_chunks": out.computed_chunks}
        rows.append(row)
        label = "cached" if out.computed_chunks == 0 else ("computed, written to the cache" if cached else "computed, no cache")
        print(f"  workers {w}: {out.seconds:.3f} s ({label}; {len(out)} items; identical to the recipe's own result)", flush=True)
    return rows


@dataclass(frozen=True, kw_only=True)
class PreprocessOptions:
    """``shardwise preprocess``'s flags (`shardwise.config.flag`: each field's flag, default and help)."""

    recipe: str = flag(help=f"one of {', '.join(RECIPES)}", required=True)
    workers: str = flag("1", "worker processes; several, comma-separated, to compare (e.g. 1,2)")
    cache_dir: str | None = flag(None, "where results are cached (default ./.shardwise-cache)")
    piece: int | None = flag(None, "characters per piece (charlm, default 8192) or images per block (digits, default 64)")
    backend: str = flag("processes", "local processes, or Ray (pip install 'shardwise[ray]')", choices=("processes", "ray"))


def add_arguments(p: Any) -> None:
    add_flags(p, PreprocessOptions)


def main(args: Any) -> int:
    start = time.perf_counter()
    run(args.recipe, parse_workers(args.workers), cache_dir=args.cache_dir, piece=args.piece, backend=args.backend)
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0
