"""Expert parallelism (``ep``): the experts of each mixture-of-experts layer split over ``ep`` ranks
inside the data-parallel dimension, tokens dispatched and combined with all-to-all.

`detect.py` finds the experts layers from the model's structure (and refuses what looks like
experts but no rule covers); `dispatch.py` routes tokens to the experts' owners and back;
`apply.py` splits the parameters, reduces the expert gradients and clips by the global norm;
`cost.py` prices it for the planner. Reached from the data-parallel strategies through
`strategies/compose.py`. Design note: docs/strategies/expert_parallel.md.
"""

from __future__ import annotations

from shardwise.strategies.expert_parallel.apply import ExpertParallel, expert_parallel
from shardwise.strategies.expert_parallel.detect import ExpertsLayer, check_model, find_experts

__all__ = ["ExpertParallel", "ExpertsLayer", "check_model", "expert_parallel", "find_experts"]
