"""Streams: `StreamLoader`, the global-batch loader over an iterable source (docs/data.md, "Streams").

The stream's order is the global order. Every rank iterates the whole stream and keeps sample ``i`` of
an epoch iff ``i % world == rank`` (stride, as Hugging Face's ``split_dataset_by_node`` when shards do not
divide), so step ``s`` trains on samples ``[s*B, (s+1)*B)`` at any world size: rank r's ``m*a`` samples
of the step are ``s*B + r + W*j`` and its micro-batch ``k`` holds ``j in [k*m, (k+1)*m)``. The position is
(epoch, samples consumed in the epoch); a resume loads the source's own state (``state_dict`` /
``load_state_dict``, saved at each step boundary) or replays the stream up to the position. Each
``next()`` runs with the global generators seeded from ``sample_seed(seed, epoch, i)``, so the samples
do not depend on the world size, the number of loader workers or a replay. An epoch ends when the
stream ends: every rank reads the whole stream, so all see the end at the same step, with no
communication.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from shardwise.data import Collate, ShardedLoader, _own_rng, _seed_all, check_workers, draws_no_randomness, per_rank_batch, pin, sample_seed
from shardwise.errors import ConfigError

__all__ = ["RESUMES", "StreamLoader", "check_source", "first_samples", "is_stream", "loader_for", "state_loses_samples", "stateful", "stream_length"]

RESUMES = ("auto", "replay")
"""How a resume finds its place in a stream: 'auto' loads the source's own state where it has
``state_dict``/``load_state_dict`` (else replays), 'replay' always reads the stream again up to the position."""


def is_stream(data: Any) -> bool:
    """Whether ``data`` is a stream: an ``IterableDataset``, or any object with ``__iter__`` and no ``__getitem__``."""
    return isinstance(data, IterableDataset) or (hasattr(data, "__iter__") and not hasattr(data, "__getitem__"))


def check_source(source: Any) -> None:
    """A one-shot iterator (a generator) cannot start a second epoch or a replay: a `ConfigError`."""
    if hasattr(source, "__next__"):
        raise ConfigError(
            f"the training data is a {type(source).__name__}, an iterator: it can be read once, so it has no second epoch and "
            "cannot be replayed on a resume. Give an iterable whose __iter__ starts the stream anew (a torch IterableDataset "
            "whose __iter__ is your generator function), or a map-style Dataset"
        )


def stateful(source: Any) -> bool:
    """Whether the source reports its position (torchdata's stateful loaders, Hugging Face ``datasets``' IterableDataset)."""
    return callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))


def state_loses_samples(source: Any) -> bool:
    """Whether the source's own state leaves samples out: a Hugging Face ``datasets`` stream shuffled with a
    buffer (``.shuffle(seed, buffer_size)``) saves its position but not the buffer, and refills it on a
    resume (measured: 5 of 17 samples lost, one seen twice), so such a source is replayed instead. Found by
    the kinds of its example iterables (``_ex_iterable`` and what each wraps); no other source is known to."""
    todo, seen = [getattr(source, "_ex_iterable", None)], 0
    while todo and seen < 256:
        ex = todo.pop()
        seen += 1
        if ex is None:
            continue
        if "BufferShuffled" in type(ex).__name__:
            return True
        todo.append(getattr(ex, "ex_iterable", None))
        todo.extend(getattr(ex, "ex_iterables", None) or ())
    return False


def stream_length(source: Any) -> int | None:
    """The stream's ``len()``, or None when it has none."""
    try:
        return int(len(source))
    except (TypeError, NotImplementedError, AttributeError):
        return None


@contextlib.contextmanager
def _whole_stream() -> Iterator[None]:
    """Hide the loader worker's identity while the source runs: a source that splits itself over a
    DataLoader's workers (``get_worker_info()``; Hugging Face ``datasets`` does) must be read whole here,
    each worker making its own micro-batches of it."""
    from torch.utils.data._utils import worker

    saved = worker._worker_info
    worker._worker_info = None
    try:
        yield
    finally:
        worker._worker_info = saved


