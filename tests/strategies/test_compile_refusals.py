"""``compile=`` refused before launch where it cannot work: a `ConfigError` from ``Trainer.fit`` in the parent,
no worker started, the message naming what was wrong, what was received and the fix."""

from __future__ import annotations

import os
from typing import Any

import pytest
from torch import nn

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.strategies import compiling, get_strategy
from tests.support import charlm_model as cm
from tests.support import models


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Trainer.fit's worker start replaced by one that records the call (and fails the test)."""
    started: list[Any] = []

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        started.append(args)
        raise AssertionError("workers were started: the refusal came too late")

    monkeypatch.setattr(Trainer, "_launch_workers", launch)
    return started


def refuse(model: nn.Module, data: Any, match: str, **settings: Any) -> str:
    base: dict[str, Any] = dict(global_batch_size=8, max_steps=1, progress_bar=False, nproc=2, loss_fn=models.ce)
    base.update(settings)
    t = Trainer(optimizer=models.sgd, **base)
    with pytest.raises(ConfigError, match=match) as err:
        t.fit(model, data)
    return str(err.value)


def test_dp_is_refused_naming_ddp() -> None:
    """(On this machine Trainer.fit refuses dp earlier: it needs 2 CUDA devices; the check the plan runs is asked directly.)"""
    with pytest.raises(ConfigError, match=r"strategy 'dp' cannot run a compiled model") as err:
        compiling.check("on", models.mlp(), get_strategy("dp"), "cuda")
    assert "nn.DataParallel" in str(err.value) and "use ddp" in str(err.value) and "compile='off'" in str(err.value)


def test_pipeline_with_compile_model_is_refused_naming_blocks(no_workers: list[Any]) -> None:
    msg = refuse(cm.build("charlm"), cm.charlm_data(16), r"compile='model': strategy 'pipeline' never calls the model whole",
                 strategy="pipeline", strategy_options={"pp": 2, "microbatches": 2}, compile="model:aot_eager", loss_fn=cm.charlm_loss)  # fmt: skip
    assert "use compile='blocks'" in msg
    assert not no_workers


def test_blocks_on_a_model_without_a_block_list_is_refused(no_workers: list[Any]) -> None:
    class TwoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

        def forward(self, x: Any) -> Any:
            return self.b(self.a(x).tanh())

    msg = refuse(TwoLayers().double(), models.classification(), r"TwoLayers has no list of repeated blocks", strategy="zero3", compile="on:aot_eager")
    assert "compiles one block at a time under strategy 'zero3'" in msg and "nn.ModuleList" in msg
    assert "a strategy that compiles the model whole (single, ddp)" in msg  # zero3 refuses 'model' (next test): not offered
    assert not no_workers


def test_compile_model_under_a_per_block_strategy_is_refused_naming_blocks(no_workers: list[Any]) -> None:
    """zero3's FSDP2 hooks sit on the blocks: a whole-model compile broke at them and ran in part uncompiled."""
    msg = refuse(cm.build("charlm"), cm.charlm_data(16), r"compile='model': strategy 'zero3' compiles one block at a time",
                 strategy="zero3", compile="model:aot_eager", loss_fn=cm.charlm_loss)  # fmt: skip
    assert "use compile='blocks'" in msg
    assert not no_workers


def test_an_unknown_backend_is_refused_listing_the_known(no_workers: list[Any]) -> None:
    msg = refuse(models.mlp(), models.classification(), r"compile backend 'tensorrt_x' is not one of torch's", strategy="ddp", compile="on:tensorrt_x")
    assert "aot_eager" in msg and "inductor" in msg and "TESTING_ONLY" not in msg
    assert not no_workers


@pytest.mark.parametrize("backend, near", [("AOT_EAGER", "aot_eager"), ("Inductor", "inductor"), ("aot-eager", "aot_eager"), ("indcutor", "inductor")])
def test_a_misspelt_backend_is_refused_with_the_nearest_name(backend: str, near: str) -> None:
    """Backend names are matched exactly (a user's registered backend may have capitals); the nearest is suggested."""
    with pytest.raises(ConfigError, match=rf"compile backend '{backend}' is not one of torch's: did you mean '{near}'\?"):
        compiling.check_backend(backend, "cpu")


@pytest.mark.parametrize("value", ["fast", "on:", "off:inductor", "blocks:"])
def test_a_bad_value_is_refused_naming_the_valid_ones(value: str) -> None:
    with pytest.raises(ConfigError, match=r"is not one of off, on, model, blocks .*'on:aot_eager'"):
        Trainer(optimizer=models.sgd, loss_fn=models.ce, compile=value)
    with pytest.raises(ConfigError, match=r"is not one of off, on, model, blocks"):
        compiling.parse(value)


PARSED = [(True, "on", "inductor"), (False, "off", "inductor"), (None, "off", "inductor"), ("ON:aot_eager", "on", "aot_eager"),
          ("blocks", "blocks", "inductor"), ("yes", "on", "inductor")]  # fmt: skip


@pytest.mark.parametrize("value, mode, backend", PARSED)
def test_values_parse(value: Any, mode: str, backend: str) -> None:
    assert compiling.parse(value) == compiling.Compile(mode, backend)


def test_inductor_without_a_cpp_compiler_is_refused_naming_aot_eager(no_workers: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, c++ or clang++
    monkeypatch.delenv("CXX", raising=False)
    msg = refuse(
        models.mlp(), models.classification(), r"Inductor compiles C\+\+ on cpu with g\+\+, and no C\+\+ compiler was found", strategy="ddp", compile="on"
    )
    assert "install one (apt install g++)" in msg and "compile='on:aot_eager'" in msg
    monkeypatch.setenv("PATH", path)  # g++ on PATH again
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # Inductor takes $CXX alone: a g++ on PATH does not help
    msg = refuse(models.mlp(), models.classification(), r"with CXX=/nonexistent/g\+\+, and no C\+\+ compiler was found", strategy="ddp", compile="on")
    assert "set CXX=g++ (found on PATH)" in msg
    assert not no_workers
    compiling.check("on:aot_eager", models.mlp(), get_strategy("ddp"))  # no compiler needed: accepted


def test_what_works_is_accepted() -> None:
    """The checks pass where compile works (they do not refuse everything)."""
    model = cm.build("charlm")
    for name, value, mode in (("ddp", "on", "model"), ("zero3", "on", "blocks"), ("pipeline", "on", "blocks"), ("tp", "blocks:aot_eager", "blocks"),
                              ("single", "model", "model"), ("dp", "off", "off"), ("zero2", True, "blocks")):  # fmt: skip
        strategy = get_strategy(name)
        setting = compiling.check(value, model, strategy)
        assert (setting.resolved(strategy.compile_unit) if setting.enabled else "off") == mode, name
