"""`TextShards`: JSON lines and Parquet text, tokenized once into a token cache, read as `TokenShards`.

Each source file is tokenized by the user's function (``str -> list of ids``), a document at a
time, each document followed by ``sep``, into one ``.npy`` token file in the cache directory
(written a chunk at a time under a temporary name and renamed into place: memory stays one
document, and a crash or a race between ranks leaves no half-written file under the final
name). The cache file's name carries a SHA-256 of the source's absolute path, size and
modification time, the tokenizer's output on a probe string, ``text_key``, ``sep`` and ``dtype``:
an edited source or another tokenizer writes a new file; the same ones are found by name, so
constructing a `TextShards` whose cache exists reads nothing but the cache files' headers. Then
the dataset is a `TokenShards` over the cache files, in the sources' order. Parquet needs
pyarrow (``pip install 'shardwise[datasets]'``). Design notes: docs/data.md, "Files on disk".
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.data.files import PathLike, TokenFile, TokenShards, _integer_dtype, as_tokens
from shardwise.errors import ConfigError

VERSION = 1
"""Part of every cache key: bump it when the cache's layout changes."""
DEFAULT_CACHE_DIR = ".shardwise-cache"  # as shardwise.data.map's; the tokens go under tokens/
PROBE = "shardwise probe: The quick brown fox jumps over the lazy dog. 0123456789 \u00e9\u00df \u6f22\u5b57\n"
JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
SUFFIXES = (*JSONL, ".parquet")


def _is_text_source(p: Path) -> bool:
    return p.is_file() and not p.name.startswith(".") and p.name.endswith(SUFFIXES)


def text_sources(sources: PathLike | Sequence[PathLike]) -> list[Path]:
    """The files ``sources`` names: a list of files, a directory (its JSON lines and Parquet files, by
    name), a glob pattern (``data/*.parquet``), or one file."""
    if isinstance(sources, (str, os.PathLike)):
        p = Path(sources)
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if _is_text_source(f))
        elif any(c in str(sources) for c in "*?["):
            files = sorted(Path(f) for f in glob.glob(str(sources)) if _is_text_source(Path(f)))
        else:
            files = [p]
    else:
        files = [Path(f) for f in sources]
    if not files:
        raise ConfigError(f"no text files found in {sources!s} (JSON lines: {', '.join(JSONL)}; Parquet: .parquet)")
    for f in files:
        if not f.is_file():
            raise ConfigError(f"text source {f} does not exist")
        if not f.name.endswith(SUFFIXES):
            raise ConfigError(
                f"{f} is neither JSON lines ({', '.join(JSONL)}) nor Parquet (.parquet); convert it, or tokenize it yourself with write_token_shards"
            )
    return files


def _jsonl(path: Path, key: str) -> Iterator[str]:
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or key not in record:
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{path}:{lineno} has no {key!r} field (it has {fields}); pass text_key= naming the text's field")
            yield _text(record[key], f"{path}:{lineno}")


def _parquet(path: Path, key: str) -> Iterator[str]:
    try:
        pq = importlib.import_module("pyarrow.parquet")  # optional: the datasets extra
    except ImportError:
        raise ConfigError(f"reading {path.name} (Parquet) needs pyarrow, which is not installed: pip install 'shardwise[datasets]'") from None
    source = pq.ParquetFile(path)
    if key not in source.schema_arrow.names:
        raise ConfigError(f"{path} has no column {key!r} (it has {source.schema_arrow.names}); pass text_key= naming the text's column")
    for batch in source.iter_batches(columns=[key], batch_size=1024):  # a batch of rows at a time: flat memory
        for i, text in enumerate(batch.column(0).to_pylist()):
            if text is not None:
                yield _text(text, f"{path} row {i}")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: the text field holds a {type(value).__name__}, not a string")
    return value


def texts(path: Path, key: str = "text") -> Iterator[str]:
    """The documents of one JSON lines or Parquet file, in file order."""
    return _parquet(path, key) if path.name.endswith(".parquet") else _jsonl(path, key)


