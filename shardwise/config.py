"""Settings as dataclass fields: one field gives a command-line flag, a TOML key and their help.

A settings class is a dataclass; each field's help is the docstring written under it (or the
``help`` of its `flag` metadata). From it this module derives, for any such class:

- `settings_of(cls)`: each field's name (its TOML key), type, default and help, and `convert`
  to turn a command-line string or a TOML value into the field's type (``"1.5"`` -> 1.5,
  ``"a,b"`` -> ``("a", "b")``, ``"true"`` -> True) with a one-line `ConfigError` naming the key;
- `add_arguments(parser, cls)`: one argparse flag per field (``--sync-every`` for ``sync_every``),
  its type, choices, default and help taken from the field, and what argparse needs beyond that
  (aliases, ``nargs``, a metavar, an action) from `flag`;
- `check_keys`, `from_mapping`: a TOML section's keys checked against the fields (the closest one
  named) and read into the class.

Users: `shardwise.strategies.options` (strategy options), `shardwise.trainer.config`
(``TrainerConfig``) and every command's options class (``shardwise plan``, ``simulate``, ...).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import sys
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from shardwise.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Required:
    """The default of a field that has none (nothing can be built without it)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


# --- types ------------------------------------------------------------------------------------


def union_args(tp: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(tp)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return typing.get_args(tp)
    return None


def split_optional(tp: Any) -> tuple[Any, bool]:
    """``(inner type, whether None is allowed)``: ``int | None`` -> ``(int, True)``."""
    args = union_args(tp)
    if args is None or type(None) not in args:
        return tp, tp is type(None)
    rest = tuple(a for a in args if a is not type(None))
    if len(rest) == 1:
        return rest[0], True
    return Union.__getitem__(rest), True


def sequence_item(tp: Any) -> Any | None:
    """The item type of ``tuple[X, ...]``, ``list[X]``, ``Sequence[X]`` (None for other types)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    if origin in (list, Sequence, set, frozenset) and len(args) == 1:
        return args[0]
    if tp in (list, tuple):
        return Any
    return None


def is_mapping(tp: Any) -> bool:
    return typing.get_origin(tp) in (dict, Mapping) or tp is dict


def type_name(tp: Any) -> str:
    """A type as a reader writes it: ``int | None``, ``tuple[str, ...]``, ``Literal['a', 'b']``."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    args = union_args(tp)
    if args is not None:
        return " | ".join(type_name(a) for a in args)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return f"Literal[{', '.join(repr(a) for a in typing.get_args(tp))}]"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(tp))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{inner}]" if inner else name
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def format_value(value: Any) -> str:
    """A value as it is written on the command line (``true``, ``none``, ``a,b``)."""
    if value is REQUIRED:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(format_value(v) for v in value) if value else '""'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r} = {format_value(v)!r}" if isinstance(v, str) else f"{k!r} = {format_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def describe(tp: Any) -> str:
    """What a value of this type looks like, for errors and help: ``a whole number or none``."""
    inner, optional = split_optional(tp)
    text = _describe(inner)
    return f"{text} or none" if optional and inner is not type(None) else text


def _describe(tp: Any) -> str:
    simple = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", Any: "any value"}
    if tp in simple:
        return simple[tp]
    if typing.get_origin(tp) is Literal:
        return "one of: " + ", ".join(format_value(v) for v in typing.get_args(tp))
    item = sequence_item(tp)
    if item is not None:
        return f"a comma-separated list (each {_describe(item)})"
    if is_mapping(tp):
        return 'a TOML table such as {key = "value"} (or its JSON text)'
    args = union_args(tp)
    if args is not None:
        return " or ".join(_describe(a) for a in args)
    return f"a {type_name(tp)}"


# --- values -----------------------------------------------------------------------------------


class Bad(Exception):
    """A value that does not fit a type (turned into a ConfigError naming the setting)."""


def convert(value: Any, tp: Any) -> Any:
    """``value`` (a command-line string, or what TOML read) as type ``tp``; raises `Bad`."""
    inner, optional = split_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        raise Bad
    if optional and isinstance(value, str) and value.strip().lower() == "none" and inner is not str:
        return None
    if inner is type(None):
        raise Bad
    return _convert_inner(value, inner)


def _convert_inner(value: Any, tp: Any) -> Any:
    if tp is Any:
        return value
    if tp in (bool, int, float, str):
        return _convert_scalar(value, tp)
    if typing.get_origin(tp) is Literal:
        for choice in typing.get_args(tp):
            try:
                if _convert_inner(value, type(choice)) == choice:
                    return choice
            except Bad:
                continue
        raise Bad
    if sequence_item(tp) is not None or typing.get_origin(tp) is tuple:
        return _convert_sequence(value, tp)
    if is_mapping(tp):
        return _convert_mapping(value, tp)
    args = union_args(tp)
    if args is not None:
        for member in sorted(args, key=lambda a: 0 if isinstance(a, type) and isinstance(value, a) else 1):
            try:
                return convert(value, member)
            except Bad:
                continue
        raise Bad
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if isinstance(value, str):
            try:
                return tp(value)
            except (TypeError, ValueError):
                raise Bad from None
    raise Bad


def _convert_scalar(value: Any, tp: type) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise Bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # --set key=4 reads 4 as a TOML number
        raise Bad
    # A number, or its text; never a bool (True is an int to Python, not a count); an int where a float is asked.
    accepted = (int,) if tp is int else (int, float)
    if isinstance(value, accepted) and not isinstance(value, bool):
        return tp(value)
    if isinstance(value, str):
        try:
            return tp(value.strip())
        except ValueError:
            raise Bad from None
    raise Bad


def _convert_sequence(value: Any, tp: Any) -> Any:
    item = sequence_item(tp)
    if isinstance(value, (list, tuple)):
        parts: list[Any] = list(value)
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if item is not None:
            parts = [p for p in parts if p]
    else:
        raise Bad
    if item is None:  # fixed length: tuple[int, int]
        items = typing.get_args(tp)
        if len(parts) != len(items):
            raise Bad
        return tuple(convert(p, t) for p, t in zip(parts, items, strict=True))
    converted = [convert(p, item) for p in parts]
    origin = typing.get_origin(tp) or tp
    return converted if origin is list else tuple(converted)


def _convert_mapping(value: Any, tp: Any) -> Any:
    if isinstance(value, str):
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            try:  # its JSON text, as the help of a table setting says ({"fc1": "colwise"})
                value = json.loads(value)
            except json.JSONDecodeError:
                raise Bad from None
    if not isinstance(value, dict):
        raise Bad
    key_t, val_t = typing.get_args(tp) or (Any, Any)
    return {convert(k, key_t): convert(v, val_t) for k, v in value.items()}


# --- a settings class's fields ----------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each annotated field of ``cls`` and its bases (subclass first)."""
    docs: dict[str, str] = {}
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, doc in _own_field_docs(klass).items():
            docs.setdefault(name, doc)
    return docs


@functools.cache
def _own_field_docs(klass: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return {}  # defined where no source is kept (an interactive session): no help text
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    if node is None:
        return {}
    docs = {}
    for stmt, after in itertools.pairwise(node.body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


@dataclass(frozen=True)
class Setting:
    """One field of a settings class: its name (the TOML key), type, default and help."""

    name: str
    """The field name: the keyword argument and the TOML key."""
    type: Any
    """The field's type, resolved (``int | None``, ``Literal['gpipe', '1f1b']``, ``tuple[str, ...]``)."""
    default: Any
    """The field's default (`REQUIRED` when it has none)."""
    help: str
    """The docstring under the field, or its `flag` help (empty when it has neither)."""

    @property
    def flag(self) -> str:
        """The command-line flag: ``--`` and the name with dashes (``--sync-every``)."""
        return name_to_flag(self.name)

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The values of a ``Literal[...]`` field, else None."""
        inner, _ = split_optional(self.type)
        return typing.get_args(inner) if typing.get_origin(inner) is Literal else None

    @property
    def switch(self) -> bool:
        """A boolean setting: an on/off flag (``--offload`` / ``--no-offload``)."""
        return split_optional(self.type)[0] is bool

    def convert(self, value: Any, where: str = "setting") -> Any:
        """``value`` (command-line text or a TOML value) as this field's type, or a one-line `ConfigError`
        that starts with ``where`` (``strategy 'ddp': option``) and names the key, its flag and what it takes."""
        try:
            return convert(value, self.type)
        except Bad:
            pass
        hint = ""
        if self.choices and isinstance(value, str):
            close = difflib.get_close_matches(value, [format_value(c) for c in self.choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where} {self.name} ({self.flag}) must be {describe(self.type)}; got {value!r}{hint}") from None


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED


def settings_of(cls: type) -> tuple[Setting, ...]:
    """Every public init field of the dataclass ``cls``, in field order."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError, AttributeError):  # an annotation that does not resolve: its field takes values as given
        hints = {}
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        spec = f.metadata.get("cli")
        text = spec.help if isinstance(spec, Flag) and spec.help else docs.get(f.name, "")
        out.append(Setting(f.name, hints.get(f.name, Any), _default(f), text))
    return tuple(out)


def name_to_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# --- command-line flags -----------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """What argparse needs of a field beyond its name, type, default and help (`flag` builds it)."""

    help: str | None = None
    names: tuple[str, ...] = ()
    """The flag and its aliases (default: ``--`` and the field name with dashes)."""
    positional: bool = False
    metavar: str | None = None
    choices: Sequence[Any] | None = None
    nargs: int | str | None = None
    const: Any = None
    action: Any = None
    type: Any = None
    """The argparse ``type`` (default: from the field's type: int, float, a Literal's values' type)."""
    required: bool = False
    group: tuple[str, str] | None = None
    """``(title, description)`` of the argument group it is shown in."""


def flag(default: Any = dataclasses.MISSING, help: str | None = None, *, default_factory: Any = dataclasses.MISSING, **options: Any) -> Any:  # noqa: A002
    """A dataclass field that is a command-line flag: ``nproc: int = flag(1, "processes (default 1)")``.

    ``help`` (else the docstring under the field) is its help; ``options`` (the fields of `Flag`:
    names, positional, metavar, choices, nargs, const, action, type, required, group) is what
    argparse takes, needed only where the field's name, type and default do not say it."""
    kwargs: dict[str, Any] = {k: tuple(v) if k == "names" else v for k, v in options.items()}
    spec = Flag(help, **kwargs)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"cli": spec})
    return dataclasses.field(default=default, metadata={"cli": spec})


def _argparse_kwargs(setting: Setting, spec: Flag, default: Any) -> dict[str, Any]:
    """The keyword arguments of ``add_argument`` for one field."""
    kw: dict[str, Any] = {"default": default, "help": setting.help.replace("``", "").replace("%", "%%") or None}
    if spec.required:
        kw["required"] = True
    inner, _ = split_optional(setting.type)
    if spec.action is None and spec.type is None and inner is bool and spec.nargs is None:
        kw["action"] = "store_true"
        return kw
    if spec.action is not None:
        kw["action"] = spec.action
    choices = spec.choices if spec.choices is not None else setting.choices
    if choices is not None:
        kw["choices"] = list(choices)
    for key in ("metavar", "nargs", "const"):
        if getattr(spec, key) is not None:
            kw[key] = getattr(spec, key)
    if spec.type is not None:
        kw["type"] = spec.type
    else:
        base = sequence_item(inner) if spec.nargs not in (None, "?") and sequence_item(inner) is not None else inner
        if choices is not None:
            base = builtins.type(next(iter(choices)))
        if base in (int, float):
            kw["type"] = base
    return kw


def add_arguments(
    parser: Any, cls: type, *, unset: bool = False, marked_only: bool = False, only: Iterable[str] | None = None, group: tuple[str, str] | None = None
) -> None:
    """One flag of ``parser`` per field of the dataclass ``cls`` (its dest is the field name).

    ``unset``: every flag defaults to None ("not given"; `given` reads what was), so that a TOML value stands
    unless the flag is given. ``marked_only``: only the fields made with `flag` (the others are TOML keys only);
    ``only``: these fields only. ``group``: ``(title, description)`` of the argument group they are shown in."""
    groups: dict[str, Any] = {}
    root, parser = parser, parser.add_argument_group(*group) if group is not None else parser
    fields = {f.name: f for f in dataclasses.fields(cls)}
    wanted = None if only is None else set(only)
    for setting in settings_of(cls):
        if wanted is not None and setting.name not in wanted:
            continue
        spec = fields[setting.name].metadata.get("cli")
        if not isinstance(spec, Flag):
            if marked_only:
                continue
            spec = Flag()
        target = parser
        if spec.group is not None:
            if spec.group[0] not in groups:
                groups[spec.group[0]] = root.add_argument_group(*spec.group)
            target = groups[spec.group[0]]
        default = setting.default if setting.default is not REQUIRED else None
        kw = _argparse_kwargs(setting, spec, None if unset and not spec.positional else default)
        if spec.positional:
            target.add_argument(setting.name, **kw)
        else:
            target.add_argument(*(spec.names or (setting.flag,)), dest=setting.name, **kw)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (flags added with ``unset``): ``{name: value}``."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}


# --- TOML -------------------------------------------------------------------------------------


def check_keys(cls: type, values: Iterable[str], what: str) -> None:
    """A `ConfigError` naming each key of ``values`` that is not a field of ``cls`` (and the closest one)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        hints = [f"{u} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(u, known, n=1)) else u for u in unknown]
        raise ConfigError(f"unknown {what}: {', '.join(hints)}; known: {', '.join(sorted(known))}")


def from_mapping(cls: type, values: Mapping[str, Any], section: str) -> Any:
    """An instance of ``cls`` from the keys of a TOML ``[section]``; an unknown key or a value of the wrong
    type is a one-line `ConfigError` (``[plan] nproc (--nproc) must be a whole number; got 'x'``)."""
    check_keys(cls, values, f"[{section}] keys")
    own = {s.name: s for s in settings_of(cls)}
    return cls(**{k: own[k].convert(v, f"[{section}]") if k in own else v for k, v in values.items()})
