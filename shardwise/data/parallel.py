"""``shardwise.data.map``: apply a function to every item of a data set with local worker
processes (or a Ray cluster), results in input order, cached by content hash.

Preprocessing (tokenizing text, computing features) is the part of a pipeline that runs before
training and is embarrassingly parallel: each item is transformed alone. ``map`` cuts the items
into chunks whose size depends only on the number of items (never on the worker count), hands
the chunks to ``workers`` processes started with the *spawn* method (fresh interpreters: no
forked torch threads or locks), and puts the results back in input order. The output is
therefore the same list for 1, 2 or 3 workers, and the same chunks hash to the same keys.

Cache. Each chunk's results are stored under ``cache_dir`` (default ``.shardwise-cache`` in the
current directory; pass another, or ``cache=False``) in a file named by a SHA-256 of: a format
version, ``fn``'s module and qualified name, its source code (for a ``functools.partial``, the
wrapped function's plus the bound arguments), the caller's ``version``, and the bytes of the
chunk's items (tensors by dtype, shape and raw bytes; strings, numbers and containers by value).
A second run with the same function and items reads the files instead of computing ("cached").
The source hash does not see helpers ``fn`` calls: after changing one, pass a new ``version``
or delete the cache directory. Files are written to a temporary name and renamed, and read
back with ``torch.load(weights_only=True)``, so results must be tensors, numbers, strings,
bytes, None, or lists / tuples / dicts of them (anything else: ``cache=False``).

Backends: ``"processes"`` (default; ``multiprocessing`` with the spawn context, so ``fn`` must be
picklable: a module-level function or a ``functools.partial`` of one, not a lambda or a nested
function) and ``"ray"`` (one Ray task per chunk; connects to the cluster ``ray.init()`` finds,
else starts a local one with ``workers`` CPUs and stops it after; the optional extra
``pip install 'shardwise[ray]'``).

>>> from shardwise.data import map as pmap
>>> out = pmap(str.upper, ["a", "b"], workers=2, cache=False)  # doctest: +SKIP
>>> list(out), out.computed_chunks                                # doctest: +SKIP
(['A', 'B'], 2)
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from shardwise.errors import ConfigError

CACHE_FORMAT = 1
"""Part of every cache key: bump it when the key or the file layout changes."""
DEFAULT_CACHE_DIR = ".shardwise-cache"
MAX_CHUNKS = 64
"""The default chunk size is ``ceil(items / MAX_CHUNKS)``: enough chunks to balance a few
workers, few enough that each chunk's pickling and file cost is small."""

Backend = Literal["processes", "ray"]


class Mapped(list[Any]):
    """The results, in input order (a ``list``), and how they were obtained."""

    cached_chunks: int = 0
    computed_chunks: int = 0
    workers: int = 1
    backend: str = "processes"
    seconds: float = 0.0
    cache_dir: Path | None = None

    def describe(self) -> str:
        """One line: items, chunks read from the cache and computed, workers, time."""
        where = f" (cache {self.cache_dir})" if self.cache_dir is not None else " (no cache)"
        if self.computed_chunks == 0 and self.cached_chunks:
            how = f"cached: all {self.cached_chunks} chunks read"
        else:
            how = f"{self.computed_chunks} chunks computed with {self.workers} {self.backend} worker(s), {self.cached_chunks} cached"
        return f"{len(self)} items: {how} in {self.seconds:.3f} s{where}"


# -- hashing ---------------------------------------------------------------------------------


