"""Strategy options generated from the strategy dataclasses: flags, TOML keys, defaults, help, conversion.

The claim under test: an option is one dataclass field and its docstring, and from that the
``shardwise train`` flag, its help, the ``[trainer.strategy_options]`` key, its type conversion
and ``shardwise strategies``' listing follow with no other change. The last test walks every
registered strategy, so each family converted to a dataclass is checked without editing it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pytest

import shardwise.strategies as registry
from shardwise import cli
from shardwise.errors import ConfigError
from shardwise.strategies import available, get_strategy, register_strategy
from shardwise.strategies.data_parallel.ddp import DDP
from shardwise.strategies.data_parallel.single import Single
from shardwise.strategies.options import (
    REQUIRED,
    catalog,
    field_docs,
    format_value,
    is_options_class,
    options_of,
    resolve,
    strategy_options,
    type_name,
)

DDP_DOCS = {
    "bucket_cap_mb": "Size of each gradient bucket DDP reduces while backward runs (MiB).",
    "find_unused_parameters": "Allow parameters that get no gradient in some steps (slower: DDP walks the graph each step).",
    "static_graph": "Declare that the set of used parameters never changes across steps (lets DDP skip checks).",
    "broadcast_buffers": "Copy rank 0's buffers (BatchNorm statistics) to every rank before each forward.",
    "allreduce": "Gradient allreduce algorithm: native, ring, tree, recursive-doubling, ... (shardwise.comm.algorithms), "
    "or hierarchical (reduce inside each node, all-reduce among node leaders, broadcast back).",
    "node_size": "Processes per node for allreduce=hierarchical (0: the launcher's LOCAL_WORLD_SIZE); a divisor of the world size.",
    "compression": "Gradient codec with error feedback: fp16, bf16, int8, topk:RATIO, powersgd:RANK, ... (shardwise.comm.codecs).",
    "record_buckets": "Also time each native gradient bucket (launch to completion) in the comm record; bytes are recorded either way.",
    "ep": "Expert parallelism: split each mixture-of-experts layer's experts over groups of ep data-parallel ranks "
    "(tokens exchanged by all-to-all); a divisor of the world size and of the number of experts.",
    "cp": "Context parallelism: split each sequence over this many ranks (attention by ring or Ulysses); they share samples.",
    "cp_style": "How context-parallel attention sees the whole sequence: ring (key/value blocks passed round) or ulysses (all-to-all over heads).",
}
"""DDP's field docstrings as written in ddp.py: the help its flags must carry word for word."""


@dataclass(frozen=True)
class Knobs(Single):
    """A test strategy: single's plan and apply, with one option of every kind the CLI converts."""

    name: ClassVar[str] = "knobs"

    knob: int = 3
    """How many knobs to turn."""
    flavour: Literal["plain", "spicy"] = "plain"
    """Which flavour to cook."""
    names: tuple[str, ...] = ()
    """Layer names to touch."""
    portion: float | None = None
    """A fraction, or none for the default."""
    chatty: bool = False
    """Say more."""
    lookup: dict[str, str] = field(default_factory=dict)
    """Layer name to plan."""
    slots: tuple[int, ...] | None = None
    """Slot indices."""


@dataclass(frozen=True)
class PipeLike(Single):
    """A test strategy sharing ``width`` and ``merge_rule`` with `TensorLike`, with another default."""

    name: ClassVar[str] = "pipe-like"

    width: int = 1
    """Tensor-parallel degree inside each stage."""
    merge_rule: Literal["ddp", "fsdp"] = "ddp"
    """How the data-parallel dimension is kept in sync."""
    pace: Literal["gpipe", "1f1b"] = "1f1b"
    """Pipeline schedule."""


@dataclass(frozen=True)
class TensorLike(Single):
    """A test strategy sharing ``width`` (optional here) and ``merge_rule``."""

    name: ClassVar[str] = "tensor-like"

    width: int | None = None
    """Tensor-parallel degree (default: the whole world)."""
    merge_rule: Literal["ddp", "fsdp"] = "ddp"
    """How the data-parallel dimension is kept in sync."""


@dataclass(frozen=True)
class ClashA(Single):
    """A test strategy whose options clash in type with `ClashB`'s."""

    name: ClassVar[str] = "clash-a"

    girth: int = 1
    """A size."""
    heat: bool = False
    """A switch here."""


@dataclass(frozen=True)
class ClashB(Single):
    """See `ClashA`."""

    name: ClassVar[str] = "clash-b"

    girth: tuple[str, ...] = ()
    """Names, here."""
    heat: int = 0
    """A number there."""


