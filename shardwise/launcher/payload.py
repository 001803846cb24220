"""What ``launch`` sends to its workers: the function and its arguments, pickled by value.

Plain ``pickle`` first, exactly as before: functions and classes go by reference (module and
name), and a worker finds those of the user's script by running the script up to its call to
``launch`` / ``fit`` (``launcher.worker``). Plain pickle cannot send what has no importable name:
a lambda, a closure (``make_loss(scale)``'s inner function), a function a library defines inside
another (the forward hook transformers' ``gradient_checkpointing_enable()`` registers on the input
embeddings), nor, when there is no script for a worker to run (a notebook, a REPL, ``python -c``),
anything defined in ``__main__``. Only then is the payload pickled again with cloudpickle, which
sends such functions by value (their code, closure cells and the globals they read). It still
sends everything that has an importable name by reference, the user's script included when a
worker runs it, so a class of the script is the worker's own class, as with plain pickle.

What cannot be pickled either way (a lock, an open file, a socket, a generator) is named before
anything starts: ``find_unpicklable`` walks the payload (the arguments by name, attributes, items,
a module's children and hooks, a function's closure cells and globals, a partial's parts) to the
innermost object that fails, e.g. ``trainer.loss_fn.<closure>.lock`` or
``model.layers.0._forward_hooks[3]``, and ``fix_for`` says what to do for that kind of object.
"""

from __future__ import annotations

import collections
import functools
import inspect
import io
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from shardwise.errors import LaunchError

_MAX_DEPTH = 40


class _PlainPickler(pickle.Pickler):
    """Plain pickle that notes whether anything refers to ``__main__``."""

    uses_main = False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) or callable(obj):
            if getattr(obj, "__module__", None) == "__main__":
                self.uses_main = True
        return NotImplemented


def _by_value_pickler(main_by_reference: bool) -> type[pickle.Pickler]:
    """cloudpickle's pickler, but what plain pickle sends by reference goes by reference, ``__main__``'s
    names too when a worker runs the script (``main_by_reference``): cloudpickle would send every
    function and class of ``__main__`` by value, and a worker would then hold two classes of one name."""
    import cloudpickle

    code_reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]

    def keep_filename(code: types.CodeType) -> tuple[Any, ...]:
        # cloudpickle names every code it sends "<dynamic-code>"; a worker's traceback (and the launcher's
        # report of the user's frame) should name the user's file and line.
        return (_with_filename, (*code_reduce(code), code.co_filename))

    class Pickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap({types.CodeType: keep_filename, io.TextIOWrapper: _open_file}, cloudpickle.Pickler.dispatch_table)

        def reducer_override(self, obj: Any) -> Any:
            main = sys.modules.get("__main__")
            if main_by_reference and isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
                if _lookup(main, getattr(obj, "__qualname__", "")) is obj:
                    return NotImplemented  # plain pickle's save_global: __main__.name, found by the worker's run of the script
            reduced = super().reducer_override(obj)
            if main_by_reference and isinstance(obj, types.FunctionType) and main is not None and obj.__globals__ is vars(main):
                reduced = _in_workers_main(reduced, self)
            return reduced

    return Pickler


def _open_file(f: io.TextIOWrapper) -> tuple[Any, ...]:
    """The worker's own standard streams for this process's; any other open file is refused (cloudpickle
    would send a copy of a readable file's contents, which no rank could write to or read on from)."""
    for name in ("stdout", "stderr", "stdin"):
        if f is getattr(sys, name) or f is getattr(sys, f"__{name}__"):
            return (getattr, (sys, name))
    raise pickle.PicklingError(f"cannot pickle an open file ({getattr(f, 'name', '?')!r}, mode {getattr(f, 'mode', '?')!r})")


def _with_filename(make: Any, args: tuple[Any, ...], filename: str) -> types.CodeType:
    code: types.CodeType = make(*args)
    return code.replace(co_filename=filename)


