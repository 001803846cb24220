"""The Trainer's side of streams (docs/data.md, "Streams"): the parent's checks of a stream before launch,
what the run's first lines say about a resume, and evaluation over a stream.

Evaluation over a stream: data-parallel rank ``r`` evaluates the samples ``i % dp == r`` of the stream
(every sample once, by the stride training uses). Every rank reads the whole stream, so once it ends each
rank knows its length and so every rank's batch count (no communication): a rank with fewer batches runs
one more forward on the stream's first sample and drops its result, as the map-style evaluation does
(FSDP's and pipelines' forwards are collective).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data._utils.collate import default_collate

from shardwise.data.stream import StreamLoader, first_samples, is_stream, state_loses_samples, stateful, stream_length
from shardwise.engine import Engine
from shardwise.errors import ConfigError
from shardwise.trainer.evaluate import EvalFn, batch_size_of, limited_size, reduced_means

if TYPE_CHECKING:
    from shardwise.trainer.loop import Trainer

__all__ = ["agree_on_first_samples", "check_fit", "check_val", "evaluate_stream", "notes"]


def digest(value: Any) -> int:
    """A 63-bit hash of a sample or a batch: tensors and arrays by their bytes, mappings by sorted keys, the rest by repr."""
    import hashlib

    import numpy as np

    h = hashlib.blake2b(digest_size=8)

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"T{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, np.ndarray):
            h.update(f"A{v.shape}{v.dtype}".encode() + np.ascontiguousarray(v).tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(f"K{k!s}".encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"L{len(v)}".encode())
            for item in v:
                feed(item)
        else:
            h.update(repr(v).encode())

    feed(value)
    return int.from_bytes(h.digest(), "little") >> 1


AGREE_SAMPLES = 64
"""The fewest samples the ranks' agreement check compares. Two processes' unseeded filters that keep 70% each
agree on one sample with probability 0.58: their first 8 kept samples were the same for 23 of 3,000 seed pairs
(one start in 130 passed unnoticed on a global batch of 8); on 64, about 90 samples read, 0.58^90 ~ 1e-21."""


def agree_on_first_samples(engine: Engine, loader: Any) -> None:
    """Every loop rank hashes the stream's first samples of epoch 0 (a global batch, and at least AGREE_SAMPLES) and
    the ranks compare: a stream that reads differently in different processes (a set's order, an unseeded random
    filter, a stream that shards itself by rank) would train duplicated and missing samples silently, since every
    rank keeps its share by position.
    One all-reduce of two numbers at the start of a fit; a `ConfigError` on every rank where they differ."""
    if not isinstance(loader, StreamLoader) or engine.data_mesh.size("dp") == 1:
        return
    source = loader.source
    if stateful(source):  # read a copy: putting a stateful source's position back is not exact for every source
        try:
            source = copy.deepcopy(source)
        except Exception:  # noqa: BLE001 - a source that cannot be copied (an open connection): not checked
            return
    count = max(loader.global_batch, AGREE_SAMPLES)
    mine = digest(first_samples(source, count, loader.seed, restore=source is loader.source))
    both = torch.tensor([mine, -mine], dtype=torch.int64)
    engine.all_reduce(both, "max")
    if int(both[0]) != mine or -int(both[1]) != mine:
        raise ConfigError(
            f"the stream {type(loader.source).__name__} reads differently in different processes: its first {count} samples "
            "of epoch 0 are not the same on every rank. Every rank reads the whole stream and "
            "keeps its share by position (i % world == rank), so the stream must yield the same samples in the same order "
            "in every process: no iteration over a set (its order differs between processes), no unseeded random choice (seed from the "
            "arguments, or draw from torch/random/numpy's global generators, which shardwise seeds per sample), and no "
            "splitting by rank or world size inside the stream (shardwise splits it)"
        )


def check_fit(trainer: Trainer, dataset: Any, collate: Any, global_batch: int) -> Any:
    """What a stream of training data can refuse before launch; returns its first sample, collated (a batch of one)."""
    cfg = trainer.config
    n, name = stream_length(dataset), type(dataset).__name__
    if n is None and not cfg.max_steps and not cfg.fast_dev_run:
        raise ConfigError(
            f"the training data ({name}) is a stream with no __len__: how many steps an epoch takes is known only when it ends, "
            "so max_epochs cannot size the run (nor its schedule). Set max_steps=... (--max-steps N)"
        )
    if n is None and isinstance(cfg.limit_train_batches, float):
        raise ConfigError(
            f"limit_train_batches={cfg.limit_train_batches} is a fraction of an epoch, and {name} is a stream with no __len__: give a whole number of steps"
        )
    first = first_samples(dataset, 1 if n is not None else global_batch, cfg.seed)
    got = n if n is not None else len(first)
    if not first or got == 0:
        raise ConfigError(f"the training stream ({name}) yields no sample")
    if got < global_batch:
        raise ConfigError(f"the training stream ({name}) yields {got} samples, fewer than one global batch of {global_batch}; lower the global batch size")
    return (collate or default_collate)([first[0]])


def check_val(trainer: Trainer, data: Any, what: str = "validation") -> None:
    """A stream of evaluation data that cannot work, before launch."""
    from shardwise.data import unpack_data

    dataset = unpack_data(data)[0] if data is not None else None
    if not is_stream(dataset):
        return
    name = type(dataset).__name__
    if trainer._adapter is not None:
        raise ConfigError(f"the {what} data ({name}) is a stream: a {type(trainer._adapter).__name__} module evaluates map-style data only; give a Dataset")
    if isinstance(trainer.config.limit_val_batches, float) and stream_length(dataset) is None:
        limit = trainer.config.limit_val_batches
        raise ConfigError(f"limit_val_batches={limit} is a fraction, and the {what} stream ({name}) has no __len__: give a whole number of batches")
    if not first_samples(dataset, 1):
        raise ConfigError(f"the {what} stream ({name}) yields no sample")


def notes(loader: Any) -> list[str]:
    """The run's first lines about a stream: how a resume will find its place."""
    if not isinstance(loader, StreamLoader):
        return []
    name = type(loader.source).__name__
    if loader.uses_state:
        how = f"a resume loads {name}'s own state (state_dict/load_state_dict, saved with each checkpoint)"
    else:
        why = (
            f"{name} has no state_dict/load_state_dict"
            if not stateful(loader.source)
            else "its shuffle buffer is not in its state_dict: a resume by it would lose the buffered samples"
            if state_loses_samples(loader.source)
            else "stream_resume='replay'"
        )
        how = f"a resume replays the stream up to its position ({why}): it reads the samples already trained on again"
    length = "no __len__: an epoch ends where the stream does" if loader.n is None else f"{loader.n} samples"
    lines = [f"training data: a stream ({name}, {length}), each rank keeping samples i % {loader.world_size} == rank; {how}"]
    if loader.num_workers > 0:
        lines.append(
            f"each of the {loader.num_workers} data-loading workers reads the whole stream and collates its share of the "
            "micro-batches: workers spread collation, not reading (a stream whose cost is in __iter__ is read "
            f"{loader.num_workers} times over; num_workers=0 reads it once)"
        )
    return lines


