"""``dp`` (single-process DataParallel): refused before launch without two GPUs; exact against ``single`` with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.strategies import Batch, get_strategy


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2+ GPUs: the refusal does not apply")
def test_dp_is_refused_before_launch_without_two_gpus(tmp_path) -> None:
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"needs at least 2 CUDA devices; this machine has {count}\. Use strategy='single'"):
        get_strategy("dp").plan(1, batch=Batch(16))
    trainer = Trainer(
        strategy="dp",
        nproc=1,
        max_steps=2,
        global_batch_size=16,
        loss_fn=lambda out, b: nn.functional.cross_entropy(out, b[1]),
        out=str(tmp_path / "run"),
        accelerator="cpu",
    )
    with pytest.raises(ConfigError, match="strategy 'dp' splits each batch across the GPUs"):
        trainer.fit(_model(), _data())
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_dp_refuses_several_processes() -> None:
    with pytest.raises(ConfigError, match="strategy 'dp' drives every GPU from one process; got a world size of 2. Use strategy='ddp'"):
        get_strategy("dp").plan(2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_dp_equals_single_on_two_gpus() -> None:
    def fit(strategy: str) -> dict[str, torch.Tensor]:
        model = _model().double()
        trainer = Trainer(
            strategy=strategy,
            nproc=1,
            max_steps=5,
            global_batch_size=16,
            precision="64",
            seed=0,
            loss_fn=lambda out, b: nn.functional.cross_entropy(out, b[1].to(out.device)),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
        trainer.fit(model, _data())
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    ref, dp = fit("single"), fit("dp")
    for name in ref:
        torch.testing.assert_close(dp[name], ref[name], rtol=1e-10, atol=1e-12)
