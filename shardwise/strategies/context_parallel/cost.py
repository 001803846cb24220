"""What context parallelism costs, as pure numbers: a cp rank's activations and its attention traffic.

Context parallelism is an option of ddp, the sharded strategies and tp, not a strategy of its own,
so this module costs no strategy of its own (``COSTS`` is empty): its `ContextParallelOption`
(``OPTIONS``) prices a candidate with ``cp`` > 1 and `candidates` proposes some, with the figures (docs/strategies/context_parallel.md, docs/planner.md):

- activations: each cp rank runs ``seq / cp`` tokens through every block, so a block keeps
  ``1/cp`` of its activations (everything a block saves is per token; ring attention saves its
  queries, keys, values, output and log-sum-exps, never a score matrix). Outside the blocks, the
  embedding output is split too; the model's output (the logits) is gathered whole on every cp rank.
- bytes: ring attention sends each layer's local keys and values ``cp - 1`` hops forward, and in
  backward again ``cp - 1`` hops plus their gradients ``cp`` hops (`ring.ring_bytes`); Ulysses sends
  ``(cp - 1) / cp`` of q, k, v and the output in forward and the same in backward (`ring.ulysses_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from shardwise.strategies.context_parallel.ring import ring_bytes, ulysses_bytes
from shardwise.strategies.cost.family import Candidate, OptionCost, Step, StrategyCost
from shardwise.strategies.cost.terms import Shape

if TYPE_CHECKING:
    from shardwise.strategies.cost.cluster import Cluster
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 90
COSTS: dict[str, StrategyCost] = {}
MIN_SEQ = 256
"""The shortest sequence the planner proposes cp for: below it a rank's share of attention is too small to pay its ring."""


def _logits(spec: ModelSpec, samples: float) -> float:
    """Activation bytes outside the blocks that are not the embedding output (the logits, the loss): whole on every cp rank."""
    return max(spec.act_bytes_other_sample * samples - spec.seq * spec.hidden * spec.act_bytes * samples, 0.0)


def activation_bytes(spec: ModelSpec, samples: float, cp: int, tp: int = 1, sequence_parallel: bool = False) -> dict[str, float]:
    """One cp rank's activation bytes for ``samples`` samples: the blocks' (``1/cp`` of the whole
    sequence's), outside the blocks (the embedding output split, the logits whole), and their total."""
    blocks = spec.layers * spec.layer_activation_bytes(samples, tp, sequence_parallel) / cp
    embed = spec.seq * spec.hidden * spec.act_bytes * samples
    other = embed / cp + _logits(spec, samples)
    return {"blocks": blocks, "other": other, "total": blocks + other}


def attention_bytes(spec: ModelSpec, samples: float, cp: int, style: str = "ring", kv_heads: int | None = None, tp: int = 1) -> float:
    """Bytes one cp rank sends per step for ``samples`` samples (forward and backward, every layer)."""
    if cp == 1:
        return 0.0
    heads = max(spec.heads // tp, 1)
    kv = max((kv_heads or spec.heads) // tp, 1)
    head_dim = spec.hidden // max(spec.heads, 1)
    local = samples * (spec.seq // cp) * head_dim * spec.act_bytes
    if style == "ring":
        fwd, bwd = ring_bytes(int(local * kv), cp)
        return float(spec.layers * (fwd + bwd))
    kv_sent = kv if kv % cp == 0 else heads
    one = 2 * ulysses_bytes(int(local * heads), cp) + 2 * ulysses_bytes(int(local * kv_sent), cp)
    return float(spec.layers * 2 * one)


def output_bytes(spec: ModelSpec, samples: float) -> float:
    """Bytes of the model's per-token output for ``samples`` samples (the logits, ``vocab`` wide; else ``hidden``): what a
    cp rank's forward gathers whole, sending ``(cp - 1) / cp`` of it."""
    return samples * spec.seq * (spec.vocab or spec.hidden) * spec.act_bytes


def attention_heads(model: nn.Module) -> tuple[int, int] | None:
    """(heads, key/value heads) the model's config declares, or None: what `attention_bytes` needs of a module."""
    from shardwise.strategies.context_parallel import _heads

    return _heads(model)


class ContextParallelOption(OptionCost):
    """``cp`` on a candidate: ``Shape.dp`` already counts the cp ranks (a rank's compute and block activations are its
    tokens'); the logits stay whole on each cp rank, and attention's ring or all-to-all traffic is on the critical path."""

    def applies(self, shape: Shape) -> bool:
        return shape.cp > 1

    def memory(self, s: Step, memory: dict[str, float]) -> None:
        # a rank's share is s.micro samples' worth of tokens; its cp group's samples are cp times as many, logits whole
        memory["activations"] += _logits(s.spec, s.micro) * (s.shape.cp - 1)

    def collectives(self, s: Step) -> None:
        shape, spec = s.shape, s.spec
        cp, ring = shape.cp, shape.cp_style == "ring"
        sent = attention_bytes(spec, s.micro * cp, cp, shape.cp_style, spec.kv_heads or None, shape.tp)
        hops = spec.layers * (3 * (cp - 1) + 1) if ring else spec.layers * 8  # ring: cp-1 forward, 2cp-1 backward; Ulysses: 8 all-to-alls
        s.add("send" if ring else "all_to_all", "cp", cp, s.settings.accumulate * s.m, sent, sent, hops, shape.tp)
        # the model's per-token output (the logits) gathered whole on every cp rank in forward (`zigzag.gather`)
        s.add_library("all_gather", "cp", cp, s.settings.accumulate * s.m, output_bytes(spec, s.micro * cp), shape.tp)


OPTIONS = (ContextParallelOption(),)


def candidates(cluster: Cluster, spec: ModelSpec, global_batch: int, accumulate: int = 1) -> list[Candidate]:
    """For a model with attention heads and sequences of `MIN_SEQ` tokens or more: cp 2 under ddp (ring and, where the
    heads divide, Ulysses) and zero3, and cp 2 x tp 2 on four processes or more."""
    if cluster.nproc % 2 or spec.heads < 2 or spec.seq < MIN_SEQ or spec.seq % 4:
        return []
    out = [Candidate("ddp", {"cp": 2}), Candidate("zero3", {"cp": 2})]
    if spec.heads % 2 == 0:
        out.append(Candidate("ddp", {"cp": 2, "cp_style": "ulysses"}))
    if cluster.nproc % 4 == 0 and spec.heads % 2 == 0:
        out.append(Candidate("tp", {"tp": 2, "cp": 2}))
    return out
