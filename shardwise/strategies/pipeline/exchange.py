"""Gathering what each pipeline rank holds, with tensors alone on the wire (no pickled object).

A pipeline's checkpoint gathers every stage's model and optimizer state, and its timeline every
rank's events; each rank's part has its own size. ``all_gather_varlen`` gathers 1-D tensors of
different lengths (their lengths first, then the tensors padded to the longest).
``all_gather_tree`` gathers a structure of dicts, lists and tuples holding tensors, numbers,
strings, booleans and None: its shape travels as JSON text in a ``uint8`` tensor (data, never
code: nothing is unpickled) with each tensor's dtype and shape, and the tensors' bytes travel
as one ``uint8`` tensor. Every exchange goes through `shardwise.comm.all_gather`, so the
recorder counts it.

>>> back = _decode(*_encode({0: {"w": torch.arange(3.0)}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "fused": None}]}))
>>> back[0]["w"], back["groups"]
(tensor([0., 1., 2.]), [{'lr': 0.1, 'betas': (0.9, 0.99), 'fused': None}])
"""

from __future__ import annotations

import json
from typing import Any

import torch

from shardwise.comm import Group, Recorder, all_gather
from shardwise.errors import ConfigError

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def all_gather_varlen(tensor: torch.Tensor, *, group: Group, recorder: Recorder | None, device: torch.device) -> list[torch.Tensor]:
    """Every rank's 1-D ``tensor`` (lengths may differ; the dtype may not), in group rank order, on ``device``.

    Two all-gathers: the lengths, then the tensors padded to the longest."""
    flat = tensor.reshape(-1).to(device)
    sizes = [int(s) for s in all_gather(torch.tensor([flat.numel()], dtype=torch.int64, device=device), group=group, recorder=recorder)]
    longest = max(sizes)
    if longest == 0:
        return [flat[:0] for _ in sizes]
    padded = torch.zeros(longest, dtype=flat.dtype, device=device)
    padded[: flat.numel()] = flat
    return [part[:size] for part, size in zip(all_gather(padded, group=group, recorder=recorder), sizes, strict=True)]


def all_gather_tree(obj: Any, *, group: Group, recorder: Recorder | None, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` (dicts, lists, tuples of tensors, numbers, strings, booleans, None),
    in group rank order; tensors come back on the CPU, each its own copy."""
    shape, payload = _encode(obj)
    text = torch.frombuffer(bytearray(shape.encode()), dtype=torch.uint8) if shape else torch.zeros(0, dtype=torch.uint8)
    shapes = all_gather_varlen(text, group=group, recorder=recorder, device=device)
    payloads = all_gather_varlen(payload, group=group, recorder=recorder, device=device)
    return [_decode(s.cpu().numpy().tobytes().decode(), p.cpu()) for s, p in zip(shapes, payloads, strict=True)]


def _encode(obj: Any) -> tuple[str, torch.Tensor]:
    """``obj`` as JSON text (tensors replaced by their index, dtype and shape) and the tensors' bytes."""
    tensors: list[torch.Tensor] = []

    def enc(x: Any, where: str) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            t = x.detach()
            name = str(t.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise ConfigError(f"the pipeline's state exchange does not carry {t.dtype} tensors (at {where})")
            tensors.append(t.contiguous().reshape(-1).cpu())
            return {"T": [len(tensors) - 1, name, list(t.shape)]}
        if isinstance(x, dict):
            return {"d": [[enc(k, where), enc(v, f"{where}[{k!r}]")] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"t": [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return {"l": [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        raise ConfigError(
            f"the pipeline's state exchange carries tensors, numbers, strings, booleans, None and dicts, lists and "
            f"tuples of them; got {type(x).__name__} at {where} (an optimizer with state of another type cannot be gathered)"
        )

    shape = json.dumps(enc(obj, "state"))
    enc = None  # type: ignore[assignment]  # the recursive closure is a reference cycle: it kept `tensors` until the garbage collector ran
    parts = [t.view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8) for t in tensors]
    tensors.clear()
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return shape, payload


def _decode(shape: str, payload: torch.Tensor) -> Any:
    """Inverse of `_encode`: tensors are views of ``payload`` in order (copied where a view would be misaligned)."""
    tree = json.loads(shape)
    offset = 0

    def dec(x: Any) -> Any:
        nonlocal offset
        if not isinstance(x, dict):
            return x
        kind, value = next(iter(x.items()))
        if kind == "T":
            _, name, dims = value
            dtype = _DTYPES[name]
            numel = 1
            for d in dims:
                numel *= d
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            raw = payload[offset : offset + nbytes]
            if offset % 8:  # a view of another dtype needs aligned bytes: copy those
                raw = raw.clone()
            offset += nbytes
            return raw.view(dtype).reshape(dims)
        if kind == "d":
            return {dec(k): dec(v) for k, v in value}
        if kind == "t":
            return tuple(dec(v) for v in value)
        return [dec(v) for v in value]

    try:
        return dec(tree)
    finally:
        dec = None  # type: ignore[assignment]  # break the recursive closure's cycle (it held the whole payload)