def _feed(h: Any, obj: Any) -> None:
    """Feed ``obj``'s content (with its type) to the hash ``h``: equal values, equal bytes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"ndarray:{a.dtype.str}:{a.shape}:".encode())
        h.update(a.tobytes())
    elif isinstance(obj, (str, bytes)):
        data = obj.encode() if isinstance(obj, str) else obj
        h.update(f"{type(obj).__name__}:{len(data)}:".encode())
        h.update(data)
    elif obj is None or isinstance(obj, (bool, int, float, complex)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}:{len(obj)}[".encode())
        for item in obj:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(obj, dict):
        h.update(f"dict:{len(obj)}{{".encode())
        for key in obj:  # insertion order is part of the value a function sees
            _feed(h, key)
            _feed(h, obj[key])
        h.update(b"}")
    else:
        h.update(f"pickle:{type(obj).__module__}.{type(obj).__qualname__}:".encode())
        h.update(pickle.dumps(obj, protocol=4))


def _code_of(fn: Any) -> str:
    """What identifies ``fn``'s behaviour: its qualified name and source code."""
    if isinstance(fn, functools.partial):
        h = hashlib.sha256()
        _feed(h, list(fn.args))
        _feed(h, dict(sorted(fn.keywords.items())))
        return f"partial({_code_of(fn.func)}, {h.hexdigest()})"
    name = f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):  # built-in or C functions: their name is their identity
        source = ""
    if not (inspect.isfunction(fn) or inspect.isbuiltin(fn) or inspect.ismethod(fn) or isinstance(fn, type)):
        source += pickle.dumps(fn, protocol=4).hex()  # a callable object: its state too
    return f"{name}\n{source}"


def function_key(fn: Callable[[Any], Any], version: str | int = 0) -> str:
    """The part of every chunk's cache key that depends on the function (and ``version``)."""
    return hashlib.sha256(f"shardwise.data.map/{CACHE_FORMAT}\n{version}\n{_code_of(fn)}".encode()).hexdigest()


def chunk_key(fn_key: str, items: Sequence[Any]) -> str:
    h = hashlib.sha256(fn_key.encode())
    _feed(h, list(items))
    return h.hexdigest()


# -- the cache -------------------------------------------------------------------------------


def _cacheable(obj: Any) -> bool:
    if obj is None or isinstance(obj, (torch.Tensor, bool, int, float, str, bytes)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_cacheable(x) for x in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, (str, int)) and _cacheable(v) for k, v in obj.items())
    return False


def _read(path: Path) -> list[Any] | None:
    """A cached chunk, or None when there is none (or it cannot be read: it is then recomputed)."""
    if not path.is_file():
        return None
    try:
        value = torch.load(path, weights_only=True, map_location="cpu")
    except Exception:  # a damaged or foreign file is a miss, never a wrong result
        return None
    return value if isinstance(value, list) else None