def _read(it: Iterator[Any], seed: int, epoch: int, start: int, count: int, keep: bool = True, seeded: bool = True) -> tuple[list[tuple[int, Any]], int]:
    """Up to ``count`` next samples as (index, sample), sample ``start + t`` read with the global generators seeded
    from (seed, epoch, start + t); and how many were read (``keep=False`` reads and drops them: a replay).
    ``seeded=False`` (a source whose ``__iter__``'s class says ``draws_no_randomness``) skips the seeding."""
    out: list[tuple[int, Any]] = []
    got = 0
    with _own_rng() if seeded else contextlib.nullcontext(), _whole_stream():  # nothing seeded: nothing to put back
        for t in range(count):
            if seeded:
                _seed_all(sample_seed(seed, epoch, start + t))
            try:
                sample = next(it)
            except StopIteration:
                break
            got += 1
            if keep:
                out.append((start + t, sample))
    return out, got


def _open(source: Any, epoch: int, state: Any) -> Iterator[Any]:
    """The source's iterator for ``epoch``: ``set_epoch`` first where it has one, then a saved state."""
    with _whole_stream():
        if callable(getattr(source, "set_epoch", None)):
            source.set_epoch(epoch)
        if state is not None:
            source.load_state_dict(state)
        return iter(source)


def first_samples(source: Any, count: int, seed: int = 0, restore: bool = True) -> list[Any]:
    """The stream's first ``count`` samples of epoch 0, seeded as training reads them; a stateful source's
    position is put back afterwards unless ``restore`` is False (the parent's checks and ``overfit_batches``
    read them; the ranks' agreement check reads a copy)."""
    saved = copy.deepcopy(source.state_dict()) if restore and stateful(source) else None
    try:
        pairs, _ = _read(_open(source, 0, None), seed, 0, 0, count, seeded=not draws_no_randomness(source, "__iter__"))
    finally:
        if saved is not None:
            source.load_state_dict(saved)
    return [s for _, s in pairs]


class _Spec(NamedTuple):
    """What a feed of micro-batches needs (pickled to the loader's workers)."""

    source: Any
    collate: Collate | None
    seed: int
    global_batch: int
    world_size: int
    rank: int
    accumulate: int
    micro: int
    drop_last: bool
    limit: int | None
    capture: bool
    length: int | None = None  # the stream's __len__ where the epoch is cut by it alone: checked against where it ends


class _Item(NamedTuple):
    """One item of a feed: a micro-batch (``kind`` "micro") or an epoch's end ("end")."""

    kind: str
    epoch: int
    batch: Any
    weight: float | None
    samples: int
    state: Any


