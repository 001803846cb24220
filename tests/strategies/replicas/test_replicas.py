"""local-sgd, diloco and gossip as options and plans: names and defaults as before, every refusal in the plan."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap

import pytest
import torch
from torch import nn

from shardwise.comm.mesh import Mesh
from shardwise.errors import ConfigError
from shardwise.strategies import Batch, get_strategy
from shardwise.strategies.replicas import DiLoCo, Gossip, LocalSGD
from shardwise.strategies.replicas.gossip import ring_neighbours

DEFAULTS = {
    "local-sgd": (LocalSGD, {"sync_every": 8}),
    "diloco": (DiLoCo, {"sync_every": 8, "outer_lr": 0.7, "outer_momentum": 0.9, "compression": None}),
    "gossip": (Gossip, {"sync_every": 1}),
}


@pytest.mark.parametrize("name", DEFAULTS)
def test_the_registry_builds_the_frozen_options_with_the_same_names_and_defaults(name: str) -> None:
    cls, defaults = DEFAULTS[name]
    strategy = get_strategy(name)
    assert type(strategy) is cls and strategy.name == name and strategy.options() == defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.sync_every = 2  # type: ignore[misc]
    assert get_strategy(name, sync_every=4).options()["sync_every"] == 4


@pytest.mark.parametrize("cls", [LocalSGD, DiLoCo, Gossip])
def test_every_option_has_a_docstring(cls: type) -> None:
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    documented = {
        node.target.id
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("name", DEFAULTS)
def test_the_plan_is_every_rank_a_whole_replica_on_the_data_dimension(name: str) -> None:
    layout = get_strategy(name).plan(4, batch=Batch(32, accumulate=2), mesh={"dp": 4})
    assert dict(layout.degrees) == {"dp": 4, "pp": 1, "tp": 1}
    assert (layout.trainers, layout.data_parallel, layout.servers, layout.expendable, layout.micro_batch) == (4, 4, (), (), 4)


@pytest.mark.parametrize("name", DEFAULTS)
def test_the_plan_refuses_a_split_model_an_untrainable_model_and_no_process(name: str) -> None:
    strategy = get_strategy(name)
    with pytest.raises(ConfigError, match=rf"strategy '{name}' keeps the whole model on every rank.*\{{'tp': 2\}}.*choose 'pipeline' or 'tp'"):
        strategy.plan(4, mesh={"tp": 2})
    with pytest.raises(ConfigError, match=r"\{'pp': 2\}"):
        strategy.plan(4, mesh={"pp": 2, "tp": 1})
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match=rf"{name} got a model with no trainable parameters \(Linear\); nothing to train"):
        strategy.plan(2, model=frozen)
    with pytest.raises(ConfigError, match=rf"strategy '{name}' needs at least one process; got a world size of 0"):
        strategy.plan(0)
    with pytest.raises(ConfigError, match="not divisible"):
        strategy.plan(4, batch=Batch(10))
    strategy.plan(2, model=nn.Linear(2, 2))  # a trainable model passes


def test_apply_outside_a_process_group_says_how_to_start_one() -> None:
    for name in DEFAULTS:
        with pytest.raises(ConfigError, match=rf"strategy '{name}' needs a process group; start the run with nproc >= 1"):
            get_strategy(name).apply(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), Mesh.build(world_size=1), None)  # type: ignore[arg-type]


def test_diloco_refusals_name_the_value_received() -> None:
    with pytest.raises(ConfigError, match=r"outer_lr must be > 0 \(the paper uses 0.7\); got -1"):
        DiLoCo(outer_lr=-1)
    with pytest.raises(ConfigError, match="outer_lr must be > 0.*got True"):
        DiLoCo(outer_lr=True)
    with pytest.raises(ConfigError, match=r"outer_momentum must be in \[0, 1\).*got -0.1"):
        DiLoCo(outer_momentum=-0.1)
    with pytest.raises(ConfigError, match="sync_every must be a whole number of steps >= 1.*got 2.0"):
        DiLoCo(sync_every=2.0)  # type: ignore[arg-type]
    DiLoCo(outer_momentum=0.0, compression="none")  # momentum 0 and no codec are valid


def test_ring_neighbours() -> None:
    assert [ring_neighbours(k, 4) for k in range(4)] == [[1, 3], [0, 2], [1, 3], [0, 2]]
    assert ring_neighbours(0, 2) == [1] and ring_neighbours(1, 2) == [0] and ring_neighbours(0, 1) == []
