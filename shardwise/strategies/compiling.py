"""``torch.compile`` under every strategy: where the compiled regions are, what is refused, what is reported.

The setting (``TrainerConfig.compile``, ``--compile``, ``Engine(compile=)``) is ``off`` (the default),
``on``, ``model`` or ``blocks``, optionally with a backend after a colon (``on:aot_eager``; the default
backend is Inductor). Python's ``True``/``False`` mean ``on``/``off``.

- ``model``: the module the strategy runs is compiled whole, after the strategy placed it: the model
  under ``single`` and the replicas, the ``DistributedDataParallel`` wrapper under ``ddp`` (so
  Dynamo's DDP optimizer splits the graph at the gradient buckets and the allreduces still overlap
  backward), the model under ``zero1``.
- ``blocks``: every block of the model's block list (found as activation checkpointing and the
  pipeline find it) is compiled on its own, before the strategy wraps or splits it: FSDP2's units are
  those blocks, and its all-gathers and reduce-scatters run between compiled regions (torch skips
  FSDP2's hooks when tracing); tensor parallelism's DTensor blocks are traced with their
  redistributions; each pipeline stage runs its compiled blocks. Blocks of one class share their
  compiled code (their parameters are graph inputs), so a model of 32 layers compiles one block.
- ``on``: the strategy's choice (`Strategy.compile_unit`): ``model`` where the model runs whole,
  ``blocks`` where it is sharded, split by tensor parallelism or cut into stages.

Mechanism: ``nn.Module.compile`` in place: no module is wrapped or renamed, so parameter names,
checkpoints, tp plans, FSDP units and pipeline cuts are the same with and without compile. Compilation
happens on a region's first call, inside the first step: `compile_seconds` is the time Dynamo and the
backend spent, which the Trainer reports apart from the step time, and `report` counts the graphs and
the recompilations (a new batch shape, evaluation's ``no_grad``) with their reasons, and the frames
that failed to compile and run uncompiled (``eager_fallbacks``: past Dynamo's recompile limit, an
unsupported construct). Dynamo's caches are the process's: a second run in one process reuses the
first's graphs where their guards pass and recompiles where they do not (another batch size, another
backend), and its report counts those recompilations as its own.

Under tp (and FSDP's traffic counting) the collective counter's dispatch mode ignores compile internals
(`shardwise.strategies.counting`): it is off while Dynamo traces, so the graph is the same with and
without it, and on while the compiled code runs, so it counts the same collectives. It still sees every
operator the compiled code dispatches: under Inductor the collectives and extern kernels only (the
fused kernels are C++ or Triton, not operators), under ``aot_eager`` every aten operator, as eager.

Refused before launch (`check`): an unknown mode or backend; a strategy that cannot compile
(``Strategy.compile_unit == "none"``: ``dp``'s ``nn.DataParallel``); ``model`` where the strategy never
calls the model whole (the pipeline); ``blocks`` on a model without a block list; Inductor without
its compiler (a C++ compiler on CPU, Triton on CUDA); a Python that Dynamo does not support.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError

MODES = ("off", "on", "model", "blocks")
"""The values `parse` accepts, each optionally followed by ``:BACKEND``."""


@dataclass(frozen=True)
class Compile:
    """A parsed ``compile`` value."""

    mode: str = "off"
    """``off``, ``on`` (the strategy chooses), ``model`` or ``blocks``."""
    backend: str = "inductor"
    """``torch.compile``'s backend (``inductor``; ``aot_eager`` traces and differentiates without generating code)."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def resolved(self, unit: str) -> str:
        """``model`` or ``blocks`` for a strategy whose `Strategy.compile_unit` is ``unit``."""
        if self.mode == "on":
            return "blocks" if unit == "stages" else unit
        return self.mode

    def __str__(self) -> str:
        return self.mode if self.backend == "inductor" else f"{self.mode}:{self.backend}"


