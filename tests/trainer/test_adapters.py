"""The Trainer's registry of model adapters: integrations register, the trainer asks them in order."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from shardwise import Trainer
from shardwise.trainer import adapters


class _Plain(nn.Linear):
    pass


def test_a_registered_factory_is_asked_once_and_the_first_adapter_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters, "_FACTORIES", [])
    asked: list[str] = []
    sentinel: Any = object()

    def declines(trainer: Any, model: nn.Module, kind: str, **kw: Any) -> None:
        asked.append("declines")
        return None

    def takes(trainer: Any, model: nn.Module, kind: str, **kw: Any) -> Any:
        asked.append(f"takes {kind} {kw}")
        return sentinel

    for factory in (declines, takes, declines):  # a second registration of the same factory is ignored
        adapters.register_adapter(factory)
    assert adapters.adapter_for(Trainer(), _Plain(2, 1), "val") is sentinel
    assert asked == ["declines", "takes val {'has_val': False, 'total': None}"]


def test_the_lightning_integration_is_registered_by_importing_the_trainer_from_shardwise() -> None:
    from shardwise.integrations.lightning import adapter_for

    assert adapter_for in adapters._FACTORIES
    assert adapters.adapter_for(Trainer(), _Plain(2, 1), "fit") is None  # a plain module: the Trainer runs it itself


def test_a_script_that_takes_the_trainer_from_shardwise_trainer_gets_the_lightning_adapter_too() -> None:
    """The adapter comes from the installed package's entry point, not from which path imported the Trainer."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from shardwise.trainer.loop import Trainer\n"
        "from shardwise.trainer.adapters import adapter_for\n"
        "class M(nn.Linear):\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        return self(batch).sum()\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "assert 'shardwise.integrations.lightning' not in sys.modules\n"
        "adapter = adapter_for(Trainer(), M(2, 1), 'fit')\n"
        "print(type(adapter).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "LightningAdapter"
