"""``--model`` for ``shardwise plan``: a recipe, a Hugging Face config JSON, a ``module:factory`` or a parameter count.

Returns the `ModelSpec` the cost model reads and, when there is a real module (a recipe or a
factory), the module itself so each strategy's ``plan`` can check it (a pipeline that cannot
split it, tensor parallelism that finds no layer to shard) exactly as it will at launch.
"""

from __future__ import annotations

import copy
import importlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.cost.model_spec import ModelSpec, StepFit, from_hf_config, from_param_count, measured_spec
from shardwise.tools.recipes import available as recipes
from shardwise.tools.recipes import get_recipe

EXAMPLE_SAMPLES = 8
"""Samples in the example batch FLOPs and activations are counted on (they scale per sample)."""
TIMED_STEPS = 40
"""Steps of each timing run (logged every 5; the median interval after the first counts)."""
TIMED_TARGET_S = 1.5
"""A run shorter than this is repeated with more steps (at most `TIMED_MAX_STEPS`): a millisecond
step needs more than 7 intervals for their median to settle."""
TIMED_MAX_STEPS = 200
TIMED_RUNS = 3
"""Timing runs of each size, taken in turns (lo, hi, lo, hi, ...); each size's time is their median.
Every prediction on a profile measured here starts from this timing, so one run taken in a slow
stretch of the machine would move all of them alike (the calibration network's one-layer step timed
0.89 ms in one calibration and 1.23 ms in the next)."""
TIMED_BUDGET_S = 10.0
"""No further round of runs once the timing has taken this long: a long step's one round already
spans many seconds (charlm's, about 15), where a millisecond step's takes 1-3 s."""
_now = time.monotonic


def time_step(
    model: nn.Module,
    data: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    sizes: tuple[int, int],
    threads: int = 1,
    best: bool = False,
) -> StepFit:
    """Time the `Trainer`'s own step of a copy of ``model`` (``single``, ``threads`` threads) at two batch sizes; fit a line.

    The Trainer's step, not a bare forward-backward-step loop: its loader, precision context, loss
    and optimizer call are part of what every strategy's step costs on each rank, and a strategy's
    own cost (`shardwise.strategies.cost.cluster.Framework`) is what it adds on top. Each size trains
    `TIMED_STEPS` steps (more for a short step); a run's time is the median logged interval after the first
    (`shardwise.tools.advisor.validate.measured_step_s`), a size's the median of its `TIMED_RUNS` runs, taken in
    turns with the other size's (fewer once the timing has taken `TIMED_BUDGET_S`). ``model`` is not changed.
    ``best``: each size's fastest run instead of the median (the model's capability: one run that other work
    slowed cannot move it; a load model then stretches it for the load planned).
    """
    from shardwise.tools.advisor.validate import timed_fit

    lo, hi = sorted(sizes)

    def timed(size: int, steps: int) -> float:
        return timed_fit(copy.deepcopy(model), data, steps=steps, batch=size, optimizer=make_optimizer, loss_fn=loss_fn, quiet=True)

    runs: dict[int, list[float]] = {lo: [], hi: []}
    steps = dict.fromkeys((lo, hi), TIMED_STEPS)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = _now()
    try:
        for _ in range(TIMED_RUNS):
            if runs[lo] and _now() - start >= TIMED_BUDGET_S:
                break
            for size in (lo, hi):
                step = timed(size, steps[size])
                if steps[size] == TIMED_STEPS and step * TIMED_STEPS < TIMED_TARGET_S:
                    steps[size] = min(TIMED_MAX_STEPS, 5 * math.ceil(TIMED_TARGET_S / step / 5))
                    step = timed(size, steps[size])
                runs[size].append(step)
    finally:
        torch.set_num_threads(before)
    pick = min if best else statistics.median
    seconds = [pick(runs[lo]), pick(runs[hi])]
    per_sample = max(0.0, (seconds[1] - seconds[0]) / (hi - lo)) if hi > lo else 0.0
    return StepFit(fixed_s=max(0.0, seconds[0] - per_sample * lo), per_sample_s=per_sample, sizes=(lo, hi), threads=threads)


