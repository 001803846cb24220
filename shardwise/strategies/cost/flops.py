"""A model's FLOPs per training step, and the device peak they are measured against (MFU).

Model FLOPs (Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022, appendix B):
the matrix products of one forward and one backward, with no activation-checkpointing recompute, so
that model FLOPs utilization (MFU) compares runs that recompute and runs that do not.

`count` runs the model once on one batch of samples, in the caller's process, on the meta device:
a deep copy of the model whose parameters and buffers are meta tensors (shape and dtype, no storage,
no arithmetic), the batch on meta too, and ``torch.utils.flop_counter.FlopCounterMode`` counts the
forward, the loss the trainer would take (``step(model, batch)``) and ``torch.autograd.grad`` of it
with respect to the meta parameters. The user's model is not touched: no ``.grad``, no weight or
buffer (a BatchNorm's running statistics), no Python attribute a forward changes (a call counter),
not its mode. What a forward does outside the module (writing a file) it does once more here. Meta tensors are what ``FakeTensorMode`` is made of;
fake tensors on CPU route ``scaled_dot_product_attention`` to the CPU flash kernel, which the counter
does not count (a 4-layer CharGPT: 306.9 M counted under fake tensors, 332.1 M on meta, whose
math path the counter sees), so the device is meta.

Where counting fails (an operation without a meta kernel, a model that reads ``.item()``), a
transformer falls back to PaLM's formula: ``6 N + 12 L H Q T`` FLOPs per token, N the parameters that
take part in matrix products (embedding tables are looked up, not multiplied; an output layer tied to
the embedding counts), L layers, H heads of width Q (H Q: the attention width), T the sequence length.
L, H Q come from a Hugging Face ``config`` or the model's block list; T from the batch's token ids.

Peaks (`peak_for`): a CUDA device by name (`shardwise.strategies.cost.cluster`'s datasheet profiles:
bf16/fp16 dense tensor-core figure under mixed precision, TF32's where float32 matmuls may use it,
fp32 otherwise, fp64); a CPU by a short timed matmul at the run's threads and dtype (`cpu_peak`), the
largest ever measured kept on disk per (CPU model, threads, dtype, torch version): load only lowers it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.data.batches import model_args

StepFn = Callable[[nn.Module, Any], torch.Tensor]

CACHE_DIR = Path.home() / ".cache" / "shardwise"
"""Where measured CPU peaks are kept (``cpu_peak.json``)."""


@dataclass(frozen=True)
class Count:
    """What one count found: FLOPs per sample (forward + backward) or None, how, and what it cost."""

    flops_per_sample: float | None
    method: str
    """``FlopCounterMode``, ``6N+attention (...why)`` or ``not counted (...why)``."""
    tokens_per_sample: int = 0
    """T of the batch's token ids (the model's integer (B, T) input or ``input_ids``); 0 without token ids."""
    seconds: float = 0.0
    """What counting cost in the calling process."""

    def per_step(self, global_batch: int) -> float | None:
        return None if self.flops_per_sample is None else self.flops_per_sample * global_batch

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def token_ids(batch: Any) -> torch.Tensor | None:
    """The batch's token ids: ``input_ids`` of a mapping, else the model's first positional input, when it
    is an integer tensor of two dimensions (B, T); None otherwise."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
    else:
        args = model_args(batch)[0]
        ids = args[0] if args else None
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() and not ids.is_complex():
        return ids
    return None


def samples_in(batch: Any) -> int:
    """The leading dimension of the batch's first tensor (the samples it holds)."""
    items: Any = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else [batch]
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() >= 1:
            return int(item.shape[0])
    return 1


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta")
    if isinstance(value, Mapping):
        return type(value)({k: _to_meta(v) for k, v in value.items()}) if isinstance(value, dict) else {k: _to_meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors (no storage is copied): a forward
    that changes the module's own Python state (a call counter) changes the copy's. Tied weights stay tied."""
    import copy

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad and p.is_floating_point())
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(model, memo)


def counted(model: nn.Module, batch: Any, step: StepFn | None = None) -> float:
    """FLOPs of one forward, loss and backward of ``model`` on ``batch`` (all of it), counted on a meta copy
    (`meta_copy`) in training mode. ``step(model, batch) -> loss`` is the trainer's loss path; without it
    the output is summed. Raises what the model raises where meta tensors cannot follow it (``.item()``,
    an operation without a meta kernel), or where it cannot be copied."""
    from torch.utils.flop_counter import FlopCounterMode

    twin = meta_copy(model).train()
    leaves = [p for p in twin.parameters() if p.requires_grad]
    with torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
        if step is not None:
            loss = step(twin, _to_meta(batch))
        else:
            args, kwargs = model_args(_to_meta(batch))
            out = twin(*args, **kwargs)
            loss = (out if isinstance(out, torch.Tensor) else out[0]).float().sum()
        if leaves and loss.requires_grad:
            torch.autograd.grad(loss, leaves, allow_unused=True)
    return float(counter.get_total_flops())


def matmul_params(model: nn.Module) -> int:
    """N of PaLM's formula: trainable parameters of every module but embedding tables (a lookup multiplies
    nothing); a weight tied to an output layer is that layer's too, so it counts (once)."""
    seen: set[int] = set()
    n = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return n