def parse(value: str | bool | Compile | None) -> Compile:
    """``"blocks:aot_eager"`` -> ``Compile("blocks", "aot_eager")``; a bad value a `ConfigError` naming the valid ones."""
    if isinstance(value, Compile):
        return value
    if value is None or value is False:
        return Compile()
    if value is True:
        return Compile("on")
    text = str(value).strip()
    mode, colon, backend = text.partition(":")
    mode = {"true": "on", "1": "on", "yes": "on", "false": "off", "0": "off", "no": "off", "": "off"}.get(mode.lower(), mode.lower())
    if mode not in MODES or (colon and not backend.strip()) or (mode == "off" and colon):
        raise ConfigError(
            f"compile={value!r} is not one of {', '.join(MODES)} (optionally ':BACKEND', e.g. 'on:aot_eager'); 'on' compiles "
            "where the strategy runs the model ('model' whole, 'blocks' one block at a time), 'off' (the default) does not"
        )
    return Compile(mode, backend.strip() or "inductor")


def check(value: str | bool | Compile | None, model: nn.Module, strategy: Any, device: str = "cpu") -> Compile:
    """Everything that makes compile fail, refused in the parent before launch; the parsed setting."""
    setting = parse(value)
    if not setting.enabled:
        return setting
    name, unit = strategy.name, strategy.compile_unit
    if unit == "none":
        raise ConfigError(
            f"compile={str(setting)!r}: strategy {name!r} cannot run a compiled model ({strategy.compile_refusal}); "
            "use ddp (one process per device) for a compiled data-parallel run, or compile='off'"
        )
    where = setting.resolved(unit)
    if where == "model" and unit == "stages":
        raise ConfigError(
            f"compile='model': strategy {name!r} never calls the model whole (each rank runs its stage's blocks), so a compiled "
            "model call would never run; use compile='blocks' (or 'on', which picks it): each stage runs its blocks compiled"
        )
    if where == "model" and unit == "blocks":
        raise ConfigError(
            f"compile='model': strategy {name!r} compiles one block at a time (its hooks sit on the blocks: FSDP2's gathers, tp's "
            "layouts), and a compile of the whole model breaks at them and runs in part uncompiled; use compile='blocks' "
            "(or 'on', which picks it)"
        )
    if where == "blocks":
        from shardwise.strategies.pipeline.nested import find_blocks

        if find_blocks(model) is None:
            lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
            other = "compile='model' (the model compiled whole)" if unit == "model" else "a strategy that compiles the model whole (single, ddp)"
            raise ConfigError(
                f"compile={str(setting)!r} compiles one block at a time under strategy {name!r}, and {type(model).__name__} has no list "
                f"of repeated blocks (an nn.ModuleList of two or more modules of one class; its module lists: {lists or 'none'}); keep "
                f"the layers in an nn.ModuleList, or use {other}"
            )
    check_backend(setting.backend, device)
    return setting


