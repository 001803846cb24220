"""Strategy options read from the strategy dataclasses: one place for names, types, defaults and help.

A strategy's options are its dataclass fields (`contract.Strategy`); the docstring under each
field is its help. From them this module derives everything the outside world sees:

- `options_of(cls)`: each option's name (the TOML key, ``trainer.strategy_options.NAME``),
  type, default, help and, for a ``Literal[...]`` field, its choices.
- `catalog()`: the union over every registered strategy. An option that several strategies
  have (``tp`` in ``tp`` and ``pipeline``) is one command-line flag (``--tp``) whose help names
  them; `Catalog.disagreements` reports a shared option whose types do not agree.
- `resolve`: a strategy's option mapping checked against its fields and each value turned into
  the field's type (``"1.5"`` -> 1.5, ``"a,b"`` -> ``("a", "b")``, ``"true"`` -> True: the config
  machine's `shardwise.config.convert`), with a `ConfigError` that names the option, the strategy
  and the valid values (or the closest option name).

Adding an option to a strategy is therefore one field and its docstring: ``shardwise train``
grows the flag, ``shardwise strategies`` lists it, TOML accepts the key. A registered name
whose factory is not a dataclass strategy class has no options listed here (`Catalog.unlisted`);
its options still reach it through ``trainer.strategy_options``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from shardwise.config import (
    REQUIRED,
    Setting,
    describe,
    field_docs,
    format_value,
    is_mapping,
    name_to_flag,
    sequence_item,
    settings_of,
    split_optional,
    type_name,
    union_args,
)
from shardwise.errors import ConfigError
from shardwise.strategies.contract import Strategy

# --- one strategy's options -------------------------------------------------------------------


@dataclass(frozen=True)
class Option(Setting):
    """One option of one strategy class: a dataclass field and its docstring (`shardwise.config.Setting`);
    its name is the TOML key ``trainer.strategy_options.NAME``."""

    def convert(self, value: Any, strategy: str = "?") -> Any:
        """``value`` (command-line text or a TOML value) as this option's type, or a `ConfigError`."""
        return super().convert(value, f"strategy {strategy!r}: option")


def is_options_class(obj: Any) -> TypeGuard[type[Strategy]]:
    """A strategy class whose options this module can read: a dataclass subclass of `Strategy`."""
    return isinstance(obj, type) and issubclass(obj, Strategy) and dataclasses.is_dataclass(obj)


@functools.cache
def options_of(cls: type) -> tuple[Option, ...]:
    """Every option of a dataclass strategy class, in field order."""
    if not is_options_class(cls):
        raise ConfigError(f"{cls!r} is not a dataclass subclass of shardwise.strategies.contract.Strategy; its options cannot be read")
    return tuple(Option(s.name, s.type, s.default, s.help) for s in settings_of(cls))


def summary_line(obj: Any) -> str:
    """The first paragraph of a strategy's docstring, on one line (a sentence cut at a line break reads as cut)."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(line.strip() for line in doc.split("\n\n", 1)[0].splitlines()) if doc else ""


def kind(tp: Any) -> str:
    """What a command-line flag must be for this type, None aside: the basis of type agreement.

    ``Literal`` values count as their own type (``Literal['ddp', 'fsdp']`` is a ``str``), so two
    classes may offer different choices under one flag; anything else must be the same type.
    """
    inner, _ = split_optional(tp)
    if inner is Any:
        return "Any"
    if typing.get_origin(inner) is Literal:
        kinds = sorted({type(v).__name__ for v in typing.get_args(inner)})
        return kinds[0] if len(kinds) == 1 else " | ".join(kinds)
    item = sequence_item(inner)
    if item is not None:
        return f"list[{kind(item)}]"
    args = union_args(inner)
    if args is not None:
        return " | ".join(sorted({kind(a) for a in args}))
    return type_name(inner)


def metavar(tp: Any, name: str = "value") -> str:
    """How the value of a flag is shown in help: ``{gpipe,1f1b}``, ``A,B,...``, ``N`` or the name."""
    inner, _ = split_optional(tp)
    if typing.get_origin(inner) is Literal:
        return "{" + ",".join(format_value(v) for v in typing.get_args(inner)) + "}"
    if sequence_item(inner) is not None:
        return "A,B,..."
    if is_mapping(inner):
        return "TABLE"
    return {int: "N", float: "X", bool: "BOOL"}.get(inner, name.upper())


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
            kinds = {kind(o.type) for _, o in flag.holders} - {"Any"}
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


_NOT_COMPOSED: dict[str, tuple[str, str]] = {
    "ep": ("expert parallelism (ep)", "ep runs on strategies 'ddp', 'zero2', 'zero3' and 'hsdp'"),
    "cp": ("context parallelism (cp)", "cp runs on strategies 'ddp', 'zero1', 'zero2', 'zero3', 'hsdp' and 'tp'"),
}
"""Options of the parallelisms that compose with some strategies only: what each is, and where it runs."""


def not_composed(strategy: str, names: Collection[str]) -> str:
    """Why ``strategy`` lacks options that other strategies have (ep, cp), and what takes them: a
    sentence starting with ``": "`` to put after "has no option ...", or ``""``."""
    parts = []
    for name in names:
        if name in _NOT_COMPOSED:
            what, where = _NOT_COMPOSED[name]
            extra = " (under 'tp' with ep=1 the experts are split by tp's plan)" if name == "ep" and strategy in ("tp", "pipeline") else ""
            parts.append(f"{what} does not compose with strategy {strategy!r} yet: {where}{extra}; or drop {name}")
    return (": " + "; ".join(parts)) if parts else ""


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
            f"{name_to_flag(name)} is an option of {owners}; strategy {strategy!r} does not take it{not_composed(strategy, [name])} "
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
            f"strategy {strategy!r} has no option {', '.join(hints)}{not_composed(strategy, unknown)} (in trainer.strategy_options); "
            f"its options are: {valid} (see `shardwise strategies {strategy}`)"
        )
    return {n: own[n].convert(v, strategy) for n, v in values.items()}


__all__ = [
    "REQUIRED",
    "Catalog",
    "Flag",
    "Option",
    "StrategyOptions",
    "catalog",
    "describe",
    "field_docs",
    "not_composed",
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
