"""The ``compile`` setting as Python, flag and TOML key: what each spelling becomes, and a bad one refused
where it is written (the strategies' compiled runs are in tests/strategies/test_compile*.py)."""

from __future__ import annotations

import pytest

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.strategies.compiling import Compile, parse


def _flags(*argv: str) -> str:
    from shardwise.cli import train_parser
    from shardwise.trainer.config import apply_overrides, from_mapping

    args = train_parser().parse_args(["--recipe", "digits", *argv])
    return from_mapping(apply_overrides({}, args.set or []).get("trainer", {})).compile


def test_python_values_become_one_spelling():
    assert Trainer(compile=True).config.compile == "on"
    assert Trainer(compile=False).config.compile == "off"
    assert Trainer().config.compile == "off"
    assert Trainer(compile="blocks:aot_eager").config.compile == "blocks:aot_eager"
    assert Trainer(compile="model:inductor").config.compile == "model"  # Inductor is the default backend


def test_the_flag_alone_is_on_and_with_a_value_is_that_value():
    assert _flags("--compile") == "on"
    assert _flags("--compile", "blocks:aot_eager") == "blocks:aot_eager"  # a flag with a default value keeps what was given
    assert _flags() == "off"
    assert _flags("--compile", "--set", "trainer.compile=off") == "off"  # in order: the later wins


def test_the_other_optional_value_flags_still_take_their_constant():
    from shardwise.cli import train_parser
    from shardwise.trainer.config import apply_overrides, from_mapping

    args = train_parser().parse_args(["--recipe", "digits", "--keep-last-batch", "--compile"])
    config = from_mapping(apply_overrides({}, args.set)["trainer"])
    assert (config.drop_last, config.compile) == (False, "on")


@pytest.mark.parametrize("bad", ["fast", "on:", "off:inductor", "blocks:2:3x"])
def test_a_bad_value_is_refused_naming_the_values(bad):
    if bad == "blocks:2:3x":  # parses (the backend is checked against torch's list before launch, with the model)
        assert parse(bad) == Compile("blocks", "2:3x")
        return
    with pytest.raises(ConfigError, match="not one of off, on, model, blocks"):
        Trainer(compile=bad)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_model_made_of_torch_layers_only_is_compiled_too(strategy, capsys):
    """Dynamo skips frames in torch's own files: ``nn.Module.compile`` on an ``nn.Sequential`` compiles nothing
    (its ``_call_impl`` and forward are both torch's), and neither does compiling DDP's wrapper around one.
    shardwise compiles such a module through a frame of its own, and under ddp the module DDP calls, so the
    run's report shows a traced frame and a graph, and nothing is printed about an uncompiled run."""
    from tests.support import models

    trainer = Trainer(
        strategy=strategy,
        nproc=2 if strategy == "ddp" else 1,
        compile="on:aot_eager",
        loss_fn=models.ce,
        optimizer=models.sgd,
        global_batch_size=16,
        max_steps=2,
        precision="64",
        progress_bar=False,
    )
    summary = trainer.fit(models.mlp(), models.classification(32))
    report = summary["compile"]
    name = "Sequential" if strategy == "single" else "DistributedDataParallel(Sequential)"
    assert report["compiled"] == [name] and report["frames"] >= 1 and report["graphs"] >= 1, report
    assert "made no graph" not in capsys.readouterr().out


def test_an_engine_of_ones_own_loop_refuses_a_bad_backend_as_a_config_error():
    from shardwise import Engine
    from tests.support import models

    engine = Engine(compile="on:nope")
    with pytest.raises(ConfigError, match="compile backend 'nope' is not one of torch's"):
        engine.setup(models.mlp(), models.sgd)


def test_compile_seconds_hold_the_backward_graphs_compiled_on_their_first_backward():
    """The backward graph is compiled lazily, inside the first backward: its seconds are compile time too (else a
    first step's backward compile would count as step time and lower every rate)."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics

    from shardwise.strategies.compiling import compile_seconds

    def total(key: str) -> float:
        return float(sum(compilation_time_metrics.get(key, ())))

    before, fwd0, bwd0 = compile_seconds(), total("_compile.compile_inner"), total("backward._backward_impl")
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)), backend="aot_eager")
    model(torch.randn(3, 4)).sum().backward()
    forward, backward = total("_compile.compile_inner") - fwd0, total("backward._backward_impl") - bwd0
    assert forward > 0 and backward > 0
    assert compile_seconds() - before == pytest.approx(forward + backward)
