"""Counting DTensor's collectives: a dispatch mode that sees every operator below DTensor, so it
sees the functional collectives of DTensor's redistributions and c10d's own (FSDP2's), and counts
each by (group label, kind, phase), recording it on the run's `Recorder` with its payload and the
bandwidth-optimal bytes (no seconds: the collectives are asynchronous inside DTensor).

The mode costs a Python call on every operator of the step: about 6% of a tp step of charlm's
1.8M-parameter GPT on this machine (`benchmarks/families.py`), over the 1% a default may cost.
`StepCounts` keeps the counts exact for less: the collectives DTensor issues follow from the
model's code and the shapes of its inputs, so a step whose batch has the same signature (every
tensor's shape and dtype, every other leaf's value) as an earlier counted one issues the same
collectives. A signature is counted on its first two steps (the first may do one-time work); once
two counts agree, its steps replay the counted list into the `Recorder` and the counts, and every
``verify_every``-th step is counted again. A verification that disagrees (code whose collectives
depend on the values, not the shapes) turns replay off for the rest of the run: every step is
counted from then on, and the summary says so (``counting: "every step"``).

>>> with count_collectives(tp=tp_mesh.get_group()) as counts:         # doctest: +SKIP
...     model(x).sum().backward()
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes

_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "allreduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


Logged = list[tuple[tuple[str, str, str], CommEvent | None]]
"""The collectives of one step, in order: (name, kind, phase) and what was recorded for it."""


def collective_counter_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        """Counts the collectives DTensor (and FSDP2) issue, by kind, group and phase (forward/backward).

        A dispatch mode sees every operator below DTensor, so it sees the functional collectives
        DTensor's redistributions run (``_c10d_functional.*``) and c10d's own (``c10d.*``, FSDP2).
        Each is recorded on the ``Recorder`` with its payload and the bandwidth-optimal bytes.
        """

        def __init__(self, recorder: Recorder | None, names: dict[str, tuple[str, int]]) -> None:
            super().__init__()
            self.recorder, self.names = recorder, names
            self.counts: Counter[tuple[str, str, str]] = Counter()
            self.log: Logged = []
            """Every collective counted, in order, with what was recorded (what `StepCounts` replays)."""
            self.phase: str | None = None
            """Set by the strategy (forward inside step_fn, backward after); None: inside an autograd node or not."""

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            """Under torch.compile the mode is off while Dynamo traces and on while the compiled code runs: the
            graph compiles as without it, and the mode sees only what compiled code dispatches. Under Inductor that
            is its collectives and extern kernels, not each fused operator, so the counts stay exact and most of the
            per-operator Python calls go (358 -> 126 a step, charlm tp=2); under aot_eager every aten operator still
            goes through the dispatcher, as eager. Without this Dynamo would skip every frame under the mode."""
            return True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            ns = getattr(func, "namespace", "")
            if ns in ("_c10d_functional", "c10d_functional", "c10d"):
                kind = _KINDS.get(func._schema.name.split("::")[-1])
                if kind is not None:
                    self._record(kind, func, args)
            return out

        def _record(self, kind: str, func: Any, args: Any) -> None:
            # c10d's in-place reduce-scatters take (outputs, inputs, ...): the payload is the input.
            first = args[1] if kind == "reduce_scatter" and func.namespace == "c10d" else args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            group = None
            for a in args[1:]:  # funcol: (..., group_name: str) last; c10d: a ProcessGroup script object
                if isinstance(a, str):
                    group = a
                elif isinstance(a, dist.ProcessGroup):
                    group = a.group_name
                elif type(a).__name__ == "ScriptObject":  # c10d ops see the group boxed
                    try:
                        group = dist.ProcessGroup.unbox(a).group_name
                    except Exception:  # noqa: BLE001 - a boxed ReduceOp, not a group
                        pass
            name, size = self.names.get(group or "", ("other", 0))
            if not size and group:  # a group the strategy did not name: ask c10d for its size
                try:
                    size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group))  # type: ignore[arg-type]
                except Exception:  # noqa: BLE001 - unknown to this torch: count it, bytes unknown
                    size = 1
            payload = sum(t.numel() * t.element_size() for t in tensors)
            if kind == "all_gather" and ns_is_input_shard(func):
                payload *= size  # the gathered buffer
            phase = self.phase or ("backward" if torch._C._current_autograd_node() is not None else "forward")
            self.counts[(name, kind, phase)] += 1
            event = None
            if self.recorder is not None:
                sent, recv = wire_bytes(kind, payload, size)
                event = CommEvent(kind, name, size, payload, sent, recv, 0.0)
                self.recorder.add(event)
            self.log.append(((name, kind, phase), event))

    return CollectiveCounter


def ns_is_input_shard(func: Any) -> bool:
    """True for all-gathers whose first argument is this rank's piece (funcol, FSDP2's coalesced/base ops)."""
    return func._schema.name.split("::")[-1] in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced")


def group_names(**groups: Any) -> dict[str, tuple[str, int]]:
    """``{process group name: (label, size)}`` from ``label=ProcessGroup`` pairs (what the counter calls each group)."""
    return {pg.group_name: (label, dist.get_world_size(pg)) for label, pg in groups.items() if pg is not None}


@contextlib.contextmanager
def count_collectives(recorder: Recorder | None = None, **groups: Any) -> Iterator[Counter[tuple[str, str, str]]]:
    """Count (and record) every collective issued inside the block, keyed ``(group label, kind, phase)``.

    >>> with count_collectives(tp=tp_mesh.get_group()) as counts:         # doctest: +SKIP
    ...     model(x).sum().backward()
    >>> counts[("tp", "all_reduce", "forward")]                             # doctest: +SKIP
    4
    """
    mode = collective_counter_mode()(recorder, group_names(**groups))
    with mode:
        yield mode.counts


def batch_signature(batch: Any) -> tuple[Any, ...]:
    """What decides a step's collectives besides the code: each tensor's shape and dtype, each other
    leaf's value (type name where it has no hashable value), in the batch's own order."""
    out: list[Any] = []
    stack = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append((tuple(item.shape), item.dtype, item.requires_grad))
        elif isinstance(item, Mapping):
            out.append(tuple(item))
            stack.extend(item[k] for k in reversed(list(item)))
        elif isinstance(item, (list, tuple)):
            out.append(len(item))
            stack.extend(reversed(item))
        elif item is None or isinstance(item, (bool, int, float, str)):
            out.append(item)
        else:
            out.append(type(item).__qualname__)
    return tuple(out)


class StepCounts:
    """Which steps run under the counting mode and what the others replay (see the module's docstring)."""

    def __init__(self, verify_every: int = 32, max_signatures: int = 16) -> None:
        self.verify_every, self.max_signatures = verify_every, max_signatures
        self._seen: dict[tuple[Any, ...], tuple[Logged, bool]] = {}  # signature -> (last counted list, confirmed by two equal counts)
        self._steps: Counter[tuple[Any, ...]] = Counter()
        self.every_step = False
        """True once a verification disagreed (or too many signatures): every step is counted from then on."""
        self.counted = 0
        self.replayed = 0

    def must_count(self, signature: tuple[Any, ...]) -> bool:
        """Whether the step with this batch signature runs under the mode (else: `replay`)."""
        self._steps[signature] += 1
        known = self._seen.get(signature)
        return self.every_step or known is None or not known[1] or self._steps[signature] % self.verify_every == 0

    def counted_step(self, signature: tuple[Any, ...], log: Logged) -> None:
        """Keep what a counted step issued; a list that differs from a confirmed one turns replay off."""
        self.counted += 1
        known = self._seen.get(signature)
        same = known is not None and known[0] == log
        if known is not None and known[1] and not same:
            self.every_step = True
        if len(self._seen) >= self.max_signatures and known is None:
            self.every_step = True  # batches of ever new shapes: nothing to replay
        self._seen[signature] = (log, same)

    def replay(self, signature: tuple[Any, ...], recorder: Recorder | None, counts: Counter[tuple[str, str, str]]) -> None:
        """Record the collectives of the last counted step with this signature, as if counted again."""
        self.replayed += 1
        for key, event in self._seen[signature][0]:
            counts[key] += 1
            if recorder is not None and event is not None:
                recorder.add(event)

    def summary(self) -> str:
        return "every step" if self.every_step else f"counted {self.counted} steps, replayed {self.replayed} of the same batch shapes"
