"""The plan (`plan_init`): which initializer runs when, and which parameter and buffer slots it writes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.errors import ConfigError
from shardwise.strategies.materialize.record import _BUILT, _PROGRAMS, Program, _bases, _recording, build_state


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
