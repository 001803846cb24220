"""The Trainer's settings: one frozen dataclass, validated before anything runs, loadable from TOML."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise import config as settings
from shardwise.config import flag
from shardwise.data import check_workers
from shardwise.errors import ConfigError
from shardwise.strategies.precision import normalize

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _count_or_fraction(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of batches or a fraction in (0, 1]; got {text!r}") from None


class _TrainerSetting(argparse.Action):
    """A flag that sets one [trainer] key as ``--set trainer.KEY=VALUE`` would (so it needs no entry in the
    command's own flag table, and a later ``--set`` of the same key wins as flags in order do)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        given = values is not None and values != []  # nargs=0 flags get []; nargs="?" without a value gets None
        value = values if self.const is None or (given and self.nargs == "?") else self.const
        text = str(value).lower() if isinstance(value, bool) else str(value)
        namespace.set = [*(getattr(namespace, "set", None) or []), f"trainer.{self.dest}={text}"]


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Everything about a run that is not code (model, loss, data are passed to ``fit``)."""

    strategy: str = flag("single")
    """Strategy name from the registry: 'single', 'ddp', ... (``shardwise.strategies.available()``; `shardwise strategies` lists them)."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options for the strategy, e.g. ``{"bucket_cap_mb": 50}`` for ddp."""
    nproc: int = flag(1)
    """Processes to start on this machine when the run was not started by a launcher (under torchrun or srun the job's
    processes are used, and a different N > 1 is an error)."""
    threads: int | None = flag(None, metavar="N")
    """Intra-op threads (``torch.set_num_threads``) of each training process; None or 0: automatic, that is a user's
    ``OMP_NUM_THREADS`` when set, else the cores shared out for started processes (cores // nproc), and torch's own count
    for a run in this process (the OMP_NUM_THREADS it started with, or what the program set). One process on a busy
    machine is often far faster with 1 than with torch's default."""
    accelerator: str = flag("auto", choices=("auto", "cpu", "cuda"))
    """'auto' (CUDA when present), 'cpu' or 'cuda'."""
    precision: str = flag("32")
    """'32', '64', 'bf16-mixed', or '16-mixed' (fp16 autocast with a grad scaler)."""
    global_batch_size: int | None = flag(None)
    """Samples per optimizer step across all processes (default: the DataLoader's batch size, else 32)."""
    drop_last: bool = flag(
        True,
        "train on the epoch's last, smaller global batch too (drop_last=False; exact, data-parallel strategies)",
        names=("--keep-last-batch",),
        action=_TrainerSetting,
        nargs=0,
        const=False,
    )
    """Leave out the last, smaller global batch of each epoch (len(data) % global batch samples; said at the start).
    False trains on it too, split over the ranks as evenly as it goes, each micro-batch's mean loss weighted by its
    share, so the step is exact: the gradient of the mean over those samples (data-parallel strategies; pipelines refuse)."""
    accumulate: int = flag(1)
    """Micro-batches per step on each rank; gradients sync only on the last."""
    max_steps: int | None = flag(None)
    """Optimizer steps to run (takes precedence over max_epochs)."""
    max_epochs: int | None = flag(None)
    """Epochs to run when max_steps is not set (default 1)."""
    clip_grad_norm: float | None = flag(None)
    """Clip gradients to this global norm (across every shard) before each step."""
    on_nonfinite: str = flag("stop", choices=("stop", "skip", "warn"), action=_TrainerSetting)
    """A step whose loss or gradients are not finite (NaN, inf), checked on every rank and agreed: 'stop' (the run ends
    with an error naming the step, the ranks and the first such tensor; no optimizer step, the newest finite checkpoint
    kept), 'skip' (no optimizer or scheduler step, counted as nonfinite_skipped, as a grad scaler skips) or 'warn'
    (trained on, one line per step). Under 16-mixed the grad scaler's own skips are not errors."""
    seed: int = flag(0)
    """Seeds model-independent randomness and the data order."""
    deterministic: bool = False
    """Use only deterministic kernels (torch.use_deterministic_algorithms)."""
    log_every: int = flag(10)
    """Log (rank 0) and reduce the training loss across ranks every this many steps."""
    val_every: int | None = flag(None)
    """Evaluate every this many steps (always at the end when validation data is given)."""
    val_batch_size: int | None = None
    """Evaluation batch per rank (default: the training micro-batch, at least 1)."""
    out: str | None = flag(None)
    """Run directory: metrics.jsonl, summary.json, checkpoints/."""
    checkpoint_every: int | None = flag(None)
    """Save a checkpoint every this many steps (and at the end) when ``out`` is set."""
    keep_last: int = 3
    """Checkpoints to keep; older ones are deleted."""
    resume: str | None = flag(None)
    """'auto' (newest valid checkpoint in out/checkpoints, if any) or a checkpoint directory."""
    overwrite: bool = flag(False)
    """Start afresh in an ``out`` that holds an earlier run: its files are moved to ``out/replaced-<time>/``."""
    progress_bar: bool | None = None
    """Show a progress bar on rank 0 (default: when stderr is a terminal; log lines otherwise)."""
    num_workers: int = flag(0, metavar="N")
    """Data-loading worker processes per rank (started once per run; 0: batches load in the training process)."""
    pin_memory: bool = flag(False)
    """Hand out batches in page-locked (pinned) memory, so their copy to the GPU is asynchronous (non_blocking: the process
    queues the step's work behind it instead of waiting); with num_workers > 0 torch's pin-memory thread pins them as they
    arrive. Needs CUDA: elsewhere it is said once and ignored."""
    prefetch_factor: int | None = flag(None, metavar="K")
    """Micro-batches each data-loading worker keeps ready ahead of the step (torch's DataLoader prefetch_factor, default 2:
    at most num_workers x K in flight); needs num_workers >= 1."""
    stream_resume: str = flag("auto", choices=("auto", "replay"))
    """How a resume finds its place in a stream (an IterableDataset): 'auto' loads the source's own state where it has
    state_dict/load_state_dict (saved with each checkpoint), else reads the stream again up to the position; 'replay' always reads it again."""
    start_method: str = "forkserver"
    """How local workers start: 'forkserver' (forks of a process that imported torch once, from the
    second launch in a process or with more ranks than cores; 'fork' is the same) or 'spawn' (a fresh
    interpreter each, always). Either way the model and data reach them pickled."""
    timeout_s: float = 300.0
    """Seconds a collective waits for its peers before failing with the rank and operation named."""
    preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signals that stop training with a checkpoint at the next log step instead of ending the process
    (a spot notice, Slurm's --signal); ``shardwise train`` then exits with 75. Empty: signals act as usual."""
    debug_collectives: bool = flag(False)
    """Check that every rank runs the same collectives in the same order with the same shapes (torch's
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), and meet at a monitored barrier after every step that names the
    ranks that did not come; slower: for finding a mismatch, which on gloo can give wrong values instead of a hang."""
    mesh: dict[str, int] = field(default_factory=dict)
    """Parallel degrees other than data parallel, e.g. ``{"tp": 2}``."""
    sync_batchnorm: bool = False
    """BatchNorm statistics over the global batch under data parallelism (SyncBatchNorm, CPU and GPU)."""
    return_weights: str = "auto"
    """Whether ``fit`` with worker processes sets the trained weights into the caller's ``model``: 'auto' (yes, unless the
    model was built on the meta device or its weights exceed 1 GiB and the run writes checkpoints: then they are only in
    ``out/checkpoints``), 'always' or 'never'. Each rank builds its own model by running the script up to ``fit``."""
    activation_checkpointing: str = flag("off", action=_TrainerSetting, metavar="off|blocks[:K]|ops[:K]")
    """Recompute blocks' activations in backward instead of keeping them (every strategy): 'off', 'blocks' (every block
    of the model's block list keeps only its inputs: about one more forward a step), 'blocks:K' (every K-th block),
    'ops' (every block keeps its matrix products' outputs, recomputes norms, activations and element-wise work) or
    'ops:K'. Gradients equal the run without it; parameter names do not change (`shardwise.strategies.checkpointing`)."""
    compile: str = flag("off", nargs="?", const="on", action=_TrainerSetting, metavar="off|on|model|blocks[:BACKEND]")
    """torch.compile the model under any strategy: 'off' (the default), 'on' (the strategy chooses: the model whole where it
    runs whole, each block where it is sharded, split or staged), 'model' or 'blocks'; ':BACKEND' picks torch's backend
    ('on:aot_eager'; Inductor by default). Python's True is 'on'. Compile seconds and recompilations are reported apart from
    the step time, in summary.json's 'compile' (`shardwise.strategies.compiling`)."""
    peak_tflops: float | None = flag(None, metavar="TFLOPS")
    """The device's peak TFLOP/s for MFU where the built-in table has none (a GPU it does not list), or to replace its
    figure: summary.json's 'mfu' is the model's FLOP/s over this x the processes (`shardwise.trainer.throughput`)."""
    loggers: tuple[str, ...] = flag((), names=("--logger",), metavar="NAMES")
    """Experiment loggers on rank 0 besides metrics.jsonl: 'csv', 'tensorboard', 'mlflow', 'wandb' (a list, or one comma-separated string)."""
    experiment_name: str = "shardwise"
    """The MLflow experiment and the W&B project the run is logged under."""
    tracking_uri: str | None = None
    """MLflow tracking URI (default: a file store in out/mlruns)."""
    fast_dev_run: int = flag(0, nargs="?", const=1, metavar="N")
    """Check the whole loop quickly: this many steps (True is 1) and as many validation batches per rank; nothing is saved or logged."""
    overfit_batches: int = flag(0, metavar="N")
    """Train on the first N global batches of the training set only, in the same order every epoch (a model that cannot overfit them has a bug)."""
    limit_train_batches: int | float | None = flag(None, type=_count_or_fraction, metavar="N|F")
    """Steps per epoch: a whole number, or a fraction (0, 1] of the epoch."""
    limit_val_batches: int | float | None = flag(None, type=_count_or_fraction, metavar="N|F")
    """Evaluate on the first N x val batch x data-parallel ranks samples (every rank N batches), or a fraction (0, 1] of the set; still each sample once."""
    count_flops: bool = True
    """Count the model's FLOPs once before launch (a forward and backward of one sample on meta tensors, in the calling
    process) for FLOP/s and MFU in the summary, the log lines and the end line; False skips it (a forward with effects
    outside the model runs once more there), and the rates have no FLOPs. Off in the tools' short probe runs."""
    model_summary: bool = True
    """Print parameters per top-level module (trainable or not) and per rank after sharding at the start; also in summary.json."""
    announce_outputs: bool = True
    """Print the run's first line, on what is saved where (off in the short internal runs of tune and compress, whose command saves its own)."""
    profile: bool = flag(False)
    """Profile a window of steps on every rank with torch.profiler: a Chrome trace per rank in out/profile/, and the step breakdown in summary.json."""
    profile_skip: int = 2
    """Steps before the profiled window (the first steps pay one-time costs)."""
    profile_steps: int = 3
    """Steps in the profiled window."""

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1; got {value!r}")

        for name in ("nproc", "accumulate", "log_every", "keep_last"):
            positive(name, allow_none=False)
        if self.threads == 0 and not isinstance(self.threads, bool):
            object.__setattr__(self, "threads", None)  # 0 is automatic, as None
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(f"threads must be a whole number >= 1 (or 0 for automatic); got {self.threads!r} (e.g. --threads 1)")
        for name in ("global_batch_size", "max_steps", "max_epochs", "val_every", "val_batch_size", "checkpoint_every"):
            positive(name)
        if isinstance(self.strategy, str):  # a misspelt name is refused here, not at fit
            from shardwise.strategies import check_name

            check_name(self.strategy)
        object.__setattr__(self, "precision", normalize(self.precision))
        from shardwise.strategies.compiling import parse as parse_compile

        object.__setattr__(self, "compile", str(parse_compile(self.compile)))  # True -> 'on'; a bad value refused here
        if self.peak_tflops is not None and not (isinstance(self.peak_tflops, (int, float)) and 0 < self.peak_tflops < float("inf")):
            raise ConfigError(f"peak_tflops must be a positive number of TFLOP/s per device (e.g. 989 for an H100 in bf16); got {self.peak_tflops!r}")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"clip_grad_norm must be > 0 (or None to disable); got {self.clip_grad_norm}")
        if self.return_weights not in ("auto", "always", "never"):
            raise ConfigError(f"return_weights must be 'auto', 'always' or 'never'; got {self.return_weights!r}")
        if self.on_nonfinite not in ("stop", "skip", "warn"):
            raise ConfigError(f"on_nonfinite must be 'stop', 'skip' or 'warn'; got {self.on_nonfinite!r}")
        if not isinstance(self.drop_last, bool):
            raise ConfigError(f"drop_last must be True or False; got {self.drop_last!r}")
        if self.accelerator not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"accelerator must be 'auto', 'cpu' or 'cuda'; got {self.accelerator!r}")
        check_workers(self.num_workers, self.prefetch_factor)
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(f"pin_memory must be True or False; got {self.pin_memory!r}")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ConfigError(f"start_method must be 'spawn', 'fork' or 'forkserver'; got {self.start_method!r}")
        if self.resume is not None and self.resume != "auto" and not Path(self.resume).exists():
            raise ConfigError(f"resume={self.resume!r}: no such checkpoint directory; pass 'auto' or an existing path")
        if self.resume == "auto" and self.out is None:
            raise ConfigError("resume='auto' looks for checkpoints in out/checkpoints; set out as well")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0; got {self.timeout_s}")
        self._check_preempt_signals()
        self._check_run_tools()

    def _check_preempt_signals(self) -> None:
        import signal

        given = self.preempt_signals
        names = tuple(x.strip() for x in given.split(",") if x.strip()) if isinstance(given, str) else tuple(given or ())
        allowed = sorted(s.name for s in signal.Signals if s.name not in ("SIGKILL", "SIGSTOP", "SIGUSR2", "SIGINT") and not s.name.startswith("SIGRT"))
        for name in names:
            if name not in allowed:
                raise ConfigError(f"preempt_signals: {name!r} cannot be caught for preemption; use names such as SIGTERM, SIGUSR1 (SIGUSR2 is the launcher's)")
        object.__setattr__(self, "preempt_signals", names)

    def _check_run_tools(self) -> None:
        """Loggers, quick-run limits and the profiler window (issue 14's settings)."""
        names = self.loggers.split(",") if isinstance(self.loggers, str) else list(self.loggers)
        if not all(isinstance(n, str) for n in names):
            raise ConfigError(
                f"loggers takes logger names ('csv', 'tensorboard', 'mlflow', 'wandb'); got {self.loggers!r} (pass Logger objects to Trainer(loggers=[...]))"
            )
        object.__setattr__(self, "loggers", tuple(n.strip().lower() for n in names if n.strip()))
        fast = self.fast_dev_run
        if fast is True or fast is False:
            object.__setattr__(self, "fast_dev_run", int(fast))
        elif not isinstance(fast, int) or fast < 0:
            raise ConfigError(f"fast_dev_run must be True, False or a number of steps >= 0; got {fast!r}")
        for name in ("overfit_batches", "profile_skip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a whole number >= 0; got {value!r}")
        if isinstance(self.profile_steps, bool) or not isinstance(self.profile_steps, int) or self.profile_steps < 1:
            raise ConfigError(f"profile_steps must be a whole number >= 1; got {self.profile_steps!r}")
        for name in ("limit_train_batches", "limit_val_batches"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (isinstance(value, float) and value > 1):
                raise ConfigError(f"{name} must be a whole number of batches >= 1 or a fraction in (0, 1]; got {value!r}")

    def replace(self, **changes: Any) -> TrainerConfig:
        return dataclasses.replace(self, **changes)

    def probe(self, steps: int, **changes: Any) -> TrainerConfig:
        """These settings for a short probe run of ``steps`` steps that leaves nothing behind: no run
        directory, validation, checkpoints, loggers, profile or model summary, one log line at the end
        (the range test and the batch-size finder)."""
        quiet: dict[str, Any] = dict(
            max_steps=steps,
            max_epochs=None,
            out=None,
            resume=None,
            overwrite=False,
            val_every=None,
            checkpoint_every=None,
            log_every=steps,
            progress_bar=False,
            loggers=(),
            profile=False,
            fast_dev_run=0,
            model_summary=False,
            count_flops=False,  # a probe measures memory or a loss curve: the count's own allocations would be in them
            announce_outputs=False,
            on_nonfinite="warn",  # a probe measures: the range test sweeps the rate until the loss diverges, on purpose
        )
        return self.replace(**{**quiet, **changes})


def add_flags(p: argparse.ArgumentParser) -> None:
    """``shardwise train``'s flags of the trainer settings: one per field made with `flag` (the other
    fields are [trainer] keys only); each defaults to None, so the TOML value stands unless it is given."""
    settings.add_arguments(p, TrainerConfig, unset=True, marked_only=True)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The trainer settings given as flags (those of `_TrainerSetting` went into ``args.set``)."""
    return settings.given(TrainerConfig, args)


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainerConfig)]


def from_mapping(values: Mapping[str, Any], base: TrainerConfig | None = None) -> TrainerConfig:
    """A config from a mapping of field names; unknown names are an error naming the known ones."""
    settings.check_keys(TrainerConfig, values, "trainer settings")
    return dataclasses.replace(base or TrainerConfig(), **dict(values))


def parse_value(text: str) -> Any:
    """A ``--set key=value`` value read as TOML (numbers, booleans, strings, arrays); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(sections: dict[str, dict[str, Any]], overrides: list[str]) -> dict[str, dict[str, Any]]:
    """Apply ``section.key=value`` overrides (``strategy_options.bucket_cap_mb=50`` nests one level)."""
    out = {k: dict(v) for k, v in sections.items()}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set takes section.key=value (e.g. trainer.max_steps=100); got {item!r}")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        node = out.setdefault(parts[0], {})
        for p in parts[1:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = parse_value(raw.strip())
    return out


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    sections: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if not isinstance(value, dict):
            raise ConfigError(f"config file {p}: top-level key {key!r} must be a [section] (trainer, recipe)")
        sections[key] = value
    return sections


__all__ = ["TrainerConfig", "add_flags", "apply_overrides", "field_names", "flag_values", "from_mapping", "load_toml", "parse_value"]
