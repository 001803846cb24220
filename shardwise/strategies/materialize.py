"""Models built on the meta device, materialized on each rank as that rank's share only.

`plan_init` records how the eager model would have drawn its weights; `fill` replays that on each
rank into the tensors the strategy left it. Design notes (why the values equal the eager model's
bit for bit, what is refused): docs/strategies/meta_init.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.errors import ConfigError

_RNG_ATTR = "_shardwise_build_rng"  # the CPU generator state where the model was built (set by meta_init, or at fit)


# -- building on the meta device ----------------------------------------------------------------


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


# -- the plan: which initializer runs when, and what it writes -----------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor attribute of one module: ``module.name`` (a parameter or a buffer)."""

    module: str
    name: str
    buffer: bool
    key: str  # the tensor's first name in the model (a tied weight's other names point to it)
    shape: tuple[int, ...]
    dtype: torch.dtype
    meta: bool  # a real buffer (meta_init) keeps its value unless an event writes it

    @property
    def id(self) -> str:
        return f"{self.module}.{self.name}" if self.module else self.name

    @property
    def primary(self) -> bool:
        return self.id == self.key


@dataclasses.dataclass(frozen=True)
class Event:
    """One initializer call: ``kind`` is ``reset_parameters``, ``_reset_parameters`` (torch's
    MultiheadAttention, Transformer) or ``hf`` (``owner._init_weights(module)`` of transformers)."""

    module: str
    kind: str
    owner: str | None
    writes: tuple[str, ...]  # slot ids


@dataclasses.dataclass
class InitPlan:
    """How each rank initializes a meta-built model: a recorded construction (`Program`, with the
    storage each final tensor has in it), else the modules' initializers as events."""

    events: list[Event]
    slots: dict[str, Slot]
    state: torch.Tensor | None
    program: Program | None = None
    storage_keys: dict[int, str] = dataclasses.field(default_factory=dict)  # program storage -> slot key
    how: str = "initializers"
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # slot key -> a real buffer's value
    unseen: list[str] = dataclasses.field(default_factory=list)  # classes whose __init__ wrote weights nothing recorded

    def uncovered(self) -> list[Slot]:
        if self.program is not None:
            bases = _bases(self.program)
            have = {key for st, key in self.storage_keys.items() if st in bases} | set(self.constants)
            return [s for s in self.slots.values() if s.primary and s.meta and s.key not in have]
        written = {s for e in self.events for s in e.writes}
        return [s for s in self.slots.values() if s.primary and s.meta and s.id not in written]

    def check(self, what: str = "the model") -> None:
        """Refuse a model with a meta tensor nothing can initialize (before launch)."""
        if self.unseen:
            raise ConfigError(
                f"{what} was built under torch.device('meta') and the constructor of {', '.join(self.unseen[:3])} sets weights "
                "itself (nn.init / .normal_ / .apply(...) in __init__): on the meta device those writes did nothing and "
                "cannot be replayed, so each rank would start from other weights than the model built eagerly. Build it "
                "under shardwise.meta_init() instead (it records the constructor's writes and replays them, bit for bit), or "
                "move that code into the modules' reset_parameters()"
            )
        missing = self.uncovered()
        if not missing:
            return
        names = ", ".join(f"{s.id} ({'buffer' if s.buffer else 'parameter'} of {s.module or 'the root module'})" for s in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        hint_buffer = any(s.buffer for s in missing)
        raise ConfigError(
            f"{what} was built on the meta device, and no initializer shardwise can run sets {names}{more}: "
            "each rank initializes its share by running the modules' own initializers again (reset_parameters(), "
            "transformers' _init_weights), and nothing of these sets that tensor. Give its module a reset_parameters() that "
            "initializes it, "
            + ("build the model under shardwise.meta_init() (buffers stay real there), " if hint_buffer else "")
            + "or build the model eagerly (without the meta device)"
        )


def _is_hf(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__) and callable(getattr(module, "_init_weights", None))


def _ctor_kind(module: nn.Module) -> str | None:
    cls = type(module)
    if callable(getattr(cls, "reset_parameters", None)):
        return "reset_parameters"
    if callable(getattr(cls, "_reset_parameters", None)) and cls.__module__.startswith("torch.nn"):
        return "_reset_parameters"
    return None


def _slots(model: nn.Module) -> dict[str, Slot]:
    first_name: dict[int, str] = {}
    for n, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if b is not None]:
        first_name.setdefault(id(t), n)
    slots: dict[str, Slot] = {}
    for path, m in model.named_modules():
        for kind, table in (("param", m._parameters), ("buffer", m._buffers)):
            for name, t in table.items():
                if t is None:
                    continue
                slot = Slot(path, name, kind == "buffer", first_name.get(id(t), f"{path}.{name}" if path else name), tuple(t.shape), t.dtype, t.is_meta)
                slots[slot.id] = slot
    return slots


