"""Token shards on disk: `write_token_shards` packs documents into shard files, `TokenShards` reads them.

A corpus larger than memory is a directory of flat token arrays (``.npy``, or raw ``.bin`` whose
dtype ``index.json`` records). `TokenShards` is a map-style dataset of fixed-length blocks over
them, so `ShardedLoader` gives it everything it gives any dataset: the global batch independent
of the world size, exact resume, a resume at another world size, reads spread over the ranks and
the loader's workers. Sample ``i`` is the ``i``-th block of ``seq_len + 1`` tokens (blocks of a
shard start every ``seq_len`` tokens: the last token of a block is the first of the next, so every
token but a shard's first is a target once); a shard's tail shorter than a block is left out
(`TokenShards.tail_tokens`).

Reads go through ``os.pread`` on file descriptors each process opens on first use, not
``np.memmap``: the pages a memory map touched count in the process's resident set (RssFile)
until the map is dropped, so reading a corpus through a long-lived map grows every rank's RSS with
the corpus; pread copies each block into a short-lived buffer, and the file's pages stay in the
kernel's page cache, shared and reclaimable, outside the process (tests/data/test_files.py
measures both). The dataset pickles without open files (loader workers, ranks) and reopens them
after a fork. Its shuffle is `epoch_order` (`shardwise.data.order.BlockOrder`): O(window + shards)
memory. Design notes: docs/data.md, "Files on disk".
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from numpy.lib import format as npy_format
from torch.utils.data import Dataset

from shardwise.data.order import BlockOrder
from shardwise.errors import ConfigError

INDEX = "index.json"
HEADER = 128  # bytes of the .npy header we write: room for any shape, a multiple of 64 as NumPy aligns
PathLike = str | os.PathLike[str]


def _npy_header(dtype: np.dtype, n: int) -> bytes:
    text = "{'descr': %r, 'fortran_order': False, 'shape': (%d,), }" % (dtype.str, n)  # noqa: UP031
    body = text.ljust(HEADER - 11) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


class TokenFile:
    """One token array written a chunk at a time (flat memory) under a temporary name, then
    renamed into place: a ``.npy`` (header written last, when the length is known) or a raw
    ``.bin``. ``dtype=None``: uint16 until a token needs more, then the file is widened to uint32."""

    def __init__(self, path: Path, fmt: str, dtype: np.dtype | None) -> None:
        self.path, self.fmt, self.auto = path, fmt, dtype is None
        self.dtype = np.dtype(np.uint16) if dtype is None else dtype
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")  # several writers (ranks, hosts) may race: each its own
        self.file: BinaryIO = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish)
        self.file.write(b"\0" * self._start)
        self.tokens = 0

    @property
    def _start(self) -> int:
        return HEADER if self.fmt == "npy" else 0

    def write(self, tokens: np.ndarray) -> None:
        if len(tokens):
            self._fit(int(tokens.min()), int(tokens.max()))
            self.file.write(tokens.astype(self.dtype).tobytes())
            self.tokens += len(tokens)

    def _fit(self, low: int, high: int) -> None:
        info = np.iinfo(self.dtype)
        if info.min <= low and high <= info.max:
            return
        if not self.auto or low < 0 or high > np.iinfo(np.uint32).max:
            raise ConfigError(
                f"token ids must fit the shards' dtype {self.dtype} ({info.min}..{info.max}); got ids from {low} to {high}. "
                "Give a wider dtype (dtype='uint32' or 'int64'), or check the tokenizer's output (ids are whole numbers >= 0)"
            )
        self.widen(np.dtype(np.uint32))

    def widen(self, dtype: np.dtype) -> None:
        """Rewrite what was written so far in ``dtype`` (a chunk at a time)."""
        self.file.close()
        wider = self.tmp.with_suffix(".wide")
        _convert(self.tmp, wider, self._start, self.dtype, dtype)
        os.replace(wider, self.tmp)
        self.dtype = dtype
        self.file = open(self.tmp, "r+b")  # noqa: SIM115 (not "ab": the header is written at the start last)
        self.file.seek(0, os.SEEK_END)

    def finish(self) -> None:
        if self.fmt == "npy":
            self.file.seek(0)
            self.file.write(_npy_header(self.dtype, self.tokens))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _convert(src: Path, dst: Path, start: int, old: np.dtype, new: np.dtype, chunk: int = 1 << 22) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(fin.read(start))
        while data := fin.read(chunk * old.itemsize):
            fout.write(np.frombuffer(data, old).astype(new).tobytes())


def widen_file(path: Path, fmt: str, old: np.dtype, new: np.dtype) -> None:
    """A finished shard rewritten in a wider dtype (its header too): what `write_token_shards` does
    to the shards before the first token that did not fit uint16."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.wide")
    _convert(path, tmp, HEADER if fmt == "npy" else 0, old, new)
    if fmt == "npy":
        with open(tmp, "r+b") as f:
            f.write(_npy_header(new, (os.path.getsize(tmp) - HEADER) // new.itemsize))
    os.replace(tmp, path)


def as_tokens(doc: Any) -> np.ndarray:
    """A document (a list, array, tensor or any iterable of ints) as an int64 array."""
    if not isinstance(doc, (list, tuple, np.ndarray, torch.Tensor)):
        doc = list(doc)
    arr = np.asarray(doc)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ConfigError(f"a document must be a flat sequence of token ids (ints); got an array of shape {arr.shape} and dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def write_token_shards(
    docs: Iterable[Iterable[int]],
    directory: PathLike,
    *,
    sep: int,
    shard_tokens: int = 1 << 26,
    dtype: str | np.dtype | None = None,
    format: str = "npy",  # noqa: A002 (the file format's name, as users say it)
) -> dict[str, Any]:
    """Pack ``docs`` (iterables of token ids) into shard files under ``directory``: each document
    followed by ``sep``, a shard closed at the first document end at or past ``shard_tokens``
    tokens (documents are not split), written a chunk at a time (memory: one document), then
    ``index.json`` (the shards' files and token counts, the dtype, ``sep``). ``dtype=None``: uint16
    while every id fits, else uint32. ``format``: ``"npy"`` (NumPy arrays) or ``"bin"`` (raw
    tokens; the dtype lives in the index). Returns the index. Empty documents are skipped.

    >>> write_token_shards([[5, 6, 7], [8, 9]], tmp, sep=0)["tokens"]  # doctest: +SKIP
    7
    """
    if format not in ("npy", "bin"):
        raise ConfigError(f"format must be 'npy' or 'bin'; got {format!r}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be a whole number >= 1; got {shard_tokens!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.iterdir() if p.name == INDEX or p.suffix in (".npy", ".bin"))
    if stale:
        raise ConfigError(
            f"{out} already holds token shards ({', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''}); write into an empty directory, or delete them first"
        )
    fixed = None if dtype is None else _integer_dtype(dtype)
    sep_arr = np.asarray([sep], dtype=np.int64)
    shards: list[dict[str, Any]] = []
    current: TokenFile | None = None
    documents = 0
    try:
        for doc in docs:
            tokens = as_tokens(doc)
            if not len(tokens):
                continue
            if current is None:
                current = TokenFile(out / f"shard-{len(shards):05d}.{format}", format, fixed if fixed is not None else _dtype_so_far(shards))
            before = current.dtype
            current.write(tokens)
            current.write(sep_arr)
            if current.dtype != before:  # the first id past uint16: the finished shards follow
                for shard in shards:
                    widen_file(out / shard["file"], format, before, current.dtype)
                    shard["dtype"] = str(current.dtype)
            documents += 1
            if current.tokens >= shard_tokens:
                current.finish()
                shards.append({"file": current.path.name, "tokens": current.tokens, "dtype": str(current.dtype)})
                current = None
        if current is not None:
            current.finish()
            shards.append({"file": current.path.name, "tokens": current.tokens, "dtype": str(current.dtype)})
            current = None
    finally:
        if current is not None:
            current.abandon()
    index = {
        "format": format,
        "dtype": shards[-1]["dtype"] if shards else str(fixed or np.dtype(np.uint16)),
        "sep": int(sep),
        "documents": documents,
        "tokens": sum(s["tokens"] for s in shards),
        "shards": [{"file": s["file"], "tokens": s["tokens"]} for s in shards],
    }
    tmp = out / f".{INDEX}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, out / INDEX)
    return index


def _dtype_so_far(shards: list[dict[str, Any]]) -> np.dtype | None:
    """An automatic dtype continues where the shards so far stand (uint32 once widened)."""
    if shards and shards[-1]["dtype"] != "uint16":
        return np.dtype(shards[-1]["dtype"])
    return None


def _integer_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ConfigError(f"dtype must name an integer NumPy dtype (uint16, uint32, int32, int64); got {dtype!r}") from e
    if not np.issubdtype(dt, np.integer):
        raise ConfigError(f"dtype must be an integer dtype (uint16, uint32, int32, int64); got {dt}")
    return dt


def _shard_files(path: PathLike | Sequence[PathLike]) -> tuple[list[Path], dict[str, Any] | None]:
    """The shard files ``path`` names (a directory: its index's list, else every .npy/.bin in it, by
    name; one file; or a list of files), and the directory's index when it has one."""
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
        if p.is_dir():
            if (p / INDEX).exists():
                index = json.loads((p / INDEX).read_text())
                return [p / s["file"] for s in index["shards"]], index
            files = sorted(f for f in p.iterdir() if f.suffix in (".npy", ".bin") and not f.name.startswith("."))
            if not files:
                raise ConfigError(f"{p} holds no token shards (.npy or .bin files); write some with shardwise.data.write_token_shards")
            return files, None
        files = [p]
    else:
        files = [Path(f) for f in path]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ConfigError(
            f"token shard files not found: {', '.join(missing[:3]) or 'none given'}; give a directory of .npy/.bin shards, a file, or a list of files"
        )
    return files, None


def _layout(file: Path, dtype: np.dtype | None) -> tuple[int, np.dtype, int]:
    """(offset of the first token, dtype, tokens) of one shard file; a .npy says its own from its header."""
    if file.suffix == ".npy":
        with open(file, "rb") as f:
            version = npy_format.read_magic(f)
            read = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
            shape, _, dt = read(f)
            offset = f.tell()
        if not np.issubdtype(dt, np.integer):
            raise ConfigError(f"{file} holds {dt} values, not token ids; token shards are integer arrays")
        if dtype is not None and dtype != dt:
            raise ConfigError(f"{file} holds {dt} tokens and dtype={dtype} was given; leave dtype out for .npy shards (the header says it)")
        return offset, dt, int(np.prod(shape))
    if dtype is None:
        raise ConfigError(
            f"{file} is a raw .bin shard and its dtype is unknown: its directory has no {INDEX} and no dtype was given. "
            "Pass dtype= (e.g. TokenShards(path, seq_len, dtype='uint16')), or write the shards with write_token_shards"
        )
    size = file.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(f"{file} has {size} bytes, not a whole number of {dtype} tokens ({dtype.itemsize} bytes each); check dtype=")
    return 0, dtype, size // dtype.itemsize


class TokenShards(Dataset[Any]):
    """Fixed-length blocks of a directory of token shards, a map-style dataset (see the module's notes).

    ``path``: a directory (its ``index.json`` when present, else every ``.npy``/``.bin`` in it by
    name), one file, or a list of files. ``dtype``: the tokens' dtype for ``.bin`` shards without an
    index (``.npy`` headers say theirs). ``sep``: the separator id (from the index when absent),
    needed for ``document_mask``. ``shuffle_window``: blocks per window of `epoch_order`.
    ``labels``: ``"shifted"`` gives ``(x, y)`` with ``x = block[:-1]``, ``y = block[1:]``; ``"hf"``
    gives ``{"input_ids": x, "labels": x}`` for transformers' causal LMs, which shift inside (their
    loss then has ``seq_len - 1`` targets a block, as HF's own ``group_texts`` blocks do).
    ``document_mask=True``: a block holds several documents (each ends with ``sep``); the sample
    adds ``position_ids`` restarting at 0 at each document and a block-diagonal causal
    ``attention_mask`` (bool, ``(1, seq_len, seq_len)``, True = may attend; a batch collates to
    ``(B, 1, seq, seq)``, which transformers takes as given): the shifted sample becomes
    ``(x, attention_mask, position_ids, y)``, the order of a causal LM's positional arguments.
    transformers' sdpa and flex attention read a bool mask; eager attention adds the mask to the
    scores, so give it `additive_mask` (in the model's dtype) in a collate function.
    """

    def __init__(
        self,
        path: PathLike | Sequence[PathLike],
        seq_len: int,
        *,
        dtype: str | np.dtype | None = None,
        sep: int | None = None,
        shuffle_window: int = 8192,
        labels: str = "shifted",
        document_mask: bool = False,
    ) -> None:
        for name, value in (("seq_len", seq_len), ("shuffle_window", shuffle_window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1; got {value!r}")
        if labels not in ("shifted", "hf"):
            raise ConfigError(
                f"labels must be 'shifted' ((x, y) with y = x moved by one token) or 'hf' (input_ids and labels for transformers); got {labels!r}"
            )
        files, index = _shard_files(path)
        given = None if dtype is None else _integer_dtype(dtype)
        if index is not None and given is None and index.get("format") == "bin":
            given = np.dtype(index["dtype"])
        index_sep = None if index is None else index.get("sep")
        if sep is not None and index_sep is not None and int(sep) != int(index_sep):
            raise ConfigError(f"sep={sep} was given and the shards' {INDEX} says {index_sep}; leave sep out to use the index's")
        self.sep = int(sep) if sep is not None else (None if index_sep is None else int(index_sep))
        if document_mask and self.sep is None:
            raise ConfigError(
                "document_mask=True splits blocks into documents at the separator, and no sep is known: pass sep= (the id that ends each document)"
            )
        if not files:
            raise ConfigError(f"{path}'s {INDEX} lists no shards (the documents written were all empty); write some tokens first")
        layouts = [_layout(f, given) for f in files]
        self.files = [str(f) for f in files]
        self.seq_len, self.shuffle_window, self.labels, self.document_mask = seq_len, shuffle_window, labels, bool(document_mask)
        self._offsets = [o for o, _, _ in layouts]
        self._dtypes = [d for _, d, _ in layouts]
        self.shard_tokens = [n for _, _, n in layouts]
        self.blocks_per_shard = [max(0, n - 1) // seq_len for n in self.shard_tokens]
        self._ends = [int(e) for e in np.cumsum(self.blocks_per_shard)]  # a list: bisect per sample beats np.searchsorted
        if not len(self):
            raise ConfigError(
                f"the shards hold {sum(self.shard_tokens)} tokens: no shard has a block of seq_len + 1 = {seq_len + 1}; lower seq_len or add data"
            )
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def tokens(self) -> int:
        return sum(self.shard_tokens)

    @property
    def tail_tokens(self) -> int:
        """Tokens no block covers: each shard's tail shorter than a block (all of a shard too short for one)."""
        return sum(n - (b * self.seq_len + 1 if b else 0) for n, b in zip(self.shard_tokens, self.blocks_per_shard, strict=True))

    def __repr__(self) -> str:
        dts = sorted({str(d) for d in self._dtypes})
        return (
            f"TokenShards({len(self.files)} shards, {self.tokens:,} tokens ({'/'.join(dts)}), {len(self):,} blocks of "
            f"{self.seq_len}+1, {self.tail_tokens:,} tokens left out at shard ends, labels={self.labels!r}, "
            f"document_mask={self.document_mask}, shuffle_window={self.shuffle_window})"
        )

    @property
    def order_key(self) -> str:
        """What the epoch's order depends on besides (seed, epoch): the shards' names and block counts and the
        shuffle window. Saved with the loader's position; a resume whose order would differ is refused."""
        shards = ",".join(f"{Path(f).name}:{b}" for f, b in zip(self.files, self.blocks_per_shard, strict=True))
        return f"window={self.shuffle_window};seq_len={self.seq_len};{shards}"

    def epoch_order(self, seed: int, epoch: int) -> BlockOrder:
        """Epoch ``epoch``'s order of the blocks: what `ShardedLoader` shuffles with (O(window + shards) memory)."""
        return BlockOrder(self.blocks_per_shard, seed, epoch, self.shuffle_window)

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, first token) of block ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} of {len(self)}")
        k = bisect.bisect_right(self._ends, i)
        return k, (i - (self._ends[k - 1] if k else 0)) * self.seq_len

    def block(self, i: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of block ``i`` (int64), read with one pread."""
        k, start = self.locate(int(i))
        dt = self._dtypes[k]
        want = (self.seq_len + 1) * dt.itemsize
        at = self._offsets[k] + start * dt.itemsize
        fd, chunks = self._fd(k), []
        while want:
            data = os.pread(fd, want, at)
            if not data:
                raise OSError(f"{self.files[k]} ended at byte {at}: the file shrank after it was indexed")
            chunks.append(data)
            want, at = want - len(data), at + len(data)
        return np.frombuffer(b"".join(chunks) if len(chunks) > 1 else chunks[0], dt).astype(np.int64)

    draws_no_randomness = True  # a block is a function of its index: the loader skips per-sample seeding

    def __getitem__(self, i: int) -> Any:
        block = torch.from_numpy(self.block(i))
        x = block[:-1]
        sep = -1 if self.sep is None else self.sep  # set whenever document_mask is (checked in __init__)
        if self.labels == "hf":
            sample = {"input_ids": x, "labels": x.clone()}
            if self.document_mask:
                sample["attention_mask"], sample["position_ids"] = document_mask(x, sep)
            return sample
        if self.document_mask:
            mask, positions = document_mask(x, sep)
            return x, mask, positions, block[1:]
        return x, block[1:]

    def _fd(self, k: int) -> int:
        if os.getpid() != self._pid:  # a forked child (a loader worker): its own descriptors
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(k)
        if fd is None:
            fd = self._fds[k] = os.open(self.files[k], os.O_RDONLY)
        return fd

    def close(self) -> None:
        """Close this process's open shard files (reopened on the next read)."""
        fds, self._fds = self._fds, {}
        if self._pid == os.getpid():
            for fd in fds.values():
                os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):  # at interpreter exit, or a half-built object
            pass

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()


def document_mask(x: torch.Tensor, sep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention mask, position ids) of a packed block: a ``sep`` ends a document, so token t
    belongs to document ``#seps before t``; t may attend to s <= t of its own document, and its
    position restarts at 0 where its document starts. The mask is bool ``(1, T, T)``."""
    doc = torch.cumsum((x == sep).long(), 0) - (x == sep).long()  # seps strictly before t
    t = torch.arange(len(x))
    starts = torch.zeros(int(doc[-1]) + 1, dtype=torch.long).scatter_reduce(0, doc, t, reduce="amin", include_self=False)
    mask = (doc[:, None] == doc[None, :]) & (t[:, None] >= t[None, :])
    return mask[None], t - starts[doc]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask as the additive one eager attention expects: 0 where True, the dtype's
    lowest value where False (transformers' own convention). Use the model's dtype: sdpa reads an
    additive mask of another float dtype wrongly."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)