def time_steps(
    model: nn.Module,
    data: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    sizes: tuple[int, int],
    threads: Sequence[int] = (1,),
    best: bool = False,
) -> list[StepFit]:
    """`time_step` at each of ``threads`` (each count once; ``best`` as there): the fits `ModelSpec.with_fits` keeps, one per
    thread count the planned processes run (`thread_counts`)."""
    return [time_step(model, data, loss_fn, make_optimizer, sizes, t, best) for t in sorted(set(threads))]


def thread_counts(cores: int, nprocs: Sequence[int], own: int) -> tuple[int, ...]:
    """The intra-op thread counts the planned processes run: ``own`` (a process the Trainer runs itself, `candidates.own_threads`)
    and, for ``n`` launched processes, ``cores // n`` each (at least 1; `shardwise.launch`'s share)."""
    return tuple(sorted({own, *(max(1, cores // n) if cores else 1 for n in nprocs)}))


def _mean_output_loss(output: Any, batch: Any) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else output[0]
    return logits.float().mean()


@dataclass
class PlannedModel:
    spec: ModelSpec
    module: nn.Module | None = None
    recipe: str | None = None
    example: Any = None
    """A factory's example input (what its timing and ``--validate`` train on)."""

    @property
    def trainable(self) -> bool:
        """Whether `training` has something to train (a recipe, or a factory's module and example)."""
        return self.recipe is not None or (self.module is not None and self.example is not None)

    def training(self) -> tuple[nn.Module, Any, Callable[[Any, Any], torch.Tensor], Callable[[Any], Any]] | None:
        """What ``--validate`` trains, fresh for each candidate: (model, data set, loss, optimizer). A
        recipe's own; a factory's module (a copy) on its example repeated, with the loss and optimizer
        its step was timed with (the output's mean, Adam); None for a model known by its sizes only."""
        if self.recipe is not None:
            parts = get_recipe(self.recipe).parts({"sample_chars": 0} if self.recipe == "charlm" else None)
            return parts.model, parts.train, parts.loss_fn, parts.optimizer
        if self.module is None or self.example is None:
            return None
        module = copy.deepcopy(self.module)
        return module, by_keyword(repeated(self.example), module), _mean_output_loss, _adam


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def repeated(example: Any) -> torch.utils.data.TensorDataset:
    """A factory's example input repeated into `TIMED_SAMPLES` samples (a one-tensor data set)."""
    x = example if isinstance(example, torch.Tensor) else example[0]
    reps = -(-TIMED_SAMPLES // int(x.shape[0]))
    return torch.utils.data.TensorDataset(x.repeat(reps, *([1] * (x.dim() - 1))))


class _Keyword(torch.utils.data.Dataset):
    """A one-tensor data set's samples as ``{key: x}``: the model is called ``model(key=x)``."""

    def __init__(self, data: torch.utils.data.TensorDataset, key: str) -> None:
        self.data, self.key = data, key

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {self.key: self.data[i][0]}


def by_keyword(data: torch.utils.data.TensorDataset, module: nn.Module) -> Any:
    """``data`` passed by the name of the forward's first argument when that is ``input_ids`` (a transformers model):
    called by keyword, as its own data would call it, a strategy that splits the sequence (context parallelism) sets the
    model's positions itself; positionally, the model would build them from the split length."""
    import inspect

    try:
        first = next(iter(inspect.signature(module.forward).parameters), None)
    except (TypeError, ValueError):
        return data
    return _Keyword(data, first) if first == "input_ids" else data


def _stack(samples: list[Any]) -> Any:
    first = samples[0]
    if isinstance(first, tuple | list):
        return tuple(torch.stack([torch.as_tensor(s[i]) for s in samples]) for i in range(len(first)))
    return torch.stack([torch.as_tensor(s) for s in samples])


def recipe_model(name: str, timed_batch: int | None = None, threads: Sequence[int] = (1,), best: bool = False) -> PlannedModel:
    """A built-in recipe's model, measured on its own first training samples.

    With ``timed_batch``, its training step is also timed here (`time_steps`, with the recipe's
    loss and optimizer) at ``timed_batch / 16`` and ``timed_batch`` samples, at each of ``threads``."""
    parts = get_recipe(name).parts()
    batch = _stack([parts.train[i] for i in range(EXAMPLE_SAMPLES)])
    example = batch[0] if isinstance(batch, tuple) else batch
    spec = measured_spec(name, parts.model, example, EXAMPLE_SAMPLES, loss=lambda out: parts.loss_fn(out, batch), tp_plan=tp_split(parts.model))
    spec = with_structure(spec, parts.model)
    if timed_batch:
        spec = spec.with_fits(time_steps(parts.model, parts.train, parts.loss_fn, parts.optimizer, _timed_sizes(timed_batch), threads, best))
    return PlannedModel(spec, parts.model, name)


def with_structure(spec: ModelSpec, model: nn.Module) -> ModelSpec:
    """``spec`` with what context and expert parallelism are priced by: the attention heads the model's config declares
    (`context_parallel.cost.attention_heads`) and its experts layers (`expert_parallel.cost.moe_structure`)."""
    from shardwise.strategies.context_parallel.cost import attention_heads
    from shardwise.strategies.expert_parallel.cost import moe_structure

    heads = attention_heads(model)
    if heads is not None:
        spec = replace(spec, heads=heads[0], kv_heads=heads[1])
    moe = moe_structure(model)
    return replace(spec, moe_layers=moe["moe_layers"], experts=moe["experts"], top_k=moe["top_k"], expert_params=moe["expert_params"])


def tp_split(model: nn.Module) -> dict[str, str] | None:
    """The linears tensor parallelism would split in ``model`` (its declared or automatic plan,
    resolved as the strategy resolves it), or None when it finds none: what `measured_spec` needs
    to tell the activations tp splits from those it keeps whole."""
    from shardwise.strategies.tensor_parallel.plan import resolve_plan

    try:
        return resolve_plan(model)
    except ConfigError:
        return None


def _timed_sizes(batch: int) -> tuple[int, int]:
    return max(1, batch // 16), max(2, batch)


TIMED_SAMPLES = 4096
"""Samples of the data set a factory's example is repeated into for timing."""


def import_object(spec: str, flag: str) -> Callable[..., Any]:
    """The callable ``module:name`` names (``pkg.module:name``, ``name`` may be dotted: ``module:Class.method``),
    imported as ``python -m`` would, with the current directory first on ``sys.path`` (where ``shardwise`` put
    it, so worker processes, which get this process's ``sys.path``, import the module the same way).

    Anything that is not found is a one-line `ConfigError` naming ``flag``, what was missing and where it was
    looked for; an error raised while the module itself runs keeps its traceback (it is the module's)."""
    import os
    import sys

    mod_name, colon, attr = spec.partition(":")
    if not colon or not mod_name or not attr:
        example = {"--loss": "loss", "--optimizer": "make_optimizer", "--data": "make_data", "--val-data": "make_val"}.get(flag, "make_model")
        raise ConfigError(f"{flag} {spec!r}: give module:name (e.g. {flag} mymodels:{example}, for {example} in mymodels.py here)")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
            raise  # the module was found; something it imports was not: its own traceback says where
        raise ConfigError(
            f"{flag} {spec!r}: no module named {exc.name!r} in {here} or on sys.path (check the spelling, or run from the directory that holds it)"
        ) from None
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = mod_name if i == 0 else f"{mod_name}:{'.'.join(attr.split('.')[:i])}"
            names = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise ConfigError(f"{flag} {spec!r}: {owner} ({getattr(obj, '__file__', None) or type(obj).__name__}) has no {part!r}; it has {names}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{flag} {spec!r} is a {type(obj).__name__}, not a function or class to call")
    return obj


def factory_model(spec: str, timed_batch: int | None = None, threads: Sequence[int] = (1,), best: bool = False, data: str | None = None) -> PlannedModel:
    """``module:callable`` returning an ``nn.Module`` or ``(module, example_input)``; without an example, the
    module's ``example_input`` attribute (a tensor with a batch dimension), else ``data``'s first sample
    (`example_from_data`) is used."""
    made = import_object(spec, "--model")()
    model, example = (made[0], made[1]) if isinstance(made, tuple) else (made, getattr(made, "example_input", None))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    if example is None and data is not None:
        example = example_from_data(data)
    if example is None:
        raise ConfigError(
            f"--model {spec!r} returned the module alone: FLOPs and activations are counted on an example input, so return "
            "(model, example_input) from the factory (example_input: a batch, e.g. torch.randn(8, 784)), "
            "or give the module an example_input attribute, or pass --data MODULE:FACTORY (its first sample is used)"
        )
    samples = int(example.shape[0]) if isinstance(example, torch.Tensor) else int(example[0].shape[0])
    planned = with_structure(measured_spec(spec, model, example, samples, tp_plan=tp_split(model)), model)
    if timed_batch:
        planned = planned.with_fits(time_steps(model, repeated(example), _mean_output_loss, _adam, _timed_sizes(timed_batch), threads, best))
    return PlannedModel(planned, model, example=example)


def example_from_data(data: str) -> Any:
    """A batch of one built from the first sample of ``data`` (``module:factory`` returning a map-style data set or a
    DataLoader over one, as ``shardwise train --data`` takes it): the sample's input, the ``x`` of an ``(x, y)`` item."""
    made = import_object(data, "--data")()
    dataset = getattr(made, "dataset", made)  # a DataLoader's data set
    try:
        item = dataset[0]
    except (TypeError, IndexError, KeyError) as exc:
        raise ConfigError(f"--data {data!r}: could not read its first sample (data[0]: {exc}); return a map-style Dataset or a DataLoader over one") from None
    x = item[0] if isinstance(item, tuple | list) else item
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"--data {data!r}: its first sample's input is a {type(x).__name__}, not a tensor; return (model, example_input) from --model")
    return x.unsqueeze(0)


def load_model(
    spec: str,
    *,
    params: float | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq: int | None = None,
    timed_batch: int | None = None,
    threads: Sequence[int] | None = None,
    best: bool = False,
    data: str | None = None,
) -> PlannedModel:
    """Resolve ``--model`` (or ``--params``) into a `PlannedModel`; an unknown name is a one-line `ConfigError`.

    ``timed_batch``: time a real module's step here too (for a profile measured on this machine), at each of
    ``threads`` intra-op threads (None: one, and torch's own count, a single process's: `thread_counts`); ``best``: each
    size's fastest timing run (`time_step`). ``data``: a factory's data (``--data``), whose first sample is the example
    input when the factory returns the module alone."""
    threads = tuple(threads) if threads else tuple(sorted({1, torch.get_num_threads()}))
    if params is not None and spec in ("", None):
        return PlannedModel(from_param_count(params, layers=layers, hidden=hidden, heads=heads, seq=seq or 2048))
    if spec in recipes():
        return recipe_model(spec, timed_batch, threads, best)
    if spec.endswith(".json"):
        return PlannedModel(from_hf_config(Path(spec), seq=seq))
    if ":" in spec:
        return factory_model(spec, timed_batch, threads, best, data)
    raise ConfigError(
        f"unknown --model {spec!r}; give a recipe ({', '.join(recipes())}), a Hugging Face config .json, module:factory, or --params N (e.g. --params 7.5e9)"
    )
