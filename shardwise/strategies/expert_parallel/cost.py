"""What expert parallelism costs: all-to-all bytes and expert memory per rank, pure numbers.

``shardwise plan`` prices a candidate with ``ep`` through `ExpertParallelOption` (``OPTIONS``) and proposes ep
candidates for a model with experts layers (`candidates`, `moe_structure`); `tests/strategies/expert_parallel/test_dispatch.py` checks
`all_to_all_sent` against the bytes the Recorder counts. Formulas: docs/strategies/expert_parallel.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from shardwise.strategies.cost.family import Candidate, OptionCost, Step, StrategyCost
from shardwise.strategies.cost.memory import model_state_bytes
from shardwise.strategies.cost.terms import Shape, allreduce_sent

if TYPE_CHECKING:
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 95
COSTS: dict[str, StrategyCost] = {}


def all_to_all_sent(out_pairs: int, in_pairs: int, hidden: int, elem: int, experts: int, ep: int, *, backward: bool = True) -> int:
    """Bytes one rank sends for one experts layer in one forward (and its backward): the per-expert
    counts ``(ep - 1) x experts / ep x 8``, its ``out_pairs`` rows routed to other ranks' experts
    (dispatch) and the ``in_pairs`` rows it computed for other ranks (combine), ``hidden x elem``
    bytes each; backward sends both row sets again. Received is the mirror: the same sum."""
    if ep <= 1:
        return 0
    rows = (out_pairs + in_pairs) * hidden * elem
    return (ep - 1) * (experts // ep) * 8 + rows * (2 if backward else 1)


def expected_all_to_all_sent(tokens: int, top_k: int, hidden: int, elem: int, experts: int, ep: int, layers: int = 1) -> float:
    """`all_to_all_sent` per step under balanced routing (what the load-balancing loss aims at): of a
    rank's ``tokens x top_k`` pairs, ``(ep - 1) / ep`` go elsewhere, and as many arrive."""
    remote = tokens * top_k * (ep - 1) / ep
    return layers * float(all_to_all_sent(0, 0, hidden, elem, experts, ep) + 4 * remote * hidden * elem) if ep > 1 else 0.0


def expert_bytes_per_rank(expert_params: int, bytes_per_param: float, ep: int) -> float:
    """Model state of the experts on one rank: each holds ``1 / ep`` of them (the rest of the model as its dp strategy keeps it)."""
    return expert_params * bytes_per_param / ep


def _top_k(model: nn.Module, layer: str) -> int:
    """Experts a token goes to: the ``top_k`` (or ``num_experts_per_tok``) its MoE block or router holds, else the config's."""
    parent = model.get_submodule(layer.rpartition(".")[0]) if "." in layer else model
    for module in (parent, *parent.children()):
        for key in ("top_k", "num_experts_per_tok"):
            k = getattr(module, key, None)
            if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
                return k
    cfg = getattr(model, "config", None)
    k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "moe_topk", None) or 1
    return int(k)


def moe_structure(model: nn.Module) -> dict[str, int]:
    """What the planner needs of a model's experts layers (`detect.find_experts`): ``moe_layers``, ``experts`` (the
    most in one layer), ``top_k`` and ``expert_params`` (all layers' experts); zeros for a model without them."""
    from shardwise.strategies.expert_parallel.detect import find_experts

    covered, _ = find_experts(model)
    if not covered:
        return {"moe_layers": 0, "experts": 0, "top_k": 0, "expert_params": 0}
    params = sum(p.numel() for layer in covered for p in model.get_submodule(layer.name).parameters(recurse=False) if p.requires_grad)
    return {"moe_layers": len(covered), "experts": max(e.num_experts for e in covered), "top_k": _top_k(model, covered[0].name), "expert_params": params}


class ExpertParallelOption(OptionCost):
    """``ep`` on a candidate: the experts (``1/ep`` of them a rank) are kept out of the strategy's own replication or
    sharding, their gradients summed over the ``dp / ep`` ranks holding the same experts, tokens exchanged by all-to-all
    (the expected bytes under balanced routing, `expected_all_to_all_sent`)."""

    def applies(self, shape: Shape) -> bool:
        return shape.ep > 1

    def held_params(self, spec: ModelSpec, shape: Shape, psi: float) -> float:
        return psi - spec.expert_params

    def memory(self, s: Step, memory: dict[str, float]) -> None:
        experts = model_state_bytes(0, s.spec.expert_params / s.shape.ep, 1, s.per)
        for key in ("params", "grads", "optimizer"):
            memory[key] += experts[key]
        memory["experts"] = sum(experts[k] for k in ("params", "grads", "optimizer"))

    def collectives(self, s: Step) -> None:
        spec, shape = s.spec, s.shape
        ep, tokens = shape.ep, s.micro * spec.seq
        sent = expected_all_to_all_sent(int(tokens), spec.top_k, spec.hidden, spec.act_bytes, spec.experts, ep, spec.moe_layers)
        s.add("all_to_all", "ep", ep, s.settings.accumulate * s.m, sent, sent, 5 * spec.moe_layers, 1)
        grads = s.per.grads * spec.expert_params / ep
        outer = shape.dp // ep
        wire, n = allreduce_sent(grads, outer, "native")
        s.add("all_reduce", "ep_outer", outer, 1, grads, wire, n, ep, "backward")


OPTIONS = (ExpertParallelOption(),)


def candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """For a model with experts layers: ep over every process (ddp, zero3), and ep 2 inside the data-parallel dimension on four or more."""
    if spec.experts < 2 or cluster.nproc < 2:
        return []
    degrees = [d for d in dict.fromkeys((cluster.nproc, 2)) if cluster.nproc % d == 0 and spec.experts % d == 0]
    return [Candidate(strategy, {"ep": ep}) for ep in degrees for strategy in ("ddp", "zero3")]
