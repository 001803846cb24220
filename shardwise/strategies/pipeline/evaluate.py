"""Evaluation and sampling through a pipeline: ``PipelineModule``, this rank's share of the model
under the original names, whose no-grad ``forward`` runs stage after stage over point-to-point.

The owner of stage ``s`` receives the activation from the owner of ``s - 1`` (a header of
``_HEADER`` numbers: dtype code, ndim, sizes; then the tensor), runs it, sends it on, and the
last stage's output is broadcast over the pipeline group, so ``module(x)`` returns the whole
output on every pipeline rank for any batch size. Training goes through the schedule instead.
Every message goes through `shardwise.comm` (``pp/send``, ``pp/recv``, ``pp/broadcast`` in the recorder).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.comm import Group, Recorder, broadcast, recv, send
from shardwise.errors import ConfigError
from shardwise.strategies.pipeline.split import _register


class PipelineModule(nn.Module):
    """This rank's share of the model, under the original names, callable like the user's model.

    ``module(x)`` (under ``torch.no_grad()``) runs every stage in order, activations sent from
    rank to rank over the pipeline group, and returns the last stage's output on every rank of
    the group (broadcast), so evaluation and sampling work unchanged. Every rank of the group
    must make the call (the first stage's rank reads ``x``). Training goes through the schedule
    (``Engine.forward_backward``), not through this forward.
    """

    def __init__(
        self, stages: dict[int, nn.Module], runners: dict[int, nn.Module], num_stages: int, group: Group, device: torch.device, recorder: Recorder | None = None
    ) -> None:
        super().__init__()
        for idx in sorted(stages):
            for name in stages[idx].layer_names:  # type: ignore[union-attr]
                _register_path(self, name, stages[idx].get_submodule(name))
            for name, t in getattr(stages[idx], "root_tensors", {}).items():  # a traced stage's bare parameters (a position table)
                if name not in self._parameters and name not in self._buffers:
                    if isinstance(t, nn.Parameter):
                        self.register_parameter(name, t)
                    else:
                        self.register_buffer(name, t)
        self._stage_mods = dict(stages)
        self._runners = dict(runners)  # what runs each stage (the stage module, or its DDP/FSDP wrapper)
        self.num_stages, self._group, self._device = num_stages, group, device
        self._recorder = recorder
        self.pp = group.size

    def owner(self, stage: int) -> int:
        return stage % self.pp

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            raise RuntimeError(
                "a pipeline-parallel model's forward does not carry gradients from stage to stage: train through "
                "engine.forward_backward (the pipeline schedule), and call the model under torch.no_grad() to evaluate"
            )
        from shardwise.strategies.pipeline.nested import NestedStage, batch_kwargs

        nested = any(isinstance(m, NestedStage) for m in self._stage_mods.values())
        # a model split by its block list: every stage reads the call's inputs (masks, positions)
        side = batch_kwargs(inputs, kwargs) if nested else {}
        if kwargs and not nested:
            raise ConfigError("this pipeline's stages take positional inputs; the model was called with keywords")
        me = self._group.rank
        x: tuple[Any, ...] = () if nested else inputs
        out: Any = None
        for s in range(self.num_stages):
            owner = self.owner(s)
            if owner != me:
                continue
            if s > 0 and self.owner(s - 1) != me:
                # a traced stage may take several tensors (a skip connection passed through): one message each
                count = int(getattr(self._stage_mods[s], "n_inputs", 1))
                x = tuple(_recv_tensor(self._group, self.owner(s - 1), self._device, self._recorder) for _ in range(count))
            out = self._runners[s](*x, **side)
            if s < self.num_stages - 1 and self.owner(s + 1) != me:
                for t in out if isinstance(out, tuple) else (out,):
                    _send_tensor(t, self._group, self.owner(s + 1), self._recorder)
            x = out if isinstance(out, tuple) and s < self.num_stages - 1 else (out,)
        last = self.owner(self.num_stages - 1)
        result = _broadcast_tensor(out, self._group, last, self._device, self._recorder)
        if not kwargs:
            return result
        # a dict batch: the model's own output has a loss too (labels given); every rank gets both
        from shardwise.data.batches import output_loss

        loss = output_loss(self._stage_mods[self.num_stages - 1].output) if me == last else None
        has = torch.tensor([1 if loss is not None else 0], device=self._device)
        broadcast(has, last, group=self._group, recorder=self._recorder)
        output = PipelineOutput(logits=result)
        if int(has.item()):
            output["loss"] = _broadcast_tensor(loss.detach().reshape(1) if loss is not None else None, self._group, last, self._device, self._recorder)[0]
        return output


class PipelineOutput(dict):
    """What a pipeline returns for a keyword call: ``logits`` and, with labels, ``loss``, by key or attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _register_path(owner: nn.Module, name: str, module: nn.Module) -> None:
    """Register ``module`` on ``owner`` under a dotted name of any depth (containers are ModuleDicts)."""
    if name.count(".") <= 1:
        _register(owner, name, module)
        return
    node = owner
    *parents, leaf = name.split(".")
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.ModuleDict())
        node = node._modules[part]  # type: ignore[assignment]
    node.add_module(leaf, module)


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8]
_HEADER = 10  # dtype code, ndim, up to 8 sizes


def _header(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
        raise ConfigError(f"a pipeline stage boundary must carry one tensor of at most {_HEADER - 2} dims; got {type(t).__name__}")
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _empty_from(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    ndim = int(h[1])
    return torch.empty([int(s) for s in h[2 : 2 + ndim]], dtype=_DTYPES[int(h[0])], device=device)


def _send_tensor(t: torch.Tensor, group: Group, dst: int, recorder: Recorder | None = None) -> None:
    """The header, then the tensor, to group rank ``dst``."""
    send(_header(t).to(t.device), dst, group=group, recorder=recorder)
    send(t.contiguous(), dst, group=group, recorder=recorder)


def _recv_tensor(group: Group, src: int, device: torch.device, recorder: Recorder | None = None) -> torch.Tensor:
    """A tensor from group rank ``src``, shaped by the header received first."""
    h = torch.empty(_HEADER, dtype=torch.int64, device=device)
    recv(h, src, group=group, recorder=recorder)
    out = _empty_from(h.cpu(), device)
    recv(out, src, group=group, recorder=recorder)
    return out


def _broadcast_tensor(t: torch.Tensor | None, group: Group, src: int, device: torch.device, recorder: Recorder | None = None) -> torch.Tensor:
    """``t`` from group rank ``src`` to every rank of the group (its header first)."""
    if group.size == 1:
        assert t is not None
        return t
    h = _header(t).to(device) if group.rank == src and t is not None else torch.empty(_HEADER, dtype=torch.int64, device=device)
    broadcast(h, src, group=group, recorder=recorder)
    buf = t.contiguous() if group.rank == src and t is not None else _empty_from(h.cpu(), device)
    broadcast(buf, src, group=group, recorder=recorder)
    return buf
