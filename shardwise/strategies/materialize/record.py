"""Building on the meta device: `meta_init` records every write and every draw of construction (a
`Program`), and the generator state a model was built from (`note_build_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_RNG_ATTR = "_shardwise_build_rng"  # the CPU generator state where the model was built (set by meta_init, or at fit)


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build a model with its parameters on the meta device (no memory) and its buffers real.

    >>> with shardwise.meta_init():
    ...     model = LlamaForCausalLM(config)

    Parameters are created on the meta device: their initializers run on meta tensors and draw
    nothing, while every write to them and every draw from the generator is recorded in order, so
    each rank later replays exactly what eager construction would have done, for its share only
    (`shardwise.strategies.materialize`). Buffers are computed as usual (a causal mask, rotary
    frequencies: small), so a model whose ``__init__`` computes a buffer needs no initializer for it."""
    with _recording() as program:
        yield
    for module in program.modules:
        _PROGRAMS[module] = program
        # the recorded storage of each parameter where it was registered: `model.to(dtype)` later makes new tensors
        _BUILT[module] = program.registered.get(id(module), {})


_PROGRAMS: weakref.WeakKeyDictionary[nn.Module, Program] = weakref.WeakKeyDictionary()
_BUILT: weakref.WeakKeyDictionary[nn.Module, dict[str, int]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    storage: int | None  # the meta storage it writes (None: a draw on real tensors, replayed for the generator only)
    geometry: tuple[tuple[int, ...], tuple[int, ...], int] | None  # size, stride, offset of the view written
    full: bool  # writes every element of the storage without reading the old values
    opaque: bool  # reads another meta tensor: its values cannot be replayed
    seeded: bool  # draws from the generator


_TARGET = object()  # where the written tensor stands in a recorded op's arguments
_OVERWRITES = {"fill_", "zero_", "copy_"}


@dataclasses.dataclass
class Program:
    """What a model's construction did to its meta tensors and the generator, in order."""

    state: torch.Tensor  # the generator at the start
    ops: list[_Op] = dataclasses.field(default_factory=list)
    sizes: dict[int, tuple[int, torch.dtype]] = dataclasses.field(default_factory=dict)  # storage -> (elements, dtype)
    keep: list[torch.Tensor] = dataclasses.field(default_factory=list)  # written meta tensors, alive so no storage id is reused
    modules: list[nn.Module] = dataclasses.field(default_factory=list)
    registered: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)  # id(module) -> name -> storage


def _only(program: Program, storages: set[int]) -> Program:
    """The ops of ``program`` that write ``storages`` (values only: the generator does not matter then)."""
    return dataclasses.replace(program, ops=[op for op in program.ops if op.storage in storages])


def _bases(program: Program) -> dict[int, int]:
    """Storage -> the index of its last op that writes all of it from nothing (a replay starts there)."""
    bases: dict[int, int] = {}
    for i, op in enumerate(program.ops):
        if op.storage is not None and op.full:
            bases[op.storage] = i
    for i, op in enumerate(program.ops):  # an op that reads another meta tensor after the base: not replayable
        if op.storage is not None and op.opaque and op.storage in bases and i > bases[op.storage]:
            del bases[op.storage]
    return bases


_CONSTANT_BYTES = 16 << 20  # a parameter made from a computed value keeps that value up to this size


class _Recorder(TorchDispatchMode):
    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        self.empties: set[int] = set()  # real storages torch.empty made and nothing wrote since (garbage, not a value)
        # A draw on a meta tensor is one eager construction made and this one did not: real draws after it differ
        # from eager's, and so does a value computed from them (torch.randn(...) * 0.02 after an nn.Embedding).
        self.skipped_draw = False
        self.real_draw_since = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default) and isinstance(out, torch.Tensor) and not out.is_meta:
            self.empties.add(out.untyped_storage()._cdata)
            return out
        if self.empties:
            for t in _flat(args, kwargs):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    self.empties.discard(t.untyped_storage()._cdata)  # read or written: no longer known to be garbage
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        target: torch.Tensor | None = None
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                if isinstance(value, torch.Tensor) and value.is_meta:
                    target = value
                    break
        if target is None and not seeded:
            return out
        if target is None and any(isinstance(a, torch.Tensor) and a.is_meta for a in _flat(args, kwargs)):
            return out  # a draw on meta tensors draws nothing
        opaque = False

        def keep(a: Any) -> Any:
            nonlocal opaque
            if a is target:
                return _TARGET
            if isinstance(a, torch.Tensor):
                if a.is_meta:
                    opaque = True
                    return None
                return a.detach().clone()
            if isinstance(a, list | tuple):
                return type(a)(keep(x) for x in a)
            return a

        rec_args, rec_kwargs = keep(tuple(args)), {k: keep(v) for k, v in kwargs.items()}
        program = self.program
        if seeded and target is not None:
            self.skipped_draw = True
        elif seeded and self.skipped_draw:
            self.real_draw_since = True
        if target is None:
            program.ops.append(_Op(func, rec_args, rec_kwargs, None, None, False, opaque, seeded))
            return out
        storage = target.untyped_storage()
        sid = storage._cdata
        elems = storage.nbytes() // max(target.element_size(), 1)
        program.sizes.setdefault(sid, (elems, target.dtype))
        program.keep.append(target)
        whole = target.storage_offset() == 0 and target.is_contiguous() and target.numel() == elems
        full = whole and not opaque and (seeded or func._schema.name.split("::")[-1] in _OVERWRITES)
        geometry = (tuple(target.size()), tuple(target.stride()), int(target.storage_offset()))
        program.ops.append(_Op(func, rec_args, rec_kwargs, sid, geometry, full, opaque, seeded))
        return out