def _write(path: Path, results: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    torch.save(results, tmp)
    os.replace(tmp, path)  # atomic: a reader sees the whole file or none


# -- workers ---------------------------------------------------------------------------------


def _apply(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """One chunk (module level, so spawned workers can import it)."""
    return [fn(item) for item in items]


def _check_picklable(fn: Any) -> None:
    try:
        pickle.dumps(fn)
    except Exception as exc:
        what = getattr(fn, "__qualname__", type(fn).__name__)
        raise ConfigError(
            f"map needs a picklable function; {what!r} is not ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            "Define it at module level (not a lambda or a nested function), or bind arguments with functools.partial"
        ) from None


def _items(dataset: Any) -> list[Any]:
    if isinstance(dataset, (str, bytes)):
        raise ConfigError(f"map takes a sequence of items; got a single {type(dataset).__name__} (wrap it in a list, or split it into pieces)")
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return [dataset[i] for i in range(len(dataset))]
    try:
        return list(dataset)
    except TypeError:
        raise ConfigError(f"map takes a sequence or a Dataset (len and indexing) or an iterable; got {type(dataset).__name__}") from None


def _run_processes(fn: Callable[[Any], Any], chunks: list[list[Any]], workers: int) -> list[list[Any]]:
    if workers == 1 or len(chunks) <= 1:
        return [_apply(fn, c) for c in chunks]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(workers, len(chunks))) as pool:
        return pool.starmap(_apply, [(fn, c) for c in chunks], chunksize=1)


def _run_ray(fn: Callable[[Any], Any], chunks: list[list[Any]], workers: int) -> list[list[Any]]:
    environ = dict(os.environ)  # importing ray and ray.init set RAY_* (and PYTHONBREAKPOINT) here
    try:
        import ray
    except ImportError:
        raise ConfigError("backend='ray' needs Ray; install it with: pip install 'shardwise[ray]'") from None
    started = not ray.is_initialized()
    # ray.init replaces the caller's SIGTERM handler (with sys.exit) and ray.shutdown leaves it there
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if started and main_thread else {}
    if started:
        # A cluster that ray.init finds (RAY_ADDRESS, a running head) is joined; else a local
        # instance with `workers` CPUs starts here and stops after.
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        remote = ray.remote(num_cpus=1)(_apply)
        fn_ref = ray.put(fn)
        return list(ray.get([remote.remote(fn_ref, c) for c in chunks]))
    finally:
        if started:
            ray.shutdown()
            os.environ.clear()  # the local instance is gone: its variables go with it
            os.environ.update(environ)
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


def map(  # noqa: A001 - shardwise.data.map is the name the public API asked for
    fn: Callable[[Any], Any],
    dataset: Any,
    *,
    workers: int = 1,
    cache_dir: str | os.PathLike[str] | None = None,
    cache: bool = True,
    version: str | int = 0,
    chunk_size: int | None = None,
    backend: Backend = "processes",
) -> Mapped:
    """``[fn(item) for item in dataset]``, computed by ``workers`` processes, in input order.

    ``cache_dir``: where results are kept (default ``./.shardwise-cache``); ``cache=False``
    reads and writes nothing. ``version`` goes into the key (change it to invalidate).
    ``chunk_size``: items per task and per cache file (default ``ceil(len / 64)``); it is part
    of the cache key's input, so keep it fixed between runs that should share a cache.
    Returns a `Mapped` (a list) whose ``describe()`` says what was cached and what computed.
    """
    start = time.perf_counter()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"map: workers must be a whole number >= 1; got {workers!r}")
    if backend not in ("processes", "ray"):
        raise ConfigError(f"map: backend must be 'processes' or 'ray'; got {backend!r}")
    if not callable(fn):
        raise ConfigError(f"map needs a function of one item; got {type(fn).__name__}")
    _check_picklable(fn)  # refused at any worker count, so 1 worker behaves as N do
    items = _items(dataset)
    size = chunk_size if chunk_size is not None else max(1, math.ceil(len(items) / MAX_CHUNKS))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"map: chunk_size must be a whole number >= 1; got {chunk_size!r}")
    chunks = [items[i : i + size] for i in range(0, len(items), size)]
    root = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR) if cache else None
    results: list[list[Any] | None] = [None] * len(chunks)
    paths: list[Path | None] = [None] * len(chunks)
    if root is not None:
        fn_key = function_key(fn, version)
        for i, chunk in enumerate(chunks):
            key = chunk_key(fn_key, chunk)
            paths[i] = root / "map" / key[:2] / f"{key}.pt"
            results[i] = _read(paths[i])  # type: ignore[arg-type]
    todo = [i for i, r in enumerate(results) if r is None]
    run = _run_ray if backend == "ray" else _run_processes
    for i, done in zip(todo, run(fn, [chunks[i] for i in todo], workers), strict=True):
        results[i] = done
        path = paths[i]
        if path is not None:
            if not _cacheable(done):
                bad = next(type(x).__name__ for x in done if not _cacheable(x))
                raise ConfigError(
                    f"map's cache keeps tensors, numbers, strings, bytes and lists/tuples/dicts of them; fn returned a {bad}. "
                    "Return those types, or pass cache=False"
                )
            _write(path, done)
    out = Mapped(x for chunk in results for x in (chunk or []))
    out.cached_chunks, out.computed_chunks = len(chunks) - len(todo), len(todo)
    out.workers, out.backend, out.cache_dir = workers, backend, root
    out.seconds = time.perf_counter() - start
    return out
