"""What a pipeline schedule can run, and how a step's batch becomes its micro-batches.

``check_schedule`` refuses up front what torch would raise only inside the workers (or on one
rank while the others wait). ``split_batch`` cuts a batch exactly as the schedule cuts its input
(``torch.tensor_split`` on dim 0), so the last stage's loss sees the same rows the first stage
ran; ``_Replay`` stands in for the model there, so the user's ``loss_fn`` runs unchanged.

>>> [tuple(c.shape) for c in split_batch(torch.zeros(6, 2), 3)]
[(2, 2), (2, 2), (2, 2)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardwise.errors import ConfigError
from shardwise.strategies.cost.bubble import SCHEDULES


def check_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Refuse, before anything runs, what a schedule cannot run (torch raises some of these only
    on one rank, mid-step, while the others wait forever)."""
    if schedule not in SCHEDULES:
        import difflib

        close = difflib.get_close_matches(schedule, SCHEDULES, n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}{hint}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"pipeline {name} must be a whole number >= 1; got {value!r}")
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(
            f"schedule 1f1b needs at least as many micro-batches as stages; got microbatches={microbatches} < pp={pp}; "
            f"use microbatches >= {pp} or schedule gpipe"
        )
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise ConfigError(
                f"schedule interleaved needs virtual_stages >= 2 (model chunks per rank); got {virtual_stages}; use gpipe or 1f1b for one chunk per rank"
            )
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            # torch's interleaved 1F1B runs micro-batches in rounds of about pp (flex schedule).
            raise ConfigError(
                f"schedule interleaved needs microbatches to be a multiple of max(1, microbatches // pp) = {rounds}; "
                f"got microbatches={microbatches} with pp={pp}; use a multiple of {pp}"
            )
    elif virtual_stages != 1:
        raise ConfigError(f"virtual_stages={virtual_stages} needs schedule interleaved; {schedule} runs one stage per rank")


def _schedule_class(schedule: str) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[schedule]


def split_batch(batch: Any, m: int) -> list[Any]:
    """``m`` equal micro-batches of a batch (a tensor, or a tuple/list of tensors), cut along
    dim 0 as the pipeline schedule cuts its inputs (``torch.tensor_split``)."""
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, m, dim=0))
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(b, m) if isinstance(b, torch.Tensor) else [b] * m for b in batch]
        return [type(batch)(p[i] for p in parts) if isinstance(batch, tuple) else [p[i] for p in parts] for i in range(m)]
    if isinstance(batch, Mapping):
        cut = {k: split_batch(v, m) if isinstance(v, torch.Tensor) else [v] * m for k, v in batch.items()}
        return [{k: cut[k][i] for k in batch} for i in range(m)]
    raise ConfigError(f"the pipeline strategy splits batches that are tensors, tuples or dicts of tensors; got {type(batch).__name__}")


