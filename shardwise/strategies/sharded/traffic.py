"""Recording what FSDP2 sends: `CollectiveTraffic` records FSDP2's all-gathers, reduce-scatters and
HSDP's allreduce where FSDP2 issues them, and DTensor's collectives through the counting mode of
`shardwise.strategies.counting` (docs/strategies/sharded.md, "What each stage sends").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.strategies.counting import collective_counter_mode, group_names
from shardwise.strategies.sharded.units import fsdp_modules


class _Untimed:
    """Passes events to the run's `Recorder` without seconds: FSDP2's collectives run
    asynchronously inside it, so the time of a call is not observed (None, not 0)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def add(self, event: CommEvent) -> None:
        self.recorder.add(dataclasses.replace(event, seconds=None))


_FSDP_C10D_OPS = frozenset({"_allgather_base_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"})
"""The c10d operators FSDP2 issues for its all-gathers and reduce-scatters (HSDP's allreduce is
``allreduce_`` over the replicate group)."""


def _fsdp_counter(counter: type, replicate_group: str | None, fsdp_ops: bool = True) -> type:
    """The counting mode of `shardwise.strategies.counting`, narrowed to what FSDP2 and DTensor send, so that no byte is recorded twice or missed:

    - A collective sent through `shardwise.comm` inside a recorded block (SyncBatchNorm's
      statistics, a loss that averages across ranks) is recorded by comm itself: of the c10d
      operators only FSDP2's own are taken (its all-gathers and reduce-scatters, and under hsdp
      the allreduce over the replicate group), and none with ``fsdp_ops`` off (FSDP2's own are then
      recorded where FSDP2 issues them, `CollectiveTraffic.hook`). DTensor's functional
      collectives are all taken.
    - A dispatch mode sees an operator before a tensor subclass does, so the collectives DTensor
      issues while it runs an operator (the allreduce of a sharded gradient norm's partial sums)
      would run under the mode's handler, where the mode is off, and go unseen. Declining
      DTensor's operators (``NotImplemented``, as torch's CommDebugMode does) hands them to
      DTensor, whose collectives then reach the mode.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def group_of(args: Any) -> str | None:
        for a in args[1:]:
            if isinstance(a, dist.ProcessGroup):
                return a.group_name
            if type(a).__name__ == "ScriptObject":  # c10d operators see the group boxed
                try:
                    return dist.ProcessGroup.unbox(a).group_name
                except Exception:  # noqa: BLE001 - a boxed ReduceOp, not a group
                    continue
        return None

    class FSDPCounter(counter):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _record(self, kind: str, func: Any, args: Any) -> None:
            if func.namespace == "c10d":
                op = func._schema.name.split("::")[-1]
                fsdp_allreduce = op == "allreduce_" and replicate_group is not None and group_of(args) == replicate_group
                if not fsdp_ops or (op not in _FSDP_C10D_OPS and not fsdp_allreduce):
                    return  # sent through shardwise.comm, which records it, or recorded at FSDP2's source
            super()._record(kind, func, args)

    return FSDPCounter


class _Phase:
    """The phase FSDP2's collectives are recorded under (None: forward, or backward inside an autograd node)."""

    def __init__(self, phase: str | None = None) -> None:
        self.phase = phase


_MODE_PHASES = frozenset({"clip", "checkpoint"})
"""Phases whose collectives DTensor issues (a sharded norm's partial sums, state-dict gathers):
seen by the dispatch mode. FSDP2's own all-gathers, reduce-scatters and allreduces are recorded
where FSDP2 calls them (`CollectiveTraffic.hook`), with no per-operator cost."""


