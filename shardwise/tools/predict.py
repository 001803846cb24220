"""``shardwise predict CHECKPOINT --recipe NAME --nproc N --out DIR``: a checkpoint's model over a
recipe's data set, data-parallel, written in shards with one index.

Any strategy's checkpoint loads: a plain one (single, ddp, zero1, the pipeline's, which gathers
the whole model) as it is, a sharded one (zero2, zero3 / fsdp, hsdp, tp: DCP files) whole in
each process (`checkpoint.export.model_weights`, once per process). So the default, data-parallel prediction (``single`` for
one process, ``ddp`` for more) serves every checkpoint whose model fits one process; for a model
that does not, ``--strategy tp`` or ``--strategy pipeline`` splits it across the processes
while predicting. The checkpoint's model is checked against the recipe's before any process
starts (names and shapes), so a checkpoint of another model is one line, not a traceback per rank.

The work is `Trainer.predict`, which gives each data-parallel rank a contiguous range of the
samples (every sample once, none duplicated) and returns the outputs in dataset order on rank 0.
To keep a large output out of any one process's memory, the data set is cut into parts of
``rows_per_shard`` rows and `Trainer.predict` runs once per part (a fresh copy of the model, whose
weights each process read from the checkpoint once, before the first part); rank 0 writes each
part as it comes::

    DIR/predictions/part-00000.pt   # a tensor of rows_per_shard rows (the last may have fewer)
    DIR/predictions/part-00001.pt
    DIR/index.json                  # rows per shard, total rows, dtype, shape, checkpoint and step,
                                    # throughput at N processes and at 1, max |difference| between them

The processes are started once (`shardwise.launch`) and keep one process group across parts.
Throughput is samples per second of the prediction loop on rank 0 (all parts, each with its
model copy and strategy setup, after the one checkpoint read), measured from the first part to the last;
with ``N > 1`` one more pass in this process with ``single`` gives the 1-process figure
(``--no-baseline`` skips it) and the largest absolute difference between its outputs and the
written shards (0 when the per-process batches give the same arithmetic).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset, TensorDataset

from shardwise import checkpoint as ckpt
from shardwise.checkpoint.export import model_weights
from shardwise.config import add_arguments as add_flags
from shardwise.config import flag
from shardwise.errors import ConfigError
from shardwise.launcher import choose_device, connect, detect_env, launch
from shardwise.strategies import Batch, get_strategy
from shardwise.tools.recipes import get_recipe

HELP = "predict a recipe's data set with a checkpoint's model, data-parallel, into shards and an index"

PREDICT_STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "tp", "pipeline")
"""Strategies prediction runs under: data-parallel ones, and tp / pipeline to split a model that
does not fit one process. The others (parameter servers, replicas) exist for training only."""


@dataclass(frozen=True)
class PredictJob:
    """Everything a prediction process needs (picklable: it crosses to the workers)."""

    checkpoint: str
    recipe: str
    recipe_options: dict[str, Any] = field(default_factory=dict)
    split: str = "val"
    limit: int | None = None
    strategy: str = "single"
    strategy_options: dict[str, Any] = field(default_factory=dict)
    nproc: int = 1
    batch_size: int = 64
    rows_per_shard: int = 4096
    accelerator: str = "auto"
    out: str | None = None
    """Where rank 0 writes the parts; None computes them and compares with ``compare_to``."""
    compare_to: str | None = None


# -- checks in the parent ------------------------------------------------------------------


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory, or a run directory's newest valid checkpoint."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"checkpoint {str(path)!r}: no such directory; pass a checkpoint directory (RUN/checkpoints/step-NNNNNNNN) or a run directory")
    if (p / "manifest.json").is_file():
        return p
    found = ckpt.latest_valid(p / "checkpoints") if (p / "checkpoints").is_dir() else None
    if found is None:
        raise ConfigError(f"checkpoint {str(path)!r}: not a checkpoint directory (no manifest.json) nor a run directory with checkpoints/")
    return Path(found)


def _stored_shapes(path: Path, manifest: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    if "model" in manifest.get("sharded", {}).get("keys", []):
        return {k: tuple(v) for k, v in ckpt.sharded_shapes(path, "model").items()}
    state = ckpt.load_shared(path)
    model = state.get("model")
    if not isinstance(model, dict):
        raise ConfigError(f"checkpoint {path} holds no model state; it holds {sorted(k for k in state if not k.startswith('__'))}")
    return {k: tuple(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}


def check_checkpoint_model(path: Path, manifest: Mapping[str, Any], model: torch.nn.Module, recipe: str) -> None:
    """One line when the checkpoint's parameters are not the recipe model's (names and shapes)."""
    mine = model.state_dict()
    if manifest.get("model_fingerprint") == ckpt.fingerprint(mine):
        return
    exp = {k: tuple(v.shape) for k, v in mine.items()}
    got = _stored_shapes(path, manifest)
    missing, unexpected = sorted(set(exp) - set(got)), sorted(set(got) - set(exp))
    shapes = [f"{k}: checkpoint {got[k]} vs recipe {exp[k]}" for k in sorted(set(exp) & set(got)) if exp[k] != got[k]]
    if not (missing or unexpected or shapes):
        return
    detail = "; ".join(
        part
        for part in (
            f"missing {len(missing)} (e.g. {missing[:2]})" if missing else "",
            f"unexpected {len(unexpected)} (e.g. {unexpected[:2]})" if unexpected else "",
            f"different shapes ({', '.join(shapes[:2])})" if shapes else "",
        )
        if part
    )
    raise ConfigError(
        f"checkpoint {path} (strategy {manifest.get('strategy')}, step {manifest.get('step')}) does not hold the model recipe "
        f"{recipe!r} builds: {detail}; pass the --recipe and --set recipe.KEY=VALUE it was trained with"
    )


# -- the data --------------------------------------------------------------------------------


def _data(job: PredictJob) -> tuple[torch.nn.Module, Any]:
    parts = get_recipe(job.recipe).parts(job.recipe_options)
    data = parts.val if job.split == "val" else parts.train
    if job.limit is not None and job.limit < len(data):
        data = _rows(data, 0, job.limit)
    return parts.model, data


def _rows(data: Any, start: int, stop: int) -> Any:
    if isinstance(data, TensorDataset):  # one-call indexing kept
        return TensorDataset(*(t[start:stop] for t in data.tensors))
    return Subset(data, range(start, stop))


def _bounds(n: int, rows: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


# -- the prediction processes -------------------------------------------------------------------


def _predict_parts(job: PredictJob) -> dict[str, Any] | None:
    """Run in every process: predict each part with `Trainer.predict`; rank 0 writes (or compares)
    it and returns what it did; the other ranks return None."""
    from shardwise.trainer.loop import Trainer

    env = detect_env()
    owns = connect(env, choose_device(job.accelerator, env)) if env.distributed else False  # one group for every part
    try:
        torch.manual_seed(0)  # the model's initial weights are replaced by the checkpoint's
        model, data = _data(job)
        # Read (and verified) once per process, whole, not once per part: each part's predict then
        # only places the model. A strategy that splits the model splits these weights as it would
        # split any model's.
        model.load_state_dict(model_weights(job.checkpoint))
        trainer = Trainer(
            strategy=job.strategy,
            strategy_options=job.strategy_options,
            nproc=job.nproc,
            accelerator=job.accelerator,
            global_batch_size=job.batch_size * job.nproc,
            val_batch_size=job.batch_size,
            model_summary=False,
        )
        shards: list[dict[str, Any]] = []
        max_diff = 0.0
        dtype, row_shape = "", [0]
        start = time.perf_counter()
        for k, (a, b) in enumerate(_bounds(len(data), job.rows_per_shard)):
            out = trainer.predict(copy.deepcopy(model), _rows(data, a, b))
            if env.rank != 0:
                continue
            if not isinstance(out, torch.Tensor):
                raise ConfigError(f"predict writes tensor outputs; recipe {job.recipe!r}'s model returned {type(out).__name__}")
            dtype, row_shape = str(out.dtype).removeprefix("torch."), list(out.shape[1:])
            name = f"part-{k:05d}.pt"
            if job.out is not None:
                target = Path(job.out) / "predictions" / name
                tmp = target.with_name(f".{name}.tmp")
                torch.save(out.contiguous(), tmp)
                os.replace(tmp, target)
            elif job.compare_to is not None:
                written = torch.load(Path(job.compare_to) / "predictions" / name, weights_only=True)
                max_diff = max(max_diff, float((written.double() - out.double()).abs().max()) if out.numel() else 0.0)
            shards.append({"file": f"predictions/{name}", "first_row": a, "rows": b - a})
            del out
        seconds = time.perf_counter() - start
        if env.rank != 0:
            return None
        return {"shards": shards, "rows": len(data), "dtype": dtype, "row_shape": row_shape, "seconds": seconds, "max_abs_diff": max_diff}
    finally:
        if owns:
            import torch.distributed as dist

            dist.destroy_process_group()
            gc.collect()


# -- the command ------------------------------------------------------------------------------


def predict_checkpoint(
    checkpoint: str | os.PathLike[str],
    recipe: str,
    out: str | os.PathLike[str],
    *,
    nproc: int = 1,
    strategy: str | None = None,
    strategy_options: Mapping[str, Any] | None = None,
    recipe_options: Mapping[str, Any] | None = None,
    split: str = "val",
    limit: int | None = None,
    batch_size: int | None = None,
    rows_per_shard: int = 4096,
    accelerator: str = "auto",
    baseline: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Predict ``recipe``'s ``split`` with ``checkpoint``'s model on ``nproc`` processes; write the
    shards and ``index.json`` under ``out``; return the index."""
    _check_counts(nproc=nproc, rows_per_shard=rows_per_shard, limit=limit, batch_size=batch_size)
    if split not in ("val", "train"):
        raise ConfigError(f"predict: split must be 'val' or 'train'; got {split!r}")
    strategy = strategy or ("ddp" if nproc > 1 else "single")
    if strategy not in PREDICT_STRATEGIES:
        raise ConfigError(f"predict runs under {', '.join(PREDICT_STRATEGIES)}; got strategy {strategy!r} (a checkpoint of any strategy loads under ddp)")
    path = resolve_checkpoint(checkpoint)
    manifest = ckpt.verify(path)
    the_recipe = get_recipe(recipe)
    batch_size = batch_size or int(the_recipe.trainer_defaults.get("global_batch_size", 64))
    job = PredictJob(
        checkpoint=str(path),
        recipe=recipe,
        recipe_options=dict(recipe_options or {}),
        split=split,
        limit=limit,
        strategy=strategy,
        strategy_options=dict(strategy_options or {}),
        nproc=nproc,
        batch_size=batch_size,
        rows_per_shard=rows_per_shard,
        accelerator=accelerator,
        out=str(out),
    )
    torch.manual_seed(0)
    model, data = _data(job)
    check_checkpoint_model(path, manifest, model, recipe)
    # The strategy's refusals (world size, degrees, a model it cannot split), here, in one line.
    (chosen := get_strategy(strategy, **job.strategy_options)).plan(nproc, model=model, batch=Batch(batch_size * nproc, 1), mesh=None)
    root = _fresh_out(Path(out), overwrite)
    wall = time.perf_counter()
    result = launch(_predict_parts, job, nproc=nproc)[0] if nproc > 1 or chosen.needs_process_group else _predict_parts(job)
    wall = time.perf_counter() - wall
    assert result is not None  # rank 0's
    throughput: dict[str, Any] = {
        "nproc": nproc,
        "strategy": strategy,
        "seconds": round(result["seconds"], 4),
        "samples_per_s": round(result["rows"] / result["seconds"], 2),
        "wall_seconds_with_start": round(wall, 3),
    }
    index: dict[str, Any] = {
        "checkpoint": str(path),
        "step": manifest.get("step"),
        "checkpoint_strategy": manifest.get("strategy"),
        "recipe": recipe,
        "recipe_options": job.recipe_options,
        "split": split,
        "rows": result["rows"],
        "rows_per_shard": rows_per_shard,
        "dtype": result["dtype"],
        "shape": [result["rows"], *result["row_shape"]],
        "shards": result["shards"],
        "throughput": throughput,
    }
    if baseline and nproc > 1:
        _one_process_baseline(job, root, result["seconds"], index)
    (root / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


def _check_counts(**counts: int | None) -> None:
    for name, value in counts.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"predict: {name} must be a whole number >= 1; got {value!r}")


