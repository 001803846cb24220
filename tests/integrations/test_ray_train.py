"""shardwise inside Ray Train: ``TorchTrainer`` with 2 CPU workers on a local Ray instance runs the
digits recipe through `shardwise.integrations.ray_train.fit`, and its weights equal the same Trainer's with
``nproc=2`` started by shardwise itself.

Ray's start-up is most of the cost on two cores, so the module holds one Ray instance and one
``TorchTrainer`` run that checks everything: the refusals first (inside the workers, before
anything trains), then a fit that fails once after its first checkpoint, so Ray restarts the
workers and the run resumes from Ray's checkpoint (``ray.train.get_checkpoint()``), and ends
where the uninterrupted run does. Ray listens on loopback only, with no dashboard and no usage
reporting.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sklearn  # noqa: F401  # digits' data package sets KMP_* once per interpreter: before the hygiene fixture's snapshot
import torch

import shardwise
from shardwise import Trainer, seed_everything
from shardwise.checkpoint.export import model_weights
from shardwise.errors import ConfigError
from shardwise.integrations.ray_train import fit
from shardwise.tools.recipes import get_recipe
from shardwise.trainer.callbacks import Callback

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400), pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")]  # ray.data's own renamed settings

ROOT = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY, FAIL_AFTER = 6, 3, 4


def _digits(**settings: Any) -> tuple[Trainer, Any]:
    """The digits recipe's Trainer and parts, its model built from the run's seed (same on every rank)."""
    recipe = get_recipe("digits")
    defaults = {**recipe.trainer_defaults, "max_steps": STEPS, "log_every": 2, "val_every": 3, "checkpoint_every": CHECKPOINT_EVERY}
    trainer = Trainer(**{**defaults, "strategy": "ddp", "progress_bar": False, **settings})
    seed_everything(trainer.config.seed)
    parts = recipe.parts()
    trainer.optimizer_factory, trainer.loss_fn, trainer.metrics = parts.optimizer, parts.loss_fn, parts.metrics
    return trainer, parts


class _FailOnce(Callback):
    """A worker lost after the first checkpoint: every rank raises at the end of step ``after``."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_train_step_end(self, trainer: Trainer, engine: Any, step: int, loss: torch.Tensor) -> None:
        if step == self.after:
            raise RuntimeError(f"injected failure after step {step}")


def _train_loop(config: dict[str, Any]) -> None:
    """Each Ray worker's function."""
    import ray.train

    out = Path(config["out"])
    rank = ray.train.get_context().get_world_rank()
    first_attempt = ray.train.get_checkpoint() is None
    if first_attempt:
        seen: dict[str, str] = {"shardwise": shardwise.__file__}
        for name, settings in {"nproc": {"nproc": 4}, "servers": {"strategy": "ps"}}.items():
            trainer, parts = _digits(out=str(out / f"refused-{name}"), **settings)
            try:
                fit(trainer, parts.model, parts.train, parts.val)
                seen[name] = "not refused"
            except ConfigError as exc:
                seen[name] = str(exc)
        if rank == 0:
            (out / "worker.json").write_text(json.dumps(seen))
    callbacks = [_FailOnce(FAIL_AFTER)] if first_attempt else []
    trainer, parts = _digits(out=str(out / "run"), callbacks=callbacks)
    fit(trainer, parts.model, parts.train, parts.val)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[Any]:
    # a test extra (dev installs ray[train]): missing, this fails rather than skips, so CI cannot pass without testing it
    assert importlib.util.find_spec("ray") is not None, "the ray extra is missing: pip install -e '.[dev]' (or '.[ray]')"
    environ = dict(os.environ)
    imported_before = "ray" in sys.modules
    # Workers inherit the raylet's environment: this clone's shardwise and tests (the worker
    # function lives in this module), one thread each, no usage report. Ray takes the address
    # of the machine's interface unless told it is a single-machine cluster (read once, when ray
    # is first imported): then it and torch's rendezvous listen on 127.0.0.1. The controller's
    # health check every 0.5 s (2 s by default) notices the injected failure sooner.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [environ.get("PYTHONPATH")])])
    os.environ.update(
        {
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
            "OMP_NUM_THREADS": "1",
        }
    )
    import ray

    # ray.init sets its own SIGTERM handler (sys.exit) and ray.shutdown leaves it: the handlers go
    # back with the environment, or every later test of this worker would run under it.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        assert imported_before or ray.util.get_node_ip_address() == "127.0.0.1"
        yield ray
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environ)
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


