"""The bytes autograd keeps for backward: what the planner calls a step's activations.

`SavedBytes` is a ``saved_tensors_hooks`` pair that adds up every tensor saved for backward by
storage (views of one buffer count once), leaving out parameters (and views of them: a matmul
saves its weight), and follows each saved tensor until autograd lets it go, so ``peak`` is the
largest amount alive at once. A pipeline's 1F1B schedule frees one micro-batch's tensors before
the next forward saves its own; the peak sees that, a running sum would not. The planner's
`measured_spec` and ``shardwise plan --validate`` both measure activations this way, so the
prediction and the measurement mean the same bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
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
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter):
            return t
        local = _local(t)
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._params:
            return t
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
        weakref.finalize(t, self._release, ptr)
        return t

    def _release(self, ptr: int) -> None:
        entry = self._alive.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self._alive[ptr]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard here
