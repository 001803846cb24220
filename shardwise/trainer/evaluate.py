"""The Trainer's other loops: evaluation (``validate`` / ``test`` and the evaluations during fit),
prediction, and the model summary printed at the start of a run.

Exact over the data set at any world size: data-parallel rank ``r`` evaluates the contiguous
range ``shardwise.data.eval_shard`` gives it (every sample once, no padding, shards differing by
at most one sample); sums weighted by batch size are all-reduced and divided once. Where a
forward is collective (FSDP, pipelines, tensor parallelism) every rank makes the same number of
calls: a rank with fewer batches runs one more on a real sample and drops its result.

Prediction: each rank's outputs for its range are written into a zero tensor the size of the
whole set at their dataset positions; one all-reduce (sum) over the loop's ranks, where only one
rank of each data-parallel replica contributes (pipeline and tensor-parallel ranks of a replica
hold the same outputs), leaves every row written exactly once, so rank 0 returns the outputs in
dataset order, bit for bit what each rank computed. Only tensors cross the wire.

``limit_val_batches``: a whole number N keeps the first ``N x batch x dp`` samples (N batches on
every rank), a fraction keeps that share of the set; the kept samples are still split exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardwise.comm.mesh import DIM_ORDER
from shardwise.data import eval_batches, eval_shard, fetch
from shardwise.data.batches import call_model
from shardwise.engine import Engine

DATA_DIM = DIM_ORDER[0]
"""The mesh dimension along which data-parallel replicas lie (a replica's ranks differ in the others)."""

EvalFn = Callable[[nn.Module, Any], Mapping[str, torch.Tensor]]
"""``(module, batch) -> {"loss": ..., metric: ...}``: one batch's means."""


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (tuple, list)):
        return batch_size_of(batch[0])
    if isinstance(batch, Mapping):
        return batch_size_of(next(iter(batch.values())))
    raise TypeError(f"cannot tell the size of a batch of type {type(batch).__name__}")