@pytest.fixture(scope="module")
def ray_run(ray_session: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    import ray.train
    from ray.train.torch import TorchTrainer

    out = tmp_path_factory.mktemp("ray")
    result = TorchTrainer(
        _train_loop,
        train_loop_config={"out": str(out)},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(storage_path=str(out / "ray-storage"), name="digits", failure_config=ray.train.FailureConfig(max_failures=1)),
    ).fit()
    return result, out


def test_the_trainer_runs_inside_ray_train_and_equals_its_own_two_processes(ray_run: tuple[Any, Path], tmp_path: Path) -> None:
    result, out = ray_run
    assert result.error is None
    assert json.loads((out / "worker.json").read_text())["shardwise"] == shardwise.__file__  # the workers ran this shardwise
    # Ray restarted the workers after the injected failure; the second attempt resumed from the
    # checkpoint Ray holds, not from the run directory.
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    assert summary["steps_this_run"] == STEPS - CHECKPOINT_EVERY
    assert str(out / "ray-storage") in summary["resumed_from"]
    # Ray's Result: the metrics of the last report, and the last checkpoint, a shardwise one.
    assert result.metrics["step"] == STEPS and result.metrics["checkpoint"] == f"step-{STEPS:08d}"
    assert result.metrics["train_loss"] == summary["train_loss"] and result.metrics["val_loss"] == summary["val_loss"]
    ray_weights = model_weights(result.checkpoint.path)  # verified against its manifest
    assert torch.equal(ray_weights["net.0.weight"], model_weights(out / "run" / "checkpoints" / f"step-{STEPS:08d}")["net.0.weight"])

    reference, parts = _digits(nproc=2, out=str(tmp_path / "spawned"))
    spawned = reference.fit(parts.model, parts.train, parts.val)
    assert spawned["train_loss"] == result.metrics["train_loss"] and spawned["val_loss"] == result.metrics["val_loss"]
    own = parts.model.state_dict()
    assert sorted(own) == sorted(ray_weights)
    for name, tensor in own.items():
        assert torch.equal(tensor, ray_weights[name]), name  # bitwise: same data split, same two-rank sums


def test_a_world_size_ray_did_not_start_or_a_serving_rank_is_refused(ray_run: tuple[Any, Path]) -> None:
    _, out = ray_run
    seen = json.loads((out / "worker.json").read_text())
    assert seen["nproc"] == (
        "Trainer(nproc=4) asked for 4 processes, but this Ray Train job has 2 workers (ScalingConfig(num_workers=2)); "
        "shardwise joins Ray's workers and spawns nothing. Leave nproc out (or set nproc=2), or give TorchTrainer "
        "ScalingConfig(num_workers=4)"
    )
    assert "strategy 'ps' keeps 1 serving rank(s) out of the training loop" in seen["servers"]
    assert not (out / "refused-nproc").exists()  # refused before anything was written


def test_outside_a_ray_worker_fit_says_where_it_runs(ray_session: Any) -> None:
    trainer, parts = _digits()
    with pytest.raises(ConfigError, match=r"runs inside a Ray Train worker: call it from the function given to ray\.train\.torch\.TorchTrainer"):
        fit(trainer, parts.model, parts.train)


def test_without_ray_the_error_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_ray(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    trainer, parts = _digits()
    with pytest.raises(ConfigError, match=r"^shardwise.integrations.ray_train needs Ray Train, which is not installed: pip install 'shardwise\[ray\]'$"):
        fit(trainer, parts.model, parts.train)
