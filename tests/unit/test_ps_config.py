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


@pytest.mark.parametrize(
    "nproc, options, message",
    [
        (2, {"servers": 2}, r"servers=2 leaves no worker in a world of 2 processes; use nproc >= 3"),
        (3, {"servers": 3}, r"servers=3 leaves no worker in a world of 3 processes"),
        (3, {"servers": 0}, r"servers must be a whole number >= 1; got 0"),
        (3, {"mode": "ssp", "staleness": -1}, r"staleness must be a whole number of steps >= 0.*got -1"),
        (3, {"mode": "ssp"}, r"mode='ssp' needs a staleness bound; pass staleness=S"),
        (3, {"mode": "async", "staleness": 2}, r"staleness=2 applies only to mode='ssp'"),
        (3, {"mode": "eventual"}, r"mode must be one of sync, async, ssp; got 'eventual'"),
        (3, {"compression": "powersgd:2"}, r"runs inside DDP's hook"),
    ],
)
def test_bad_parameter_server_options_are_config_errors_before_launch(nproc: int, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _fit("ps", nproc=nproc, **options)


def test_central_needs_a_worker_besides_its_server() -> None:
    with pytest.raises(ConfigError, match="servers=1 leaves no worker in a world of 1 processes"):
        _fit("central", nproc=1)


def test_the_global_batch_is_split_over_workers_only() -> None:
    # 3 processes, 1 server: 2 workers take the data, so a global batch of 10 is fine (10 / 3 would not be).
    from shardwise.strategies.protocol import trainers

    assert trainers(get_strategy("ps", servers=1), 3) == 2 and trainers(get_strategy("ddp"), 3) == 3
    with pytest.raises(ConfigError, match="not divisible"):
        Trainer(strategy="ps", strategy_options={"servers": 1}, nproc=4, loss_fn=ce, global_batch_size=10, max_steps=1).fit(mlp(), classification())


def test_ps_workers_loop_alone_and_are_expendable_only_when_no_one_waits_for_them() -> None:
    # async and ssp: workers 1 .. W-1 may die (rank 0 writes the summary; servers hold the model).
    assert get_strategy("ps", servers=1, mode="async").expendable_ranks(4) == [1, 2]
    assert get_strategy("ps", servers=2, mode="ssp", staleness=1).expendable_ranks(4) == [1]
    # sync: every step waits for every worker, so losing one must stop the run.
    assert get_strategy("ps", servers=1).expendable_ranks(4) == [] and get_strategy("central").expendable_ranks(3) == []


def test_a_worker_keeps_its_clock_in_its_optimizer_state() -> None:
    from shardwise.strategies.param_server import RemoteOptimizer

    model = mlp()
    opt = RemoteOptimizer(model.parameters(), 0.1, client=None)  # type: ignore[arg-type]
    opt.steps = 7
    other = RemoteOptimizer(mlp().parameters(), 0.2, client=None)  # type: ignore[arg-type]
    other.load_state_dict(opt.state_dict())
    assert other.steps == 7 and other.param_groups[0]["lr"] == 0.1


def test_launch_refuses_to_lose_rank_zero_or_ranks_that_do_not_exist() -> None:
    from shardwise import launch

    for bad in ([0], [3], [-1]):
        with pytest.raises(ConfigError, match="expendable ranks must be in 1 .. 2"):
            launch(print, nproc=3, expendable=bad)