def copies_per_shard(engine: Engine) -> int:
    """How many ranks evaluate each data shard: the pipeline and tensor-parallel ranks of one
    data-parallel replica all see the same samples, so a sum over the loop's ranks counts each
    sample this many times (1 for purely data-parallel strategies)."""
    return max(1, engine.group.size // engine.mesh.size("dp"))


def limited_size(n: int, limit: int | float | None, batch_size: int, dp: int) -> int:
    """How many samples of an ``n``-sample evaluation set a ``limit_val_batches`` keeps."""
    if limit is None:
        return n
    if isinstance(limit, float):
        return max(1, min(n, int(round(n * limit))))
    return min(n, limit * batch_size * dp)


class _Head:
    """The first ``n`` samples of a data set (``limit_val_batches``)."""

    def __init__(self, dataset: Any, n: int) -> None:
        self.dataset, self.n = dataset, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.dataset[i]


def head(dataset: Any, n: int) -> Any:
    if n >= len(dataset):
        return dataset
    from torch.utils.data import TensorDataset

    if isinstance(dataset, TensorDataset):  # keeps the one-call indexing of tensor data sets
        return TensorDataset(*(t[:n] for t in dataset.tensors))
    return _Head(dataset, n)


def _calls(n: int, world: int, batch_size: int) -> int:
    """Forward calls every rank makes: the most batches any rank's shard needs (at least one)."""
    return max(1, max(-(-len(eval_shard(n, world, r)) // batch_size) for r in range(world)))


def evaluate(engine: Engine, module: nn.Module, dataset: Any, collate: Any, batch_size: int, eval_fn: EvalFn, prefix: str = "val") -> dict[str, float]:
    """``{prefix_<key>: mean over every sample, prefix_samples: count}`` for every key ``eval_fn``
    returns, each sample counted once across ranks."""
    was_training = module.training
    module.eval()
    totals: dict[str, float] = {}
    count = 0
    world, rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
    calls = _calls(len(dataset), world, batch_size)
    keys: list[str] = []
    with torch.no_grad(), engine.autocast():
        done = 0
        for batch in eval_batches(dataset, world, rank, batch_size, collate):
            batch = engine.to_device(batch)
            n = batch_size_of(batch)
            values = eval_fn(module, batch)
            keys = keys or list(values)
            count += n
            for k, v in values.items():
                totals[k] = totals.get(k, 0.0) + float(v) * n
            done += 1
        for _ in range(calls - done):
            # The padding call runs on every rank that has fewer batches (its collectives, FSDP's
            # gathers, tp's reductions, pair with the other ranks'); only its keys are kept.
            padded = list(eval_fn(module, engine.to_device(fetch(dataset, [0], collate))))
            keys = keys or padded
    module.train(was_training)
    return reduced_means(engine, prefix, count, totals, keys)


def reduced_means(engine: Engine, prefix: str, count: int, totals: dict[str, float], keys: list[str]) -> dict[str, float]:
    """Every rank's sums (of each key's value times its batch size, and of samples) reduced once and divided:
    ``{prefix_key: mean over every sample, prefix_samples: count}``. Every rank ran at least one call, so every
    rank knows the keys (the same code returns them)."""
    sums = torch.tensor([float(count)] + [totals.get(k, 0.0) for k in keys], dtype=torch.float64, device=engine.device)
    engine.all_reduce(sums, "sum")
    sums /= copies_per_shard(engine)
    samples = max(sums[0].item(), 1.0)
    out = {f"{prefix}_{k}": sums[1 + i].item() / samples for i, k in enumerate(keys)}
    out[f"{prefix}_samples"] = int(sums[0].item())
    return out


def predict_output(module: nn.Module, batch: Any) -> Any:
    """The module's ``predict_step(batch)`` when it has one, else its forward on the batch."""
    step = getattr(module, "predict_step", None)
    return step(batch) if callable(step) else call_model(module, batch)


def _leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _leaves(item)]
    if isinstance(obj, Mapping):
        return [t for key in obj for t in _leaves(obj[key])]
    raise TypeError(f"predict returns tensors, tuples, lists or dicts of tensors; got {type(obj).__name__}")


def _rebuild(like: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(like, torch.Tensor):
        return leaves.pop(0)
    if isinstance(like, (tuple, list)):
        return type(like)(_rebuild(item, leaves) for item in like)
    return {key: _rebuild(like[key], leaves) for key in like}


def _full(t: Any) -> torch.Tensor:
    from shardwise.checkpoint import full_tensor

    return full_tensor(t).detach()  # type: ignore[no-any-return]


def predict(engine: Engine, module: nn.Module, dataset: Any, collate: Any, batch_size: int) -> Any:
    """The outputs for every sample in dataset order, on rank 0 (None elsewhere); each output
    tensor's first dimension is the batch's."""
    was_training = module.training
    module.eval()
    world, rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
    n = len(dataset)
    shard = eval_shard(n, world, rank)
    calls = _calls(n, world, batch_size)
    pieces: list[list[torch.Tensor]] = []
    like: Any = None
    with torch.no_grad(), engine.autocast():
        done = 0
        for batch in eval_batches(dataset, world, rank, batch_size, collate):
            out = predict_output(module, engine.to_device(batch))
            like = out
            pieces.append([_full(t) for t in _leaves(out)])
            done += 1
        for _ in range(calls - done):
            out = predict_output(module, engine.to_device(fetch(dataset, [0], collate)))
            like = out if like is None else like
            if not pieces:
                pieces.append([_full(t)[:0] for t in _leaves(out)])  # the shapes, no rows
    module.train(was_training)
    # One rank per data-parallel replica writes its rows (the others of the replica hold the same).
    writes = all(engine.mesh.coordinate(d) == 0 for d in engine.mesh.degrees if d != DATA_DIM)
    results = []
    for i in range(len(pieces[0])):
        mine = torch.cat([p[i] for p in pieces])
        buffer = torch.zeros((n, *mine.shape[1:]), dtype=mine.dtype, device=engine.device)
        if writes:
            buffer[shard.start : shard.stop] = mine.to(engine.device)
        wire = buffer if buffer.dtype != torch.bool else buffer.to(torch.uint8)
        engine.all_reduce(wire, "sum")
        results.append((wire.to(torch.bool) if buffer.dtype == torch.bool else wire).cpu())
    return _rebuild(like, results) if engine.is_rank_zero else None


# -- model summary -------------------------------------------------------------------------


def _local_numel(p: torch.Tensor) -> int:
    from shardwise.checkpoint import is_dtensor

    return int(p.to_local().numel()) if is_dtensor(p) else int(p.numel())  # type: ignore[attr-defined]


def module_table(model: nn.Module) -> list[dict[str, Any]]:
    """Parameters of each top-level module (and of the model's own, as ``(own)``): trainable and frozen."""
    rows = []
    own = list(model.named_parameters(recurse=False))
    parts: list[tuple[str, list[torch.Tensor]]] = [(name, list(child.parameters())) for name, child in model.named_children()]
    if own:
        parts.append(("(own)", [p for _, p in own]))
    for name, params in parts:
        trainable = sum(p.numel() for p in params if p.requires_grad)
        frozen = sum(p.numel() for p in params if not p.requires_grad)
        child = model.get_submodule(name) if name != "(own)" else model
        rows.append({"module": name, "type": type(child).__name__, "trainable": trainable, "frozen": frozen})
    return rows


def per_rank_counts(engine: Engine, module: nn.Module) -> list[int | None]:
    """Parameters each rank holds after the strategy placed the model (its shard, its stage);
    None for a rank outside the loop (a parameter server). One all-reduce of world-size numbers."""
    own = torch.zeros(engine.world_size, dtype=torch.float64, device=engine.device)
    own[engine.rank] = float(sum(_local_numel(p) for p in module.parameters())) + 1.0  # 0 stays "not in the loop"
    engine.all_reduce(own, "sum")
    return [int(v) - 1 if v > 0 else None for v in own.tolist()]


def format_summary(rows: list[dict[str, Any]], per_rank: list[int | None]) -> str:
    width = max([len(r["module"]) for r in rows] + [6])
    lines = [f"{'module':<{width}}  {'type':<16} {'trainable':>12} {'frozen':>10}"]
    for r in rows:
        lines.append(f"{r['module']:<{width}}  {r['type'][:16]:<16} {r['trainable']:>12,} {r['frozen']:>10,}")
    lines.append(f"{'total':<{width}}  {'':<16} {sum(r['trainable'] for r in rows):>12,} {sum(r['frozen'] for r in rows):>10,}")
    held = "  ".join(f"rank {i}: {c:,}" if c is not None else f"rank {i}: (serves)" for i, c in enumerate(per_rank))
    lines.append(f"parameters per rank after sharding: {held}")
    return "\n".join(lines)