class CollectiveTraffic:
    """Records the collectives FSDP2 issues on the run's `Recorder`, by group label, and counts
    them by ``(group, kind, phase)``.

    FSDP2 calls c10d itself (all-gathers before forward and backward, reduce-scatters after
    backward, the allreduce across HSDP's replicas). ``hook(model)`` records them at the source:
    each unit's all-gather and reduce-scatter go through recording versions of FSDP2's default
    communication objects (``set_custom_all_gather`` / ``set_custom_reduce_scatter``, the
    tensors actually handed to c10d, padded shards included), and HSDP's allreduce is recorded
    by FSDP2's all-reduce hook with the reduced shard. That costs nothing per operator. Where
    this torch lacks those methods, or a unit holds more than one parameter group, the dispatch
    mode of `shardwise.strategies.counting` sees each c10d operator instead (a
    Python call per operator). DTensor's own collectives (clipping's norm, checkpoints) are
    always seen by that mode, in the phases that issue them.

    ``phase(name)`` names the collectives of a block; blocks nest (an inner one, e.g. a forward
    inside ``forward_backward``, adds nothing). With ``enabled`` off nothing is recorded and no
    operator pays the mode's Python call.
    """

    def __init__(self, recorder: Recorder | None, groups: Mapping[str, Any], enabled: bool = True) -> None:
        self.recorder = _Untimed(recorder) if recorder is not None else None
        self.names = group_names(**groups)
        self.enabled = enabled
        self.counts: Counter[tuple[str, str, str]] = Counter()
        replicate = groups.get("replicate")
        self._replicate = replicate.group_name if replicate is not None else None
        self._counter = collective_counter_mode() if enabled else None
        self._mode_class = _fsdp_counter(self._counter, self._replicate) if self._counter is not None else None
        self.hooked = False
        """Whether FSDP2's own collectives are recorded at the source (`hook`), not by the mode."""
        self._state: _Phase | None = None
        self._active: Any = None
        self._hook_blocks: list[contextlib.ExitStack] = []

    def hook(self, model: nn.Module) -> None:
        """Record every FSDP2 unit's collectives where FSDP2 issues them (see the class)."""
        modules = fsdp_modules(model)
        if self._counter is None or not modules:
            return
        if not all(hasattr(m, "set_custom_all_gather") and hasattr(m, "set_custom_reduce_scatter") for m in modules):
            return  # an older torch: the mode sees FSDP2's c10d operators
        # torch before 2.12 holds one group per unit (`_fsdp_param_group`); later ones a list
        if any(len(getattr(m._get_fsdp_state(), "_fsdp_param_groups", ())) > 1 for m in modules):
            return  # per-parameter meshes: FSDP2 takes one custom communication per unit only
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        traffic = self

        class RecordedAllGather(DefaultAllGather):
            def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
                traffic._record("all_gather", group, output_tensor)  # the payload is the gathered buffer
                return super().__call__(output_tensor, input_tensor, group, async_op)

        class RecordedReduceScatter(DefaultReduceScatter):
            def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
                traffic._record("reduce_scatter", group, input_tensor)  # the payload is the whole gradient
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        for m in modules:
            m.set_custom_all_gather(RecordedAllGather())
            m.set_custom_reduce_scatter(RecordedReduceScatter())
            if self._replicate is not None:
                # Called after HSDP's allreduce across the replicas, with the reduced shard (its payload).
                m.set_all_reduce_hook(lambda shard: traffic._record("all_reduce", traffic._replicate, shard))
        self.hooked = True
        self._mode_class = _fsdp_counter(self._counter, self._replicate, fsdp_ops=False)

    def _record(self, kind: str, group: Any, tensor: torch.Tensor) -> None:
        name = group if isinstance(group, str) else group.group_name
        label, size = self.names.get(name, ("other", 1))
        state = self._state
        phase = (state.phase if state is not None else None) or ("backward" if torch._C._current_autograd_node() is not None else "forward")
        self.counts[(label, kind, phase)] += 1
        if self.recorder is not None:
            payload = tensor.numel() * tensor.element_size()
            sent, recv = wire_bytes(kind, payload, size)
            self.recorder.add(CommEvent(kind, label, size, payload, sent, recv, None))

    @contextlib.contextmanager
    def phase(self, name: str | None) -> Iterator[Any]:
        """Record the collectives issued in the block under phase ``name`` (None: forward, or backward
        inside an autograd node); yields an object whose ``phase`` a caller may move (None when off or
        nested)."""
        if self._mode_class is None or self._active is not None:
            yield None
            return
        if self.hooked and name not in _MODE_PHASES:
            state = self._state = _Phase(name)
            self._active = state
            try:
                yield state
            finally:
                self._active = self._state = None
            return
        mode = self._mode_class(self.recorder, self.names)
        mode.phase = name
        self._active = mode
        if self.hooked:
            self._state = mode  # FSDP2's own collectives in the block (none expected) take the mode's phase
        try:
            with mode:
                yield mode
        finally:
            self._active = self._state = None
            self.counts.update(mode.counts)

    def watch_forward(self, module: nn.Module) -> None:
        """Record the collectives of every forward of ``module`` run outside a block (evaluation):
        a pre-hook placed before FSDP2's own (the root's all-gather) opens a block, a hook after
        FSDP2's post-forward closes it, exception or not."""
        if self._mode_class is None:
            return

        def before(mod: nn.Module, args: Any) -> None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.phase("forward" if torch.is_grad_enabled() else "eval"))
            self._hook_blocks.append(stack)

        def after(mod: nn.Module, args: Any, output: Any) -> None:
            if self._hook_blocks:
                self._hook_blocks.pop().close()

        module.register_forward_pre_hook(before, prepend=True)
        module.register_forward_hook(after, always_call=True)

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        """Calls per optimizer step, ``{"group/kind": {phase: calls}}``."""
        out: dict[str, dict[str, float]] = {}
        for (group, kind, phase), n in sorted(self.counts.items()):
            out.setdefault(f"{group}/{kind}", {})[phase] = n / max(steps, 1)
        return out