def _fresh_out(root: Path, overwrite: bool) -> Path:
    """``root`` with an empty predictions/ (an earlier run's index only with ``overwrite``)."""
    if (root / "index.json").exists() and not overwrite:
        raise ConfigError(f"{root} already holds predictions (index.json); choose another --out or pass --overwrite")
    (root / "predictions").mkdir(parents=True, exist_ok=True)
    for old in (root / "predictions").glob("part-*.pt"):
        old.unlink()
    return root


def _one_process_baseline(job: PredictJob, root: Path, seconds: float, index: dict[str, Any]) -> None:
    """One more pass in this process with ``single``: the 1-process throughput, and the largest difference from the written shards."""
    one = _predict_parts(replace(job, strategy="single", nproc=1, strategy_options={}, out=None, compare_to=str(root)))
    assert one is not None
    throughput = index["throughput"]
    throughput["one_process"] = {
        "seconds": round(one["seconds"], 4),
        "samples_per_s": round(one["rows"] / one["seconds"], 2),
        "threads": torch.get_num_threads(),
    }
    throughput["speedup"] = round(one["seconds"] / seconds, 3)
    index["max_abs_diff_vs_one_process"] = one["max_abs_diff"]


def format_report(index: Mapping[str, Any], out: str | os.PathLike[str]) -> str:
    t = index["throughput"]
    lines = [
        f"predicted {index['rows']} rows of {index['recipe']} ({index['split']}) with checkpoint step {index['step']} "
        f"({index['checkpoint_strategy']}): {len(index['shards'])} shard(s) of up to {index['rows_per_shard']} rows, "
        f"{index['dtype']} {index['shape']}, in {out}/predictions (index: {out}/index.json)",
        f"throughput: {t['samples_per_s']:,.1f} samples/s on {t['nproc']} process(es) ({t['strategy']}, {t['seconds']:.3f} s)",
    ]
    if "one_process" in t:
        lines.append(
            f"            {t['one_process']['samples_per_s']:,.1f} samples/s on 1 process ({t['one_process']['seconds']:.3f} s): "
            f"{t['speedup']:.2f}x with {t['nproc']}; max |difference| {index['max_abs_diff_vs_one_process']:.3g}"
        )
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class PredictOptions:
    """``shardwise predict``'s arguments (`shardwise.config.flag`: each field's flag, default and help)."""

    checkpoint: str = flag(help="a checkpoint directory (RUN/checkpoints/step-NNNNNNNN) or a run directory (its newest valid checkpoint)", positional=True)
    recipe: str = flag(help="the recipe the checkpoint was trained with (its model and data)", required=True)
    out: str = flag(help="directory for predictions/part-NNNNN.pt and index.json", required=True)
    nproc: int = flag(1, "processes (default 1)")
    strategy: str | None = flag(None, f"default ddp (single for 1 process); one of {', '.join(PREDICT_STRATEGIES)}")
    split: str = flag("val", "which data set of the recipe (default val)", choices=("val", "train"))
    limit: int | None = flag(None, "only the first N samples")
    batch_size: int | None = flag(None, "samples per forward in each process (default: the recipe's global batch)")
    rows_per_shard: int = flag(4096, "rows in each predictions/part-NNNNN.pt (default 4096)")
    accelerator: str = flag("auto", "'auto' (CUDA when present), 'cpu' or 'cuda'", choices=("auto", "cpu", "cuda"))
    no_baseline: bool = flag(False, "skip the 1-process pass that gives the throughput to compare with")
    overwrite: bool = flag(False, "replace the predictions an earlier run wrote in --out")
    set: list[str] = flag(
        help="a recipe option the checkpoint was trained with (repeatable)", action="append", metavar="recipe.KEY=VALUE", default_factory=list
    )


def add_arguments(p: Any) -> None:
    add_flags(p, PredictOptions)


def main(args: Any) -> int:
    from shardwise.trainer.config import apply_overrides

    sections = apply_overrides({}, args.set)
    unknown = sorted(set(sections) - {"recipe"})
    if unknown:
        raise ConfigError(f"predict takes --set recipe.KEY=VALUE; got sections {unknown}")
    index = predict_checkpoint(
        args.checkpoint,
        args.recipe,
        args.out,
        nproc=args.nproc,
        strategy=args.strategy,
        recipe_options=sections.get("recipe"),
        split=args.split,
        limit=args.limit,
        batch_size=args.batch_size,
        rows_per_shard=args.rows_per_shard,
        accelerator=args.accelerator,
        baseline=not args.no_baseline,
        overwrite=args.overwrite,
    )
    print(format_report(index, args.out), flush=True)
    return 0


__all__ = ["PREDICT_STRATEGIES", "PredictJob", "add_arguments", "check_checkpoint_model", "format_report", "main", "predict_checkpoint", "resolve_checkpoint"]
