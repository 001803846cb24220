"""Global-batch data loading: a stateful sharded sampler and exact-once evaluation.

The user sets the *global* batch. Each step, a seeded permutation of the epoch
gives the global batch's indices; rank r takes the r-th contiguous slice of it,
and splits that into ``accumulate`` micro-batches. The global batch is the same
whatever the world size, so results do not depend on how many processes run.

The loader's position (epoch, steps taken in the epoch) is all the state it has:
the order is a pure function of (seed, epoch), so a resume mid-epoch continues
with exactly the next samples, at any world size.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
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
            f"choose a global batch that is a multiple of {parts} (e.g. {lower} or {lower + parts})"
        )
    return global_batch // parts


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def fetch(dataset: Any, indices: Sequence[int], collate: Collate | None = None) -> Any:
    """Gather one batch: tensor data sets are indexed in one call, others sample by sample."""
    if collate is None and isinstance(dataset, TensorDataset):
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return tuple(t[idx] for t in dataset.tensors)
    samples = [dataset[i] for i in indices]
    return (collate or default_collate)(samples)


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
    ) -> None:
        self.dataset = dataset
        self.n = len(dataset)  # type: ignore[arg-type]
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.accumulate = accumulate
        self.micro = per_rank_batch(global_batch, world_size, accumulate)
        if self.n < global_batch:
            raise ConfigError(
                f"the training set has {self.n} samples, fewer than one global batch of {global_batch}; "
                "lower the global batch size"
            )
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.epoch = 0
        self.step_in_epoch = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.global_batch  # the last partial global batch is dropped

    def _step_indices(self, perm: torch.Tensor, step: int) -> list[list[int]]:
        start = step * self.global_batch + self.rank * self.micro * self.accumulate
        mine = perm[start : start + self.micro * self.accumulate].tolist()
        return [mine[i * self.micro : (i + 1) * self.micro] for i in range(self.accumulate)]

    def index_plan(self) -> Iterator[list[list[int]]]:
        """Indices of the remaining steps of the current epoch (no data touched)."""
        perm = epoch_permutation(self.n, self.seed, self.epoch, self.shuffle)
        for step in range(self.step_in_epoch, self.steps_per_epoch):
            yield self._step_indices(perm, step)

    def __iter__(self) -> Iterator[list[Any]]:
        """One epoch's remaining steps; the next iteration starts the next epoch."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        plan = list(self.index_plan())
        batches = self._batches(plan)
        for micro_batches in batches:
            self.step_in_epoch += 1
            yield micro_batches
        self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def _batches(self, plan: list[list[list[int]]]) -> Iterator[list[Any]]:
        if self.num_workers == 0:
            for step in plan:
                yield [fetch(self.dataset, idx, self.collate_fn) for idx in step]
            return
        # Worker processes prefetch micro-batches; the position still counts what was consumed.
        flat = [idx for step in plan for idx in step]
        loader = DataLoader(self.dataset, batch_sampler=flat, num_workers=self.num_workers, collate_fn=self.collate_fn or default_collate)
        it = iter(loader)
        for _ in plan:
            yield [next(it) for _ in range(self.accumulate)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed, "n": self.n, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("n") != self.n or state.get("global_batch") != self.global_batch:
            raise ConfigError(
                f"the checkpoint's data position was saved for {state.get('n')} samples in global batches of "
                f"{state.get('global_batch')}; this run has {self.n} samples in batches of {self.global_batch}. "
                "Resume with the same data set and global batch size"
            )
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.seed = int(state["seed"])


def eval_shard(n: int, world_size: int, rank: int) -> range:
    """This rank's contiguous share of ``n`` evaluation samples: every sample exactly once, no padding."""
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def eval_batches(dataset: Any, world_size: int, rank: int, batch_size: int, collate: Collate | None = None) -> Iterator[Any]:
    shard = eval_shard(len(dataset), world_size, rank)
    for start in range(shard.start, shard.stop, batch_size):
        yield fetch(dataset, range(start, min(start + batch_size, shard.stop)), collate)


def unpack_data(data: Any) -> tuple[Any, Collate | None, int, int | None]:
    """Accept a Dataset or a DataLoader: returns (dataset, collate_fn, num_workers, batch_size)."""
    if data is None:
        return None, None, 0, None
    if isinstance(data, DataLoader):
        collate = data.collate_fn if data.collate_fn is not default_collate else None
        return data.dataset, collate, data.num_workers, data.batch_size
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise ConfigError(
            f"data must be a map-style Dataset (with __getitem__ and __len__) or a DataLoader over one; got {type(data).__name__}"
        )
    return data, None, 0, None
