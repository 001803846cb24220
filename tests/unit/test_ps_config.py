"""Bad options of the asynchronous, decentralized and parameter-server strategies fail before any process starts."""

from __future__ import annotations

import pytest

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.strategies import get_strategy
from tests.dist.models import ce, classification, mlp


def _fit(strategy: str, nproc: int = 2, **options: object) -> None:
    Trainer(strategy=strategy, strategy_options=options, nproc=nproc, loss_fn=ce, max_steps=1, progress_bar=False).fit(mlp(), classification())


@pytest.mark.parametrize("strategy", ["local-sgd", "diloco", "gossip"])
@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_sync_every_below_one_or_not_whole_is_a_config_error_before_launch(strategy: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"sync_every must be a whole number of steps >= 1.*got " + repr(bad).replace(".", r"\.")):
        _fit(strategy, sync_every=bad)


def test_diloco_outer_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="outer_lr must be > 0.*got 0"):
        get_strategy("diloco", outer_lr=0)
    with pytest.raises(ConfigError, match=r"outer_momentum must be in \[0, 1\).*got 1.0"):
        get_strategy("diloco", outer_momentum=1.0)
    with pytest.raises(ConfigError, match="cannot compress a pseudo-gradient"):
        get_strategy("diloco", compression="powersgd:2")
    with pytest.raises(ConfigError, match="unknown codec|Known codecs"):
        get_strategy("diloco", compression="zip")


def test_unknown_option_names_the_strategy() -> None:
    with pytest.raises(ConfigError, match="bad options for strategy 'local-sgd'"):
        get_strategy("local-sgd", every=2)