def _signature(slots: dict[str, Slot]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {sid: (s.key, s.shape) for sid, s in slots.items()}


def plan_init(model: nn.Module) -> InitPlan:
    """How each rank will initialize ``model`` (built on the meta device), found without memory.

    A model built under `meta_init` replays its recorded construction. A transformers model is built
    again from its config under the recorder (meta parameters: nothing allocated) when its names and
    shapes are those of ``model``. Otherwise its modules' initializers are the events, in eager
    construction order, each with the slots it writes."""
    slots = _slots(model)
    program = next((_PROGRAMS[m] for m in model.modules() if m in _PROGRAMS), None)
    storage_keys: dict[int, str] = {}
    if program is not None:
        for slot in slots.values():
            owner = model.get_submodule(slot.module)
            built = _BUILT.get(owner, {}).get(slot.name) if not slot.buffer else None
            if built is not None and slot.primary:
                storage_keys.setdefault(built, slot.key)
        recorded = InitPlan([], slots, program.state, program, storage_keys, "recorded in meta_init")
        if recorded.uncovered():  # a module deep-copied after construction (nn.Transformer's layers): its initializers instead
            events = _plan_events(model, slots)
            if len(events.uncovered()) < len(recorded.uncovered()):
                events.state = program.state
                return events
        return recorded
    config = getattr(model, "config", None)
    if _is_hf(model) and config is not None:
        state = torch.random.get_rng_state()
        try:
            with _recording() as program:
                twin = type(model)(config)
        except Exception:  # noqa: BLE001 - a model its class cannot rebuild from its config: the initializers instead
            program = None
        finally:
            torch.random.set_rng_state(state)
        if program is not None:
            twin_slots = _slots(twin)
            if _signature(twin_slots) == _signature(slots):
                constants: dict[str, torch.Tensor] = {}
                for sid, slot in twin_slots.items():
                    t = _slot_tensor(twin, slot)
                    if t.is_meta:
                        storage_keys.setdefault(t.untyped_storage()._cdata, slot.key)
                    elif slot.primary and slots[sid].meta:
                        constants[slot.key] = t  # a buffer its constructor computes (rotary frequencies): small
                return InitPlan([], slots, build_state(model), program, storage_keys, f"{type(model).__name__}(config) recorded", constants)
    return _plan_events(model, slots)


def _slot_tensor(model: nn.Module, slot: Slot) -> torch.Tensor:
    owner = model.get_submodule(slot.module)
    return (owner._buffers if slot.buffer else owner._parameters)[slot.name]  # type: ignore[return-value]


_INIT_IN_CTOR = (
    "nn.init.",
    "init.normal_",
    "init.uniform_",
    "init.xavier",
    "init.kaiming",
    "init.trunc_normal_",
    "init.zeros_",
    "init.ones_",
    "init.constant_",
    ".normal_(",
    ".uniform_(",
    ".apply(",
    ".fill_(",
    ".zero_(",
)


def _constructor_initializers(model: nn.Module) -> list[str]:
    """Classes of ``model`` (outside torch) whose ``__init__`` sets values itself: under ``torch.device("meta")``
    those writes drew nothing and were not seen, so the modules' initializers alone would give other weights."""
    import inspect

    found: list[str] = []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        if cls.__module__.startswith("torch."):
            continue
        try:
            source = inspect.getsource(cls.__init__)
        except (OSError, TypeError):
            continue
        if any(marker in source for marker in _INIT_IN_CTOR):
            found.append(cls.__qualname__)
    return found


def _plan_events(model: nn.Module, slots: dict[str, Slot]) -> InitPlan:
    paths = {id(m): p for p, m in model.named_modules()}
    order: list[tuple[str, str, str | None]] = []
    done: set[int] = set()

    def hf_events(root: nn.Module) -> None:
        # transformers' smart_apply: children first, a nested pretrained model dispatching its own _init_weights
        def visit(m: nn.Module, owner: nn.Module) -> None:
            for child in m.children():
                visit(child, child if _is_hf(child) else owner)
            if id(m) not in done:
                done.add(id(m))
                order.append((paths[id(m)], "hf", paths[id(owner)]))

        visit(root, root)

    seen: set[int] = set()

    def construct(m: nn.Module) -> None:
        if id(m) in seen:  # a module registered twice was built once
            return
        seen.add(id(m))
        for child in m.children():
            construct(child)
        kind = _ctor_kind(m)
        if kind is not None:
            order.append((paths[id(m)], kind, None))
        if _is_hf(m):
            hf_events(m)

    construct(model)
    events = [Event(path, kind, owner, _writes(model, path, kind, owner, slots)) for path, kind, owner in order]
    unseen = [] if _is_hf(model) else _constructor_initializers(model)
    return InitPlan([e for e in events if e.writes], slots, build_state(model), unseen=unseen)


class _Writes(TorchDispatchMode):
    """Notes the storages every op writes in place (meta tensors: nothing runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in value if isinstance(value, list | tuple) else [value]:
                if isinstance(t, torch.Tensor):
                    self.storages.add(t.untyped_storage()._cdata)
        return func(*args, **kwargs)


def _run_event(model: nn.Module, path: str, kind: str, owner: str | None) -> None:
    module = model.get_submodule(path)
    with torch.no_grad():
        if kind == "hf":
            init_weights: Any = model.get_submodule(owner or "")._init_weights
            init_weights(module)
        else:
            getattr(module, kind)()


@contextlib.contextmanager
def _swapped(model: nn.Module, values: dict[str, torch.Tensor], slots: dict[str, Slot]) -> Iterator[None]:
    """Each slot in ``values`` holds that tensor while the body runs (a parameter wrapped as one)."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for sid, value in values.items():
            slot = slots[sid]
            owner = model.get_submodule(slot.module)
            table: dict[str, Any] = owner._buffers if slot.buffer else owner._parameters
            saved.append((table, slot.name, table[slot.name]))
            table[slot.name] = value if slot.buffer else nn.Parameter(value, requires_grad=False)
        yield
    finally:
        for table, name, old in reversed(saved):
            table[name] = old


def _writes(model: nn.Module, path: str, kind: str, owner: str | None, slots: dict[str, Slot]) -> tuple[str, ...]:
    """The slots the event writes, found by running it on distinct meta tensors (ties untied)."""
    fresh = {sid: torch.empty(s.shape, dtype=s.dtype, device="meta") for sid, s in slots.items()}
    by_storage = {t.untyped_storage()._cdata: sid for sid, t in fresh.items()}
    state = torch.random.get_rng_state()  # an initializer that draws a CPU tensor and copies it in must not move the run's generator
    mode = _Writes()
    try:
        with _swapped(model, fresh, slots), mode:
            _run_event(model, path, kind, owner)
    except Exception:  # noqa: BLE001 - an initializer that cannot run on meta tensors: assume it writes its own tensors
        return tuple(sid for sid, s in slots.items() if s.module == path)
    finally:
        torch.random.set_rng_state(state)
    return tuple(sid for st in mode.storages if (sid := by_storage.get(st)) is not None)


# -- filling this rank's share -----------------------------------------------------------------


Transform = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(name, full value, this rank's tensor) -> full value`` in the layout the run holds (tp's fused permutation)."""


def allocate(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Storage on ``device`` for every meta tensor of ``module`` (uninitialized), real tensors moved there.
    FSDP2's and DTensor parameters go through their own ``_apply``."""
    device = torch.device(device)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, name))
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    for group in holders.values():  # a tied weight gets one new parameter per holder from _apply: one again
        first = group[0][0]._parameters[group[0][1]]
        for m, name in group[1:]:
            m._parameters[name] = first
    return module


