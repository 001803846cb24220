"""The planner's cost model: memory, traffic and step time of a layout, without a process group.

Every function maps numbers to numbers, so the planner, the strategies' own accounting and the unit
tests share them. Modules:

- ``estimate``: one candidate's memory, collectives and step time (`estimate.estimate`).
- ``terms``: its vocabulary (`Settings`, `Shape`, `Collective`, byte and round counts).
- ``family``: `StrategyCost`, what a strategy family's ``cost.py`` tells the planner; ``families``
  finds those through the strategy registry.
- ``memory``: model-state bytes per rank for ZeRO stages 0-3 (Rajbhandari et al. 2020).
- ``bubble``: the pipeline bubble, predicted (Narayanan et al. 2021) and measured.
- ``model_spec``: a model's counts (parameters, FLOPs, activations), measured or GPT-shaped;
  ``saved``: what autograd saves, counted; ``peak``: a run's peak memory, predicted.
- ``cluster``: a device profile (links, FLOP/s, the calibrated per-strategy work) and a cluster.

The formulas and their sources: docs/planner.md. The simulations are `shardwise.tools.simulate`.
"""
