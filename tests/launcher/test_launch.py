"""shardwise.launch: results per rank, failures raised in the parent as one short report, hangs stopped,
and under a launcher: joined, nothing spawned."""

from __future__ import annotations

import inspect
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import Trainer, launch
from shardwise.errors import ConfigError, LaunchError
from shardwise.launcher.spawn import RemoteTraceback
from tests.support import zoo

pytestmark = pytest.mark.dist


def _rank_and_sum() -> tuple[int, int, float, int]:
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t[0].item(), torch.get_num_threads()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    # Rank 0 waits in a collective its peer never joins: launch must stop it.
    dist.all_reduce(torch.ones(1))


def _sleep_forever() -> None:
    time.sleep(600)


def test_results_come_back_per_rank_with_one_thread_each():
    results = launch(_rank_and_sum, nproc=2, threads_per_proc=1)
    assert results == [(0, 2, 3.0, 1), (1, 2, 3.0, 1)]


def test_a_failing_rank_raises_its_own_exception_in_the_parent(tmp_path):
    # Rank 0's collective would wait an hour for its peer: returning at all within the test's limit
    # means launch stopped it (the bound below is that limit, not a guess at how fast the machine is).
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank one") as info:
        launch(_fail_on_rank_one, nproc=2, error_dir=tmp_path, collective_timeout_s=3600)
    assert "rank 1 failed" in str(info.value.__cause__)
    assert time.monotonic() - start < 170


def test_a_hang_is_stopped_and_names_the_ranks():
    with pytest.raises(LaunchError, match=r"timed out after 3s; ranks still running: \[0, 1\]"):
        launch(_sleep_forever, nproc=2, timeout=3)


def test_bad_nproc_and_unpicklable_functions_are_clear_errors():
    with pytest.raises(ConfigError, match="nproc must be a whole number >= 1; got 0"):
        launch(_rank_and_sum, nproc=0)
    lock = threading.Lock()
    with pytest.raises(LaunchError, match=r"could not send fn.<closure>.lock to the worker processes: it is a _thread.lock, which cannot be pickled"):
        launch(lambda: lock, nproc=1)


# -- a worker's error: one short block, the original type, the full traceback in a file ---------------
_BOOM_LINE = inspect.getsourcelines(_fail_on_rank_one)[1] + 2  # the `raise` line


def _config_error_everywhere() -> None:
    raise ConfigError("bad setting x=3")


def test_the_failure_report_is_short_names_the_user_frame_and_points_at_the_full_traceback(tmp_path):
    with pytest.raises(ValueError, match="boom on rank one") as info:
        launch(_fail_on_rank_one, nproc=2, error_dir=tmp_path / "errors")
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    lines = str(cause).splitlines()
    assert lines[0] == "rank 1 failed: ValueError: boom on rank one"
    assert lines[1] == f"  at {os.path.relpath(__file__)}:{_BOOM_LINE} in _fail_on_rank_one"
    # Rank 0, waiting for rank 1 in all_reduce, may fail too (its peer closed the connection) or be stopped first.
    assert lines[2:-1] in ([], ["  then: rank 0 (RuntimeError)"]), lines
    assert lines[-1].startswith(f"  full traceback: {tmp_path / 'errors' / 'rank-1.txt'}")
    full = (tmp_path / "errors" / "rank-1.txt").read_text()
    assert "Traceback (most recent call last)" in full and "boom on rank one" in full and "shardwise/launcher/worker.py" in full


def test_the_same_error_on_every_rank_is_one_entry_of_the_original_type_with_a_temporary_traceback_dir():
    with pytest.raises(ConfigError, match="bad setting x=3") as info:
        launch(_config_error_everywhere, nproc=2)
    text = str(info.value.__cause__)
    assert text.splitlines()[0] in (
        "ranks 0, 1 failed: ConfigError: bad setting x=3",
        "ranks 1, 0 failed: ConfigError: bad setting x=3",
        "rank 0 failed: ConfigError: bad setting x=3",
        "rank 1 failed: ConfigError: bad setting x=3",
    )
    paths = [Path(p) for p in text.splitlines()[-1].split("full traceback: ")[1].split(", ")]
    try:
        # every listed file exists; the first failing rank's holds the error (a rank stopped or failing
        # otherwise after it, e.g. its peer closing the connection under load, is listed with its own)
        assert all(p.is_file() for p in paths), text
        assert "bad setting x=3" in paths[0].read_text(), text
    finally:
        shutil.rmtree(paths[0].parent)


class _TensorOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)  # a batch of the wrong width fails here


def _dict_loss(output, batch):
    return output.sum()


