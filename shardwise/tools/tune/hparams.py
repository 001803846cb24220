"""Hyperparameter search: trials of a recipe or your own model, each a ``shardwise train`` run of its
own, ``parallel`` at a time, on Optuna (``pip install 'shardwise[tune]'``).

Optuna and not Ray Tune: each trial is already a run with its own processes (any strategy, any
``nproc``), so the search needs a sampler, a pruner and a loop that starts ``K`` runs at a time, not
a cluster. ``study.optimize(n_jobs=K)`` runs ``K`` trials in threads of this process, each thread
starting one ``shardwise train`` subprocess and reading its ``metrics.jsonl`` as it is written
(`trial.run_trial`): importing Optuna takes a fraction of a second, where starting Ray takes
seconds and would put each run inside an actor that holds cores the run's own ranks need.

- the space (`space.py`): ``--space KEY=KIND:ARGS`` with the keys ``shardwise train --set`` takes,
  and ``param.NAME`` for your own factories (`hparam`); every key, every range's ends and every
  choice are checked against the trainer's settings, the strategy's options and the recipe's
  options before any trial starts, as is the metric's name;
- the sampler: TPE (its first trials random), random, or a grid over choices, seeded at any
  ``parallel`` (`InOrder`);
- the pruner: the median rule (a trial whose best value so far is worse than the median of the
  finished trials' at the same step stops), successive halving, Hyperband, or none; the metric is
  reported every ``report_every`` steps (the trials' ``val_every``, or ``log_every`` for a training
  metric), a fifth of the run by default;
- each trial's threads: ``OMP_NUM_THREADS`` = the cores over ``parallel`` x the trial's processes;
- the result: a table (trial, state, metric, steps, seconds, params), the best trial, and the
  ``shardwise train`` command that reproduces it; ``search.json`` in the search's directory.

>>> space = {"recipe.lr": "loguniform:1e-4:1e-1", "trainer.global_batch_size": [32, 64, 128]}
>>> result = search_hparams(space, recipe="digits", trials=4, parallel=2, max_steps=40)  # doctest: +SKIP
>>> result.best.params, result.command()                                                 # doctest: +SKIP
({'recipe.lr': 0.00443, 'trainer.global_batch_size': 32}, 'shardwise train --recipe digits --max-steps 40 ... --set recipe.lr=0.00443...')
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.tools.tune.space import Dimension, format_value, grid_size, grid_values, parse_space
from shardwise.tools.tune.target import PARAMS_ENV, Target
from shardwise.tools.tune.trial import HparamTrial, TrialFailed, run_trial

PRUNERS = ("median", "halving", "hyperband", "none")
SAMPLERS = ("tpe", "random", "grid")
INSTALL = "pip install torch==2.13.0 'shardwise[tune]'"


def hparam(name: str, default: Any = None) -> Any:
    """This trial's value of ``param.NAME`` (``--space param.NAME=...``), or ``default`` outside a search.

    For your own model's settings, read in its factories: ``lr = hparam("lr", 1e-3)``."""
    values = json.loads(os.environ.get(PARAMS_ENV) or "{}")
    return values.get(name, default)


@dataclass
class HparamSearchResult:
    """The search's trials, in order, and the best of them."""

    metric: str
    direction: str
    trials: list[HparamTrial]
    best_number: int | None
    out: str
    target: Target
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> HparamTrial | None:
        return next((t for t in self.trials if t.number == self.best_number), None)

    def command(self, trial: HparamTrial | None = None) -> str:
        """The ``shardwise train`` command (with ``--set`` flags) that reproduces ``trial`` (the best by default)."""
        chosen = trial or self.best
        if chosen is None:
            raise ConfigError("no trial completed: there is no best configuration to reproduce")
        return self.target.reproduce(chosen.params)

    def table(self) -> str:
        keys = list(self.trials[0].params) if self.trials else []
        head = ["trial", "state", self.metric, "steps", "seconds", *keys]
        rows = [head]
        for t in self.trials:
            mark = "*" if t.number == self.best_number else ""
            value = "" if t.value is None else f"{t.value:.4g}"
            rows.append([f"{t.number}{mark}", t.state, value, str(t.steps), f"{t.seconds:.1f}", *(_short(t.params.get(k)) for k in keys)])
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "metric": self.metric,
            "direction": self.direction,
            "out": self.out,
            "seconds": round(self.seconds, 3),
            "settings": self.settings,
            "best": None if best is None else {**best.to_dict(), "command": self.command(best)},
            "trials": [t.to_dict() for t in self.trials],
        }


