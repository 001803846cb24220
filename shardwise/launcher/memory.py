"""One process's peak memory, as the operating system and the CUDA allocator count it.

On Linux the peak resident memory is ``VmHWM`` of ``/proc/self/status`` (the kernel's high-water
mark of the resident set: every page the process ever held at once, its share of the shared
libraries included) and the current one ``VmRSS``. Elsewhere ``resource.getrusage``'s
``ru_maxrss`` (kilobytes on Linux and the BSDs, bytes on macOS) is the peak and the current
figure is unknown. On CUDA the allocator's own peaks (``torch.cuda.max_memory_allocated``, what
tensors held; ``max_memory_reserved``, what the caching allocator took from the driver) come too.

A high-water mark only rises: the figure at fit start is what the process held before the
strategy placed the model (the interpreter, torch, the script's own model as it was built), the
figure at the end the peak of the whole run. The Trainer records both on every rank and the
launching process's peak after its workers return (summary.json's ``memory`` section).

>>> snap = snapshot()
>>> snap["peak_bytes"] > 0 and snap["source"] in ("VmHWM", "ru_maxrss")
True
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

STATUS = Path("/proc/self/status")


def parse_status(text: str) -> dict[str, int]:
    """``{"VmHWM": bytes, "VmRSS": bytes, ...}`` from the text of ``/proc/<pid>/status`` (its ``kB``
    are kibibytes: the kernel prints pages times 4 for 4 KiB pages).

    >>> parse_status("Name:\\tpython\\nVmHWM:\\t  2048 kB\\nVmRSS:\\t 1024 kB\\n")
    {'VmHWM': 2097152, 'VmRSS': 1048576}
    """
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep or not key.startswith("Vm"):
            continue
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def _maxrss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux and the BSDs kilobytes


def host_memory(status: Path = STATUS) -> dict[str, Any]:
    """``peak_bytes`` (the high-water mark), ``rss_bytes`` (now; None where unknown) and ``source``."""
    try:
        fields = parse_status(status.read_text())
    except OSError:
        fields = {}
    if "VmHWM" in fields:
        return {"peak_bytes": fields["VmHWM"], "rss_bytes": fields.get("VmRSS"), "source": "VmHWM"}
    return {"peak_bytes": _maxrss_bytes(), "rss_bytes": None, "source": "ru_maxrss"}


def snapshot(device: Any = None) -> dict[str, Any]:
    """This process's figures now: `host_memory`, and on a CUDA ``device`` the allocator's peaks
    (``cuda_max_allocated_bytes``, ``cuda_max_reserved_bytes``)."""
    out = host_memory()
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        import torch

        out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["cuda_max_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    return out


FIELDS = ("peak_bytes", "rss_bytes", "cuda_max_allocated_bytes", "cuda_max_reserved_bytes")
"""The numbers of a `snapshot`, in the order `as_row` packs them (-1 for one not measured)."""


def as_row(snap: dict[str, Any]) -> list[float]:
    """A snapshot's numbers as floats for a collective (-1: not measured)."""
    return [float(snap[k]) if snap.get(k) is not None else -1.0 for k in FIELDS]


def from_row(row: list[float]) -> dict[str, int | None]:
    """`as_row` undone (``None`` for -1)."""
    return {k: (int(v) if v >= 0 else None) for k, v in zip(FIELDS, row, strict=True)}


MMAP_THRESHOLD = 4 << 20
"""Allocations from this size up are given back to the operating system when freed (glibc)."""

_heap_set = False


def return_large_frees() -> bool:
    """Make glibc's malloc give every block of `MMAP_THRESHOLD` or more back to the system when it is freed.

    glibc serves a large block with its own mapping, returned on free, but raises that threshold to
    the size of each mapped block freed (up to 32 MB): after a training step frees its first gradient
    buckets and gathered weights, blocks of a few MB come from per-thread heaps that keep freed
    memory and fragment, and a rank's resident memory grows far above what its tensors hold. Fixed
    at 4 MB (which turns the adjustment off), a 200 M-parameter Llama's zero3 rank peaked at 1.70 GB
    instead of 1.92-2.32 GB over two steps (benchmarks/memory.py). Once per process, Linux with glibc
    only; True when set."""
    global _heap_set
    if _heap_set or not sys.platform.startswith("linux"):
        return _heap_set
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        _heap_set = bool(libc.mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
    return _heap_set
