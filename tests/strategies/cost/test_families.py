"""The strategy families' costs, found through the registry: what the planner, the recommendation and
the calibration loop over instead of naming strategies."""

from __future__ import annotations

from shardwise.strategies import available
from shardwise.strategies.cost.cluster import Cluster, load_profile
from shardwise.strategies.cost.families import all_costs, cost_modules, cost_of, option_costs, propose
from shardwise.strategies.cost.family import ONE_PROCESS, PIPELINE, REFERENCE, REPLICATE, SHARD_ALL, SHARD_STATE, SPLIT_LAYERS, UNRELIABLE, StrategyCost
from shardwise.strategies.cost.model_spec import transformer_spec


def test_each_family_folder_with_a_cost_module_is_found_in_plan_order_and_costs_registered_names() -> None:
    modules = cost_modules()
    assert [m.__name__.split(".")[2] for m in modules] == [
        "data_parallel",
        "sharded",
        "tensor_parallel",
        "pipeline",
        "param_server",
        "replicas",
        "context_parallel",  # the options several strategies share (cp, ep): found without a registered name
        "expert_parallel",
    ]
    assert [type(o).__name__ for o in option_costs()] == ["ContextParallelOption", "ExpertParallelOption"]
    assert set(all_costs()) <= set(available())
    assert all(cost.name == name for name, cost in all_costs().items())


def test_a_strategy_no_family_costs_gets_a_plain_replica_s_defaults() -> None:
    cost = cost_of("gossip")
    assert type(cost) is StrategyCost and cost.name == "gossip" and cost.advised_for == () and not cost.offloads


def test_every_proposed_candidate_is_costed_by_its_family_and_every_step_of_the_guide_has_a_strategy() -> None:
    cluster = Cluster(load_profile("h100-80gb"), 16, 2)
    candidates = propose(cluster, transformer_spec("7b", layers=32, hidden=4096, heads=32, vocab=32000, seq=2048), 512)
    assert {c.strategy for c in candidates} == set(all_costs())
    steps = {step for cost in all_costs().values() for step in cost.advised_for}
    assert steps == {REFERENCE, ONE_PROCESS, REPLICATE, SHARD_STATE, SHARD_ALL, SPLIT_LAYERS, PIPELINE, UNRELIABLE}  # one-process: single (issue 39)
    # one process: the one-device reference alone
    small = transformer_spec("small", layers=4, hidden=512, heads=8, vocab=1000, seq=128)
    assert [c.strategy for c in propose(Cluster(load_profile("h100-80gb"), 1), small, 8)] == ["single"]