@pytest.fixture
def extra(monkeypatch):
    """A registry of extra strategies that starts empty and is restored after the test."""
    monkeypatch.setattr(registry, "_EXTRA", {})
    return register_strategy


def train_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def group_of(parser: argparse.ArgumentParser, flag: str) -> str:
    return next(g.title for g in parser._action_groups for a in g._group_actions if flag in a.option_strings)


def parse(parser: argparse.ArgumentParser, *argv: str) -> dict[str, Any]:
    return cli.strategy_flag_values(parser.parse_args(["--recipe", "digits", *argv]))


# --- one strategy's options --------------------------------------------------------------------


def test_ddp_options_are_its_fields_with_their_docstrings():
    options = options_of(DDP)
    assert [o.name for o in options] == [f.name for f in dataclasses.fields(DDP)] == list(DDP_DOCS)
    assert {o.name: o.help for o in options} == DDP_DOCS
    assert {o.name: o.default for o in options} == {f.name: f.default for f in dataclasses.fields(DDP)}
    assert {o.name: type_name(o.type) for o in options} == {
        "bucket_cap_mb": "float",
        "find_unused_parameters": "bool",
        "static_graph": "bool",
        "broadcast_buffers": "bool",
        "allreduce": "str",
        "node_size": "int",
        "compression": "str | None",
        "record_buckets": "bool",
        "ep": "int",
        "cp": "int",
        "cp_style": "Literal['ring', 'ulysses']",
    }
    assert [o.flag for o in options if o.switch] == ["--find-unused-parameters", "--static-graph", "--broadcast-buffers", "--record-buckets"]


def test_ddp_flags_are_generated_from_its_fields():
    parser = cli.train_parser()
    actions = train_actions(parser)
    flags = catalog().flags
    for option in options_of(DDP):
        action = actions[option.flag]
        assert action.dest == f"strategy_option__{option.name}" and action.default is None  # not given: TOML stands
        assert DDP_DOCS[option.name] in action.help
        assert "(default: " in action.help and format_value(option.default) in action.help.rsplit("(default: ", 1)[1]
        # Its own group, or the shared one when another strategy has the option too (compression: diloco, ps).
        assert group_of(parser, option.flag) == ("options of several strategies" if flags[option.name].shared else "strategy ddp")
        if option.switch:
            assert actions["--no-" + option.flag[2:]] is action
    # Nothing given: no strategy option set. Given: converted to the field's type and reaching the strategy.
    assert parse(parser) == {}
    given = parse(parser, "--strategy", "ddp", "--bucket-cap-mb", "1.5", "--no-broadcast-buffers", "--allreduce", "ring", "--static-graph")
    assert given == {"bucket_cap_mb": "1.5", "broadcast_buffers": False, "allreduce": "ring", "static_graph": True}
    strategy = get_strategy("ddp", **resolve("ddp", given, flags=given))
    assert isinstance(strategy, DDP)
    assert (strategy.bucket_cap_mb, strategy.broadcast_buffers, strategy.allreduce, strategy.static_graph) == (1.5, False, "ring", True)
    assert strategy.ddp_kwargs()["broadcast_buffers"] is False
    help_text = " ".join(parser.format_help().split())  # argparse wraps to the terminal's width
    assert "strategy ddp: Distributed data parallel: whole model per rank, gradients averaged each step." in help_text
    assert "--bucket-cap-mb X Size of each gradient bucket DDP reduces while backward runs (MiB). (default: 25.0)" in help_text


def test_the_flags_that_existed_before_generation_keep_their_spelling_and_meaning():
    # The hand-written list this replaced: flag -> (strategies whose field it sets, field name).
    before = {
        "--allreduce": (("ddp",), "allreduce"),
        "--compression": (("ddp",), "compression"),
        "--offload": (("zero2", "zero3", "fsdp", "hsdp"), "offload"),
        "--sync-every": (("local-sgd", "diloco", "gossip"), "sync_every"),
        "--servers": (("ps",), "servers"),
        "--mode": (("ps",), "mode"),
        "--staleness": (("ps",), "staleness"),
        "--pp": (("pipeline",), "pp"),
        "--tp": (("tp", "pipeline"), "tp"),
        "--microbatches": (("pipeline",), "microbatches"),
        "--schedule": (("pipeline",), "schedule"),
        "--layers": (("pipeline",), "layers"),
        "--split-points": (("pipeline",), "split_points"),
        "--sequence-parallel": (("tp",), "sequence_parallel"),
        "--dp-strategy": (("tp", "pipeline"), "dp_strategy"),
    }
    actions = train_actions(cli.train_parser())
    flags = catalog().flags
    for flag, (strategies, name) in before.items():
        converted = [s for s in strategies if strategy_options(s) is not None]
        assert converted, f"{flag}: none of {strategies} is a dataclass strategy (every built-in one is)"
        assert flag in actions and actions[flag].dest == f"strategy_option__{name}", flag
        assert set(converted) <= set(flags[name].strategies), (flag, flags[name].strategies)


