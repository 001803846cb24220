"""Experiment loggers: the run's metrics, hyperparameters and summary, from rank 0, into CSV,
TensorBoard, MLflow or Weights & Biases (or a logger of your own).

``Trainer(loggers=["csv", "tensorboard"])`` or ``shardwise train ... --logger csv,tensorboard``.
Every record that goes to metrics.jsonl goes to each logger with its step (training log steps and
evaluations); the resolved configuration (`TrainerConfig`, strategy options flattened as
``strategy_options.NAME``, plus any ``hparams=`` the Trainer was given) is logged once as
hyperparameters, and summary.json's numbers at the end. Loggers exist only on rank 0: one
record per run, never one per rank.

==============  ==============================  =================================================
name            writes                          needs
==============  ==============================  =================================================
``csv``         ``out/csv/metrics.csv``,        nothing
                ``hparams.json``, ``summary.json``
``tensorboard`` ``out/tensorboard/`` events     ``pip install 'shardwise[tensorboard]'``
``mlflow``      ``out/mlruns/`` (a file store)  ``pip install 'shardwise[mlflow]'``
                or ``tracking_uri``
``wandb``       ``out/wandb/``; offline when    ``pip install 'shardwise[wandb]'``
                no ``WANDB_API_KEY`` is set
==============  ==============================  =================================================

A resumed run continues the same record: the CSV drops rows after the resumed step, TensorBoard
purges later steps, MLflow and W&B reopen the run tagged with the trainer's lineage id
(``run_id``, kept across resumes).

Your own logger: subclass `Logger` and pass an instance, ``Trainer(loggers=[MyLogger()])``::

    class PrintLogger(Logger):
        def log_metrics(self, step, metrics):
            print(step, metrics)

Only tensors and numbers are logged as metrics; ``None`` (a NaN in metrics.jsonl) is left out.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError


@dataclass(frozen=True)
class RunInfo:
    """Where and what a logger records: the run directory (None without ``out``), the trainer's
    lineage id, the experiment name, the MLflow tracking URI, and the step a resume restarts after."""

    out: Path | None
    run_id: str
    experiment: str = "shardwise"
    tracking_uri: str | None = None
    resumed_step: int | None = None


class Logger:
    """A logger's interface. ``log_metrics`` is required; the rest default to nothing.

    ``setup`` runs once on rank 0 before anything is logged; ``log_hyperparams`` once with the
    flat resolved configuration; ``log_metrics(step, metrics)`` for each record; ``finalize``
    with the run's summary (the same dict as summary.json) at the end.
    """

    name = "custom"

    def setup(self, run: RunInfo) -> None:
        return None  # a logger that needs no place or id has nothing to prepare

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        return None

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define log_metrics(step, metrics)")

    def finalize(self, summary: Mapping[str, Any]) -> None:
        return None


# -- flattening ---------------------------------------------------------------------------


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and tuples become strings of their items."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(str(v) for v in value)
        else:
            out[name] = value
    return out


def numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a flat mapping, whole numbers kept whole (booleans and None left out)."""
    return {k: v if isinstance(v, int) else float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# -- csv -----------------------------------------------------------------------------------


class CSVLogger(Logger):
    """``out/csv/metrics.csv`` (one row per record, a column per key; a new key rewrites the file
    with the wider header), ``hparams.json`` and ``summary.json``. No package needed."""

    name = "csv"

    def __init__(self, directory: str | None = None) -> None:
        self.directory = Path(directory) if directory else None
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]

    def setup(self, run: RunInfo) -> None:
        if self.directory is None:
            if run.out is None:
                raise ConfigError("the csv logger writes into the run directory: set out=... (--out DIR) or CSVLogger(directory=...)")
            self.directory = run.out / "csv"
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "metrics.csv"
        if run.resumed_step is not None and path.exists():
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    if float(row.get("step") or 0) <= run.resumed_step:
                        self.rows.append({k: v for k, v in row.items() if v != ""})
            for row in self.rows:
                self._widen(row)
        self._rewrite()

    def _widen(self, row: Mapping[str, Any]) -> bool:
        new = [k for k in row if k not in self.columns]
        self.columns.extend(new)
        return bool(new)

    def _rewrite(self) -> None:
        assert self.directory is not None
        tmp = self.directory / "metrics.csv.tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.directory / "metrics.csv")

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        assert self.directory is not None
        (self.directory / "hparams.json").write_text(json.dumps(dict(params), indent=1, default=str) + "\n")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self.directory is not None
        row = {"step": step, **{k: repr(v) for k, v in metrics.items()}}
        self.rows.append(row)
        if self._widen(row):
            self._rewrite()
            return
        with open(self.directory / "metrics.csv", "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def finalize(self, summary: Mapping[str, Any]) -> None:
        assert self.directory is not None
        (self.directory / "summary.json").write_text(json.dumps(_json_safe(summary), indent=1, default=str) + "\n")


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


# -- tensorboard ------------------------------------------------------------------------------


class TensorBoardLogger(Logger):
    """Scalars per record into ``out/tensorboard/`` (torch's ``SummaryWriter``, which needs the
    ``tensorboard`` package), the hyperparameters with the final metrics for TensorBoard's
    HPARAMS tab, and both as text. A resume purges steps after the resumed one."""

    name = "tensorboard"

    def __init__(self, directory: str | None = None) -> None:
        self.directory = Path(directory) if directory else None
        self.writer: Any = None
        self.params: dict[str, Any] = {}

    def setup(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.directory is None:
            if run.out is None:
                raise ConfigError("the tensorboard logger writes into the run directory: set out=... (--out DIR)")
            self.directory = run.out / "tensorboard"
        purge = run.resumed_step + 1 if run.resumed_step is not None else None
        self.writer = SummaryWriter(log_dir=str(self.directory), purge_step=purge)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.params = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
        self.writer.add_text("hparams", "\n".join(f"    {k} = {v}" for k, v in sorted(self.params.items())), 0)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finalize(self, summary: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        final = {f"final/{k}": v for k, v in numbers(flatten(summary)).items() if math.isfinite(v) and not k.startswith("comm.")}
        exp, ssi, sei = hparams(  # type: ignore[no-untyped-call]
            {k: v for k, v in self.params.items() if v is not None}, final
        )
        for event in (exp, ssi, sei):
            self.writer.file_writer.add_summary(event)
        for key, value in final.items():
            self.writer.add_scalar(key, value, int(summary.get("steps") or 0))
        self.writer.add_text("summary", "    " + json.dumps(_json_safe(summary), indent=1, default=str).replace("\n", "\n    "), int(summary.get("steps") or 0))
        self.writer.close()


# -- mlflow ----------------------------------------------------------------------------------


class MLflowLogger(Logger):
    """One MLflow run per training run (tagged ``shardwise.run_id``; a resume reopens it) in
    ``out/mlruns`` (a local file store) or the ``tracking_uri`` given: params, metrics per step,
    the summary's numbers as ``final/...`` metrics and summary.json as an artifact."""

    name = "mlflow"

    def __init__(self) -> None:
        self.client: Any = None
        self.run_uuid: str | None = None
        self.out: Path | None = None
        self.uri = ""

    def setup(self, run: RunInfo) -> None:
        uri = run.tracking_uri
        if uri is None:
            if run.out is None:
                raise ConfigError("the mlflow logger writes to out/mlruns by default: set out=... (--out DIR) or tracking_uri=...")
            uri = (run.out / "mlruns").resolve().as_uri()
        self.out, self.uri = run.out, uri
        with _file_store_allowed(uri):
            self._open(run)

    def _open(self, run: RunInfo) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(run.experiment)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(run.experiment)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`shardwise.run_id` = '{run.run_id}'", max_results=1)
        if found:
            self.run_uuid = found[0].info.run_id
            self.client.update_run(self.run_uuid, status="RUNNING")
        else:
            self.run_uuid = self.client.create_run(experiment_id, tags={"shardwise.run_id": run.run_id}, run_name=f"shardwise-{run.run_id}").info.run_id

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        with _file_store_allowed(self.uri):
            existing = self.client.get_run(self.run_uuid).data.params
            fresh = [Param(k, str(v)[:500]) for k, v in params.items() if k not in existing]  # params are write-once in MLflow
            for i in range(0, len(fresh), 100):
                self.client.log_batch(self.run_uuid, params=fresh[i : i + 100])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with _file_store_allowed(self.uri):
            self.client.log_batch(self.run_uuid, metrics=[Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()])

    def finalize(self, summary: Mapping[str, Any]) -> None:
        steps = int(summary.get("steps") or 0)
        final = {f"final/{k}": v for k, v in numbers(flatten(summary)).items() if math.isfinite(v) and not k.startswith("comm.")}
        self.log_metrics(steps, final)
        with _file_store_allowed(self.uri):
            if self.out is not None and (self.out / "summary.json").exists():
                self.client.log_artifact(self.run_uuid, str(self.out / "summary.json"))
            self.client.set_terminated(self.run_uuid, status="FINISHED")


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow keeps its file store (``file:`` URIs) in maintenance mode and refuses it unless
    ``MLFLOW_ALLOW_FILE_STORE`` is true; the default ``out/mlruns`` is one, so the variable is set
    during MLflow's calls only, and put back after."""
    if not uri.startswith("file:"):
        yield
        return
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def _mlflow_key(key: str) -> str:
    """MLflow keys allow letters, digits and ``_-./ :``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-./ :" else "_" for c in key)


# -- wandb -----------------------------------------------------------------------------------


class WandbLogger(Logger):
    """One W&B run per training run (id = the lineage id, so a resume continues it) in
    ``out/wandb``; offline (files only, ``wandb sync`` uploads them later) unless
    ``WANDB_API_KEY`` is set or ``WANDB_MODE`` says otherwise."""

    name = "wandb"

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode
        self.run: Any = None
        self._service: str | None = None

    def setup(self, run: RunInfo) -> None:
        import wandb

        if run.out is None:
            raise ConfigError("the wandb logger writes into the run directory: set out=... (--out DIR)")
        mode = self.mode or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._service = os.environ.get("WANDB_SERVICE")  # wandb sets it for its children: put back at the end
        (run.out / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=run.experiment,
            id=run.run_id,
            resume="allow",
            dir=str(run.out),
            mode=mode,  # type: ignore[arg-type]
            name=f"shardwise-{run.run_id}",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def finalize(self, summary: Mapping[str, Any]) -> None:
        for key, value in numbers(flatten(summary)).items():
            if not key.startswith("comm."):
                self.run.summary[f"final/{key}"] = value
        self.run.finish()
        import wandb

        wandb.teardown()  # stop wandb's service process with the run
        if self._service is None:
            os.environ.pop("WANDB_SERVICE", None)


# -- names -----------------------------------------------------------------------------------

BUILT_IN: dict[str, tuple[type[Logger], str | None]] = {
    "csv": (CSVLogger, None),
    "tensorboard": (TensorBoardLogger, "tensorboard"),
    "mlflow": (MLflowLogger, "mlflow"),
    "wandb": (WandbLogger, "wandb"),
}
"""name -> (class, the package it imports: checked before launch)."""


def check_names(names: Sequence[str]) -> None:
    """Unknown names and missing packages, in the parent before launch: one line each, naming
    the install command."""
    for name in names:
        if name not in BUILT_IN:
            import difflib

            close = difflib.get_close_matches(name, list(BUILT_IN), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown logger {name!r}.{hint} Known loggers: {', '.join(BUILT_IN)} (or a Logger object in Trainer(loggers=[...]))")
        package = BUILT_IN[name][1]
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"the {name} logger needs the {package} package, which is not installed: pip install 'shardwise[{name}]'")


class Loggers:
    """The run's loggers on rank 0 (an empty fan-out elsewhere): set up, then every record to each."""

    def __init__(self, loggers: Sequence[Logger], run: RunInfo | None) -> None:
        self.loggers = list(loggers) if run is not None else []
        for logger in self.loggers:
            assert run is not None
            logger.setup(run)

    @classmethod
    def build(cls, names: Sequence[str], objects: Sequence[Logger], run: RunInfo | None) -> Loggers:
        return cls([BUILT_IN[n][0]() for n in names] + list(objects), run)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_hyperparams(params)

    def log_metrics(self, record: Mapping[str, Any]) -> None:
        if not self.loggers:
            return
        step = int(record["step"])
        values = {k: v for k, v in numbers(record).items() if k != "step"}
        for logger in self.loggers:
            logger.log_metrics(step, values)

    def finalize(self, summary: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.finalize(summary)