def check_backend(backend: str, device: str) -> None:
    """An unknown backend, a Python Dynamo does not run on, or Inductor without its compiler: a `ConfigError`."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        import sys

        raise ConfigError(f"compile: torch.compile does not support this Python ({sys.version.split()[0]}) with torch {torch.__version__}; use compile='off'")
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        import difflib

        usable = sorted(k for k in known if "TESTING" not in k.upper())
        # names are matched exactly (a registered backend of the user's may have capitals): the nearest one suggested
        near = [k for k in usable if k.lower() == backend.lower()] or difflib.get_close_matches(backend.lower(), usable, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"compile backend {backend!r} is not one of torch's: {hint}{', '.join(usable)} (e.g. compile='on:aot_eager')")
    if backend != "inductor":
        return
    if device.startswith("cuda"):
        try:
            import triton  # type: ignore[import-not-found]  # noqa: F401
        except ImportError:
            raise ConfigError(
                "compile: Inductor generates Triton kernels on CUDA and triton is not installed: pip install triton "
                "(it comes with torch's CUDA wheels), or compile='on:aot_eager' (no code generation)"
            ) from None
    else:
        # Inductor's own search (torch._inductor.config.cpp.cxx): $CXX, else g++ (clang++ on macOS); nothing else
        import sys

        cxx = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
        if shutil.which(cxx) is None:
            others = [c for c in ("g++", "c++", "clang++") if c != cxx and shutil.which(c)]
            hint = f"CXX={others[0]} (found on PATH)" if others else "install one (apt install g++)"
            raise ConfigError(
                f"compile: Inductor compiles C++ on {device} with {'CXX=' + cxx if os.environ.get('CXX') else cxx}, and no C++ compiler "
                f"was found there: set {hint}, or compile='on:aot_eager' (no code generation)"
            )


def compile_blocks(model: nn.Module, setting: Compile) -> list[str]:
    """Compile every block of the model's block list in place (before the strategy); their names."""
    from shardwise.strategies.pipeline.nested import find_blocks

    path = find_blocks(model)
    if path is None:
        raise ConfigError(f"compile='blocks': {type(model).__name__} has no list of repeated blocks (see compiling.check)")
    blocks = model.get_submodule(path)
    assert isinstance(blocks, nn.ModuleList)
    for block in blocks:
        if compile_in_place(block, setting.backend):  # torch's own blocks compile their forward (no cache to drop)
            block._compiled_call_impl = BlockCall(block, block._compiled_call_impl)
    return [f"{path}.{i}" for i in range(len(blocks))]


_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


class BlockCall:
    """A compiled block's call (what ``nn.Module.__call__`` runs in place of the block's own).

    A Hugging Face decoder hands each layer a key/value cache even while training. A cache makes Dynamo guard on
    the layer's index and on the cache's fill state, so every layer would compile a graph of its own and, past
    Dynamo's recompile limit (8), run uncompiled. While gradients are on, a block is called without the cache
    (training reads none; transformers' own gradient checkpointing drops it too), so the blocks share one graph.
    Without gradients a call that carries a cache (evaluation, ``generate`` after an in-process fit) runs the
    block's own call uncompiled: the cache is then the model's output, and filling it is what the call is for."""

    def __init__(self, module: nn.Module, compiled: Any) -> None:
        self.module, self.compiled = module, compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
            if not torch.is_grad_enabled():
                return self.module._call_impl(*args, **kwargs)
            kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
        return self.compiled(*args, **kwargs)