def _split(spec: _Spec, pairs: list[tuple[int, Any]]) -> tuple[list[list[tuple[int, Any]]], list[float] | None]:
    """This rank's micro-batches of one step (stride ``i % W == r``), and their loss weights for a smaller last
    step: ``size x parts / samples`` each, 0 for a part left empty (it gets a copy of the step's first sample)."""
    mine = pairs[spec.rank :: spec.world_size]
    a = spec.accumulate
    if len(pairs) == spec.global_batch:
        m = spec.micro
        return [mine[k * m : (k + 1) * m] for k in range(a)], None
    sizes = [len(mine) // a + (k < len(mine) % a) for k in range(a)]
    parts, out, at = spec.world_size * a, [], 0
    for size in sizes:
        out.append(mine[at : at + size] or [pairs[0]])
        at += size
    return out, [size * parts / len(pairs) for size in sizes]


def _collate(spec: _Spec, epoch: int, pairs: list[tuple[int, Any]]) -> Any:
    if spec.collate is None:  # torch's default_collate draws nothing
        return default_collate([s for _, s in pairs])
    with _own_rng():
        _seed_all(sample_seed(spec.seed, epoch, -1 - pairs[0][0]))  # a random collate draws as `seeded_fetch`'s does
        return spec.collate([s for _, s in pairs])


def _epoch(spec: _Spec, epoch: int, consumed: int, step: int, state: Any) -> Iterator[tuple[list[list[tuple[int, Any]]], list[float] | None, int]]:
    """The steps of ``epoch`` from a position: (this rank's micro-batches, their weights, the step's samples)."""
    it = _open(spec.source, epoch, state)
    seeded = not draws_no_randomness(spec.source, "__iter__")
    if state is None and consumed:
        _, got = _read(it, spec.seed, epoch, 0, consumed, keep=False, seeded=seeded)  # replay: read and drop what was trained on
        if got < consumed:
            raise ConfigError(
                f"the stream ended after {got} samples of epoch {epoch}, before the checkpoint's position ({consumed} samples): "
                "resume with the same stream (and seed) the checkpoint was trained on"
            )
    i = consumed
    while spec.limit is None or step < spec.limit:
        pairs, got = _read(it, spec.seed, epoch, i, spec.global_batch, seeded=seeded)
        if got < spec.global_batch:
            _check_length(spec, epoch, i + got)
        if not got or (got < spec.global_batch and spec.drop_last):
            return
        micro, weights = _split(spec, pairs)
        yield micro, weights, got
        step, i = step + 1, i + got
        if got < spec.global_batch:
            return
    if spec.length is not None:  # the epoch was cut by __len__: the stream must end there too
        _, got = _read(it, spec.seed, epoch, i, spec.length - i + 1, keep=False, seeded=seeded)
        _check_length(spec, epoch, i + got)


def _check_length(spec: _Spec, epoch: int, read: int) -> None:
    """A stream whose ``__len__`` says another number of samples than it yields: a `ConfigError` (every rank reads
    the whole stream, so every rank raises it at the same step)."""
    if spec.length is not None and read != spec.length:
        more = "at least " if read > spec.length else ""
        raise ConfigError(
            f"{type(spec.source).__name__}.__len__ says {spec.length} samples, and epoch {epoch} of the stream yielded {more}{read}: "
            "the epochs would follow __len__, leaving samples out or reading some twice. Make __len__ return the number of "
            "samples __iter__ yields, or remove __len__ (then set max_steps)"
        )


def _items(spec: _Spec, epoch: int, consumed: int, step: int, state: Any, worker: int = 0, workers: int = 1) -> Iterator[_Item]:
    """Every epoch's items from a position on, endless: worker ``w`` of ``N`` makes the items ``g`` with
    ``g % N == w`` of this rank's sequence (micro-batches, then an end marker per epoch); torch's DataLoader
    hands its workers' items out round-robin, so the order is the one-process order."""
    g = 0
    while True:
        fresh, steps = consumed == 0, 0
        for micro, weights, samples in _epoch(spec, epoch, consumed, step, state):
            steps += 1
            for t, pairs in enumerate(micro):
                if g % workers == worker:
                    last = t == len(micro) - 1
                    after = copy.deepcopy(spec.source.state_dict()) if spec.capture and last else None  # the position after this step
                    yield _Item("micro", epoch, _collate(spec, epoch, pairs), None if weights is None else weights[t], samples, after)
                g += 1
        if fresh and not steps:
            raise ConfigError(
                f"epoch {epoch} of the stream holds no global batch of {spec.global_batch} samples"
                f"{' (drop_last leaves a smaller one out)' if spec.drop_last else ''}: lower the global batch size or give more data"
            )
        if g % workers == worker:
            yield _Item("end", epoch, None, None, 0, None)
        g += 1
        epoch, consumed, step, state = epoch + 1, 0, 0, None


class _Workers(IterableDataset):
    """What each loader worker runs: the whole stream, making its share of this rank's items."""

    def __init__(self, spec: _Spec, start: tuple[int, int, int, Any]) -> None:
        self.spec, self.start = spec, start

    def __iter__(self) -> Iterator[_Item]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return _items(self.spec, *self.start, worker=worker, workers=workers)


def _itself(item: Any) -> Any:
    return item


class StreamLoader:
    """This rank's micro-batches of each global batch of a stream, resumable mid-epoch at any world size.

    The interface of `ShardedLoader`: iterating yields one step at a time (a list of ``accumulate``
    collated micro-batches) until the epoch's stream ends (or ``limit`` steps); the next iteration
    starts the next epoch. ``state_dict`` is the global position (epoch, samples consumed), with the
    source's own state where it reports one (``resume="auto"``), so it loads at another world size; a
    state saved for another global batch is refused. ``num_workers > 0``: each worker iterates the
    stream and collates its share of the micro-batches (the same batches, bit for bit, as without).
    """

    def __init__(
        self,
        source: Any,
        *,
        global_batch: int,
        world_size: int = 1,
        rank: int = 0,
        accumulate: int = 1,
        seed: int = 0,
        collate_fn: Collate | None = None,
        num_workers: int = 0,
        limit: int | float | None = None,
        drop_last: bool = True,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        resume: str = "auto",
    ) -> None:
        """``limit``: steps per epoch (a fraction of the epoch needs a stream with ``__len__``). ``resume``: 'auto'
        (the source's own state where it has ``state_dict``/``load_state_dict``, else a replay) or 'replay'."""
        check_source(source)
        self.source, self.dataset = source, source
        self.global_batch, self.world_size, self.rank, self.accumulate = global_batch, world_size, rank, accumulate
        self.micro = per_rank_batch(global_batch, world_size, accumulate)
        if resume not in RESUMES:
            raise ConfigError(f"resume={resume!r} for a stream: choose 'auto' (the source's own state where it has one, else a replay) or 'replay'")
        self.resume = resume
        self.n = stream_length(source)
        if self.n is not None and self.n < global_batch:
            raise ConfigError(f"the training stream has {self.n} samples, fewer than one global batch of {global_batch}; lower the global batch size")
        if isinstance(limit, float) and self.n is None:
            raise ConfigError(f"limit_train_batches={limit} is a fraction of an epoch, and the stream has no __len__: give a whole number of steps")
        self.seed, self.collate_fn, self.limit, self.drop_last = seed, collate_fn, limit, drop_last
        check_workers(num_workers, prefetch_factor)
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.epoch, self.step_in_epoch, self.consumed = 0, 0, 0
        self._source_state: Any = None
        self._last: tuple[list[float] | None, int] = (None, global_batch)
        self._feed: Any = None
        self._feed_at: tuple[int, int, int] | None = None

    @property
    def uses_state(self) -> bool:
        """Whether a resume loads the source's own state (else it replays the stream up to the position)."""
        return self.resume == "auto" and stateful(self.source) and not state_loses_samples(self.source)

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps an epoch takes; None when the stream has no ``__len__`` (the epoch ends where the stream does)."""
        if self.n is None:
            return None
        full = self.n // self.global_batch if self.drop_last else -(-self.n // self.global_batch)
        if self.limit is None:
            return full
        return max(1, min(full, int(full * self.limit))) if isinstance(self.limit, float) else min(full, self.limit)

    @property
    def left_out(self) -> int:
        """Samples of each epoch no step takes (``n % global batch`` under ``drop_last``; 0 without ``__len__``)."""
        return self.n % self.global_batch if self.drop_last and self.n is not None else 0

    @property
    def last_weights(self) -> list[float] | None:
        """The micro-batch loss weights of the step just handed out (None for a full global batch)."""
        return self._last[0] if self.step_in_epoch else None

    @property
    def last_step_samples(self) -> int:
        """Samples in the global batch of the step just handed out."""
        return self._last[1] if self.step_in_epoch else self.global_batch

    def _spec(self) -> _Spec:
        limit = self.steps_per_epoch if self.n is not None else self.limit if isinstance(self.limit, int) else None  # a known length ends the epoch
        return _Spec(
            self.source,
            self.collate_fn,
            self.seed,
            self.global_batch,
            self.world_size,
            self.rank,
            self.accumulate,
            self.micro,
            self.drop_last,
            limit,
            self.uses_state,
            self.n if self.limit is None else None,
        )

    def _position(self) -> tuple[int, int, int]:
        return self.epoch, self.consumed, self.step_in_epoch

    def _epoch_over(self) -> bool:
        spe = self.steps_per_epoch
        limit = spe if spe is not None else self.limit if isinstance(self.limit, int) else None
        return limit is not None and self.step_in_epoch >= limit

    def _next_epoch(self) -> None:
        self.epoch, self.step_in_epoch, self.consumed, self._source_state = self.epoch + 1, 0, 0, None

    def _open_feed(self) -> Any:
        """The feed of items from the current position: kept across iterations while it stands there, else a new one."""
        if self._feed is not None and self._feed_at == self._position():
            return self._feed
        self.close()
        start = (self.epoch, self.consumed, self.step_in_epoch, self._source_state if self.uses_state and self.consumed else None)
        if self.num_workers == 0:
            self._feed = _items(self._spec(), *start)
        else:
            loader = DataLoader(
                _Workers(self._spec(), start),
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=_itself,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor,
                generator=torch.Generator().manual_seed(self.seed),  # starting workers draws nothing from the global generator
            )
            self._feed = iter(loader)
        self._feed_at = self._position()
        return self._feed

    def __iter__(self) -> Iterator[list[Any]]:
        """The current epoch's remaining steps; the next iteration starts the next epoch."""
        if self._epoch_over():
            if self._feed is not None and self._feed_at == self._position():
                next(self._feed)  # the epoch's end marker
                self._next_epoch()
                self._feed_at = self._position()
            else:
                self._next_epoch()
        feed = self._open_feed()
        while not self._epoch_over() or self.steps_per_epoch is None:
            first = next(feed)
            if first.kind == "end":
                break
            items = [first, *(next(feed) for _ in range(self.accumulate - 1))]
            last = items[-1]
            self.step_in_epoch += 1
            self.consumed += last.samples
            self._source_state = last.state
            self._last = ([it.weight for it in items] if last.weight is not None else None, last.samples)
            self._feed_at = self._position()
            batches = [it.batch for it in items]
            yield [pin(b) for b in batches] if self.pin_memory and self.num_workers == 0 else batches
        else:
            return  # a known epoch length reached: the feed's end marker is read at the next iteration
        self._next_epoch()
        self._feed_at = self._position()

    def close(self) -> None:
        """Stop the data-loading worker processes (the Trainer calls this at the end of a run)."""
        feed, self._feed, self._feed_at = self._feed, None, None
        if feed is not None and hasattr(feed, "_shutdown_workers"):
            feed._shutdown_workers()
        elif feed is not None and hasattr(feed, "close"):
            feed.close()

    def state_dict(self) -> dict[str, Any]:
        """The global position: epoch, steps and samples consumed in it, and the source's state after them (or None: replay)."""
        source = self._source_state if self.uses_state and self.consumed else None
        return {
            "kind": "stream",
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "source": source,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position, saved at any world size; another global batch is refused."""
        if state.get("kind") != "stream":
            raise ConfigError(
                "the checkpoint's data position is a map-style loader's (a Dataset read by index) and this run trains on a stream: "
                "resume with the data the checkpoint was trained on"
            )
        if state.get("global_batch") != self.global_batch:
            raise ConfigError(
                f"the checkpoint's data position was saved for global batches of {state.get('global_batch')} samples; this run takes "
                f"{self.global_batch}: a stream's position counts samples of whole global batches. Resume with global batch size {state.get('global_batch')}"
            )
        self.close()
        self.epoch, self.step_in_epoch, self.consumed = int(state["epoch"]), int(state["step_in_epoch"]), int(state["consumed"])
        self.seed = int(state["seed"])
        self._source_state = state.get("source") if self.uses_state else None


def loader_for(dataset: Any, *, resume: str = "auto", shuffle: bool = True, **options: Any) -> ShardedLoader | StreamLoader:
    """The loader over ``dataset``: a `StreamLoader` for a stream (``resume``: 'auto' or 'replay'; a stream
    keeps its own order, ``shuffle`` is not used), else a `ShardedLoader`; ``options`` are the loaders' own."""
    if is_stream(dataset):
        return StreamLoader(dataset, resume=resume, **options)
    return ShardedLoader(dataset, shuffle=shuffle, **options)