# --- a new strategy: one line in one place ------------------------------------------------------


def test_a_registered_strategy_dataclass_gets_its_flags_help_and_listing_with_no_other_change(extra, capsys):
    extra("knobs", Knobs)
    parser = cli.train_parser()
    actions = train_actions(parser)
    for option in options_of(Knobs):
        assert option.help and option.help in actions[option.flag].help
        assert group_of(parser, option.flag) == "strategy knobs"
    assert actions["--flavour"].metavar == "{plain,spicy}" and actions["--names"].metavar == "A,B,..."
    given = parse(
        parser,
        "--strategy",
        "knobs",
        "--knob",
        "7",
        "--flavour",
        "spicy",
        "--names",
        "fc1,fc2",
        "--portion",
        "0.25",
        "--chatty",
        "--lookup",
        '{fc1 = "colwise"}',
        "--slots",
        "0,1",
    )
    options = resolve("knobs", given, flags=given)
    assert options == {"knob": 7, "flavour": "spicy", "names": ("fc1", "fc2"), "portion": 0.25, "chatty": True, "lookup": {"fc1": "colwise"}, "slots": (0, 1)}
    strategy = get_strategy("knobs", **options)
    assert isinstance(strategy, Knobs) and strategy.options() == options
    assert cli.cmd_strategies("knobs") == 0
    out = capsys.readouterr().out
    assert "knobs: A test strategy: single's plan and apply" in out
    assert "--knob N   (knob = 3)\n      How many knobs to turn." in out
    assert "--chatty / --no-chatty   (chatty = false)" in out and "--flavour {plain,spicy}   (flavour = plain)" in out
    # A strategy the user did not choose does not take the new flags.
    with pytest.raises(ConfigError, match=r"--knob is an option of strategy knobs; strategy 'ddp' does not take it \(it takes --bucket-cap-mb, "):
        resolve("ddp", {"knob": "3"}, flags={"knob"})


def test_an_option_several_strategies_have_is_one_flag_naming_them(extra):
    extra("pipe-like", PipeLike)
    extra("tensor-like", TensorLike)
    known = catalog()
    assert [line for line in known.disagreements() if "-like" in line] == []  # int and int | None agree; two Literals of strings agree
    width = known.flags["width"]
    assert width.shared and set(width.strategies) == {"pipe-like", "tensor-like"} and not width.switch
    parser = cli.train_parser()
    actions = train_actions(parser)
    assert actions["--merge-rule"].help == "[pipe-like, tensor-like] How the data-parallel dimension is kept in sync. (default: ddp)"
    assert actions["--width"].help == (  # docstrings that differ: each strategy's own
        "pipe-like: Tensor-parallel degree inside each stage. tensor-like: Tensor-parallel degree (default: the whole world). "
        "(default: pipe-like 1; tensor-like none)"
    )
    assert group_of(parser, "--width") == group_of(parser, "--merge-rule") == "options of several strategies"
    assert group_of(parser, "--pace") == "strategy pipe-like"
    assert "Also takes --width, --merge-rule (above)." in " ".join(parser.format_help().split())
    # One flag, each strategy's own type: "none" is None for tensor-like, an error for pipe-like.
    assert resolve("tensor-like", {"width": "none"}, flags={"width"}) == {"width": None}
    assert resolve("pipe-like", {"width": "2"}, flags={"width"}) == {"width": 2}
    with pytest.raises(ConfigError, match=r"strategy 'pipe-like': option width \(--width\) must be a whole number; got 'none'"):
        resolve("pipe-like", {"width": "none"}, flags={"width"})
    with pytest.raises(
        ConfigError, match=r"--pace is an option of strategy pipe-like; strategy 'tensor-like' does not take it \(it takes --width, --merge-rule\)"
    ):
        resolve("tensor-like", {"pace": "1f1b"}, flags={"pace"})


