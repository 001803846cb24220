"""Models built on the meta device, materialized on each rank as that rank's share only.

`record` (`meta_init`: construction recorded, the generator state of the build), `plan`
(`plan_init`: which initializer writes which tensor, in eager order) and `fill` (`fill`,
`fill_share`, `materialize`: the plan replayed into the tensors the strategy left this rank).
Design notes (why the values equal the eager model's bit for bit, what is refused):
docs/strategies/meta_init.md.
"""

from __future__ import annotations

from shardwise.strategies.materialize.fill import Transform, allocate, attach, fill, fill_share, materialize, to_device
from shardwise.strategies.materialize.plan import Event, InitPlan, Slot, plan_init
from shardwise.strategies.materialize.record import Program, build_state, has_meta, meta_init, note_build_state

__all__ = [
    "Event",
    "InitPlan",
    "Program",
    "Slot",
    "Transform",
    "allocate",
    "attach",
    "build_state",
    "fill",
    "fill_share",
    "has_meta",
    "materialize",
    "meta_init",
    "note_build_state",
    "plan_init",
    "to_device",
]