def cache_key(
    source: Path, probe: list[int], text_key: str, sep: int, dtype: np.dtype | None, first: list[int] | None = None, tokenizer_id: str | None = None
) -> str:
    """The cache file's key: the source (path, size, modification time), the settings, and the tokenizer as far as it
    can be told apart: its ids for a fixed probe text and for the file's first document, and ``tokenizer_id``."""
    st = source.stat()
    what = [VERSION, str(source.resolve()), st.st_size, st.st_mtime_ns, text_key, int(sep), str(dtype), probe, first, tokenizer_id]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def token_ids(tokenize: Callable[[str], Any], text: str, where: str) -> np.ndarray:
    """``tokenize(text)`` as token ids, or a `ConfigError` saying what the tokenizer returned and how to fix it."""
    out = tokenize(text)
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        keys = sorted(str(k) for k in out.keys())
        hint = ' (lambda t: tok(t)["input_ids"])' if "input_ids" in keys else ""
        raise ConfigError(f"tokenize returned a mapping with keys {keys} for {where}; it must return the token ids{hint}")
    if isinstance(out, str) or (isinstance(out, (list, tuple)) and out and isinstance(out[0], str)):
        raise ConfigError(
            f"tokenize returned text ({out[:3]!r}...) for {where}, not token ids: return the ids (for a Hugging Face "
            'tokenizer, tok(t)["input_ids"] or tok.convert_tokens_to_ids(tokens))'
        )
    try:
        ids = as_tokens(out)
    except ConfigError as exc:
        raise ConfigError(f"tokenize's output for {where} is not token ids: {exc}") from None
    if ids.size and int(ids.min()) < 0:
        raise ConfigError(f"tokenize returned a negative id ({int(ids.min())}) for {where}: token ids are >= 0")
    return ids


def tokenize_file(source: Path, target: Path, tokenize: Callable[[str], Any], text_key: str, sep: int, dtype: np.dtype | None) -> int:
    """Tokenize ``source`` into the token file ``target`` (atomically); returns its tokens."""
    out = TokenFile(target, "npy", dtype)
    sep_arr = np.asarray([sep], dtype=np.int64)
    try:
        for k, text in enumerate(texts(source, text_key)):
            tokens = token_ids(tokenize, text, f"document {k} of {source}")
            if len(tokens):
                out.write(tokens)
                out.write(sep_arr)
        out.finish()
    except BaseException:
        out.abandon()
        raise
    return out.tokens


class TextShards(TokenShards):
    """Blocks of tokenized text: JSON lines / Parquet files through ``tokenize``, cached (see the module).

    ``sources``: files, a directory, or a glob. ``tokenize``: a document's text -> its token ids
    (a list, an array or a tensor; e.g. ``lambda t: tok(t)["input_ids"]``). ``sep``: the id that
    ends each document (the tokenizer's EOS). ``text_key``: the JSON field or Parquet column.
    ``cache_dir``: where the token files go (default ``.shardwise-cache/tokens``). ``tokenizer_id``: a
    name for the tokenizer and its settings (``"gpt2, max_length=512"``), part of the cache key: the key
    also holds the tokenizer's ids for a probe text and each file's first document, which a change that
    only shows on other text (a truncation of long documents) does not alter. The rest is
    `TokenShards`'. ``tokenized``: how many source files this construction tokenized (0 when
    the cache held them all).

    >>> data = TextShards("corpus/*.jsonl", lambda t: tok(t)["input_ids"], 1024, sep=tok.eos_token_id)  # doctest: +SKIP
    """

    def __init__(
        self,
        sources: PathLike | Sequence[PathLike],
        tokenize: Callable[[str], Any],
        seq_len: int,
        *,
        sep: int,
        text_key: str = "text",
        cache_dir: PathLike | None = None,
        dtype: str | np.dtype | None = None,
        shuffle_window: int = 8192,
        labels: str = "shifted",
        document_mask: bool = False,
        tokenizer_id: str | None = None,
    ) -> None:
        if not callable(tokenize):
            raise ConfigError(f"tokenize must be a function from a document's text to its token ids; got {type(tokenize).__name__}")
        files = text_sources(sources)
        fixed = None if dtype is None else _integer_dtype(dtype)
        probe = [int(i) for i in token_ids(tokenize, PROBE, "a probe text")]
        cache = Path(cache_dir) if cache_dir is not None else Path(DEFAULT_CACHE_DIR) / "tokens"
        cache.mkdir(parents=True, exist_ok=True)
        targets, self.tokenized = [], 0
        for f in files:
            head = next(iter(texts(f, text_key)), None)  # the file's first document: a tokenizer the probe misses shows here
            first = None if head is None else [int(i) for i in token_ids(tokenize, head, f"document 0 of {f}")]
            target = cache / f"{f.name.split('.')[0]}-{cache_key(f, probe, text_key, sep, fixed, first, tokenizer_id)[:20]}.npy"
            if not target.exists():
                tokenize_file(f, target, tokenize, text_key, sep, fixed)
                self.tokenized += 1
            targets.append(target)
        self.sources = [str(f) for f in files]
        self.cache_dir = str(cache)
        super().__init__(targets, seq_len, sep=sep, shuffle_window=shuffle_window, labels=labels, document_mask=document_mask)

    def __repr__(self) -> str:
        return f"TextShards({len(self.sources)} source files, cache {self.cache_dir}): " + super().__repr__()
