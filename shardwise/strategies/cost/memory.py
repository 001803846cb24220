"""Bytes of model state per rank for each ZeRO stage (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC 2020, section 5 and figure 1).

Model state is three things per parameter: the parameters the forward computes with,
their gradients, and the optimizer state (``K`` bytes per parameter, which counts the
fp32 master copy when one is kept apart from the compute parameters). With ``Psi``
parameters and a shard degree ``N``:

========================= ============ ============ ============ =====================
stage                     params       grads        optimizer    mixed Adam (2, 2, 12)
========================= ============ ============ ============ =====================
0: baseline (ddp)         p Psi        g Psi        K Psi        (2 + 2 + K) Psi
1: P_os (zero1)           p Psi        g Psi        K Psi / N    4 Psi + K Psi / N
2: P_os+g (zero2)         p Psi        g Psi / N    K Psi / N    2 Psi + (2 + K) Psi / N
3: P_os+g+p (zero3/fsdp)  p Psi / N    g Psi / N    K Psi / N    (2 + 2 + K) Psi / N
========================= ============ ============ ============ =====================

The paper's numbers are mixed precision with Adam: fp16 parameters and gradients
(``p = g = 2``) and ``K = 12`` (fp32 master weights, momentum and variance, 4 bytes each).

**fp32 variant (derived here).** Without mixed precision the parameters and gradients are
fp32 (``p = g = 4``) and the optimizer steps them in place, so there is no master copy:
``K = 4 x slots`` (Adam: 2 slots, 8 bytes; SGD with momentum: 1 slot, 4 bytes; plain SGD:
0). Baseline ``16 Psi``, P_os ``8 Psi + 8 Psi / N``, P_os+g ``4 Psi + 12 Psi / N``,
P_os+g+p ``16 Psi / N`` with Adam. Where an implementation keeps the optimizer's shard as a
separate tensor from the replicated compute parameters (shardwise's zero2 on FSDP2 does),
that shard is a master copy and adds ``p`` bytes to ``K``: ``4 Psi + (4 + 12) Psi / N``.
The same formulas hold for float64 with 8 in place of 4.

Scalars the optimizer keeps per tensor (Adam's ``step``) are not per-parameter state and
are left out of both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STAGE_OF: dict[str, int] = {"single": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}
"""The ZeRO stage each strategy implements (hsdp is stage 3 within a shard group)."""

CATEGORIES = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs in each category before sharding."""

    params: float
    """The parameters the forward computes with (2 for fp16/bf16, 4 for fp32)."""
    grads: float
    """Their gradients."""
    optimizer: float
    """``K``: optimizer state per parameter, including a master copy when one is kept."""


MIXED_ADAM = BytesPerParam(params=2, grads=2, optimizer=12)
"""The ZeRO paper's setting: fp16 parameters and gradients, Adam with fp32 master weights (K = 12)."""


def plain(dtype_bytes: int = 4, optimizer_slots: int = 2, master_copy: bool = False) -> BytesPerParam:
    """Bytes per parameter without mixed precision (fp32: ``dtype_bytes=4``; fp64 parity runs: 8).

    ``optimizer_slots`` is the number of parameter-shaped tensors the optimizer keeps
    (Adam 2, SGD with momentum 1, SGD 0); ``master_copy`` adds a separate copy of the
    parameters (the shard an optimizer steps when it is not the compute tensor).

    >>> plain(4, 2)
    BytesPerParam(params=4, grads=4, optimizer=8)
    """
    if dtype_bytes <= 0 or optimizer_slots < 0:
        raise ValueError(f"dtype_bytes must be > 0 and optimizer_slots >= 0; got {dtype_bytes}, {optimizer_slots}")
    return BytesPerParam(params=dtype_bytes, grads=dtype_bytes, optimizer=dtype_bytes * (optimizer_slots + int(master_copy)))


def sharded_categories(stage: int) -> dict[str, bool]:
    """Which categories a ZeRO stage partitions across the shard group."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {stage!r}")
    return {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}


def model_state_bytes(stage: int, psi: float, shard_degree: int, per_param: BytesPerParam = MIXED_ADAM) -> dict[str, float]:
    """Predicted bytes per rank of each category and their ``total`` (ZeRO paper, figure 1).

    >>> b = model_state_bytes(3, 7.5e9, 64)          # the paper's 7.5B model on 64 GPUs
    >>> round(b["total"] / 2**30, 2)                  # GiB per GPU (paper: 1.88 GB)
    1.75
    """
    if psi < 0:
        raise ValueError(f"the parameter count must be >= 0; got {psi}")
    if shard_degree < 1:
        raise ValueError(f"the shard degree must be >= 1; got {shard_degree}")
    split = sharded_categories(stage)
    out = {name: getattr(per_param, name) * psi / (shard_degree if split[name] else 1) for name in CATEGORIES}
    out["total"] = sum(out[name] for name in CATEGORIES)
    return out


def per_shard_numel(shape: tuple[int, ...], shard_degree: int) -> list[int]:
    """Elements each rank holds of a tensor sharded on dim 0 with ``torch.chunk`` (FSDP2's layout).

    ``torch.chunk`` gives ``ceil(d0 / N)`` rows to the first ranks and the rest to the
    last, so uneven shapes leave some ranks a little short (or empty).

    >>> per_shard_numel((10, 3), 4)
    [9, 9, 9, 3]
    """
    if not shape:
        return [1 if r == 0 else 0 for r in range(shard_degree)]
    rows, rest = shape[0], 1
    for d in shape[1:]:
        rest *= d
    size = -(-rows // shard_degree) if rows else 0
    out = []
    for r in range(shard_degree):
        start = min(r * size, rows)
        out.append((min(start + size, rows) - start) * rest)
    return out


def compare(measured: Mapping[str, float], predicted: Mapping[str, float]) -> dict[str, dict[str, float | None]]:
    """``{category: {measured, predicted, ratio}}`` for params, grads, optimizer and total."""
    out: dict[str, dict[str, float | None]] = {}
    for name in (*CATEGORIES, "total"):
        m = float(measured.get(name, sum(measured.get(c, 0.0) for c in CATEGORIES) if name == "total" else 0.0))
        p = float(predicted[name])
        out[name] = {"measured": m, "predicted": p, "ratio": (m / p) if p else (1.0 if m == 0 else None)}
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_table(section: Mapping[str, Any]) -> str:
    """The ``memory_per_rank`` section of summary.json as a small text table."""
    title = f"model state per rank ({section.get('strategy', '?')}, ZeRO stage {section.get('stage', '?')}, shard degree {section.get('shard_degree', '?')})"
    lines = [title, f"{'':10s} {'measured':>12s} {'predicted':>12s} {'ratio':>7s}"]
    for name in (*CATEGORIES, "total"):
        row = section[name]
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        lines.append(f"{name:10s} {_human(row['measured']):>12s} {_human(row['predicted']):>12s} {ratio:>7s}")
    return "\n".join(lines)