class _MainGlobals:
    """Stands for the worker's ``__main__`` namespace in a pickle."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_main_globals, ())


def _main_globals() -> dict[str, Any]:
    return vars(sys.modules["__main__"])


def _in_workers_main(reduced: Any, pickler: pickle.Pickler) -> Any:
    """A lambda or closure of the user's script, sent by value but living in the worker's ``__main__``
    (the script the worker ran up to the call): it reads the worker's globals, as a ``def`` at the
    script's top level does, not copies of the parent's. The globals it reads that the worker may lack
    (defined below the call, or under ``if __name__ == "__main__":``) travel too and fill in only what
    is missing; those that cannot be pickled (a lock, an open file) stay behind: the worker has its own."""
    make, (code, _, name, defaults, closure), (state, slots), *rest = reduced
    captured = slots.get("__globals__", {})
    cls = type(pickler)
    slots = {**slots, "__globals__": {k: v for k, v in captured.items() if _fails(v, cls) is None}}
    return (make, (code, _MainGlobals(), name, defaults, closure), (state, slots), rest[0], rest[1], _set_in_main)


def _set_in_main(func: Any, state: Any) -> None:
    """cloudpickle's own state setter, less its update of the globals (the worker's names win) and its
    ``__builtins__`` (the script's module stays)."""
    fields, slots = state
    func.__dict__.update(fields)
    for cell, value in zip(func.__closure__ or (), slots["__closure__"] or (), strict=True):
        try:
            cell.cell_contents = value.cell_contents
        except ValueError:  # an empty cell
            continue
    for key, value in slots.items():
        if key not in ("__globals__", "__closure__", "_cloudpickle_submodules"):
            setattr(func, key, value)
    for key, value in slots["__globals__"].items():
        func.__globals__.setdefault(key, value)


def _lookup(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        if part == "<locals>":
            return None
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _dumps(obj: Any, pickler: type[pickle.Pickler]) -> bytes:
    buf = io.BytesIO()
    pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def dumps(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], main_spec: tuple[str, str] | None) -> bytes:
    """The payload a worker loads with plain ``pickle.load``: ``(fn, args, kwargs)``. ``main_spec`` is how
    a worker finds the user's script (None: there is none to run). Raises ``LaunchError`` naming the
    object that cannot be sent, where it sits in the arguments, and a fix for it."""
    # Plain pickle, by value: multiprocessing's own pickler (with torch's reducers) would
    # put tensors in shared memory, and every rank would then step the same parameters.
    buf = io.BytesIO()
    plain = _PlainPickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        plain.dump((fn, args, kwargs))
        if not (plain.uses_main and main_spec is None):
            return buf.getvalue()
    except Exception:  # noqa: BLE001 - whatever plain pickle refuses, cloudpickle gets a try
        pass
    pickler = _by_value_pickler(main_by_reference=main_spec is not None)
    try:
        return _dumps((fn, args, kwargs), pickler)
    except Exception as exc:  # noqa: BLE001 - named below, whatever the object raised
        error = exc
    path, culprit, reason = find_unpicklable(fn, args, kwargs, pickler)
    kind = _type_name(culprit)
    raise LaunchError(
        f"could not send {path} to the worker processes: it is {kind}, which cannot be pickled ({reason or _first_line(error)}). {fix_for(culprit, path)}"
    ) from None  # the pickler's own traceback adds nothing to this message


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _type_name(obj: Any) -> str:
    t = type(obj)
    name = t.__qualname__ if t.__module__ in ("builtins", None) else f"{t.__module__}.{t.__qualname__}"
    return f"a {name}"


def _fails(obj: Any, pickler: type[pickle.Pickler]) -> str | None:
    """Why ``obj`` cannot be pickled, or None when it can."""
    try:
        _dumps(obj, pickler)
    except RecursionError:
        return None  # too deep to say: not this object's own fault
    except Exception as exc:  # noqa: BLE001
        return _first_line(exc)
    return None


def _roots(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The payload's parts under the names the caller knows them by: the function, then its arguments
    by parameter name where the signature says it (``trainer``, ``model`` for ``Trainer.fit``'s workers)."""
    yield "fn", fn  # launch(fn, ...)
    try:
        params = inspect.signature(fn).parameters
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature to read: by position and keyword
        yield from ((f"args[{i}]", a) for i, a in enumerate(args))
        yield from kwargs.items()
        return
    for name, value in bound.items():
        if params[name].kind is inspect.Parameter.VAR_POSITIONAL:
            yield from ((f"{name}[{i}]", v) for i, v in enumerate(value))
        elif params[name].kind is inspect.Parameter.VAR_KEYWORD:
            yield from value.items()
        else:
            yield name, value


_MODULE_DICTS = ("_parameters", "_buffers", "_modules")


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """An object's parts as path suffixes, in the order pickle would meet them."""
    if isinstance(obj, (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
        return
    if isinstance(obj, types.FunctionType):
        # Free variables by name (a closure's captured values), then the globals its code reads.
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
            try:
                yield f".<closure>.{name}", cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for name in _global_names(obj.__code__):
            if name in obj.__globals__:
                yield f".<global>.{name}", obj.__globals__[name]
        return
    if isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
        return
    if isinstance(obj, functools.partial):
        yield ".func", obj.func
        for i, v in enumerate(obj.args):
            yield f".args[{i}]", v
        for k, v in obj.keywords.items():
            yield f".keywords[{k!r}]", v
        return
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        import torch

        if isinstance(obj, torch.nn.Module):
            # A module's children, parameters and buffers under their own names (model.layers.0.attn), as
            # state_dict names them; its hooks and other attributes as they are held (model._forward_hooks[3]).
            for held in _MODULE_DICTS:
                yield from ((f".{k}", v) for k, v in state.get(held, {}).items())
            state = {k: v for k, v in state.items() if k not in _MODULE_DICTS}
        for k, v in state.items():
            yield f".{k}", v
    for slot in getattr(type(obj), "__slots__", ()):
        if isinstance(slot, str) and hasattr(obj, slot) and slot != "__dict__":
            yield f".{slot}", getattr(obj, slot)


def _global_names(code: types.CodeType) -> Iterator[str]:
    seen: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        for name in c.co_names:
            if name not in seen:
                seen.add(name)
                yield name
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def find_unpicklable(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pickler: type[pickle.Pickler]) -> tuple[str, Any, str | None]:
    """(path, object, why) of the innermost object of the payload that ``pickler`` cannot pickle: the
    first failing part of the first failing argument, followed down while one of its own parts fails."""
    for name, value in _roots(fn, args, kwargs):
        reason = _fails(value, pickler)
        if reason is not None:
            return _descend(name, value, reason, pickler)
    return "the function and its arguments", (fn, args, kwargs), None


def _descend(path: str, obj: Any, reason: str, pickler: type[pickle.Pickler]) -> tuple[str, Any, str]:
    seen = {id(obj)}
    for _ in range(_MAX_DEPTH):
        for suffix, child in _children(obj):
            if id(child) in seen:
                continue
            why = _fails(child, pickler)
            if why is not None:
                path, obj, reason = path + suffix, child, why
                seen.add(id(child))
                break
        else:
            break  # no part fails alone: this object is the one
    return path, obj, reason


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def fix_for(obj: Any, path: str) -> str:
    """What to do about one object that cannot reach the workers, by its kind."""
    import threading

    lock_types = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Event, threading.Semaphore)
    if isinstance(obj, lock_types):
        fix = (
            "A lock guards threads of one process, and every rank is a process of its own: create it in each worker "
            "instead, at the top level of the script above the call to fit/launch (each worker runs that part), or "
            "lazily inside the function, or drop it"
        )
    elif isinstance(obj, io.IOBase):
        fix = (
            "An open file belongs to this process: pass the file's name and open it inside the function (or at the top "
            "level of the script above the call to fit/launch, which each worker runs; rank 0 alone should write "
            "to one file)"
        )
    elif isinstance(obj, types.GeneratorType):
        fix = "A generator runs once, in this process: pass a list, a Dataset, or a function that makes the generator"
    elif _type_module(obj) in ("socket", "ssl", "sqlite3", "_thread", "threading", "multiprocessing.connection"):
        fix = "It belongs to this process: create it inside the function, so that each worker makes its own"
    else:
        fix = (
            f"Create it inside the function so that each worker makes its own, or give {type(obj).__qualname__} "
            "`__getstate__`/`__setstate__` that leave out what cannot be copied"
        )
    hook = next((h for h in _HOOKS if f".{h}[" in path), None)
    if hook is not None:
        owner = path.split(f".{hook}[")[0]
        fix += (
            f". It is held by a hook registered on {owner} ({hook}): or remove the hook before fit (keep the handle "
            "register_*_hook returned and call handle.remove()) and register it in the model's __init__, which each worker runs"
        )
    return fix + "."


def _type_module(obj: Any) -> str:
    return getattr(type(obj), "__module__", "") or ""