def compile_module(module: nn.Module, setting: Compile) -> list[str]:
    """Compile the module the strategy runs, whole, in place; its class name.

    Under DDP the module DDP calls is compiled, not DDP's own call: Dynamo skips frames in torch's files, so
    it would skip DDP's forward and find a frame to trace only inside a model of the user's own class, never
    in an ``nn.Sequential``. The inner call is traced while DDP's forward runs, so Dynamo's DDP optimizer
    still splits the graph at the gradient buckets."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        compile_in_place(module.module, setting.backend)
        return [f"DistributedDataParallel({type(module.module).__name__})"]
    compile_in_place(module, setting.backend)
    return [type(module).__name__]


def compile_in_place(module: nn.Module, backend: str) -> bool:
    """``module.compile(backend=...)``, except for a module whose forward is torch's own (``nn.Sequential``,
    ``nn.TransformerEncoderLayer``, ``nn.Linear``): Dynamo skips frames in torch's files, so its ``_call_impl`` and
    forward would both run uncompiled, silently. Such a module's forward is compiled through a frame of this file,
    which Dynamo traces (and inlines torch's forward from), set as the module's ``forward``; its hooks run around
    it uncompiled, in ``_call_impl``. Tracing its whole ``_call_impl`` instead broke at FSDP2's hooks (Dynamo may not
    trace them) and then skipped the forward: a per-block strategy compiled no block of ``nn.Linear``s.
    True where the module's call was compiled (``_compiled_call_impl``), False where its forward was."""
    try:
        from torch._dynamo import trace_rules

        skipped = bool(trace_rules.check(module.forward))
    except Exception:  # noqa: BLE001 - a torch without this rule table: compile as torch's method does
        skipped = False
    if not skipped:
        module.compile(backend=backend)
        return True
    forward = module.forward

    def forward_traced(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    module.forward = torch.compile(forward_traced, backend=backend)
    return False


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: Dynamo's frames (and their forward graphs) and the
    backward graphs compiled on their first backward."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover - a torch without the metrics
        return 0.0
    keys = ("_compile.compile_inner", "backward._backward_impl")
    return float(sum(sum(compilation_time_metrics.get(k, ())) for k in keys))


def _totals() -> dict[str, Any]:
    """This process's compile counters so far (Dynamo's are process-wide: a report is the difference of two)."""
    out: dict[str, Any] = {"compile_s": compile_seconds(), "graphs": 0, "graph_breaks": 0, "frames": 0, "metrics": 0}
    try:
        from torch._dynamo.utils import counters, get_compilation_metrics

        out["graphs"] = int(counters["stats"].get("unique_graphs", 0))
        out["graph_breaks"] = int(sum(counters["graph_break"].values()))
        out["frames"] = int(counters["frames"].get("ok", 0))
        out["metrics"] = get_compilation_metrics()
    except Exception:  # noqa: BLE001 - a torch without these internals: the counts are unknown, the run is not
        out["metrics"] = []
    return out


class Tracker:
    """What one run compiled: counters taken when the run starts, reported as differences at its end."""

    def __init__(self, setting: Compile, unit: str) -> None:
        self.setting, self.unit = setting, unit
        self.compiled: list[str] = []
        _keep_metrics(METRICS_KEPT)
        self._start = _totals()

    def seconds(self) -> float:
        """Compile seconds since the run started (the Trainer takes them out of the step time)."""
        return compile_seconds() - float(self._start["compile_s"])

    def report(self) -> dict[str, Any]:
        """The run's ``compile`` section: where, how long, how many graphs, and each recompilation's reason."""
        now, start = _totals(), self._start
        seen = {id(m) for m in start["metrics"]}
        new = [m for m in now["metrics"] if id(m) not in seen]
        reasons = [m.recompile_reason for m in new if getattr(m, "recompile_reason", None)]
        failed = [str(m.fail_reason or m.fail_type) for m in new if getattr(m, "fail_type", None) or getattr(m, "fail_reason", None)]
        compiled = self.compiled
        return {
            "mode": self.setting.resolved(self.unit),
            "backend": self.setting.backend,
            "compiled": compiled if len(compiled) <= 4 else [*compiled[:3], f"... {len(compiled)} in all"],
            "compile_s": round(self.seconds(), 3),
            "frames": now["frames"] - start["frames"],
            "graphs": now["graphs"] - start["graphs"],
            "graph_breaks": now["graph_breaks"] - start["graph_breaks"],
            "recompiles": len(reasons),
            "recompile_reasons": [str(r).splitlines()[0][:200] for r in reasons[:8]],
            "eager_fallbacks": len(failed),
            "eager_fallback_reasons": [r.splitlines()[0][:200] for r in failed[:8]],
        }


METRICS_KEPT = 4096
"""Dynamo keeps the metrics of its last 64 compilations by default: a run that compiled more (many frames,
several recompilations) would lose the earliest from its report. A run keeps at least this many."""


def _keep_metrics(n: int) -> None:
    try:
        from torch._dynamo import utils
    except ImportError:  # pragma: no cover
        return
    current = getattr(getattr(utils, "_compilation_metrics", None), "maxlen", None)
    if current is not None and current < n and hasattr(utils, "set_compilation_metrics_limit"):
        utils.set_compilation_metrics_limit(n)
