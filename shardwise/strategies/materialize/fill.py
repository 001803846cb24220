"""Filling this rank's share (`fill`, `fill_share`, `materialize`): the plan replayed on temporary
full-shape tensors, each value kept only where this rank holds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.materialize.plan import Event, InitPlan, Slot, _run_event, _slot_tensor, _swapped, plan_init
from shardwise.strategies.materialize.record import _TARGET, _bases, _only, _Op

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
