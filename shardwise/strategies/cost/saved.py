"""The bytes autograd keeps for backward: what the planner calls a step's activations.

`SavedBytes` is a ``saved_tensors_hooks`` pair that adds up every tensor saved for backward by
storage (views of one buffer count once), leaving out parameters (and views of them: a matmul
saves its weight), and follows each saved tensor until autograd lets it go, so ``peak`` is the
largest amount alive at once. A pipeline's 1F1B schedule frees one micro-batch's tensors before
the next forward saves its own; the peak sees that, a running sum would not. The planner's
`measured_spec` and ``shardwise plan --validate`` both measure activations this way, so the
prediction and the measurement mean the same bytes.

Under activation checkpointing (`shardwise.strategies.checkpointing`) a checkpointed block saves its
inputs here (torch's checkpoint saves them outside its region); what the block saves inside is
packed by checkpoint's own hooks and dropped, and the tensors its recompute saves in backward (one
block at a time) are packed by them too, so neither is counted. The outputs the ``ops`` form keeps
live in its own cache and are counted through `SavedBytes.kept`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn


class SavedBytes:
    """Counts the storages saved for backward while ``hooks()`` is entered (see the module)."""

    def __init__(self, params: Iterable[torch.Tensor] = (), act_bytes: int | None = None) -> None:
        self._params = {_local(p).untyped_storage().data_ptr() for p in params}
        self.act_bytes = act_bytes
        """Count floating-point tensors at this many bytes an element (None: as stored)."""
        self._alive: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors holding it]
        self.now = 0
        self.peak = 0
        self.total = 0
        """Bytes of every storage saved (each once), freed or not."""
        self.where = "other"
        """A label the caller sets while a part of the model runs (`by_label` adds up per label)."""
        self.by_label: dict[str, int] = {}

    def hooks(self) -> AbstractContextManager[Any]:
        return self._counting()

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            _ACTIVE.remove(self)

    @staticmethod
    def kept(t: torch.Tensor, owner: object) -> None:
        """Count ``t`` in every probe counting now, until ``owner`` is freed: a tensor kept for backward
        outside autograd's saved tensors (selective activation checkpointing keeps the outputs it does not
        recompute in a cache of its own, `shardwise.strategies.checkpointing`), which no pack hook sees."""
        for probe in _ACTIVE:
            probe._count(t, owner)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t, t)
        return t

    def _count(self, t: torch.Tensor, owner: object) -> None:
        if isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter):
            return
        local = _local(t)
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._params:
            return
        entry = self._alive.get(ptr)
        if entry is None:
            size = storage.nbytes()
            if self.act_bytes is not None and local.is_floating_point():
                size = size // local.element_size() * self.act_bytes
            entry = self._alive[ptr] = [size, 0]
            self.now += size
            self.total += size
            self.peak = max(self.peak, self.now)
            self.by_label[self.where] = self.by_label.get(self.where, 0) + size
        entry[1] += 1
        weakref.finalize(owner, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self._alive.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self._alive[ptr]


_ACTIVE: list[SavedBytes] = []
"""The probes whose ``hooks()`` are entered, innermost last (for `SavedBytes.kept`)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard here