def _cap(dataset: Any, limit: int | float | None, batch_size: int, dp: int) -> int | None:
    """How many of the stream's samples an evaluation reads (None: all)."""
    if limit is None:
        return None
    if isinstance(limit, float):
        n = stream_length(dataset)
        return None if n is None else limited_size(n, limit, batch_size, dp)
    return limit * batch_size * dp


def evaluate_stream(
    engine: Engine, module: nn.Module, dataset: Any, collate: Any, batch_size: int, eval_fn: EvalFn, prefix: str, limit: int | float | None
) -> dict[str, float]:
    """As `shardwise.trainer.evaluate.evaluate` over a stream: each sample once (rank r: ``i % dp == r``)."""
    was_training = module.training
    module.eval()
    world, rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
    cap = _cap(dataset, limit, batch_size, world)
    collate = collate or default_collate
    totals: dict[str, float] = {}
    keys: list[str] = []
    count = done = n = 0
    first: Any = None

    def run(samples: list[Any]) -> None:
        nonlocal count, done, keys
        batch = engine.to_device(collate(samples))
        values = eval_fn(module, batch)
        keys = keys or list(values)
        size = batch_size_of(batch)
        count, done = count + size, done + 1
        for k, v in values.items():
            totals[k] = totals.get(k, 0.0) + float(v) * size

    with torch.no_grad(), engine.autocast():
        mine: list[Any] = []
        for sample in dataset:
            if cap is not None and n >= cap:
                break
            first = sample if n == 0 else first
            if n % world == rank:
                mine.append(sample)
            n += 1
            if len(mine) == batch_size:
                run(mine)
                mine = []
        if mine:
            run(mine)
        if n == 0:
            raise ConfigError(f"the {prefix} stream ({type(dataset).__name__}) yielded no sample")
        shares = [-(-(n - r) // world) for r in range(world)]  # every rank's samples, known once the stream has ended
        calls = max(1, max(-(-share // batch_size) for share in shares))
        for _ in range(calls - done):  # the padding call: every rank makes as many forward calls (collective forwards pair)
            padded = list(eval_fn(module, engine.to_device(collate([first]))))
            keys = keys or padded
    module.train(was_training)
    return reduced_means(engine, prefix, count, totals, keys)