def test_options_whose_types_disagree_are_reported_and_the_parser_still_builds(extra):
    extra("clash-a", ClashA)
    extra("clash-b", ClashB)
    lines = [line for line in catalog().disagreements() if "clash-" in line]
    assert lines == [
        "option girth (--girth) has types that disagree: clash-a: int; clash-b: tuple[str, ...]",
        "option heat (--heat) has types that disagree: clash-a: bool; clash-b: int",
    ]
    parser = cli.train_parser()
    assert train_actions(parser)["--heat"].nargs is None  # a bool in one, a number in the other: it takes a value
    assert resolve("clash-a", parse(parser, "--heat", "true"), flags={"heat"}) == {"heat": True}
    assert resolve("clash-b", parse(parser, "--heat", "3", "--girth", "a,b"), flags={"heat", "girth"}) == {"heat": 3, "girth": ("a", "b")}


def test_the_registered_strategies_options_agree_in_type_and_no_flag_collides_with_a_trainer_flag():
    known = catalog()
    assert known.disagreements() == []
    actions = train_actions(cli.train_parser())
    for name, flag in known.flags.items():
        assert flag.flag in actions, name
        assert actions[flag.flag].dest == flag.dest, f"{flag.flag} is a trainer flag too: rename the option {name!r}"


# --- conversion ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("knob", "7", 7),
        ("knob", 7, 7),
        ("knob", " -1 ", -1),
        ("portion", "0.5", 0.5),
        ("portion", 2, 2.0),
        ("portion", "none", None),
        ("portion", None, None),
        ("portion", "1e-3", 0.001),
        ("chatty", "true", True),
        ("chatty", "no", False),
        ("chatty", True, True),
        ("chatty", "1", True),
        ("flavour", "spicy", "spicy"),
        ("flavour", "plain", "plain"),
        ("names", "a, b,,c", ("a", "b", "c")),
        ("names", ["a"], ("a",)),
        ("names", "", ()),
        ("slots", "0,1", (0, 1)),
        ("slots", [2, 3], (2, 3)),
        ("slots", "none", None),
        ("lookup", '{fc1 = "colwise", "fc*2" = "rowwise"}', {"fc1": "colwise", "fc*2": "rowwise"}),
        ("lookup", {"a": "b"}, {"a": "b"}),
    ],
)
def test_command_line_text_and_toml_values_convert_to_the_field_type(option, value, expected):
    converted = {o.name: o for o in options_of(Knobs)}[option].convert(value, "knobs")
    assert converted == expected and type(converted) is type(expected)


def test_strings_stay_strings_and_unions_keep_the_member_the_value_fits():
    compression = {o.name: o for o in options_of(DDP)}["compression"]
    assert compression.convert("none", "ddp") == "none"  # a str | None field keeps the word: ddp reads it as no codec
    assert compression.convert("topk:0.01", "ddp") == "topk:0.01"

    @dataclass(frozen=True)
    class Wrap(Single):
        wrap: str | list[str] = "auto"
        """Modules to shard: auto, or their names."""
        lr: float | int = 1
        """A learning rate."""

    wrap, lr = options_of(Wrap)
    assert wrap.convert("auto", "w") == "auto" and wrap.convert(["a", "b"], "w") == ["a", "b"]
    assert lr.convert(3, "w") == 3 and type(lr.convert(3, "w")) is int and lr.convert("0.5", "w") == 0.5


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("knob", "seven", r"strategy 'knobs': option knob \(--knob\) must be a whole number; got 'seven'"),
        ("knob", 1.5, r"option knob \(--knob\) must be a whole number; got 1.5"),
        ("knob", True, r"option knob \(--knob\) must be a whole number; got True"),
        ("portion", "half", r"option portion \(--portion\) must be a number or none; got 'half'"),
        ("chatty", "maybe", r"option chatty \(--chatty\) must be true or false; got 'maybe'"),
        ("chatty", 2, r"must be true or false; got 2"),
        ("flavour", "spicey", r"option flavour \(--flavour\) must be one of: plain, spicy; got 'spicey' \(did you mean 'spicy'\?\)"),
        ("slots", "0,x", r"option slots \(--slots\) must be a comma-separated list \(each a whole number\) or none; got '0,x'"),
        ("lookup", "fc1=colwise", r"option lookup \(--lookup\) must be a TOML table such as \{key = \"value\"\} \(or its JSON text\); got 'fc1=colwise'"),
        ("names", 3, r"option names \(--names\) must be a comma-separated list \(each a string\); got 3"),
    ],
)
def test_a_bad_value_names_the_option_the_strategy_and_the_valid_values(option, value, message):
    with pytest.raises(ConfigError, match=message):
        {o.name: o for o in options_of(Knobs)}[option].convert(value, "knobs")