def _shape(model: nn.Module) -> tuple[int, int] | None:
    """(layers, attention width) from a Hugging Face config, else from the block list (its length, and the
    input width of the first linear in a block), else None."""
    config = getattr(model, "config", None)
    if config is not None:
        get = lambda *keys: next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)  # noqa: E731
        layers, hidden = get("num_hidden_layers", "n_layer", "num_layers"), get("hidden_size", "n_embd", "d_model")
        heads, head_dim = get("num_attention_heads", "n_head"), get("head_dim")
        if layers and hidden:
            return int(layers), int(heads * head_dim) if heads and head_dim else int(hidden)
    from shardwise.strategies.pipeline.nested import find_blocks

    found = find_blocks(model)
    if found is None:
        return None
    blocks = list(model.get_submodule(found).children())
    first = next((m for m in blocks[0].modules() if isinstance(m, nn.Linear)), None) if blocks else None
    return (len(blocks), first.in_features) if first is not None else None


def formula(model: nn.Module, batch: Any) -> tuple[float | None, str]:
    """PaLM's ``(6 N + 12 L H Q T) T`` FLOPs per sample, or None and why it does not apply."""
    ids = token_ids(batch)
    if ids is None:
        return None, "the batch has no token ids (an integer (B, T) input or input_ids) to read T from"
    shape = _shape(model)
    if shape is None:
        return None, f"{type(model).__name__} has neither a Hugging Face config nor a block list to read layers and width from"
    layers, width = shape
    seq = int(ids.shape[1])
    per_token = 6 * matmul_params(model) + 12 * layers * width * seq
    return float(per_token * seq), f"N={matmul_params(model)}, L={layers}, HQ={width}, T={seq}"


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def count(model: nn.Module, batch: Any, step: StepFn | None = None) -> Count:
    """FLOPs per sample of ``model`` trained on batches like ``batch``: counted (`counted`), or PaLM's formula
    where counting fails, or None with the reasons. Never raises for the model's sake."""
    start = time.perf_counter()
    ids = token_ids(batch)
    tokens = int(ids.shape[1]) if ids is not None else 0
    samples = max(1, samples_in(batch))
    try:
        flops = counted(model, batch, step)
        return Count(flops / samples, "FlopCounterMode", tokens, time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - any failure of the model on meta tensors falls back
        failed = f"counting failed: {_why(exc)}"
    try:
        per_sample, how = formula(model, batch)
    except Exception as exc:  # noqa: BLE001
        per_sample, how = None, _why(exc)
    if per_sample is None:
        return Count(None, f"not counted ({failed}; no formula: {how})", tokens, time.perf_counter() - start)
    return Count(per_sample, f"6N+attention ({failed}; PaLM appendix B with {how})", tokens, time.perf_counter() - start)


# -- peaks ---------------------------------------------------------------------------------------

GPU_NAMES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("H200", ("NVL",), "h200"),  # the H200 NVL (PCIe) card: 835 TFLOPS bf16 dense, not the SXM's 989
    ("H100", ("PCIE", "NVL"), "h100-80gb"),  # the PCIe and NVL cards have lower peaks than the SXM5 datasheet's
    ("A100", (), "a100-40gb"),  # 40 and 80 GB, SXM4 and PCIe: the same tensor-core peak
)
"""(a word of ``torch.cuda.get_device_name``, words that exclude it, the built-in profile)."""


def gpu_profile(name: str) -> str | None:
    """The built-in profile of a CUDA device named ``name``, or None where the table has none."""
    upper = name.upper()
    for word, unless, profile in GPU_NAMES:
        if word in upper and not any(u in upper for u in unless):
            return profile
    return None


def gpu_peak(name: str, precision: str, tf32: bool) -> tuple[float | None, str]:
    """Peak FLOP/s of one CUDA device for a run's precision, and where the figure comes from."""
    from shardwise.strategies.cost.cluster import BUILTIN

    key = gpu_profile(name)
    if key is None:
        return None, f"no peak figure for {name}: set peak_tflops"
    profile = BUILTIN[key]
    kind = {"bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed", "64": "64"}.get(precision, "tf32" if tf32 else "32")
    what = {"tf32": "tf32 tensor core (float32 matmul precision 'high')", "32": "fp32"}.get(kind, kind)
    return float(profile.flops[kind]), f"{profile.name} datasheet, {what} dense: {profile.source.split(';')[0]}"