def test_a_shape_mismatch_in_the_users_forward_is_reported_at_that_line_in_out_errors(tmp_path):
    # (a dict batch the forward cannot take is refused in the parent: tests/data/test_batches.py)
    data = [(torch.randn(5), torch.tensor(1)) for _ in range(16)]
    trainer = Trainer(strategy="ddp", nproc=2, global_batch_size=4, max_steps=2, loss_fn=_dict_loss, out=str(tmp_path), progress_bar=False)
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        trainer.fit(_TensorOnly(), data)
    lines = str(info.value.__cause__).splitlines()
    forward_line = inspect.getsourcelines(_TensorOnly.forward)[1] + 1
    assert lines[0].startswith(
        ("ranks 0, 1 failed: RuntimeError", "ranks 1, 0 failed: RuntimeError", "rank 0 failed: RuntimeError", "rank 1 failed: RuntimeError")
    )
    assert lines[1] == f"  at {os.path.relpath(__file__)}:{forward_line} in forward"
    assert (tmp_path / "errors").is_dir() and any((tmp_path / "errors").glob("rank-*.txt"))


# -- under a launcher: join, spawn nothing, refuse a different nproc ---------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pid_rank_world() -> tuple[int, int, int]:
    return os.getpid(), dist.get_rank(), dist.get_world_size()


def _torchrun_like(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    for key, value in dict(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)


def test_launch_under_a_launcher_runs_here_and_returns_this_ranks_result(monkeypatch):
    _torchrun_like(monkeypatch, 1)
    assert launch(_pid_rank_world, nproc=1) == [(os.getpid(), 0, 1)]  # this process, no child (hygiene checks)
    assert not dist.is_initialized()  # the group launch created is gone again


def test_an_nproc_that_disagrees_with_the_launchers_world_size_is_a_config_error(monkeypatch):
    _torchrun_like(monkeypatch, 2)
    with pytest.raises(ConfigError, match=r"launch\(nproc=...\) asked for 3 processes, but this process already runs in a job of 2 started by torchrun"):
        launch(_pid_rank_world, nproc=3)
    with pytest.raises(ConfigError, match=r"Trainer\(nproc=...\) asked for 3 processes.*job of 2.*Set nproc=2"):
        Trainer(strategy="ddp", nproc=3, loss_fn=_dict_loss).fit(_TensorOnly(), [torch.randn(4)] * 8)
    assert not dist.is_initialized()


def test_a_function_from_an_interactive_session_crosses_by_value(monkeypatch):
    # A notebook's or REPL's __main__ has no script for a worker to run: its functions go by value.
    import pickle
    import types

    from shardwise.launcher import payload

    fake_main = types.ModuleType("__main__")  # a REPL's __main__: no __file__
    monkeypatch.setitem(__import__("sys").modules, "__main__", fake_main)

    def in_repl() -> int:
        return 1

    in_repl.__module__ = "__main__"
    in_repl.__qualname__ = "in_repl"
    fake_main.in_repl = in_repl  # type: ignore[attr-defined]
    sent = payload.dumps(in_repl, (), {}, None)
    monkeypatch.delattr(fake_main, "in_repl")  # a worker's __main__ does not have it
    fn, _, _ = pickle.loads(sent)
    assert fn() == 1 and fn is not in_repl


def _scaled_loss(scale: float) -> Any:
    def loss(output: Any, batch: Any) -> torch.Tensor:  # a closure, as users write them
        return scale * zoo.causal_lm_loss64(output, batch)

    return loss


def test_a_lambda_optimizer_a_closure_loss_a_lambda_collate_and_gradient_checkpointing_train_under_ddp_as_single(recwarn):
    # Each of the four is refused by plain pickle (the model for the forward hook transformers'
    # gradient_checkpointing_enable registers on the input embeddings, a function local to transformers).
    from torch.utils.data import DataLoader, default_collate

    def fit(strategy: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        model = zoo.build("gpt2", layers=1)
        model.gradient_checkpointing_enable()
        assert model.transformer.wte._forward_hooks and model.transformer.h[0].gradient_checkpointing
        data = DataLoader(zoo.dataset("gpt2", 16), batch_size=4, collate_fn=lambda samples: default_collate(samples))
        trainer = Trainer(
            strategy=strategy,
            nproc=1 if strategy == "single" else 2,
            global_batch_size=8,
            max_steps=2,
            precision="64",
            seed=0,
            progress_bar=False,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            loss_fn=_scaled_loss(0.5),
        )
        summary = trainer.fit(model, data)
        return summary, model.state_dict()

    single, single_state = fit("single")
    ddp, ddp_state = fit("ddp")
    assert ddp["steps"] == 2 and abs(ddp["train_loss"] - single["train_loss"]) < 1e-9
    for name, value in single_state.items():
        torch.testing.assert_close(ddp_state[name], value, rtol=0, atol=1e-9, msg=name)
    assert not torch.equal(single_state["transformer.h.0.mlp.c_fc.weight"], zoo.build("gpt2", layers=1).state_dict()["transformer.h.0.mlp.c_fc.weight"])