def concat_batches(batches: Sequence[Any]) -> Any:
    """One batch from the step's loader micro-batches (concatenated along dim 0)."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches), dim=0)
    if isinstance(first, Mapping):
        return {k: concat_batches([b[k] for b in batches]) if isinstance(first[k], torch.Tensor) else first[k] for k in first}
    if isinstance(first, (tuple, list)):
        cols = [concat_batches([b[i] for b in batches]) if isinstance(first[i], torch.Tensor) else first[i] for i in range(len(first))]
        return tuple(cols) if isinstance(first, tuple) else cols
    raise ConfigError(f"the pipeline strategy splits batches that are tensors or tuples of tensors; got {type(first).__name__}")


def batch_rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping) and batch:
        return batch_rows(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch:
        return batch_rows(batch[0])
    raise ConfigError(f"the pipeline strategy splits batches that are tensors or tuples of tensors; got {type(batch).__name__}")


def check_rows(rows: int, microbatches: int, where: str) -> None:
    if rows % microbatches or rows < microbatches:
        raise ConfigError(
            f"{where}: the per-rank batch of {rows} samples does not split into {microbatches} equal pipeline "
            f"micro-batches; choose a batch per rank (global batch / dp) that is a multiple of {microbatches}, "
            "or change microbatches"
        )


class _Replay:
    """Stands in for the model inside the user's ``step_fn`` on the last stage: returns the
    pipeline's output for the micro-batch, so ``loss_fn(model(*inputs), batch)`` (or the model's
    own loss, ``model(**batch).loss``) runs as written.

    ``full`` is the last stage's whole output for a model split by its block list (a
    ModelOutput with ``logits`` and, when the batch holds ``labels``, ``loss``); otherwise the
    output tensor is returned."""

    def __init__(self, output: Any, batch: Any, full: Any = None, own: Any = None) -> None:
        from shardwise.data.batches import model_args

        self.output, self.full = output, full
        self.batch = batch
        self.model: Any = own[0] if own is not None else None  # the user's model, whose training_step calls it (``own[1]``: how)
        self.args: tuple[Any, ...]
        self.kwargs: dict[str, Any]
        self.args, self.kwargs = own[1].bind(batch) if own is not None else model_args(batch)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.model is not None and len(args) == 1 and not kwargs and args[0] is self.batch:
            # the Trainer's step function calls training_step through the model (`call_through`): run the
            # user's training_step, its self(...) answered by this stage's output
            from shardwise.strategies.pipeline.own_step import run_own_step

            return run_own_step(self.model, self.batch, self._answer)
        return self._answer(*args, **kwargs)

    def _answer(self, *args: Any, **kwargs: Any) -> Any:
        def same(a: Any, b: Any) -> bool:
            return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape)

        fits = (
            len(args) == len(self.args)
            and all(same(a, b) for a, b in zip(args, self.args, strict=True))
            and set(kwargs) == set(self.kwargs)
            and all(same(kwargs[k], self.kwargs[k]) for k in kwargs)
        )
        if not fits:
            raise ConfigError(
                "the pipeline strategy computes the loss on its last stage from the model's output: the step "
                "function must be loss_fn(model(*inputs), batch) with inputs the batch's leading elements, or "
                "the model's own loss from a dict batch (pass loss_fn=... to the Trainer; a training_step that "
                "calls the whole model cannot be split)"
            )
        return self.full if self.full is not None else self.output


def keep_buffers_through_inference(stage: Any, module: Any) -> None:
    """Undo what torch's shape inference does to ``module``'s buffers.

    A ``PipelineStage`` built without example shapes runs its first micro-batch through the stage
    once more, before the schedule's own forwards, to learn the shapes it sends (torch forks the
    random state around it, but not the buffers); that extra forward would update BatchNorm's
    running statistics and batch counter a sixth time in five steps. The buffers are copied before
    that forward and put back once torch has freed the inference's autograd graph (this stage
    instance only)."""
    if not any(True for _ in module.buffers()):
        return
    infer = getattr(stage, "_forward_metadata_inference", None)
    cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
    legacy = getattr(stage, "_shape_inference", None)
    if (infer is None or cleanup is None) and legacy is not None:
        # torch up to 2.12: `_shape_inference` runs the stage on meta copies of the micro-batch under
        # no_grad; BatchNorm's batch counter, a real buffer, still counts it (seen on torch 2.11)
        def inference(*args: Any, **kwargs: Any) -> Any:
            kept = [(b, b.detach().clone()) for b in module.buffers()]
            try:
                return legacy(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for b, copy in kept:
                        if not torch.equal(b, copy):
                            b.copy_(copy)

        stage._shape_inference = inference
        return
    if infer is None or cleanup is None:
        return
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def before(*args: Any, **kwargs: Any) -> Any:
        saved[:] = [(b, b.detach().clone()) for b in module.buffers()]
        return infer(*args, **kwargs)

    def after(*args: Any, **kwargs: Any) -> Any:
        result = cleanup(*args, **kwargs)
        with torch.no_grad():
            for b, copy in saved:
                if not torch.equal(b, copy):
                    b.copy_(copy)
        saved.clear()
        return result

    stage._forward_metadata_inference = before
    stage._post_metadata_inference_cleanup = after
