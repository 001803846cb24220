"""What context parallelism costs, as pure numbers: a cp rank's activations and its attention traffic.

Context parallelism is an option of ddp, the sharded strategies and tp, not a strategy of its own,
so this module registers no candidates (``COSTS`` is empty); it gives the figures a plan with
``cp`` > 1 is priced with (docs/strategies/context_parallel.md, docs/planner.md):

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

from shardwise.strategies.context_parallel.ring import ring_bytes, ulysses_bytes

if TYPE_CHECKING:
    from shardwise.strategies.cost.family import StrategyCost
    from shardwise.strategies.cost.model_spec import ModelSpec

PLAN_ORDER = 90
COSTS: dict[str, StrategyCost] = {}


def activation_bytes(spec: ModelSpec, samples: float, cp: int, tp: int = 1, sequence_parallel: bool = False) -> dict[str, float]:
    """One cp rank's activation bytes for ``samples`` samples: the blocks' (``1/cp`` of the whole
    sequence's), outside the blocks (the embedding output split, the logits whole), and their total."""
    blocks = spec.layers * spec.layer_activation_bytes(samples, tp, sequence_parallel) / cp
    embed = spec.seq * spec.hidden * spec.act_bytes * samples
    logits = max(spec.act_bytes_other_sample * samples - embed, 0.0)
    other = embed / cp + logits
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


def candidates(*args: object, **kwargs: object) -> list[object]:
    """None: cp is an option the user asks for, not a layout the planner proposes."""
    return []