def _flat(args: Any, kwargs: Any) -> Iterator[Any]:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, list | tuple):
            yield from a
        else:
            yield a


@contextlib.contextmanager
def _recording() -> Iterator[Program]:
    """Parameters created on the meta device; every write to a meta tensor and every draw recorded."""
    program = Program(torch.random.get_rng_state())
    original_new = nn.Parameter.__dict__["__new__"]  # the staticmethod itself, put back as it was
    original_register = nn.Module.register_parameter

    recorder = _Recorder(program)

    def new(cls: type, data: torch.Tensor | None = None, requires_grad: bool = True) -> Any:
        if data is None or data.device.type == "meta":
            return original_new.__func__(cls, data, requires_grad)
        real = data
        fresh = real.untyped_storage()._cdata in recorder.empties  # before empty_like below reads it
        data = torch.empty_like(data, device="meta")  # uninitialized memory is never touched: no resident bytes
        param = original_new.__func__(cls, data, requires_grad)
        if not fresh and real.nbytes <= _CONSTANT_BYTES and not recorder.real_draw_since:
            # a value computed before it became a parameter (torch.zeros, torch.randn(...) * 0.02): kept, small
            sid = data.untyped_storage()._cdata
            program.sizes.setdefault(sid, (data.numel(), data.dtype))
            program.keep.append(data)
            geometry = (tuple(data.size()), tuple(data.stride()), 0)
            program.ops.append(_Op(torch.ops.aten.copy_.default, (_TARGET, real.detach().clone()), {}, sid, geometry, True, False, False))
        return param

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_register(self, name, param)
        program.modules.append(self)
        if param is not None and param.is_meta:
            program.registered.setdefault(id(self), {})[name] = param.untyped_storage()._cdata

    original_seed = torch.manual_seed

    def manual_seed(seed: int) -> Any:
        # a seed set inside the build: the replay sets the generator there too
        out = original_seed(seed)
        recorder.skipped_draw = recorder.real_draw_since = False
        program.ops.append(_Op(torch.random.set_rng_state, (torch.random.get_rng_state(),), {}, None, None, False, False, False))
        return out

    setattr(nn.Parameter, "__new__", staticmethod(new))  # noqa: B010 - patched for the build only, put back below
    setattr(nn.Module, "register_parameter", register)  # noqa: B010
    setattr(torch, "manual_seed", manual_seed)  # noqa: B010
    setattr(torch.random, "manual_seed", manual_seed)  # noqa: B010
    try:
        with recorder:
            yield program
    finally:
        setattr(nn.Parameter, "__new__", original_new)  # noqa: B010
        setattr(nn.Module, "register_parameter", original_register)  # noqa: B010
        setattr(torch, "manual_seed", original_seed)  # noqa: B010
        setattr(torch.random, "manual_seed", original_seed)  # noqa: B010


def has_meta(model: nn.Module) -> bool:
    """True when any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)


def note_build_state(model: nn.Module) -> None:
    """Record the generator state now as the model's build state, unless `meta_init` recorded one
    (``Trainer.fit`` calls this where it receives a meta model)."""
    if has_meta(model) and build_state(model) is None:
        model.__dict__[_RNG_ATTR] = torch.random.get_rng_state()


def build_state(model: nn.Module) -> torch.Tensor | None:
    for m in model.modules():
        state = m.__dict__.get(_RNG_ATTR)
        if state is not None:
            return state  # type: ignore[no-any-return,unused-ignore]
    return None
