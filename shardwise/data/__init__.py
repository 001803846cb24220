"""Global-batch data loading: a stateful sharded sampler and exact-once evaluation.

The user sets the *global* batch; each step rank r takes the r-th contiguous slice of a seeded
permutation of the epoch and splits it into ``accumulate`` micro-batches, so results do not
depend on the world size, and the loader's position (epoch, steps) is all its state: a resume
continues with exactly the next samples. ``batches.py`` turns a batch into a call and a loss;
``shardwise.data.map`` (``parallel.py``) preprocesses before training. Design notes (the last
smaller batch, per-sample seeding, one worker pool per run, pinned batches and prefetch,
evaluation shards): docs/data.md.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset
from torch.utils.data._utils.collate import default_collate

from shardwise.errors import ConfigError

Collate = Callable[[list[Any]], Any]


def per_rank_batch(global_batch: int, world_size: int, accumulate: int = 1) -> int:
    """Micro-batch size on one rank; an indivisible combination is a `ConfigError`."""
    for name, value in (("global batch", global_batch), ("world size", world_size), ("accumulate", accumulate)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a whole number >= 1; got {value!r}")
    parts = world_size * accumulate
    if global_batch % parts:
        lower = max(parts, global_batch - global_batch % parts)
        raise ConfigError(
            f"global batch {global_batch} is not divisible by world size {world_size} x accumulate {accumulate}; "
            f"choose a global batch that is a multiple of {parts} (e.g. {lower} or {lower + parts}): "
            f"global_batch_size= in Python, --global-batch-size on the command line"
        )
    return global_batch // parts


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def epoch_order(dataset: Any, n: int, seed: int, epoch: int, shuffle: bool = True) -> Any:
    """Epoch ``epoch``'s order of ``n`` samples: ``dataset.epoch_order(seed, epoch)`` where the dataset has
    one (`TokenShards`: O(window + shards) memory, not O(n)), else `epoch_permutation`. Any object with
    ``len`` and int and slice indexing serves (a tensor, a range, a list, `shardwise.data.order.BlockOrder`)."""
    if not shuffle:
        return range(n)
    own = getattr(dataset, "epoch_order", None)
    if callable(own):
        order = own(seed, epoch)
        if len(order) != n:
            raise ConfigError(f"{type(dataset).__name__}.epoch_order({seed}, {epoch}) has {len(order)} positions and the dataset {n} samples; they must match")
        return order
    return epoch_permutation(n, seed, epoch)


def _ids(part: Any) -> list[int]:
    """A slice of an order as a list of ints (a tensor's ``tolist``, a range or a list as they are)."""
    return part.tolist() if isinstance(part, torch.Tensor) else [int(i) for i in part]


def fetch(dataset: Any, indices: Sequence[int], collate: Collate | None = None) -> Any:
    """Gather one batch: tensor data sets are indexed in one call, others sample by sample."""
    if collate is None and isinstance(dataset, TensorDataset):
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return tuple(t[idx] for t in dataset.tensors)
    samples = [dataset[i] for i in indices]
    return (collate or default_collate)(samples)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index`` in ``epoch``: what any randomness in ``__getitem__`` draws from."""
    return (seed * 1_000_003 + epoch) * 2_147_483_647 + index * 7_919 + 1


@contextlib.contextmanager
def _own_rng() -> Iterator[None]:
    """Run with torch's CPU, Python's and NumPy's generators saved and restored around it."""
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(np_state)


def _seed_all(value: int) -> None:
    torch.default_generator.manual_seed(value)  # the CPU generator alone: torch.manual_seed also seeds every device (~250 us)
    random.seed(value)
    np.random.seed(value % 2**32)


def seeded_fetch(dataset: Any, indices: Sequence[int], collate: Collate | None, seed: int, epoch: int) -> Any:
    """One batch with each sample's randomness a function of (seed, epoch, index) alone.

    Augmentation in ``__getitem__`` (and a random collate) draws from torch's, Python's and
    NumPy's global generators; seeding them per sample makes a batch the same in the main
    process or in any data-loading worker, at any world size. The caller's generators are left
    as they were (dropout in the training step draws its own stream). A ``TensorDataset``
    holds no randomness and is indexed in one call; a dataset that says it draws none
    (`draws_no_randomness`) skips the seeding (~70 us a sample)."""
    if collate is None and (isinstance(dataset, TensorDataset) or draws_no_randomness(dataset)):
        return fetch(dataset, indices)
    with _own_rng():
        samples = []
        for i in indices:
            _seed_all(sample_seed(seed, epoch, int(i)))
            samples.append(dataset[i])
        _seed_all(sample_seed(seed, epoch, -1 - int(indices[0])) if len(indices) else seed)
        return (collate or default_collate)(samples)


def draws_no_randomness(dataset: Any, method: str = "__getitem__") -> bool:
    """Whether ``dataset``'s samples draw nothing from the global generators: the class that defines
    its ``method`` (``__getitem__``; a stream's ``__iter__``) sets ``draws_no_randomness = True``
    (`TokenShards` does). Declared by that class itself, so a subclass that overrides the method (an
    augmentation) is seeded again unless it says so too."""
    for klass in type(dataset).__mro__:
        if method in vars(klass):
            return vars(klass).get("draws_no_randomness") is True
    return False


class _SeededBatches(Dataset):
    """What the persistent DataLoader's workers run: a key (epoch, indices) -> the seeded micro-batch."""

    def __init__(self, dataset: Any, collate: Collate | None, seed: int) -> None:
        self.dataset, self.collate, self.seed = dataset, collate, seed

    def __getitem__(self, key: tuple[int, tuple[int, ...]]) -> Any:
        epoch, indices = key
        return seeded_fetch(self.dataset, indices, self.collate, self.seed, epoch)

    def __len__(self) -> int:
        return len(self.dataset)


def _first(items: list[Any]) -> Any:
    return items[0]


class _PlanSampler(Sampler):
    """Batch sampler over every epoch from a position on: one key per micro-batch, endless."""

    def __init__(self, loader: ShardedLoader, epoch: int, step: int) -> None:
        self.loader, self.epoch, self.step = loader, epoch, step

    def __iter__(self) -> Iterator[list[tuple[int, tuple[int, ...]]]]:
        epoch, step = self.epoch, self.step
        while True:
            perm = self.loader.order(epoch)
            for s in range(step, self.loader.steps_per_epoch):
                for idx in self.loader._step_indices(perm, s):
                    yield [(epoch, tuple(idx))]
            epoch, step = epoch + 1, 0

    def __len__(self) -> int:  # endless; DataLoader only asks for it to size a progress bar
        return 2**62


class _Counted:
    """The next ``n`` items of an iterator (the persistent stream, one epoch at a time)."""

    def __init__(self, it: Iterator[Any], n: int) -> None:
        self.it, self.n = it, n

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        if self.n <= 0:
            raise StopIteration
        self.n -= 1
        return next(self.it)


class ShardedLoader:
    """This rank's micro-batches of each global batch, resumable mid-epoch.

    Iterating yields one step at a time: a list of ``accumulate`` collated
    micro-batches. The position advances as each step is handed out, so a
    checkpoint taken between steps records exactly what was consumed.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        global_batch: int,
        world_size: int = 1,
        rank: int = 0,
        accumulate: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Collate | None = None,
        num_workers: int = 0,
        limit: int | float | None = None,
        drop_last: bool = True,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
    ) -> None:
        """``limit``: steps per epoch, a whole number or a fraction of the epoch (the first steps of
        each epoch's order; ``limit_train_batches``). ``drop_last=False``: the epoch's last, smaller
        global batch is a step too (`step_weights`). ``pin_memory``: hand out batches in page-locked
        memory (by the DataLoader's pin thread with workers, else as each is fetched), so that a copy to
        the GPU with ``non_blocking=True`` is asynchronous; only where CUDA exists (`pinning`), else ignored.
        ``prefetch_factor``: micro-batches each worker keeps ready (torch's default 2); needs workers."""
        self.dataset = dataset
        self.n = len(dataset)  # type: ignore[arg-type]
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.accumulate = accumulate
        self.micro = per_rank_batch(global_batch, world_size, accumulate)
        if self.n < global_batch:
            raise ConfigError(f"the training set has {self.n} samples, fewer than one global batch of {global_batch}; lower the global batch size")
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn
        check_workers(num_workers, prefetch_factor)
        self.num_workers = num_workers
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()  # what is done: no CUDA, nothing to pin for
        self.prefetch_factor = prefetch_factor
        self.limit = limit
        self.drop_last = drop_last
        self.epoch = 0
        self.step_in_epoch = 0
        self._stream: Any = None
        self._stream_position: tuple[int, int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        full = self.n // self.global_batch if self.drop_last else -(-self.n // self.global_batch)  # the last partial global batch is dropped
        if self.limit is None:
            return full
        if isinstance(self.limit, float):
            return max(1, min(full, int(full * self.limit)))
        return min(full, self.limit)

    @property
    def left_out(self) -> int:
        """Samples of each epoch no step takes (``n % global batch`` under ``drop_last``, else 0)."""
        return self.n % self.global_batch if self.drop_last else 0

    def _parts(self, step: int) -> tuple[int, list[int]] | None:
        """(samples, every part's size) of a smaller last step; None for a full global batch."""
        size = min(self.global_batch, self.n - step * self.global_batch)
        if size >= self.global_batch:
            return None
        parts = self.world_size * self.accumulate
        return size, [size // parts + (k < size % parts) for k in range(parts)]

    def order(self, epoch: int) -> Any:
        """Epoch ``epoch``'s order of the samples (`epoch_order`): step s trains positions [s*B, (s+1)*B)."""
        return epoch_order(self.dataset, self.n, self.seed, epoch, self.shuffle)

    def _step_indices(self, perm: Any, step: int) -> list[list[int]]:
        last = self._parts(step)
        if last is None:
            start = step * self.global_batch + self.rank * self.micro * self.accumulate
            mine = _ids(perm[start : start + self.micro * self.accumulate])
            return [mine[i * self.micro : (i + 1) * self.micro] for i in range(self.accumulate)]
        _, sizes = last
        base = step * self.global_batch
        out = []
        for k in range(self.rank * self.accumulate, (self.rank + 1) * self.accumulate):
            at = base + sum(sizes[:k])
            idx = _ids(perm[at : at + sizes[k]])
            out.append(idx or [int(perm[base])])  # an empty part: a copy, weighted 0 (a forward needs a sample)
        return out

    @property
    def last_step_samples(self) -> int:
        """Samples in the global batch of the step just handed out."""
        return min(self.global_batch, self.n - (self.step_in_epoch - 1) * self.global_batch) if self.step_in_epoch else self.global_batch

    @property
    def last_weights(self) -> list[float] | None:
        """The weights of the step just handed out (`step_weights`; None for a full global batch)."""
        return None if self.drop_last or not self.step_in_epoch else self.step_weights(self.step_in_epoch - 1)

    def step_weights(self, step: int) -> list[float] | None:
        """This rank's micro-batch loss weights at ``step`` of an epoch: None for a full global batch; for
        the smaller last one ``size x parts / samples`` each (0 for a padding copy), so that the strategy's
        mean over micro-batches and ranks is the mean over the step's samples."""
        last = self._parts(step)
        if last is None:
            return None
        size, sizes = last
        parts = len(sizes)
        return [sizes[k] * parts / size for k in range(self.rank * self.accumulate, (self.rank + 1) * self.accumulate)]

    def index_plan(self) -> Iterator[list[list[int]]]:
        """Indices of the remaining steps of the current epoch (no data touched)."""
        perm = self.order(self.epoch)
        for step in range(self.step_in_epoch, self.steps_per_epoch):
            yield self._step_indices(perm, step)

    def __iter__(self) -> Iterator[list[Any]]:
        """One epoch's remaining steps; the next iteration starts the next epoch."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        if self.num_workers == 0:
            for step in list(self.index_plan()):
                self.step_in_epoch += 1
                micro = [self._fetch(self.epoch, idx) for idx in step]
                yield [pin(b) for b in micro] if self.pin_memory else micro
        else:
            stream = self._worker_stream()
            for _ in range(self.step_in_epoch, self.steps_per_epoch):
                micro = [next(stream) for _ in range(self.accumulate)]
                self.step_in_epoch += 1
                yield micro
        self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def _fetch(self, epoch: int, indices: Sequence[int]) -> Any:
        return seeded_fetch(self.dataset, indices, self.collate_fn, self.seed, epoch)

    def _worker_stream(self) -> Iterator[Any]:
        """Micro-batches from one persistent DataLoader whose workers live as long as this loader:
        its batch sampler walks the epochs from the current position on, so workers prefetch
        across epoch ends and start once (a new DataLoader per epoch paid the workers' start-up
        every epoch). A position that moved under it (a resume) starts a new one."""
        position = (self.epoch, self.step_in_epoch)
        if self._stream is None or self._stream_position != position:
            self.close()
            sampler = _PlanSampler(self, self.epoch, self.step_in_epoch)
            loader = DataLoader(
                _SeededBatches(self.dataset, self.collate_fn, self.seed),
                batch_sampler=sampler,
                num_workers=self.num_workers,
                collate_fn=_first,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor,
                persistent_workers=False,
                # its own generator: starting workers draws their base seed from it, not from the
                # global one the training step's dropout draws from (every sample is seeded anyway)
                generator=torch.Generator().manual_seed(self.seed),
            )
            self._stream = iter(loader)
        steps = self.steps_per_epoch - self.step_in_epoch
        self._stream_position = (self.epoch + 1, 0)  # where the stream stands once this epoch is consumed
        return _Counted(self._stream, steps * self.accumulate)

    def close(self) -> None:
        """Stop the data-loading worker processes (the Trainer calls this at the end of a run)."""
        stream, self._stream = self._stream, None
        if stream is not None and hasattr(stream, "_shutdown_workers"):
            stream._shutdown_workers()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed, "n": self.n, "global_batch": self.global_batch}
        key = getattr(self.dataset, "order_key", None) if self.shuffle else None
        if isinstance(key, str):
            state["order_key"] = key  # a dataset's own order (`TokenShards`: shards and shuffle window)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("n") != self.n or state.get("global_batch") != self.global_batch:
            raise ConfigError(
                f"the checkpoint's data position was saved for {state.get('n')} samples in global batches of "
                f"{state.get('global_batch')}; this run has {self.n} samples in batches of {self.global_batch}. "
                "Resume with the same data set and global batch size"
            )
        key = getattr(self.dataset, "order_key", None) if self.shuffle else None
        if "order_key" in state and isinstance(key, str) and state["order_key"] != key:
            raise ConfigError(order_changed(self.dataset, state["order_key"], key))
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.seed = int(state["seed"])


def order_changed(dataset: Any, saved: str, now: str) -> str:
    """The message for a resume whose order (a dataset's ``order_key``: ``name=value`` parts and ``file:blocks``
    shards, ';'-separated) differs from the checkpoint's: what changed, then the fix."""
    old_parts, new_parts = saved.split(";"), now.split(";")
    pairs = zip(old_parts, new_parts, strict=False)
    settings = [f"{a.split('=')[0]} {a.split('=')[1]} -> {b.split('=')[1]}" for a, b in pairs if "=" in a and "=" in b and a != b]
    old_shards, new_shards = (set(p.split(",")) for p in (old_parts[-1], new_parts[-1]))
    if old_shards != new_shards:
        gone, added = sorted(old_shards - new_shards), sorted(new_shards - old_shards)
        settings.append(f"shards: {len(gone)} gone or changed ({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''}), {len(added)} new or changed")
    return (
        f"the checkpoint's data position is a place in an order of {type(dataset).__name__} that this run's would not follow "
        f"({'; '.join(settings) or 'its order key differs'}): the rest of the epoch would train some samples twice and skip "
        "others. Resume with the same shards and shuffle_window (or start a new run in another out directory)"
    )


def check_workers(num_workers: Any, prefetch_factor: Any) -> None:
    """A worker count and a prefetch depth a loader can use, or a `ConfigError` saying how to fix them."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be a whole number >= 0 (data-loading processes per rank); got {num_workers!r}")
    if prefetch_factor is None:
        return
    if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int) or prefetch_factor < 1:
        raise ConfigError(f"prefetch_factor must be a whole number >= 1 (micro-batches each data-loading worker keeps ready); got {prefetch_factor!r}")
    if num_workers == 0:
        raise ConfigError(
            f"prefetch_factor={prefetch_factor} sets how many micro-batches each data-loading worker keeps ready, and "
            "num_workers is 0: there are no workers (each batch is loaded in the training process when the step asks "
            "for it). Set num_workers >= 1 (--num-workers N), or leave prefetch_factor out (a DataLoader given to fit keeps its own)"
        )


def pinning(requested: bool, device: torch.device) -> tuple[bool, str | None]:
    """Whether to pin batches for a run on ``device``, and the note to say once when a request is ignored:
    page-locked memory only speeds up copies to a CUDA device."""
    if not requested or device.type == "cuda":
        return bool(requested), None
    if not torch.cuda.is_available():
        return False, "pin_memory needs CUDA; this machine has none, batches are not pinned"
    return False, f"pin_memory needs a CUDA run; this one trains on {device.type} (accelerator='cpu'), batches are not pinned"


def pin(batch: Any) -> Any:
    """``batch`` with every tensor in page-locked memory (tuples, named tuples, lists and dicts followed;
    an object with its own ``pin_memory()`` method calls it, as torch's DataLoader does)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device.type != "cpu" or batch.is_pinned() else batch.pin_memory()  # a tensor already on a device stays
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(pin(x) for x in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(pin(x) for x in batch)
    if isinstance(batch, dict):
        return {k: pin(v) for k, v in batch.items()}
    if callable(getattr(batch, "pin_memory", None)):
        return batch.pin_memory()
    return batch


def loader_options(data: Any) -> tuple[bool, int | None]:
    """A DataLoader's own ``pin_memory`` and ``prefetch_factor`` (None without workers); (False, None) for a Dataset."""
    if not isinstance(data, DataLoader):
        return False, None
    return bool(data.pin_memory), data.prefetch_factor if data.num_workers > 0 else None


def eval_shard(n: int, world_size: int, rank: int) -> range:
    """This rank's contiguous share of ``n`` evaluation samples: every sample exactly once, no padding."""
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def eval_batches(dataset: Any, world_size: int, rank: int, batch_size: int, collate: Collate | None = None) -> Iterator[Any]:
    shard = eval_shard(len(dataset), world_size, rank)
    for start in range(shard.start, shard.stop, batch_size):
        yield fetch(dataset, range(start, min(start + batch_size, shard.stop)), collate)


def unpack_data(data: Any) -> tuple[Any, Collate | None, int, int | None]:
    """Accept a Dataset, a stream or a DataLoader over either: returns (dataset, collate_fn, num_workers, batch_size).

    A stream (an ``IterableDataset``, or any object with ``__iter__`` and no ``__getitem__``) is returned as
    it is; `shardwise.data.stream.StreamLoader` reads it (docs/data.md, "Streams")."""
    from shardwise.data.stream import check_source, is_stream

    if data is None:
        return None, None, 0, None
    if isinstance(data, DataLoader):
        collate = data.collate_fn if data.collate_fn is not default_collate else None
        if is_stream(data.dataset):
            check_source(data.dataset)
        return data.dataset, collate, data.num_workers, data.batch_size
    if is_stream(data):
        check_source(data)
        return data, None, 0, None
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise ConfigError(
            "data must be a map-style Dataset (with __getitem__ and __len__), a stream (an IterableDataset) or a DataLoader "
            f"over one; got {type(data).__name__}"
        )
    return data, None, 0, None


# The public ``shardwise.data.map`` (parallel preprocessing, `shardwise.data.parallel`), after this module's own names.
# Token shards and text on disk (`shardwise.data.files`, `shardwise.data.text`): map-style datasets over files.
from shardwise.data.files import TokenShards as TokenShards  # noqa: E402
from shardwise.data.files import write_token_shards as write_token_shards  # noqa: E402
from shardwise.data.parallel import Mapped as Mapped  # noqa: E402
from shardwise.data.parallel import map as map  # noqa: E402,A004
from shardwise.data.stream import StreamLoader as StreamLoader  # noqa: E402
from shardwise.data.text import TextShards as TextShards  # noqa: E402