CPU_DTYPES = {"32": torch.float32, "64": torch.float64, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown cpu"


def measure_matmul(dtype: torch.dtype, budget_s: float = 0.15) -> tuple[float, int]:
    """The best FLOP/s of square matmuls in ``dtype`` on this process's threads: (FLOP/s, size). The size
    doubles from 128 until one product takes 2 ms (at most 1024), then products run for ``budget_s`` and
    the fastest counts: products short enough that some run between two preemptions of a loaded machine
    (one thread on this one, load 5 on 2 cores: 19 GFLOP/s timed over 1024 x 1024 products, 96 over 256)."""
    n = 128
    with torch.random.fork_rng(devices=[]):
        while True:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            torch.mm(a, b)  # warm
            t = time.perf_counter()
            torch.mm(a, b)
            took = time.perf_counter() - t
            if took > 0.002 or n >= 1024:
                break
            n *= 2
        best, end = took, time.perf_counter() + budget_s
        while time.perf_counter() < end:
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / max(best, 1e-12), n


def _timed(dtype: torch.dtype, threads: int, budget_s: float = 0.15) -> tuple[float, int]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul(dtype, budget_s)
    finally:
        torch.set_num_threads(before)


def cpu_peak(precision: str, threads: int | None = None, cache_dir: Path | None = None) -> tuple[float, str]:
    """This CPU's matmul FLOP/s for ``precision`` at ``threads`` (this process's count): the largest figure ever
    measured for it, kept in ``~/.cache/shardwise/cpu_peak.json``. Load only lowers a measurement, so every call
    measures once more (briefly where a figure is kept: 0.05 s, else 0.15 s) and keeps the larger: a figure
    measured while other processes loaded the machine is replaced once a quieter moment measures more. A
    measurement is the better of the product timed at ``threads`` and ``threads`` times the product timed on
    one thread (on a loaded machine 2 threads timed 15 GFLOP/s where one thread timed 100: the threads wait
    for each other)."""
    threads = threads or torch.get_num_threads()
    dtype = CPU_DTYPES.get(precision, torch.float32)
    key = f"{cpu_model()} | {threads} threads | {str(dtype).removeprefix('torch.')} | torch {torch.__version__}"
    path = (cache_dir or CACHE_DIR) / "cpu_peak.json"
    kept = _kept(_read(path).get(key))
    budget = 0.05 if kept else 0.15
    peak, n = _timed(dtype, threads, budget)
    if threads > 1:  # a loaded machine's threads wait on each other at every product's barrier: one thread times cleanly
        one, n1 = _timed(dtype, 1, budget)
        peak, n = max((peak, n), (one * threads, n1))
    entry = {"flops_per_s": peak, "n": n, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    best = _keep_largest(path, key, entry)
    if best is entry:
        return peak, f"measured matmul peak ({key}, {n}x{n}, measured now{', above the figure kept' if kept else ''}; kept in {path})"
    return float(best["flops_per_s"]), (
        f"measured matmul peak ({key}, {best['n']}x{best['n']}, the largest measured, {best.get('measured', '?')}, kept in {path}; now {peak:.4g})"
    )


def _read(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError, TypeError):
        return dict(json.loads(path.read_text()))
    return {}


def _kept(entry: Any) -> float:
    """An entry's FLOP/s, 0 where it is missing or damaged."""
    try:
        return float(entry["flops_per_s"]) if isinstance(entry, Mapping) and float(entry["flops_per_s"]) > 0 else 0.0
    except (KeyError, TypeError, ValueError):
        return 0.0


def _keep_largest(path: Path, key: str, entry: dict[str, Any]) -> Mapping[str, Any]:
    """Merge ``entry`` into the table at ``path`` where it is larger than the one kept for ``key``; the entry that
    stands. Under a lock, the table is read right before it is replaced (atomically, through a temporary file):
    another process's keys, written while this one measured, stay."""
    with contextlib.suppress(OSError), _locked(path):
        table = _read(path)
        if _kept(table.get(key)) >= entry["flops_per_s"]:
            return dict(table[key])
        table[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu_peak.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    return entry


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``'s ``.lock`` file (where ``fcntl`` exists) for a read-merge-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not a POSIX system: the merge still re-reads right before the replace
        yield
        return
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def peak_for(device: torch.device, precision: str, override_tflops: float | None = None, threads: int | None = None) -> tuple[float | None, str]:
    """Peak FLOP/s of one device of the run, and its source: ``override_tflops`` (the ``peak_tflops``
    setting), a CUDA device's datasheet figure, or this CPU's measured matmul peak."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12, f"peak_tflops setting ({override_tflops:g} TFLOP/s)"
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return gpu_peak(torch.cuda.get_device_name(device), precision, tf32)
    if device.type == "cpu":
        return cpu_peak(precision, threads)
    return None, f"no peak figure for a {device.type} device: set peak_tflops"
