"""Strategy options read from the strategy dataclasses: one place for names, types, defaults and help.

A strategy's options are its dataclass fields (`contract.Strategy`); the docstring under each
field is its help. From them this module derives everything the outside world sees:

- `options_of(cls)`: each option's name (the TOML key, ``trainer.strategy_options.NAME``),
  type, default, help and, for a ``Literal[...]`` field, its choices.
- `catalog()`: the union over every registered strategy. An option that several strategies
  have (``tp`` in ``tp`` and ``pipeline``) is one command-line flag (``--tp``) whose help names
  them; `Catalog.disagreements` reports a shared option whose types do not agree.
- `convert` / `resolve`: a command-line string or a TOML value turned into the field's type
  (``"1.5"`` -> 1.5, ``"a,b"`` -> ``("a", "b")``, ``"true"`` -> True), and a strategy's option
  mapping checked against its fields, with a `ConfigError` that names the option, the strategy
  and the valid values (or the closest option name).

Adding an option to a strategy is therefore one field and its docstring: ``shardwise train``
grows the flag, ``shardwise strategies`` lists it, TOML accepts the key. A registered name
whose factory is not a dataclass strategy class has no options listed here (`Catalog.unlisted`);
its options still reach it through ``trainer.strategy_options``.
"""

from __future__ import annotations

import ast
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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard, Union

from shardwise.errors import ConfigError
from shardwise.strategies.contract import Strategy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Required:
    """The default of a field that has none (the strategy cannot be built without it)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


# --- types ------------------------------------------------------------------------------------


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(tp)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return typing.get_args(tp)
    return None


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``(inner type, whether None is allowed)``: ``int | None`` -> ``(int, True)``."""
    args = _union_args(tp)
    if args is None or type(None) not in args:
        return tp, tp is type(None)
    rest = tuple(a for a in args if a is not type(None))
    if len(rest) == 1:
        return rest[0], True
    return Union.__getitem__(rest), True


def _sequence_item(tp: Any) -> Any | None:
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


def _is_mapping(tp: Any) -> bool:
    return typing.get_origin(tp) in (dict, Mapping) or tp is dict