def test_toml_keys_are_checked_against_the_chosen_strategys_fields():
    assert resolve("ddp", {"bucket_cap_mb": 2, "allreduce": "ring"}) == {"bucket_cap_mb": 2.0, "allreduce": "ring"}
    with pytest.raises(
        ConfigError,
        match=r"strategy 'ddp' has no option 'bucket_cap' \(did you mean 'bucket_cap_mb'\?\) \(in trainer.strategy_options\); "
        r"its options are: bucket_cap_mb, find_unused_parameters, static_graph, broadcast_buffers, allreduce, node_size, compression, record_buckets",
    ):
        resolve("ddp", {"bucket_cap": 2})
    with pytest.raises(ConfigError, match=r"strategy 'single' has no option 'x' \(in trainer.strategy_options\); its options are: none"):
        resolve("single", {"x": 1})
    with pytest.raises(ConfigError, match=r"unknown strategy 'ddpp'. Did you mean 'ddp'\?"):
        resolve("ddpp", {"x": 1})


def test_a_strategy_that_is_not_a_dataclass_class_is_skipped_not_fatal(extra):
    def factory(**options: Any) -> Single:
        """A factory function: its options cannot be read."""
        return Single()

    extra("by-factory", factory)
    known = catalog()
    assert ("by-factory", "not a dataclass strategy class") in known.unlisted
    assert strategy_options("by-factory") is None
    assert resolve("by-factory", {"anything": "1"}) == {"anything": "1"}  # passed as given: the factory checks them
    with pytest.raises(ConfigError, match=r"--allreduce is an option of strategy ddp; strategy 'by-factory' does not take it"):
        resolve("by-factory", {"allreduce": "ring"}, flags={"allreduce"})
    assert "by-factory" in cli.train_parser().epilog


def test_field_docstrings_are_read_from_the_source_subclass_first():
    @dataclass(frozen=True)
    class Base(Single):
        a: int = 1
        """Base's a."""
        b: int = 2
        """Base's b."""

    @dataclass(frozen=True)
    class Child(Base):
        b: int = 3
        """Child's b,
        on two lines."""
        c: int = 4

    assert field_docs(Child) == {"a": "Base's a.", "b": "Child's b, on two lines."}
    assert [(o.name, o.default, o.help) for o in options_of(Child)] == [("a", 1, "Base's a."), ("b", 3, "Child's b, on two lines."), ("c", 4, "")]


# --- every registered strategy --------------------------------------------------------------------


@pytest.mark.parametrize("name", available())
def test_every_registered_strategy_class_has_documented_options_with_flags(name):
    factory = registry._factory(name)
    assert is_options_class(factory), f"{name} is registered as {factory!r}, not a dataclass strategy class"
    options = options_of(factory)
    assert [o.name for o in options] == [f.name for f in dataclasses.fields(factory) if f.init and not f.name.startswith("_")]
    actions = train_actions(cli.train_parser())
    flags = catalog().flags
    for option in options:
        where = f"{name}.{option.name}"
        assert option.help, f"{where}: the field needs a docstring (it is the flag's help)"
        assert "\n" not in option.help and len(option.help) < 200, f"{where}: one line, please"
        assert option.help in actions[option.flag].help, where
        assert name in flags[option.name].strategies, where
        assert option.default is not REQUIRED, f"{where}: every option needs a default (the CLI builds the strategy from flags alone)"
        # The annotation and the default agree, and the default survives the command line's text form.
        assert option.convert(option.default, name) == option.default, f"{where}: default {option.default!r} is not a {type_name(option.type)}"
        if option.choices is not None:
            assert option.default in option.choices or option.default is None, where
        if not isinstance(option.default, dict):
            assert option.convert(format_value(option.default), name) == option.default or option.default in ((), None), where


def test_a_table_option_takes_a_toml_inline_table_or_its_json_text():
    # the help of tp_plan says "or its JSON text": the command line must take what the help says
    lookup = {o.name: o for o in options_of(Knobs)}["lookup"]
    assert lookup.convert('{"fc1": "colwise", "fc2": "rowwise"}', "knobs") == lookup.convert('{fc1 = "colwise", fc2 = "rowwise"}', "knobs")
    assert lookup.convert('{"fc1": "colwise"}', "knobs") == {"fc1": "colwise"}
