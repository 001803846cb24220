"""Every built-in strategy against the contract, checked by mypy (``make lint``, strict here).

``on_contract`` is called once per built-in strategy with its class, its ``plan`` and ``apply``
and the run class its ``apply`` returns. mypy refuses the call when

- the strategy class or the run class is abstract (an abstract method of `Strategy` or
  `Parallel` left out: only a concrete class can be given where ``type[...]`` is expected);
- ``plan`` does not take ``(world_size, model, batch, mesh)`` and return a `Layout`;
- ``apply`` does not take ``(model, make_optimizer, mesh, recorder)`` or returns something that
  is not a `Parallel`.

Keyword names and the other `Parallel` methods' signatures are held by mypy's override check
where each class is defined (``mypy shardwise``). tests/strategies/test_registry.py imports this
module and checks that the table names exactly the registry's built-in strategies, with the
run class each ``apply`` declares, and every concrete `Parallel` in the package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from torch import nn

from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Strategy
from shardwise.strategies.data_parallel.ddp import DDP, DDPRun
from shardwise.strategies.data_parallel.dp import DataParallel, DataParallelRun
from shardwise.strategies.data_parallel.single import Single, SingleRun
from shardwise.strategies.param_server import PS, Central, ServerRun
from shardwise.strategies.pipeline import Pipeline, PipelineRun
from shardwise.strategies.pipeline.naive_mp import NaiveModelParallel, NaiveMPRun
from shardwise.strategies.replicas.diloco import DiLoCo, DiLoCoRun
from shardwise.strategies.replicas.gossip import Gossip, GossipRun
from shardwise.strategies.replicas.local_sgd import LocalSGD, LocalSGDRun
from shardwise.strategies.sharded.fsdp import FSDP, HSDP, FSDPRun, Zero2, Zero2Run
from shardwise.strategies.sharded.zero1 import Zero1, Zero1Run
from shardwise.strategies.tensor_parallel import TensorParallel, TensorParallelRun

S = TypeVar("S", bound=Strategy)
P = TypeVar("P", bound=Parallel)

Plan = Callable[[S, int, nn.Module | None, Batch | None, Mapping[str, int] | None], Layout]
Apply = Callable[[S, nn.Module, OptimizerFactory, Mesh, Recorder], P]


def on_contract(strategy: type[S], plan: Plan[S], apply: Apply[S, P], run: type[P]) -> tuple[type[Strategy], type[Parallel]]:
    """``(strategy, run)``, once mypy has checked them against the contract (see the module docstring)."""
    return strategy, run


BUILTIN: dict[str, tuple[type[Strategy], type[Parallel]]] = {
    "single": on_contract(Single, Single.plan, Single.apply, SingleRun),
    "ddp": on_contract(DDP, DDP.plan, DDP.apply, DDPRun),
    "dp": on_contract(DataParallel, DataParallel.plan, DataParallel.apply, DataParallelRun),
    "local-sgd": on_contract(LocalSGD, LocalSGD.plan, LocalSGD.apply, LocalSGDRun),
    "diloco": on_contract(DiLoCo, DiLoCo.plan, DiLoCo.apply, DiLoCoRun),
    "gossip": on_contract(Gossip, Gossip.plan, Gossip.apply, GossipRun),
    "ps": on_contract(PS, PS.plan, PS.apply, ServerRun),
    "central": on_contract(Central, Central.plan, Central.apply, ServerRun),
    "zero1": on_contract(Zero1, Zero1.plan, Zero1.apply, Zero1Run),
    "zero2": on_contract(Zero2, Zero2.plan, Zero2.apply, FSDPRun),
    "zero3": on_contract(FSDP, FSDP.plan, FSDP.apply, FSDPRun),
    "fsdp": on_contract(FSDP, FSDP.plan, FSDP.apply, FSDPRun),
    "hsdp": on_contract(HSDP, HSDP.plan, HSDP.apply, FSDPRun),
    "pipeline": on_contract(Pipeline, Pipeline.plan, Pipeline.apply, PipelineRun),
    "tp": on_contract(TensorParallel, TensorParallel.plan, TensorParallel.apply, TensorParallelRun),
    "naive-mp": on_contract(NaiveModelParallel, NaiveModelParallel.plan, NaiveModelParallel.apply, NaiveMPRun),
}

# Run classes an ``apply`` returns through a declared base (zero2's FSDPRun is a Zero2Run).
OTHER_RUNS: dict[str, type[Parallel]] = {"zero2": Zero2Run}