def type_name(tp: Any) -> str:
    """A type as a reader writes it: ``int | None``, ``tuple[str, ...]``, ``Literal['a', 'b']``."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    args = _union_args(tp)
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


def _kind(tp: Any) -> str:
    """What a command-line flag must be for this type, None aside: the basis of type agreement.

    ``Literal`` values count as their own type (``Literal['ddp', 'fsdp']`` is a ``str``), so two
    strategies may offer different choices under one flag; anything else must be the same type.
    """
    inner, _ = _split_optional(tp)
    if inner is Any:
        return "Any"
    if typing.get_origin(inner) is Literal:
        kinds = sorted({type(v).__name__ for v in typing.get_args(inner)})
        return kinds[0] if len(kinds) == 1 else " | ".join(kinds)
    item = _sequence_item(inner)
    if item is not None:
        return f"list[{_kind(item)}]"
    args = _union_args(inner)
    if args is not None:
        return " | ".join(sorted({_kind(a) for a in args}))
    return type_name(inner)


def _is_switch(tp: Any) -> bool:
    return _split_optional(tp)[0] is bool


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
    inner, optional = _split_optional(tp)
    text = _describe(inner)
    return f"{text} or none" if optional and inner is not type(None) else text


def _describe(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "a whole number"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    if typing.get_origin(tp) is Literal:
        return "one of: " + ", ".join(format_value(v) for v in typing.get_args(tp))
    item = _sequence_item(tp)
    if item is not None:
        return f"a comma-separated list (each {_describe(item)})"
    if _is_mapping(tp):
        return 'a TOML table such as {key = "value"} (or its JSON text)'
    args = _union_args(tp)
    if args is not None:
        return " or ".join(_describe(a) for a in args)
    return f"a {type_name(tp)}"


def metavar(tp: Any, name: str = "value") -> str:
    """How the value of a flag is shown in help: ``{gpipe,1f1b}``, ``A,B,...``, ``N`` or the name."""
    inner, _ = _split_optional(tp)
    if typing.get_origin(inner) is Literal:
        return "{" + ",".join(format_value(v) for v in typing.get_args(inner)) + "}"
    if _sequence_item(inner) is not None:
        return "A,B,..."
    if _is_mapping(inner):
        return "TABLE"
    return {int: "N", float: "X", bool: "BOOL"}.get(inner, name.upper())


class _Bad(Exception):
    """A value that does not fit a type (turned into a ConfigError naming the option)."""


def _convert(value: Any, tp: Any) -> Any:
    """``value`` (a command-line string, or what TOML read) as type ``tp``; raises `_Bad`."""
    inner, optional = _split_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        raise _Bad
    if optional and isinstance(value, str) and value.strip().lower() == "none" and inner is not str:
        return None
    if inner is type(None):
        raise _Bad
    return _convert_inner(value, inner)


def _convert_inner(value: Any, tp: Any) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise _Bad
    if tp is int or tp is float:
        # A number, or its text; never a bool (True is an int to Python, not a count); an int where a float is asked.
        accepted = (int,) if tp is int else (int, float)
        if isinstance(value, accepted) and not isinstance(value, bool):
            return tp(value)
        if isinstance(value, str):
            try:
                return tp(value.strip())
            except ValueError:
                raise _Bad from None
        raise _Bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # --set key=4 reads 4 as a TOML number
        raise _Bad
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            try:
                if _convert_inner(value, type(choice)) == choice:
                    return choice
            except _Bad:
                continue
        raise _Bad
    item = _sequence_item(tp)
    if item is not None:
        if isinstance(value, str):
            parts: list[Any] = [p.strip() for p in value.split(",") if p.strip()]
        elif isinstance(value, (list, tuple)):
            parts = list(value)
        else:
            raise _Bad
        converted = [_convert(p, item) for p in parts]
        origin = typing.get_origin(tp) or tp
        return converted if origin is list else tuple(converted)
    if typing.get_origin(tp) is tuple:  # fixed length: tuple[int, int]
        items = typing.get_args(tp)
        parts = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
        if len(parts) != len(items):
            raise _Bad
        return tuple(_convert(p, t) for p, t in zip(parts, items, strict=True))
    if _is_mapping(tp):
        if isinstance(value, str):
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                try:  # its JSON text, as the help of a table option says ({"fc1": "colwise"})
                    value = json.loads(value)
                except json.JSONDecodeError:
                    raise _Bad from None
        if not isinstance(value, dict):
            raise _Bad
        key_t, val_t = typing.get_args(tp) or (Any, Any)
        return {_convert(k, key_t): _convert(v, val_t) for k, v in value.items()}
    args = _union_args(tp)
    if args is not None:
        for member in sorted(args, key=lambda a: 0 if isinstance(a, type) and isinstance(value, a) else 1):
            try:
                return _convert(value, member)
            except _Bad:
                continue
        raise _Bad
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if isinstance(value, str):
            try:
                return tp(value)
            except (TypeError, ValueError):
                raise _Bad from None
    raise _Bad


# --- one strategy's options -------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One option of one strategy class: a dataclass field and its docstring."""

    name: str
    """The field name: the keyword argument and the TOML key (``trainer.strategy_options.NAME``)."""
    type: Any
    """The field's type, resolved (``int | None``, ``Literal['gpipe', '1f1b']``, ``tuple[str, ...]``)."""
    default: Any
    """The field's default (`REQUIRED` when it has none)."""
    help: str
    """The docstring under the field (empty when it has none)."""

    @property
    def flag(self) -> str:
        """The command-line flag: ``--`` and the name with dashes (``--sync-every``)."""
        return "--" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The values of a ``Literal[...]`` field, else None."""
        inner, _ = _split_optional(self.type)
        return typing.get_args(inner) if typing.get_origin(inner) is Literal else None

    @property
    def switch(self) -> bool:
        """A boolean option: an on/off flag (``--offload`` / ``--no-offload``)."""
        return _is_switch(self.type)

    def convert(self, value: Any, strategy: str) -> Any:
        """``value`` (command-line text or a TOML value) as this option's type, or a `ConfigError`."""
        try:
            return _convert(value, self.type)
        except _Bad:
            pass
        valid = describe(self.type)
        hint = ""
        if self.choices and isinstance(value, str):
            close = difflib.get_close_matches(value, [format_value(c) for c in self.choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"strategy {strategy!r}: option {self.name} ({self.flag}) must be {valid}; got {value!r}{hint}") from None


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
        source = textwrap.dedent(inspect.getsource(klass))
        tree = ast.parse(source)
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


def is_options_class(obj: Any) -> TypeGuard[type[Strategy]]:
    """A strategy class whose options this module can read: a dataclass subclass of `Strategy`."""
    return isinstance(obj, type) and issubclass(obj, Strategy) and dataclasses.is_dataclass(obj)


@functools.cache
def options_of(cls: type) -> tuple[Option, ...]:
    """Every option of a dataclass strategy class, in field order."""
    if not is_options_class(cls):
        raise ConfigError(f"{cls!r} is not a dataclass subclass of shardwise.strategies.contract.Strategy; its options cannot be read")
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError, AttributeError):  # an annotation that does not resolve: its field takes values as given
        hints = {}
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # a dataclass: is_options_class said so
        if not f.init or f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        out.append(Option(f.name, hints.get(f.name, Any), default, docs.get(f.name, "")))
    return tuple(out)


