"""Numeric precision of a run: what the model computes in and how gradients are scaled.

========== ================ ============== =====================================
precision  parameters       forward        backward
========== ================ ============== =====================================
``32``     float32          float32        plain
``64``     float64          float64        plain (parity tests)
bf16-mixed float32          autocast bf16  plain (bf16 keeps fp32's exponent range)
16-mixed   float32          autocast fp16  loss scaled by a GradScaler, so small
                                           gradients do not flush to zero
========== ================ ============== =====================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError

PRECISIONS = ("32", "64", "bf16-mixed", "16-mixed")


def normalize(precision: str | int) -> str:
    text = str(precision).strip().lower()
    aliases = {"32-true": "32", "64-true": "64", "fp32": "32", "fp64": "64", "bf16": "bf16-mixed", "16": "16-mixed", "fp16": "16-mixed"}
    text = aliases.get(text, text)
    if text not in PRECISIONS:
        raise ConfigError(f"precision must be one of {list(PRECISIONS)}; got {precision!r}")
    return text


class Precision:
    """Autocast, loss scaling and dtype conversion for one precision setting."""

    def __init__(self, precision: str | int, device: torch.device) -> None:
        self.mode = normalize(precision)
        self.device = device
        self.scaler: Any = None
        if self.mode == "16-mixed":
            self.scaler = torch.amp.GradScaler(device.type)

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float64 if self.mode == "64" else torch.float32

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.mode == "64":
            return module.to(dtype=torch.float64)
        return module

    def convert_input(self, data: Any) -> Any:
        """Move a batch to the device; floating tensors follow the parameter dtype under ``64``."""
        return move(data, self.device, torch.float64 if self.mode == "64" else None)

    def autocast(self) -> AbstractContextManager[Any]:
        if self.mode == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        if self.mode == "16-mixed":
            return torch.autocast(self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, agree: Callable[[torch.Tensor], Any] | None = None) -> bool:
        """Step the optimizer; returns False when fp16 overflow made the scaler skip it.

        ``agree`` (a max all-reduce over the ranks that step together) makes the overflow verdict one
        for all of them: a rank holds only its shard or its stage of the gradients, and a rank that
        skipped while the others stepped would leave the replicas apart and the scales differing."""
        if self.scaler is None:
            optimizer.step()
            return True
        if self.scaler._scale is None:  # a pipeline stage that computes no loss never called scale()
            self.scaler.scale(torch.zeros((), device=self.device))
        if agree is not None:
            from torch.amp.grad_scaler import OptState

            state = self.scaler._per_optimizer_states[id(optimizer)]
            if state["stage"] is not OptState.UNSCALED:
                self.scaler.unscale_(optimizer)
            found = list(state["found_inf_per_device"].values())
            flag = torch.stack([f.reshape(()) for f in found]).amax().reshape(1) if found else torch.zeros(1, device=self.device)
            agree(flag)
            for f in found:
                f.copy_(flag.reshape(f.shape))
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def move(data: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Move every tensor in a nested batch (tuple, list, dict) to ``device``."""
    if isinstance(data, torch.Tensor):
        if float_dtype is not None and data.is_floating_point():
            return data.to(device=device, dtype=float_dtype)
        return data.to(device, non_blocking=True) if data.device != device else data
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(move(x, device, float_dtype) for x in data))
    if isinstance(data, (list, tuple)):
        return type(data)(move(x, device, float_dtype) for x in data)
    if isinstance(data, dict):
        return {k: move(v, device, float_dtype) for k, v in data.items()}
    return data
