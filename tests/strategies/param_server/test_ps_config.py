"""Bad options of the asynchronous, decentralized and parameter-server strategies fail before any process starts."""

from __future__ import annotations

import pytest
import torch

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.strategies import get_strategy
from tests.support.models import ce, classification, mlp


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
    with pytest.raises(ConfigError, match="strategy 'local-sgd' has no option 'every'.*its options are: sync_every"):
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
    from shardwise.strategies import Batch

    layout = get_strategy("ps", servers=1).plan(3, batch=Batch(10))
    assert (layout.trainers, layout.data_parallel, layout.servers, layout.micro_batch) == (2, 2, (2,), 5)
    assert get_strategy("ddp").plan(3).trainers == 3
    assert get_strategy("ps", servers=2).plan(5).servers == (3, 4)  # the last ranks serve
    with pytest.raises(ConfigError, match="not divisible"):
        get_strategy("ps", servers=1).plan(3, batch=Batch(9))
    with pytest.raises(ConfigError, match="not divisible"):
        Trainer(strategy="ps", strategy_options={"servers": 1}, nproc=4, loss_fn=ce, global_batch_size=10, max_steps=1).fit(mlp(), classification())


def test_ps_workers_loop_alone_and_are_expendable_only_when_no_one_waits_for_them() -> None:
    # async and ssp: workers 1 .. W-1 may die (rank 0 writes the summary; servers hold the model).
    assert get_strategy("ps", servers=1, mode="async").plan(4).expendable == (1, 2)
    assert get_strategy("ps", servers=2, mode="ssp", staleness=1).plan(4).expendable == (1,)
    # sync: every step waits for every worker, so losing one must stop the run.
    assert get_strategy("ps", servers=1).plan(4).expendable == () and get_strategy("central").plan(3).expendable == ()


class _IntModel(torch.nn.Module):
    """A model whose one parameter is an integer tensor: nothing a server could apply a gradient to."""

    def __init__(self) -> None:
        super().__init__()
        self.count = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


def test_the_plan_is_pure_and_refuses_what_it_can_know_before_launch() -> None:
    import torch.distributed as dist

    ps = get_strategy("ps", servers=3)
    # Four parameter tensors in the MLP: three servers get one or more whole tensors each; five could not.
    assert ps.plan(5, model=mlp()).servers == (2, 3, 4)
    with pytest.raises(ConfigError, match="servers=5 but the model has only 4 parameter tensors to share out; use at most 4"):
        get_strategy("ps", servers=5).plan(6, model=mlp())
    with pytest.raises(ConfigError, match="floating-point parameters"):
        get_strategy("ps").plan(2, model=_IntModel())
    with pytest.raises(ConfigError, match="the only mesh dimension is dp.*Drop the tp setting"):
        ps.plan(5, mesh={"tp": 2})
    with pytest.raises(ConfigError, match="the data-parallel degree is the number of workers, 2"):
        ps.plan(5, mesh={"dp": 5})
    assert ps.plan(5, mesh={"dp": 2, "pp": 1}).data_parallel == 2
    assert not dist.is_initialized()  # no process group was made for any of it


def test_options_are_frozen_typed_fields_and_central_is_ps_with_one_sync_server() -> None:
    import dataclasses
    import typing

    from shardwise.strategies.param_server import MODES, PS, Central

    ps = get_strategy("ps", servers=2, mode="ssp", staleness=1, compression="none", worker_timeout_s=5)
    assert isinstance(ps, PS) and ps.compression is None and ps.worker_timeout_s == 5.0
    assert ps.options() == {"servers": 2, "mode": "ssp", "staleness": 1, "compression": None, "worker_timeout_s": 5.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        ps.servers = 3  # type: ignore[misc]
    assert typing.get_args(typing.get_type_hints(PS)["mode"]) == MODES == ("sync", "async", "ssp")
    central = get_strategy("central", compression="int8")
    assert isinstance(central, Central) and central.options() == {"compression": "int8", "worker_timeout_s": 60.0}
    assert central.plan(3).servers == (2,) and central.plan(3).expendable == ()
    with pytest.raises(ConfigError, match="strategy 'central' has no option 'servers'.*its options are: compression, worker_timeout_s"):
        get_strategy("central", servers=2)
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ConfigError, match="worker_timeout_s must be a number of seconds > 0"):
            get_strategy("ps", worker_timeout_s=bad)
    with pytest.raises(ConfigError, match="runs inside DDP's hook"):
        get_strategy("central", compression="powersgd:2")


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
