"""Side package: cost functions and simulations for the planner, without a process group.

Nothing here touches a process group or a device (``simulate_measure`` alone times a real
allreduce, for the benchmark that fits alpha and beta): every function maps numbers to numbers,
so the planner, the strategies' own accounting and the unit tests share them. Modules:

- ``memory``: model-state bytes per rank for ZeRO stages 0-3 (Rajbhandari et al. 2020).
- ``bubble``: the pipeline bubble, predicted (Narayanan et al. 2021) and measured.
- ``simulate``: a discrete-event simulation of data-parallel steps (allreduce algorithms,
  parameter servers, local SGD, stragglers, NIC sharing, overlap with the backward);
  ``simulate_events`` holds its event loops.
- ``simulate_pipeline``: pipeline schedules (GPipe, 1F1B, interleaved 1F1B) as events: step
  time, bubble and peak activations per stage, with unequal stages and costed sends.
- ``simulate_presets``: two published scaling results reproduced from their papers' inputs.
- ``simulate_measure``: alpha and beta fitted from timed allreduces of `shardwise.comm`.
- ``simulate_cli``: the ``shardwise simulate`` command.
"""