def to_device(module: nn.Module, device: torch.device | str) -> nn.Module:
    """``module.to(device)``, except that meta tensors stay on the meta device (`fill` allocates them later)."""
    device = torch.device(device)
    return module._apply(lambda t: t if t.is_meta else t.to(device))


def _targets(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for mod in modules:
        for n, p in mod.named_parameters(remove_duplicate=False):
            out.setdefault(n, p)
        for n, b in mod.named_buffers(remove_duplicate=False):
            if b is not None:
                out.setdefault(n, b)
    return out


def _write(target: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with torch.no_grad():
        if isinstance(target, DTensor):
            mesh = target.device_mesh
            mine = target.to_local()
            if all(type(p) in (Shard, Replicate) for p in target.placements):
                # this rank's block of the whole value, as a view: no DTensor made (one made per tensor is freed
                # only by the garbage collector, and kept every whole value alive until then)
                shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, target.placements)
                index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                local = full[index] if shape else full
            else:  # FSDP over tp (a strided shard): DTensor's own split
                local = distribute_tensor(full.to(mesh.device_type), mesh, target.placements, src_data_rank=None).to_local()
            if tuple(local.shape) != tuple(mine.shape):
                raise RuntimeError(f"shard of shape {tuple(local.shape)} for a local tensor of shape {tuple(mine.shape)}")
            mine.copy_(local)
        else:
            target.copy_(full)


def fill(
    model: nn.Module, plan: InitPlan, held: list[nn.Module] | None = None, *, device: torch.device | str = "cpu", transform: Transform | None = None
) -> None:
    """Give this rank's tensors storage and their values: ``held`` are the modules this rank keeps
    (default: ``model`` whole), their parameters and buffers named as in ``model``; ``model`` is the
    whole model on which the plan's initializers run (its tensors may be meta, or the strategy's
    DTensors). Values equal the eager model's from the plan's generator state, bit for bit; a model
    marked by `shardwise.init_from` reads its checkpoint's slices instead (`checkpoint.pretrained`), and only
    what the checkpoint does not hold (rotary frequencies) is initialized."""
    held = [model] if held is None else held
    for mod in held:
        allocate(mod, device)
    targets = _targets(held)
    from shardwise.checkpoint import pretrained

    record = pretrained.recorded(model)
    if record is not None:
        loaded: set[str] = set()
        for mod in held:
            loaded |= pretrained.load_local(mod, record.path, keys=record.keys, fused=_fused_of(mod))
        targets = {k: v for k, v in targets.items() if k not in loaded}
        keep = set(targets)
        plan = dataclasses.replace(
            plan,
            events=[e for e in plan.events if any(plan.slots[s].key in keep for s in e.writes)],
            program=_only(plan.program, {st for st, key in plan.storage_keys.items() if key in keep}) if plan.program is not None else None,
        )
    if plan.program is not None:
        _fill_program(model, plan, targets, transform)
        return
    slots = plan.slots
    last: dict[str, int] = {}
    chain: dict[str, list[int]] = {}
    for i, e in enumerate(plan.events):
        for sid in e.writes:
            last[sid] = i
            chain.setdefault(sid, []).append(i)
    saved_state = torch.random.get_rng_state()
    states: list[torch.Tensor] = []
    try:
        if plan.state is not None:
            torch.random.set_rng_state(plan.state)
        for i, e in enumerate(plan.events):
            states.append(torch.random.get_rng_state())
            values = {sid: _temp(slots[sid]) for sid in e.writes}
            with _swapped(model, values, slots):
                _run_event(model, e.module, e.kind, e.owner)
            for sid, value in values.items():
                slot = slots[sid]
                if last[sid] != i or not slot.primary:
                    continue  # overwritten by a later event, or a tied weight's other name: the generator moved, that is all
                if value.is_floating_point() and bool(torch.isnan(value).any()):
                    value = _replay(model, slot, [plan.events[j] for j in chain[sid]], [states[j] for j in chain[sid]], slots)
                _place(slot, value, targets, transform)
        for slot in slots.values():  # real buffers nothing writes (meta_init) keep their values
            if slot.primary and not slot.meta and slot.id not in last and slot.key in targets:
                _place(slot, model.get_submodule(slot.module)._buffers[slot.name], targets, transform)  # type: ignore[arg-type]
    finally:
        torch.random.set_rng_state(saved_state)


def _fused_of(module: nn.Module) -> dict[str, int] | None:
    """tp's fused q|k|v record of a split module (module name -> parts), for the checkpoint reader."""
    from shardwise.strategies.tensor_parallel.apply import tp_info

    info = tp_info(module)
    return dict(info.get("fused") or {}) if info else None


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


def _put(a: Any, target: torch.Tensor | None) -> Any:
    # a module-level function, not a closure: a recursive closure is a reference cycle that kept every
    # replayed tensor alive until the garbage collector ran (the whole model, at once)
    if a is _TARGET:
        return target
    if isinstance(a, list | tuple):
        return type(a)(_put(x, target) for x in a)
    return a


def _execute(op: _Op, target: torch.Tensor | None) -> None:
    op.func(*_put(op.args, target), **{k: _put(v, target) for k, v in op.kwargs.items()})


def _fill_program(model: nn.Module, plan: InitPlan, targets: dict[str, torch.Tensor], transform: Transform | None) -> None:
    """Replay the recorded construction from its generator state: a final tensor's ops from its base
    on one temporary, placed after its last op and dropped; the other draws on scratch tensors."""
    program = plan.program
    assert program is not None
    bases = _bases(program)
    last: dict[int, int] = {}
    for i, op in enumerate(program.ops):
        if op.storage is not None:
            last[op.storage] = i
    slot_of = {s.key: s for s in plan.slots.values() if s.primary}
    live: dict[int, torch.Tensor] = {}
    saved_state = torch.random.get_rng_state()
    try:
        if plan.state is not None:
            torch.random.set_rng_state(plan.state)
        with torch.no_grad():
            for i, op in enumerate(program.ops):
                if op.storage is None:
                    _execute(op, None)  # a draw on real tensors: the generator moves as it did
                    continue
                st = op.storage
                key = plan.storage_keys.get(st)
                elems, dtype = program.sizes[st]
                if key is None or st not in bases or i < bases[st]:
                    if op.seeded:  # overwritten later, or not a tensor of the final model: only the draws matter
                        size, stride, offset = op.geometry or ((elems,), (1,), 0)
                        _execute(op, torch.empty(elems, dtype=dtype).as_strided(size, stride, offset))
                    continue
                if i == bases[st]:
                    live[st] = torch.empty(elems, dtype=dtype)
                size, stride, offset = op.geometry or ((elems,), (1,), 0)
                _execute(op, live[st].as_strided(size, stride, offset))
                if i == last[st]:
                    base = live.pop(st)
                    slot = slot_of[key]
                    _place(slot, base[: _numel(slot.shape)].view(slot.shape), targets, transform)
        for key, value in plan.constants.items():
            _place(slot_of[key], value, targets, transform)
        for slot in plan.slots.values():  # real buffers (meta_init) keep their values
            if slot.primary and not slot.meta and slot.key not in plan.constants:
                _place(slot, _slot_tensor(model, slot), targets, transform)
    finally:
        torch.random.set_rng_state(saved_state)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _temp(slot: Slot) -> torch.Tensor:
    # built eagerly, a floating tensor is made in the default dtype and cast later (``model.to(torch.float64)``)
    dtype = torch.get_default_dtype() if slot.dtype.is_floating_point else slot.dtype
    t = torch.empty(slot.shape, dtype=dtype)
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    else:
        t.zero_()
    return t


def _replay(model: nn.Module, slot: Slot, events: list[Event], states: list[torch.Tensor], slots: dict[str, Slot]) -> torch.Tensor:
    """The slot's value through all its events on one temporary (its last event read an earlier value)."""
    now = torch.random.get_rng_state()
    value = _temp(slot)
    try:
        for e, state in zip(events, states, strict=True):
            torch.random.set_rng_state(state)
            others = {sid: _temp(slots[sid]) for sid in e.writes if sid != slot.id}
            with _swapped(model, {slot.id: value, **others}, slots):
                _run_event(model, e.module, e.kind, e.owner)
    finally:
        torch.random.set_rng_state(now)
    if value.is_floating_point() and bool(torch.isnan(value).any()):
        raise ConfigError(
            f"{slot.id} was built on the meta device and its initializers leave part of it unset (NaN after "
            f"{', '.join(f'{e.module or type(model).__name__}.{e.kind}' for e in events)}): build the model eagerly, "
            "or give its module a reset_parameters() that sets all of it"
        )
    return value


def _place(slot: Slot, value: torch.Tensor, targets: dict[str, torch.Tensor], transform: Transform | None) -> None:
    target = targets.get(slot.key)
    if target is None:
        return  # held by another rank (a pipeline stage)
    if transform is not None:
        value = transform(slot.key, value, target)
    _write(target, value)


_PLAN_ATTR = "_shardwise_init_plan"


def attach(model: nn.Module, plan: InitPlan) -> None:
    """Leave the plan on the meta model for the strategy's `fill_share` (the Engine, on each rank)."""
    object.__setattr__(model, _PLAN_ATTR, plan)


def fill_share(model: nn.Module, held: list[nn.Module], device: torch.device | str, transform: Transform | None = None) -> None:
    """In a strategy's ``apply``, after it wrapped or split ``model`` and before it builds the optimizer:
    this rank's tensors in ``held`` get storage and their values. Nothing to do for a model with real weights."""
    plan = model.__dict__.pop(_PLAN_ATTR, None)
    if plan is None:
        return
    fill(model, plan, held, device=device, transform=transform)


def materialize(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model on ``device`` with the weights its eager build would have had (replicas)."""
    plan = plan_init(model)
    plan.check()
    fill(model, plan, device=device)
    return model