def summary_line(obj: Any) -> str:
    """The first paragraph of a strategy's docstring, on one line (a sentence cut at a line break reads as cut)."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(line.strip() for line in doc.split("\n\n", 1)[0].splitlines()) if doc else ""


# --- every registered strategy ----------------------------------------------------------------


@dataclass(frozen=True)
class StrategyOptions:
    """The options of one strategy class, under every name it is registered as."""

    names: tuple[str, ...]
    """Registered names for the class (``fsdp`` and ``zero3`` are one class)."""
    cls: type
    options: tuple[Option, ...]

    @property
    def label(self) -> str:
        return ", ".join(self.names)

    def get(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)


@dataclass(frozen=True)
class Flag:
    """One command-line flag: an option name and every strategy that has it."""

    name: str
    holders: tuple[tuple[str, Option], ...]
    """``(registered strategy name, its option)`` for each strategy that takes this option."""

    @property
    def flag(self) -> str:
        return self.holders[0][1].flag

    @property
    def dest(self) -> str:
        """The argparse destination (kept apart from the trainer's own flags)."""
        return "strategy_option__" + self.name

    @property
    def strategies(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.holders)

    @property
    def shared(self) -> bool:
        return len({id(o) for _, o in self.holders}) > 1

    @property
    def switch(self) -> bool:
        """On/off flag when every strategy has it as a bool (else it takes a value, true/false included)."""
        return all(o.switch for _, o in self.holders)

    @property
    def metavar(self) -> str:
        metavars = {metavar(o.type, self.name) for _, o in self.holders}
        return metavars.pop() if len(metavars) == 1 else "VALUE"

    def help(self) -> str:
        """The field docstring, with the strategies and defaults when several strategies share it
        (each strategy's own docstring when theirs differ)."""
        options = _distinct(o for _, o in self.holders)
        texts = _distinct_values((", ".join(n for n, o in self.holders if o is opt), opt.help or "(no description)") for opt in options)
        text = texts[0][1] if len(texts) == 1 else " ".join(f"{names}: {doc}" for names, doc in texts)
        defaults = _distinct_values((", ".join(n for n, o in self.holders if o is opt), format_value(opt.default)) for opt in options)
        if len(defaults) == 1:
            default = defaults[0][1]
        else:
            default = "; ".join(f"{names} {value}" for names, value in defaults)
        prefix = f"[{', '.join(self.strategies)}] " if self.shared and len(texts) == 1 else ""
        suffix = "" if "(default" in text.lower() and len(texts) == 1 else f" (default: {default})"  # the docstring says it better
        return f"{prefix}{text}{suffix}"


def _distinct(options: Any) -> list[Option]:
    seen: list[Option] = []
    for o in options:
        if not any(o is s for s in seen):
            seen.append(o)
    return seen


def _distinct_values(pairs: Any) -> list[tuple[str, str]]:
    by_value: dict[str, list[str]] = {}
    for names, value in pairs:
        by_value.setdefault(value, []).append(names)
    return [(", ".join(names), value) for value, names in by_value.items()]


@dataclass(frozen=True)
class Catalog:
    """The options of every registered strategy, and their union as flags."""

    strategies: tuple[StrategyOptions, ...]
    """Strategies whose options are read from their dataclass fields, in registry order."""
    unlisted: tuple[tuple[str, str], ...]
    """``(name, why)`` for registered names whose options cannot be read (not a dataclass strategy class)."""

    def for_strategy(self, name: str) -> StrategyOptions | None:
        return next((s for s in self.strategies if name in s.names), None)

    @property
    def flags(self) -> dict[str, Flag]:
        """Option name -> its flag, over every strategy (one flag for an option several have)."""
        holders: dict[str, list[tuple[str, Option]]] = {}
        for s in self.strategies:
            for o in s.options:
                holders.setdefault(o.name, []).extend((n, o) for n in s.names)
        return {name: Flag(name, tuple(h)) for name, h in holders.items()}

    def disagreements(self) -> list[str]:
        """One line per option that strategies declare with types that one flag cannot carry."""
        lines = []
        for flag in self.flags.values():
            kinds = {_kind(o.type) for _, o in flag.holders} - {"Any"}
            if len(kinds) > 1:
                said = "; ".join(f"{n}: {type_name(o.type)}" for n, o in flag.holders)
                lines.append(f"option {flag.name} ({flag.flag}) has types that disagree: {said}")
        return lines


def catalog() -> Catalog:
    """Read every registered strategy's options (importing each strategy module)."""
    from shardwise.strategies import _factory, available

    by_class: dict[type[Strategy], list[str]] = {}
    unlisted = []
    for name in available():
        try:
            factory = _factory(name)
        except Exception as exc:  # noqa: BLE001 - a strategy whose module does not import must not stop the others' flags
            unlisted.append((name, f"its module did not import: {exc}"))
            continue
        if is_options_class(factory):
            by_class.setdefault(factory, []).append(name)
        else:
            unlisted.append((name, "not a dataclass strategy class"))
    strategies = tuple(StrategyOptions(tuple(names), cls, options_of(cls)) for cls, names in by_class.items())
    return Catalog(strategies, tuple(unlisted))


def strategy_options(name: str) -> StrategyOptions | None:
    """The options of one registered strategy (None when its factory is not a dataclass class).
    An unknown name is the registry's `ConfigError` (with the closest name)."""
    from shardwise.strategies import _factory

    factory = _factory(name)
    return StrategyOptions((name,), factory, options_of(factory)) if is_options_class(factory) else None


def resolve(strategy: str, values: Mapping[str, Any], *, flags: Collection[str] = (), known: Catalog | None = None) -> dict[str, Any]:
    """``values`` (strategy options from TOML, ``--set`` and flags) checked against ``strategy``'s
    fields and converted to their types.

    ``flags`` names the options that came from command-line flags, for the message when the
    strategy does not take one. A strategy whose options cannot be read gets ``values`` as they
    are (its own constructor checks them), except flags, which all belong to other strategies.
    """
    target = strategy_options(strategy)
    own = {o.name: o for o in target.options} if target is not None else {}
    for name in [n for n in values if n in flags and n not in own]:
        holders = (known or catalog()).flags.get(name)
        owners = (f"strateg{'ies' if len(holders.strategies) > 1 else 'y'} {', '.join(holders.strategies)}") if holders else "another strategy"
        takes = (
            ", ".join(o.flag for o in own.values())
            if own
            else "no options of its own"
            if target is not None
            else "its options through --set trainer.strategy_options.KEY=VALUE"
        )
        raise ConfigError(
            f"{name_to_flag(name)} is an option of {owners}; strategy {strategy!r} does not take it "
            f"(it takes {takes}). Drop the flag or choose a strategy that has it"
        )
    if target is None:
        return dict(values)
    unknown = [n for n in values if n not in own]
    if unknown:
        valid = ", ".join(own) if own else "none"
        hints = []
        for u in unknown:
            close = difflib.get_close_matches(u, list(own), n=1)
            hints.append(f"{u!r} (did you mean {close[0]!r}?)" if close else repr(u))
        raise ConfigError(
            f"strategy {strategy!r} has no option {', '.join(hints)} (in trainer.strategy_options); "
            f"its options are: {valid} (see `shardwise strategies {strategy}`)"
        )
    return {n: own[n].convert(v, strategy) for n, v in values.items()}


def name_to_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


__all__ = [
    "REQUIRED",
    "Catalog",
    "Flag",
    "Option",
    "StrategyOptions",
    "catalog",
    "describe",
    "field_docs",
    "format_value",
    "is_options_class",
    "metavar",
    "name_to_flag",
    "options_of",
    "resolve",
    "strategy_options",
    "summary_line",
    "type_name",
]