def _short(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else format_value(value)


def search_hparams(
    space: Mapping[str, Any] | Sequence[str],
    *,
    recipe: str | None = None,
    model: str | None = None,
    data: str | None = None,
    val_data: str | None = None,
    loss: str | None = None,
    optimizer: str | None = None,
    config: str | None = None,
    settings: Mapping[str, Any] | Sequence[str] = (),
    trials: int = 8,
    parallel: int = 1,
    metric: str = "val_loss",
    direction: str | None = None,
    max_steps: int | None = None,
    report_every: int | None = None,
    pruner: Any = "median",
    startup_trials: int = 2,
    sampler: Any = "tpe",
    seed: int = 0,
    out: str = "runs/hparams",
    overwrite: bool = False,
    threads: int | None = None,
    first: Sequence[Mapping[str, Any]] = (),
    grace_s: float = 60.0,
    echo: bool = True,
) -> HparamSearchResult:
    """Search ``space`` with ``trials`` runs of a recipe (``recipe=``) or your own model (``model=``,
    ``data=``, ... as ``shardwise train`` takes them), ``parallel`` at a time.

    ``space``: ``{KEY: "KIND:ARGS" or [choices]}`` or ``["KEY=KIND:ARGS", ...]`` (`space.py`);
    ``settings``: what every trial shares, ``{"trainer.strategy": "ddp", "trainer.nproc": 2}`` or
    ``["trainer.strategy=ddp", ...]`` (as ``--set``), on top of ``config`` (a TOML file);
    ``metric``: a name the runs log (``val_loss``, ``val_accuracy``, ``train_loss``, ``samples_per_s``),
    minimized or maximized as ``direction`` says (by default: a loss minimized, an accuracy or a throughput maximized);
    ``pruner``/``sampler``: a name (`PRUNERS`, `SAMPLERS`) or an Optuna object; ``first``: parameter
    sets to try first (a known-good baseline); ``startup_trials``: finished trials before the median
    pruner stops any. Raises `ConfigError` for anything wrong before a trial starts."""
    optuna = _optuna()
    dims = parse_space(space)
    target = Target.build(dims, recipe=recipe, own={"model": model, "data": data, "val_data": val_data, "loss": loss, "optimizer": optimizer})
    target.configure(config, settings, max_steps=max_steps, metric=metric, report_every=report_every)
    direction = _direction(metric, direction)
    _check_search(trials, parallel, threads, startup_trials, grace_s, first, dims)
    study = optuna.create_study(
        direction=direction,
        sampler=_sampler(sampler, dims, trials, seed),
        pruner=_pruner(pruner, startup_trials, target.report_every, target.max_steps),
    )
    if sampler == "grid":
        trials = min(trials, grid_size(dims))
    for params in first:
        study.enqueue_trial(dict(params))
    root = _prepare_out(Path(out), overwrite)
    env = target.env(threads or max(1, (os.cpu_count() or 1) // (parallel * target.max_nproc())))
    if echo:
        print(target.describe(trials, parallel, dims, root, env["OMP_NUM_THREADS"]), flush=True)
    runner = _Runner(target, dims, root, env, metric, grace_s, echo)
    start = time.perf_counter()
    study.optimize(runner, n_trials=trials, n_jobs=parallel, catch=(TrialFailed,))
    records = sorted(runner.records, key=lambda r: r.number)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    result = HparamSearchResult(
        metric=metric,
        direction=direction,
        trials=records,
        best_number=study.best_trial.number if done else None,
        out=str(root),
        target=target,
        seconds=time.perf_counter() - start,
        settings=target.summary(dims, trials=trials, parallel=parallel, seed=seed, pruner=pruner, sampler=sampler),
    )
    (root / "search.json").write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n")
    return result


class _Runner:
    """The objective Optuna calls in each of its threads: one trial's values, its run, its line of progress."""

    def __init__(self, target: Target, dims: dict[str, Dimension], root: Path, env: dict[str, str], metric: str, grace_s: float, echo: bool) -> None:
        self.target, self.dims, self.root, self.env, self.metric, self.grace_s, self.echo = target, dims, root, env, metric, grace_s, echo
        self.records: list[HparamTrial] = []
        self.lock = threading.Lock()
        self.in_order = InOrder()

    def __call__(self, trial: Any) -> float:
        params = self.in_order.suggest(trial, self.dims)
        record = HparamTrial(trial.number, params, str(self.root / f"trial-{trial.number:04d}"), [])
        record.command = self.target.command(params, record.out)
        with self.lock:
            self.records.append(record)
        env, steps = self.target.trial_env(self.env, params), self.target.max_steps
        try:
            return run_trial(record, trial, metric=self.metric, env=env, cwd=os.getcwd(), max_steps=steps, grace_s=self.grace_s)
        finally:
            if self.echo:
                with self.lock:
                    print(_progress(record, self.metric, steps), flush=True)


class InOrder:
    """Trials draw their values in the order of their numbers: with a sampler that keeps its seed
    (`_sampler`), a search's values are then the same at any ``parallel`` wherever they do not
    depend on which trials have finished (the random first trials, an enqueued one, a grid's order).
    A thread whose turn does not come within ``wait_s`` draws anyway (the order is lost, not the search)."""

    def __init__(self, wait_s: float = 120.0) -> None:
        self.next, self.wait_s, self.turn = 0, wait_s, threading.Condition()

    def suggest(self, trial: Any, dims: Mapping[str, Dimension]) -> dict[str, Any]:
        with self.turn:
            self.turn.wait_for(lambda: self.next >= trial.number, timeout=self.wait_s)
            try:
                return {key: dim.suggest(trial) for key, dim in dims.items()}
            finally:
                self.next = max(self.next, trial.number + 1)
                self.turn.notify_all()


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError(f"shardwise tune hparams needs Optuna: {INSTALL}") from None
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial is our own line, not Optuna's warning and traceback
    return optuna


def _direction(metric: str, direction: str | None) -> str:
    """``direction``, or the one the metric's name says: a loss falls, an accuracy or a throughput rises."""
    if direction is not None:
        if direction not in ("minimize", "maximize"):
            raise ConfigError(f"--direction is minimize or maximize; got {direction!r}")
        return direction
    name = metric.lower()
    if any(word in name for word in ("loss", "error", "perplexity")):
        return "minimize"
    if any(word in name for word in ("accuracy", "samples_per_s", "f1", "auc", "score", "precision", "recall")):
        return "maximize"
    raise ConfigError(f"--metric {metric}: say whether to --direction minimize or maximize it")


def _check_search(
    trials: int, parallel: int, threads: int | None, startup: int, grace_s: float, first: Sequence[Mapping[str, Any]], dims: dict[str, Dimension]
) -> None:
    for name, value in (("trials", trials), ("parallel", parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name} must be a whole number >= 1; got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"--threads must be a whole number >= 1; got {threads!r}")
    if startup < 0 or grace_s <= 0:
        raise ConfigError(f"startup_trials must be >= 0 and grace_s > 0; got {startup!r} and {grace_s!r}")
    for params in first:
        if set(params) != set(dims):
            raise ConfigError(f"a trial to try first gives {sorted(params)}; give a value for each key of the space, {sorted(dims)}")


def _sampler(sampler: Any, dims: dict[str, Dimension], trials: int, seed: int) -> Any:
    import optuna

    if not isinstance(sampler, str):
        return sampler
    if sampler not in SAMPLERS:
        raise ConfigError(f"--sampler is one of {', '.join(SAMPLERS)}; got {sampler!r}")
    if sampler == "grid":
        grid_size(dims)  # every dimension a choice or a whole-number range
    # optimize(n_jobs=K) reseeds the sampler for every trial (its protection for samplers copied into
    # processes); here K threads share one sampler and draw in turn (InOrder), so it keeps its seed
    kinds = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler, "grid": optuna.samplers.GridSampler}
    seeded = type(f"Seeded{kinds[sampler].__name__}", (kinds[sampler],), {"reseed_rng": lambda self: None})
    if sampler == "tpe":  # its first trials are random (a third of the search, 2 to 10), then TPE
        return seeded(seed=seed, n_startup_trials=max(2, min(10, trials // 3)))
    if sampler == "grid":
        return seeded({k: grid_values(d) for k, d in dims.items()}, seed=seed)
    return seeded(seed=seed)


def _pruner(pruner: Any, startup: int, report_every: int | None, max_steps: int | None) -> Any:
    import optuna

    if not isinstance(pruner, str):
        return pruner
    if pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup)
    if pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=report_every or "auto", reduction_factor=3)
    if pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=report_every or 1, max_resource=max_steps or "auto", reduction_factor=3)
    if pruner == "none":
        return optuna.pruners.NopPruner()
    raise ConfigError(f"--pruner is one of {', '.join(PRUNERS)}; got {pruner!r}")


def _prepare_out(root: Path, overwrite: bool) -> Path:
    """The search's directory: an earlier search there is refused, or with ``overwrite`` moved into ``replaced-<time>/``."""
    held = sorted(p for p in root.glob("trial-*")) + [p for p in (root / "search.json",) if p.exists()] if root.is_dir() else []
    if held and not overwrite:
        raise ConfigError(
            f"{root} holds an earlier search ({len([p for p in held if p.name.startswith('trial-')])} trials); "
            "pass --overwrite to move it into replaced-<time>/ there, or give another --out"
        )
    if held:
        aside = root / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir(parents=True, exist_ok=True)
        for p in held:
            p.rename(aside / p.name)
    root.mkdir(parents=True, exist_ok=True)
    return root


def _progress(record: HparamTrial, metric: str, max_steps: int | None) -> str:
    of = f" of {max_steps}" if max_steps else ""
    value = "" if record.value is None else f" {metric} {record.value:.4g}"
    params = " ".join(f"{k}={_short(v)}" for k, v in record.params.items())
    if record.state == "fail":
        return f"trial {record.number} failed after {record.seconds:.1f} s ({params}): {record.error}"
    if record.state == "pruned":
        return f"trial {record.number} pruned at step {record.pruned_at}:{value} (stopped at step {record.steps}{of}) in {record.seconds:.1f} s ({params})"
    return f"trial {record.number} complete, step {record.steps}{of}:{value} in {record.seconds:.1f} s ({params})"


__all__ = ["INSTALL", "PARAMS_ENV", "PRUNERS", "SAMPLERS", "HparamSearchResult", "HparamTrial", "hparam", "search_hparams"]
