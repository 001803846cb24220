"""tp refuses, in the parent before launch, a model its split would leave mixed or misshapen
(`tensor_parallel.rehearse`: the forward and backward run once on meta tensors with the split
applied on a fake process group), naming the module; and models that train under tp pass."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from shardwise import Trainer
from shardwise.data import fetch
from shardwise.errors import ConfigError
from shardwise.strategies.tensor_parallel import TensorParallel
from shardwise.strategies.tensor_parallel.rehearse import rehearse
from shardwise.tools.recipes.charlm import CharGPT
from tests.support.own_models import build_blockpos, build_own, own_dataset, own_loss, token_loss


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Trainer.fit with no process started: a call to launch is recorded and fails the test."""
    from shardwise.trainer import loop

    calls: list[Any] = []

    def launch(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError("launch was called: the refusal came too late")

    monkeypatch.setattr(loop, "launch", launch)
    monkeypatch.setattr(loop, "prestart", lambda *a, **k: None)
    return calls


def _fit(model: torch.nn.Module, data: Any, loss: Any, sp: bool) -> None:
    t = Trainer(
        strategy="tp",
        strategy_options={"tp": 2, "sequence_parallel": sp},
        nproc=2,
        global_batch_size=8,
        max_steps=2,
        precision="64",
        optimizer=_sgd,
        loss_fn=loss,
        progress_bar=False,
    )
    t.fit(model, data)


def test_tp_on_a_cnn_is_refused_by_fit_in_the_parent_naming_the_convolution(no_launch: list[Any], caplog: pytest.LogCaptureFixture, capfd: Any) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(
        ConfigError,
        # conv1 runs before any split linear: the true reason is that tp lays out the input of the module holding the
        # split linears (the model itself here) as a DTensor, so no tp_plan can help (a new user's report)
        match=r"SmallCNN cannot train under tp=2: .* fails in conv1 \(Conv2d\): aten.convolution.default: got mixed torch.Tensor and DTensor\. conv1 "
        r"receives a distributed tensor .* here the model itself .* a Conv2d cannot run on it\. No tp_plan changes that for this model",
    ):
        _fit(build_own("cnn"), own_dataset("cnn", 16), own_loss("cnn"), sp=False)
    assert no_launch == []
    # torch's fake-tensor and DTensor loggers were silenced: nothing of theirs reached the user
    assert not [r for r in caplog.records if r.name.startswith("torch")]
    out, err = capfd.readouterr()
    assert "fake_tensor" not in out + err and "Traceback" not in out + err


def test_sequence_parallelism_on_a_model_that_cannot_take_it_is_refused_in_the_parent(no_launch: list[Any]) -> None:
    # Each block adds its whole (8, d) position table to the residual stream, which sequence
    # parallelism shards to 4 positions a rank: the workers would fail at the first forward.
    with pytest.raises(
        ConfigError,
        match=r"BlockPosTransformer cannot train under tp=2 with sequence_parallel: .* fails in blocks.0 \(PosBlock\): .*Sequence parallelism shards",
    ):
        _fit(build_blockpos(), own_dataset("postransformer", 16), token_loss, sp=True)
    assert no_launch == []
    # the same model without sequence parallelism rehearses cleanly
    sample = fetch(own_dataset("postransformer", 4), [0])
    assert rehearse(build_blockpos(), sample, None, 2, False) is True


def test_postransformer_is_refused_with_the_reason_true_for_it_and_a_plan_that_runs() -> None:
    """Its attention reshapes q/k/v with ``d // heads``, ``d`` read from its whole input: it cannot
    run on 1/tp of its heads, with or without sequence parallelism (the reason given for both)."""
    model, sample = build_own("postransformer"), fetch(own_dataset("postransformer", 4), [0])
    for sp in (False, True):
        with pytest.raises(ConfigError) as err:
            rehearse(model, sample, None, 2, sp)
        message = str(err.value)
        assert "PosTransformer cannot train under tp=2: " in message and "fails in blocks.0.attn (Attention): shape" in message
        assert "Sequence parallelism" not in message
        assert message.endswith("This plan rehearses without error: tp_plan={'blocks.*.up': 'colwise', 'blocks.*.down': 'rowwise'}")
        assert rehearse(model, sample, {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}, 2, sp) is True


def test_models_that_train_under_tp_rehearse_cleanly() -> None:
    from tests.support import zoo

    charlm = CharGPT(11, 8, 16, 2, 2)
    cases = [(charlm, (torch.randint(0, 11, (1, 8)), torch.randint(0, 11, (1, 8))))]
    cases += [(zoo.build(name, layers=2), fetch(zoo.dataset(name, 2), [0])) for name in ("llama", "gpt2")]
    cases += [(build_own("gpt"), fetch(own_dataset("gpt", 2), [0]))]  # nanoGPT's GPT: whole attention, split MLP
    for model, sample in cases:
        for sp in (False, True):
            assert rehearse(model, sample, None, 2, sp) is True, type(model).__name__
    assert rehearse(build_own("mlp"), fetch(own_dataset("mlp", 2), [0]), None, 2, False) is True  # a root-level pair, functional ReLUs
    for p in charlm.parameters():  # the user's model is untouched (the rehearsal ran on a meta copy)
        assert p.device.type == "cpu" and not hasattr(p, "placements")


def test_the_rehearsal_judges_nothing_it_cannot_run_and_leaves_no_process_group() -> None:
    import torch.distributed as dist

    class DataDependent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum().item() > 1e9:  # .item() has no value on meta tensors
                x = x * 2
            return self.fc2(self.fc1(x))

    assert rehearse(DataDependent(), (torch.randn(1, 4), torch.zeros(1)), None, 2, False) is False
    with pytest.raises(ConfigError):
        rehearse(build_own("cnn"), fetch(own_dataset("cnn", 2), [0]), None, 2, False)
    assert not dist.is_initialized()


def test_tp_refusals_name_the_option_tp_plan() -> None:
    with pytest.raises(ConfigError, match=r"^tp_plan\['fc1'\] = 'column' is not a style"):
        TensorParallel(tp_plan={"fc1": "column"})
    with pytest.raises(ConfigError, match=r"^tp_plan names 'blocks.0.mlp.fc1', which matches no module"):
        TensorParallel(tp=2, tp_plan={"blocks.0.mlp.fc1": "colwise"}).plan(2, model=CharGPT(11, 8, 16, 2, 2))
    with pytest.raises(ConfigError, match=r"^tp_plan must be a dict"):
        TensorParallel(tp_plan="not json")
